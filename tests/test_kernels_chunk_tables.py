"""Chunk tables used by a captured graph outlive the kernels' small table cache."""

import gc
import weakref

import kernel_cases as C  # first: may set TRITON_INTERPRET before triton is imported
import torch

import fasttrain.kernels as K
from fasttrain.kernels import _multi_tensor as multi_tensor

CACHE = multi_tensor._TABLE_CACHE_SIZE


def _flood_cache():
    # more distinct gradient sets than the cache keeps; kept alive so no address is reused
    others = [[torch.ones(5 + i)] for i in range(CACHE + 4)]
    for grads in others:
        multi_tensor.chunk_table(grads, 256)
    return others


def _evicted_table(hold: bool):
    grads = [torch.randn(300), torch.randn(7)]
    if hold:
        with K.hold_chunk_tables() as held:
            table = multi_tensor.chunk_table(grads, 256)
    else:
        held, table = [], multi_tensor.chunk_table(grads, 256)
    ref = weakref.ref(table.table)
    assert not hold or held == [table]
    del table
    others = _flood_cache()
    gc.collect()
    assert all(entry.table is not ref() for entry in multi_tensor._TABLE_CACHE.values())  # evicted
    return grads, held, ref, others


def test_an_unheld_table_is_freed_on_eviction():
    # what a captured graph would meet without a holder: its table's memory is gone
    _, _, ref, _ = _evicted_table(hold=False)
    assert ref() is None


def test_a_held_table_survives_eviction_and_still_describes_the_gradients():
    grads, held, ref, _ = _evicted_table(hold=True)
    assert ref() is not None and held[0].table is ref()
    addresses = held[0].table[0].tolist()
    assert addresses[0] == grads[0].data_ptr() and addresses[-1] == grads[1].data_ptr()
    assert held[0].num_chunks == 3  # 300 elements in chunks of 256, and 7


def test_holders_collect_cache_hits_once_and_only_inside_the_block():
    grads = [torch.randn(40)]
    first = multi_tensor.chunk_table(grads, 256)
    with K.hold_chunk_tables() as outer:
        with K.hold_chunk_tables() as inner:
            assert multi_tensor.chunk_table(grads, 256) is first
        multi_tensor.chunk_table(grads, 256)
    multi_tensor.chunk_table([torch.randn(3)], 256)
    assert inner == [first] and outer == [first]


@C.requires_interpreter
def test_the_kernel_launch_registers_its_table():
    grads = [torch.randn(500), torch.randn(20)]
    with K.hold_chunk_tables() as held:
        K.clip_grad_norm_triton(grads, 1.0, **C.SMALL_LAUNCH)
        K.clip_grad_value_triton(grads, 0.1, **C.SMALL_LAUNCH)
    assert len(held) == 1 and held[0].table[0, 0].item() == grads[0].data_ptr()


def test_the_captured_step_keeps_the_tables_its_capture_used(monkeypatch):
    """The graphed engine captures inside a holder and keeps the list with the graph."""
    import warnings

    from fasttrain.engine import ENGINES
    from test_engine_graph_logic import AOT, HostGraphEngine, mlp_case
    from engine_cases import run

    class TableUsingCapture(HostGraphEngine):
        def _capture(self, body):
            # stands in for the clip kernel, which builds or fetches the table on the CPU side
            grads = [p.grad for p in self.trainer.model.parameters()]
            self.table = multi_tensor.chunk_table(grads, 256)
            return super()._capture(body)

    monkeypatch.setitem(ENGINES, "cudagraph", TableUsingCapture)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # two epochs: the second captures the graphs again after the partial batch's first run
        graphed = run(mlp_case(epochs=2), "cudagraph", AOT, eval_dataset=None)
    engine = graphed.trainer._engine
    assert set(engine._train_graphs) == {False, True}
    for captured in engine._train_graphs.values():
        assert len(captured.tables) == 1 and captured.tables[0].num_chunks >= 1
    assert engine.table in [t for c in engine._train_graphs.values() for t in c.tables]


def engine_looking_up_tables_in_capture(monkeypatch, lookup):
    """A host stand-in of the graphed engine that calls ``lookup(engine)`` inside each update
    capture, with table builds refused there, as the kernels look their tables up on a GPU."""
    from test_engine_graph_logic import HostGraphEngine

    class KernelTablesInCapture(HostGraphEngine):
        def _capture_and_replay(self, batch, update, signature, last=False):
            self.capturing_update = update
            return super()._capture_and_replay(batch, update, signature, last)

        def _record(self, body):
            calls = []

            def recorded():
                # the stand-in's capture runs the body once; its replays run it again, where a real
                # replay looks nothing up
                if not calls and self.capturing_update:
                    with monkeypatch.context() as capture:
                        capture.setattr(multi_tensor, "capturing", lambda device: True)
                        lookup(self)
                calls.append(1)
                return body()

            return super()._record(recorded)

    return KernelTablesInCapture


def flooding_trainer(**defaults):
    """``Trainer`` with a callback that, once the graphs exist (after the sixth step), builds
    more tables than the cache keeps; ``defaults`` are its arguments where a run gives none."""
    from fasttrain import Trainer
    from fasttrain.callbacks import TrainerCallback

    class FloodTables(TrainerCallback):
        def __init__(self):
            self.seen, self.kept = 0, []

        def on_train_step_end(self, trainer, **kwargs):
            self.seen += 1
            if self.seen == 6:
                self.kept = _flood_cache()

    class FloodingTrainer(Trainer):
        def __init__(self, *args, callbacks=(), **kwargs):
            super().__init__(*args, callbacks=[*callbacks, FloodTables()], **{**defaults, **kwargs})

    return FloodingTrainer


def test_a_capture_after_the_cache_evicted_the_gradients_table_finds_it_built(monkeypatch):
    """The graphs are dropped before the epoch's partial batch and captured again in the next
    epoch; meanwhile other tables evicted the gradients' one. A capture cannot copy a table to the
    device, so the engine builds the tables before capturing an update (as on a GPU, where the
    kernels look the table up inside the capture and a miss raised)."""
    from fasttrain.engine import ENGINES
    from fasttrain.engine.clipping import gradients_of
    from test_engine_graph_logic import eager_and_graphed, mlp_case
    from engine_cases import assert_runs_match

    def lookup(engine):
        multi_tensor.chunk_table(gradients_of(engine.trainer.model.parameters()), multi_tensor.DEFAULT_CHUNK)

    monkeypatch.setattr(multi_tensor, "triton_can_clip", lambda grads: bool(grads))  # as on a GPU
    monkeypatch.setitem(ENGINES, "cudagraph", engine_looking_up_tables_in_capture(monkeypatch, lookup))
    eager, graphed = eager_and_graphed(mlp_case(trainer_cls=flooding_trainer(), epochs=2))
    assert_runs_match(eager, graphed)
