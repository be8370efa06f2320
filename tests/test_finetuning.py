"""ModelFreezer: parity with pytorch-accelerated, and the fixed train/eval flags."""

import pytest
import torch
from torch import nn

from fasttrain.finetuning import ModelFreezer


def original_finetuning():
    return pytest.importorskip("pytorch_accelerated.finetuning")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.input = nn.Linear(4, 6)
        self.block_1 = nn.Sequential(
            nn.Linear(6, 6),
            nn.BatchNorm1d(6),
            nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU()),
        )
        self.block_2 = nn.Sequential(nn.Conv1d(1, 1, 1), nn.Dropout())
        self.output = nn.Linear(6, 2)

    def forward(self, x):
        return self.output(self.block_1(self.input(x)))


def snapshot(model):
    """Trainability of each parameter and the mode of each module, by name."""
    return (
        {name: p.requires_grad for name, p in model.named_parameters()},
        {name: m.training for name, m in model.named_modules()},
    )


def by_name(model, groups):
    names = {id(p): name for name, p in model.named_parameters()}
    return {index: [names[id(p)] for p in group["params"]] for index, group in groups.items()}


def layer_view(freezer):
    return [(l.layer_group_idx, type(l.module).__name__, l.is_frozen) for l in freezer.get_layers()]


def group_view(freezer):
    return [(g.layer_group_idx, type(g.module).__name__, g.is_frozen) for g in freezer.get_layer_groups()]


INDEX_RANGES = [(0, -2), (0, 0), (1, 2), (-1, 0), (2, 1), (-3, -2), (0, -1), (3, 3), (-4, 10)]


@pytest.mark.parametrize("freeze_bn", [False, True])
@pytest.mark.parametrize("from_index, to_index", INDEX_RANGES)
def test_freeze_then_unfreeze_matches_original(freeze_bn, from_index, to_index):
    torch.manual_seed(0)
    ours_model, theirs_model = Net(), Net()
    ours = ModelFreezer(ours_model, freeze_batch_norms=freeze_bn)
    theirs = original_finetuning().ModelFreezer(theirs_model, freeze_batch_norms=freeze_bn)
    assert layer_view(ours) == layer_view(theirs)
    assert group_view(ours) == group_view(theirs)

    assert ours.freeze(from_index, to_index) is None
    theirs.freeze(from_index, to_index)
    assert snapshot(ours_model) == snapshot(theirs_model)
    assert layer_view(ours) == layer_view(theirs)
    assert group_view(ours) == group_view(theirs)
    assert len(ours.get_trainable_parameters()) == len(theirs.get_trainable_parameters())

    for unfreeze_range in [(-1, 2), (-1, 0)]:
        ours_groups = ours.unfreeze(*unfreeze_range)
        theirs_groups = theirs.unfreeze(*unfreeze_range)
        assert by_name(ours_model, ours_groups) == by_name(theirs_model, theirs_groups)
        assert list(ours_groups) == list(theirs_groups)
        assert snapshot(ours_model) == snapshot(theirs_model)


def test_default_freeze_leaves_last_group_and_batch_norms_trainable():
    model = Net()
    freezer = ModelFreezer(model)
    freezer.freeze()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        "block_1.1.weight", "block_1.1.bias", "block_1.2.1.weight", "block_1.2.1.bias",
        "output.weight", "output.bias",
    }
    groups = freezer.unfreeze()
    assert by_name(model, groups) == {
        0: ["input.weight", "input.bias"],
        1: ["block_1.0.weight", "block_1.0.bias", "block_1.2.0.weight", "block_1.2.0.bias"],
        2: ["block_2.0.weight", "block_2.0.bias"],
    }
    assert all(set(group) == {"params"} for group in groups.values())
    assert all(p.requires_grad for p in model.parameters())


def test_freezer_makes_all_parameters_trainable_on_creation():
    model = Net()
    for p in model.parameters():
        p.requires_grad = False
    ModelFreezer(model)
    assert all(p.requires_grad for p in model.parameters())


