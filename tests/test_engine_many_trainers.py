"""Many trainers in one process (the bench runs every peer in one): each gets a compiled update,
and a function dynamo stops compiling is never a silent fallback."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback
from fasttrain.engine import recompile_limit

from engine_cases import MLP, MeanPool, vector_data

# dynamo alone: the recompile limit is dynamo's, and this keeps ten trainers' compiles short
DYNAMO_ONLY = {"backend": "eager"}


def _ours(caught):
    return [str(w.message) for w in caught if "fasttrain:" in str(w.message)]


def _train(i, callbacks=(), engine="compiled"):
    torch.manual_seed(i)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) if i % 2 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(model, torch.nn.functional.cross_entropy, optimizer, engine=engine,
                      compile_options=DYNAMO_ONLY, callbacks=list(callbacks))
    trainer.train(vector_data(n=16), 1, per_device_batch_size=8, gradient_clip_norm=1.0,
                  train_dataloader_kwargs={"shuffle": False, "num_workers": 0})
    return trainer


@pytest.fixture
def fresh_dynamo(dynamos_own_limits):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _many_trainers(count):
    hits = recompile_limit.hit_count()
    frames = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(count):
            before = counters["frames"]["ok"]
            trainer = _train(i)
            frames.append(counters["frames"]["ok"] - before)
            assert trainer.active_engine == "compiled"
    assert not _ours(caught), _ours(caught)
    assert recompile_limit.hit_count() == hits, recompile_limit.new_hits(hits)
    return frames


@pytest.mark.slow
def test_ten_trainers_each_compile_their_whole_update(fresh_dynamo):
    frames = _many_trainers(10)
    if recompile_limit.ISOLATES:
        # every SGD trainer compiles as many frames as the first one, every AdamW trainer as the
        # second: none runs part of its update uncompiled
        assert frames[0::2] == [frames[0]] * 5 and frames[1::2] == [frames[1]] * 5, frames


def test_without_isolation_the_limit_is_raised_per_optimizer(fresh_dynamo, monkeypatch):
    # torch before 2.12: shared frames; a limit of 2 makes the third trainer meet it unless raised
    monkeypatch.setattr(recompile_limit, "ISOLATES", False)
    with torch._dynamo.config.patch(recompile_limit=2):
        _many_trainers(4)
        assert torch._dynamo.config.recompile_limit == 2 + 4


def test_a_recompile_limit_hit_warns_once_and_runs_eager(fresh_dynamo):
    class LimitHitAt(TrainerCallback):
        def on_train_step_start(self, trainer, **kwargs):
            if trainer.progress.step_in_epoch == 1:
                # what dynamo logs when it gives up on a function
                logging.getLogger("torch._dynamo.convert_frame").warning(
                    "torch._dynamo hit config.%s (%s)\n   function: %s\n   last reason: %s",
                    "recompile_limit", 8, "'wrapper' (optimizer.py:509)", "___check_obj_id",
                )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _train(1, callbacks=[LimitHitAt()])
    messages = _ours(caught)
    assert len(messages) == 1 and "recompile_limit=8 for 'wrapper'" in messages[0] and "'eager'" in messages[0], messages
    assert trainer.active_engine == "eager"
    # the eager engine steps with plain floats again (no host read of a tensor lr per step)
    assert isinstance(trainer.optimizer.param_groups[0]["lr"], float)


# ----------------------------------------------------------------------------- what to change
class WideningCollate:
    """Each batch of a wide dataset keeps one more feature than the last, over ten widths: more
    shapes than dynamo's recompile limit (8), as text padded to each batch's longest sample makes.
    Samples of four features stay four wide (a static evaluation set)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, samples):
        xs = torch.stack([s[0] for s in samples])
        keep = min(4 + self.calls % 10, xs.size(1))
        self.calls += 1
        return xs[:, :keep].contiguous(), torch.stack([s[1] for s in samples])


def test_batches_changing_shape_past_the_limit_warn_saying_what_to_change(fresh_dynamo):
    model = MeanPool()
    trainer = Trainer(model, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                      engine="compiled", compile_options=DYNAMO_ONLY, callbacks=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(vector_data(n=12, d_in=16), 1, eval_dataset=vector_data(n=8, d_in=4, seed=2),
                      per_device_batch_size=1, collate_fn=WideningCollate(),
                      train_dataloader_kwargs={"shuffle": False, "num_workers": 0})
    messages = _ours(caught)
    assert len(messages) == 1, messages
    message = messages[0]
    # where and why: the hook, and dynamo's reason naming the batch tensor whose size changed
    assert "'calculate_train_batch_loss'" in message and "size mismatch" in message, message
    # what to change, not dynamo's "Hard failure due to fullgraph=True"
    assert "compile_options={'dynamic': None}" in message and "pad" in message, message
    assert "fullgraph" not in message, message
    assert trainer.active_engine == "eager"
    # the training forward's limit is not the evaluation's: its one shape stays compiled
    assert trainer.active_eval_engine == "compiled"


def test_a_hook_changing_a_python_number_every_update_uncompiles_the_update_at_its_third_value(fresh_dynamo):
    class CountingTrainer(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.updates_seen = 0

        def optimizer_step(self):
            # clipping by norm by hand, as scripts for the original do, and counting updates
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.updates_seen += 1  # a new value at every update: dynamo guards on it
            super().optimizer_step()

    model = MLP()
    # AdamW's step breaks the graph on purpose, so the rest of the hook is a frame of its own,
    # whose guards hold the counter's value
    trainer = CountingTrainer(model, torch.nn.functional.cross_entropy, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              engine="compiled", compile_options=DYNAMO_ONLY, callbacks=[])
    hits_before = recompile_limit.hit_count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(vector_data(n=24), 1, per_device_batch_size=2,
                      train_dataloader_kwargs={"shuffle": False, "num_workers": 0})
    messages = _ours(caught)
    assert len(messages) == 1, messages
    # dynamo's reason names the value, and the message says where such a counter belongs
    assert "self.updates_seen" in messages[0] and "scheduler_step" in messages[0], messages[0]
    # at the counter's third value (not at dynamo's recompile limit, eight) the update runs
    # uncompiled; the forward stays compiled
    assert "runs uncompiled" in messages[0] and trainer._engine._eager_update
    assert trainer.active_engine == "compiled"
    assert recompile_limit.new_hits(hits_before) == []
    assert trainer.updates_seen == 12  # every update counted, compiled or not
