"""Step-exact resume: a run stopped right after saving its training state and resumed from it
gives the same per-step losses, epoch metrics and final weights as a run never interrupted.

The runs shuffle, use dropout, momentum, a OneCycle schedule and two-step gradient accumulation,
and the resumed trainer starts from other weights and another global seed, so every piece of
state has to come from the saved directory.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from tiny_run import CountingDataset, SaveAndStop, build_trainer, make_dataset, train_kwargs, weights  # noqa: E402

from fasttrain import checkpointing  # noqa: E402
from fasttrain.callbacks import SaveTrainingStateCallback  # noqa: E402


def _reference(**kwargs):
    trainer, recorder = build_trainer()
    torch.manual_seed(123)
    trainer.train(**train_kwargs(**kwargs))
    return trainer, recorder


def _interrupted_then_resumed(tmp_path, save_and_stop_kwargs, trainer_kwargs=None, **kwargs):
    state = tmp_path / "state"
    first, first_rec = build_trainer(callbacks=[SaveAndStop(state, **save_and_stop_kwargs)], **(trainer_kwargs or {}))
    torch.manual_seed(123)
    first.train(**train_kwargs(**kwargs))
    assert first.stop_reason == "stop_training_error"

    second, second_rec = build_trainer(model_seed=7, **(trainer_kwargs or {}))
    torch.manual_seed(999)  # the resumed run must not depend on the global seed at its start
    second.train(**train_kwargs(**kwargs), resume_from=str(state))
    return first_rec.records + second_rec.records, second


def _assert_same_run(records, trainer, reference_records, reference):
    assert records == reference_records  # exact: same batches, same dropout masks, same updates
    for name, value in weights(reference).items():
        assert torch.equal(weights(trainer)[name], value), name
    for metric in ("train_loss_epoch", "eval_loss_epoch"):
        # the epoch mean is summed in other groups (a save is a flush), so compare to rounding
        assert trainer.run_history.get_metric_values(metric) == pytest.approx(
            reference.run_history.get_metric_values(metric), rel=1e-12
        )
    assert trainer.num_updates == reference.num_updates
    assert trainer.run_history.current_epoch == reference.run_history.current_epoch


@pytest.fixture(scope="module")
def reference_run():
    trainer, recorder = _reference()
    return trainer, recorder.records


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(dict(epoch=2, step=3), id="mid-epoch-after-update"),
        pytest.param(dict(epoch=2, step=2), id="inside-accumulation-window"),
        pytest.param(dict(epoch=1, step=0), id="first-micro-step"),
        pytest.param(dict(epoch=2, step=5), id="last-step-of-epoch"),
        pytest.param(dict(epoch=1, at_epoch_end=True), id="epoch-boundary-before-eval"),
    ],
)
def test_resume_matches_uninterrupted_run(tmp_path, reference_run, where):
    reference, reference_records = reference_run
    records, trainer = _interrupted_then_resumed(tmp_path, where)
    _assert_same_run(records, trainer, reference_records, reference)


def test_resume_with_replayed_data_matches_too(tmp_path, reference_run):
    reference, reference_records = reference_run
    records, trainer = _interrupted_then_resumed(
        tmp_path, dict(epoch=2, step=2), trainer_kwargs={"resume_data_skip": "replay"}
    )
    _assert_same_run(records, trainer, reference_records, reference)


def test_resume_with_dataloader_workers(tmp_path):
    # workers draw their seeds from the loader's random stream at every epoch
    workers = {"train_dataloader_kwargs": {"num_workers": 2}}
    reference, reference_rec = build_trainer()
    torch.manual_seed(123)
    reference.train(**train_kwargs(num_epochs=2, eval_data=False, **workers))
    records, trainer = _interrupted_then_resumed(tmp_path, dict(epoch=2, step=2), num_epochs=2, eval_data=False, **workers)
    assert records == reference_rec.records
    for name, value in weights(reference).items():
        assert torch.equal(weights(trainer)[name], value)


def test_sampler_level_skip_does_not_load_consumed_samples(tmp_path):
    kwargs = dict(num_epochs=1, eval_data=False, scheduler=False)
    state = tmp_path / "state"
    first, _ = build_trainer(callbacks=[SaveAndStop(state, epoch=1, step=3)])
    torch.manual_seed(123)
    first.train(**train_kwargs(**kwargs))

    counting = CountingDataset(make_dataset(24, seed=0))
    second, _ = build_trainer()
    second.train(**train_kwargs(train_dataset=counting, **kwargs), resume_from=str(state))
    # 4 of 6 batches (16 samples) were consumed before the save; only the other 8 are loaded
    assert counting.loads == 8
    assert second.num_updates == 3


def test_replay_loads_consumed_samples(tmp_path):
    kwargs = dict(num_epochs=1, eval_data=False, scheduler=False)
    state = tmp_path / "state"
    first, _ = build_trainer(callbacks=[SaveAndStop(state, epoch=1, step=3)])
    first.train(**train_kwargs(**kwargs))
    counting = CountingDataset(make_dataset(24, seed=0))
    second, _ = build_trainer(resume_data_skip="replay")
    second.train(**train_kwargs(train_dataset=counting, **kwargs), resume_from=str(state))
    assert counting.loads == 24


def test_save_training_state_callback_states_resume_exactly(tmp_path, reference_run):
    reference, reference_records = reference_run
    save_dir = tmp_path / "states"
    saver = SaveTrainingStateCallback(save_dir=str(save_dir), save_every_n_steps=3, save_at_end=False)
    trainer, recorder = build_trainer(callbacks=[saver])
    torch.manual_seed(123)
    trainer.train(**train_kwargs())
    assert recorder.records == reference_records  # saving changes nothing
    assert sorted((p.name for p in save_dir.iterdir()), key=lambda n: int(n[5:])) == [
        f"step_{n}" for n in (3, 6, 9, 12, 15, 18)
    ]

    # steps count batches, as in pytorch-accelerated: with 6 batches per epoch and two-step
    # accumulation, step 9 is inside the second window of epoch 2
    metadata = torch.load(save_dir / "step_9" / "trainer_state.pt", weights_only=True)
    assert (metadata["current_epoch"], metadata["phase"], metadata["step_in_epoch"]) == (2, "mid_epoch", 3)
    resumed, resumed_rec = build_trainer(model_seed=3)
    resumed.train(**train_kwargs(), resume_from=str(save_dir / "step_9"))
    done = [r for r in reference_records if (r[1], r[0] == "eval", r[2]) < (2, False, 3)]
    assert done + resumed_rec.records == reference_records
    for name, value in weights(reference).items():
        assert torch.equal(weights(resumed)[name], value)


def test_final_state_continues_into_more_epochs(tmp_path):
    # no scheduler: its length would depend on the number of epochs
    long_run, long_rec = build_trainer()
    torch.manual_seed(5)
    long_run.train(**train_kwargs(num_epochs=3, scheduler=False))

    save_dir = tmp_path / "states"
    short, short_rec = build_trainer(callbacks=[SaveTrainingStateCallback(save_dir=str(save_dir))])
    torch.manual_seed(5)
    short.train(**train_kwargs(num_epochs=2, scheduler=False))
    metadata = torch.load(save_dir / "final" / "trainer_state.pt", weights_only=True)
    assert (metadata["current_epoch"], metadata["phase"]) == (3, "epoch_start")

    more, more_rec = build_trainer(model_seed=1)
    torch.manual_seed(77)
    more.train(**train_kwargs(num_epochs=3, scheduler=False), resume_from=str(save_dir / "final"))
    assert short_rec.records + more_rec.records == long_rec.records
    for name, value in weights(long_run).items():
        assert torch.equal(weights(more)[name], value)


def test_resume_into_finished_run_does_nothing(tmp_path):
    save_dir = tmp_path / "states"
    trainer, _ = build_trainer(callbacks=[SaveTrainingStateCallback(save_dir=str(save_dir))])
    trainer.train(**train_kwargs(num_epochs=1, scheduler=False))
    again, again_rec = build_trainer(model_seed=4)
    again.train(**train_kwargs(num_epochs=1, scheduler=False), resume_from=str(save_dir / "final"))
    assert again_rec.records == []
    for name, value in weights(trainer).items():
        assert torch.equal(weights(again)[name], value)


def test_accumulated_gradients_are_saved_only_inside_a_window(tmp_path):
    inside, boundary = tmp_path / "inside", tmp_path / "boundary"
    trainer, _ = build_trainer(callbacks=[SaveAndStop(inside, epoch=1, step=2, stop=False)])
    trainer.train(**train_kwargs(num_epochs=1, eval_data=False))
    other, _ = build_trainer(callbacks=[SaveAndStop(boundary, epoch=1, step=3, stop=False)])
    other.train(**train_kwargs(num_epochs=1, eval_data=False))
    assert (inside / "grads_0.pt").exists()
    assert not (boundary / "grads_0.pt").exists()
    grads = torch.load(inside / "grads_0.pt", weights_only=True)
    assert set(grads) == {name for name, _ in trainer.get_model().named_parameters()}


def test_rng_state_round_trip_includes_data_generators():
    generator = torch.Generator().manual_seed(3)
    loader = torch.utils.data.DataLoader(make_dataset(8), batch_size=2, shuffle=True, generator=generator)
    state = checkpointing.capture_rng_state(loader)
    first = [torch.rand(2), torch.randint(0, 100, (3,), generator=generator)]
    checkpointing.restore_rng_state(state, loader)
    second = [torch.rand(2), torch.randint(0, 100, (3,), generator=generator)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert len(state["generators"]) == 1


def test_resume_in_a_later_train_call_of_the_same_history(tmp_path):
    # progressive resizing: a second train() keeps the run history, so its epochs are 3 and 4
    kwargs = dict(num_epochs=2, scheduler=False)
    reference, reference_rec = build_trainer()
    torch.manual_seed(1)
    reference.train(**train_kwargs(**kwargs))
    reference.train(**train_kwargs(**kwargs), reset_run_history=False)

    state = tmp_path / "state"
    first, first_rec = build_trainer(callbacks=[SaveAndStop(state, epoch=4, step=2)])
    torch.manual_seed(1)
    first.train(**train_kwargs(**kwargs))
    first.train(**train_kwargs(**kwargs), reset_run_history=False)
    resumed, resumed_rec = build_trainer(model_seed=2)
    resumed.train(**train_kwargs(**kwargs), resume_from=str(state))
    assert first_rec.records + resumed_rec.records == reference_rec.records
    assert resumed.run_history.current_epoch == 5
    for name, value in weights(reference).items():
        assert torch.equal(weights(resumed)[name], value)