def test_freeze_with_eval_freezes_and_sets_eval_unlike_the_original():
    ours_model, theirs_model = Net(), Net()
    ModelFreezer(ours_model).freeze(0, 1, set_modules_as_eval=True)
    original_finetuning().ModelFreezer(theirs_model).freeze(0, 1, set_modules_as_eval=True)

    for module in (ours_model.input, ours_model.block_1[0], ours_model.block_1[2][0], ours_model.block_1[2][2]):
        assert not module.training
        assert all(not p.requires_grad for p in module.parameters())
    # batch norms are not frozen without freeze_batch_norms, so they keep training mode
    assert ours_model.block_1[1].training and ours_model.block_1[1].weight.requires_grad
    assert ours_model.output.training and ours_model.output.weight.requires_grad

    # The original swaps the two flags: nothing is frozen and nothing is put in eval mode.
    assert all(p.requires_grad for p in theirs_model.parameters())
    assert all(m.training for m in theirs_model.modules())


def test_unfreeze_without_training_mode_unfreezes_and_keeps_modes_unlike_the_original():
    ours_model, theirs_model = Net(), Net()
    ours = ModelFreezer(ours_model)
    theirs = original_finetuning().ModelFreezer(theirs_model)
    ours.freeze(0, 2)
    theirs.freeze(0, 2)
    ours_model.eval()
    theirs_model.eval()

    groups = ours.unfreeze(set_modules_as_training=False)
    assert all(p.requires_grad for p in ours_model.parameters())
    assert not any(m.training for m in ours_model.modules())
    assert sorted(groups) == [0, 1, 2]

    theirs.unfreeze(set_modules_as_training=False)
    # The original leaves the parameters frozen (it calls train(False) on them instead).
    assert not theirs_model.input.weight.requires_grad
    assert not theirs_model.block_1[0].weight.requires_grad


def test_unfreeze_with_training_mode_restores_training_after_eval_freeze():
    model = Net()
    freezer = ModelFreezer(model, freeze_batch_norms=True)
    freezer.freeze(0, -1, set_modules_as_eval=True)
    assert not any(m.training for m in model.modules() if not list(m.children()))
    assert freezer.get_trainable_parameters() == []
    assert all(group.is_frozen for group in freezer.get_layer_groups())
    freezer.unfreeze()
    assert all(m.training for m in model.modules() if not list(m.children()))
    assert all(p.requires_grad for p in model.parameters())


def test_layer_with_mixed_parameter_states_is_reported():
    model = Net()
    freezer = ModelFreezer(model)
    model.input.bias.requires_grad = False
    with pytest.raises(ValueError, match="Linear"):
        freezer.get_layers()


def test_layer_group_indices_are_positive_and_negative():
    freezer = ModelFreezer(Net())
    assert [g.layer_group_idx for g in freezer.get_layer_groups()] == [(0, -4), (1, -3), (2, -2), (3, -1)]
    assert freezer.num_groups == 4


def test_loading_a_checkpoint_saved_before_unfreezing_says_what_to_change(tmp_path):
    """A checkpoint saved while the body was frozen (SaveBestModelCallback's best epoch) holds
    one optimizer group; after unfreezing added groups, loading its optimizer state cannot work.
    The error says why and what to pass, and loads nothing: the model keeps its weights."""
    from torch.utils.data import TensorDataset

    from fasttrain import Trainer

    torch.manual_seed(0)
    model = Net()
    freezer = ModelFreezer(model)
    freezer.freeze()
    optimizer = torch.optim.SGD(freezer.get_trainable_parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(model, nn.functional.cross_entropy, optimizer, callbacks=())
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    trainer.train(data, 1, per_device_batch_size=8, train_dataloader_kwargs={"num_workers": 0})
    path = tmp_path / "best.pt"
    trainer.save_checkpoint(path)
    for group in freezer.unfreeze().values():
        trainer.optimizer.add_param_group(group)
    trainer.train(data, 1, per_device_batch_size=8, train_dataloader_kwargs={"num_workers": 0})
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}

    with pytest.raises(ValueError, match=r"1 parameter group.*has 4") as raised:
        trainer.load_checkpoint(path)
    assert "load_optimizer=False" in str(raised.value) and "save_optimizer=False" in str(raised.value)
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name  # nothing half-loaded

    trainer.load_checkpoint(path, load_optimizer=False)  # the weights alone load
    assert not torch.equal(model.output.weight, weights["output.weight"])
