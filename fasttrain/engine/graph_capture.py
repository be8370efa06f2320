"""How the graphed engine records a step on the device: its side stream, the graphs' memory pool,
and a capture that refuses host reads.

These are the graphed engine's only CUDA calls, kept in one mixin's methods so that the tests can
run the engine's logic on the CPU with host stand-ins for streams, graphs and the allocator
(tests/test_engine_graph_logic.py overrides them).
"""

from __future__ import annotations

import contextlib
import gc

import torch


@contextlib.contextmanager
def _host_syncs_raise():
    # A host read inside a capture would invalidate it (and with it the CUDA stream); with this
    # mode torch raises a Python error before issuing the read, so the capture ends cleanly.
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def _collector_paused():
    # Python's cyclic collector runs at whatever allocation crosses its threshold. Inside a
    # capture it may free garbage holding CUDA graphs (an earlier engine's, or graphs this one
    # dropped when their guards failed): destroying a graph or handing back its pool is an
    # operation a capturing stream does not permit, and it invalidates the capture. Paused here,
    # the collector frees that garbage at its next run after the capture.
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


class DeviceCapture:
    """The CUDA side of :class:`~fasttrain.engine.cudagraph.CudaGraphEngine` (which holds
    ``_stream``, ``_pool`` and ``_graphs_held()``)."""

    def _create_stream_and_pool(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device=device)
        self._pool = None  # made by the first capture (_new_pool)
        self._long_lived_pool = None  # made by the first move (_long_lived_allocations)

    def _long_lived_allocations(self):
        """Where tensors that outlive the captures are allocated (the optimizer state at its
        creation, the static batch buffers, and the gradients moved there before a new pool is
        taken, see ``long_lived.py``): a memory pool of their own. Allocated in the default pool after the
        warm-up, they would be carved from its freed activation blocks and keep those segments
        from being handed back, so that the graphs' pool would be taken beside them."""
        if self._long_lived_pool is None:
            self._long_lived_pool = torch.cuda.MemPool()
        return torch.cuda.use_mem_pool(self._long_lived_pool)

    def _new_pool(self) -> None:
        # A capture with no graph alive starts a pool of its own: the allocator refuses to share
        # a pool whose graphs were all freed. The memory the allocator caches (the warm-up's or
        # the partial batch's activations, a freed pool) is handed back first, so that the pool is
        # not taken beside it. SYNC: empty_cache waits for the device; once per new pool (the
        # first capture, and after the graphs were dropped), never per step.
        torch.cuda.empty_cache()
        self._pool = torch.cuda.graph_pool_handle()

    def _return_cached_memory(self) -> None:
        # SYNC: empty_cache waits for the device; once, before the partial batch's first run
        torch.cuda.empty_cache()

    @contextlib.contextmanager
    def _on_side_stream(self):
        stream = self._stream
        current = torch.cuda.current_stream()
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            # later work on the current stream (and frees of side-stream tensors) waits for it
            current.wait_stream(stream)

    def _capture(self, body):
        if self._pool is None or not self._graphs_held():
            self._new_pool()
        with _collector_paused():
            return self._record(body)

    def _record(self, body):
        graph = torch.cuda.CUDAGraph()
        stream = self._stream
        current = torch.cuda.current_stream()
        stream.wait_stream(current)
        try:
            # thread_local: the DataLoader's pin-memory thread may call CUDA during the capture
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                with _host_syncs_raise():
                    outputs = body()
        except BaseException:
            # when ending an invalidated capture raises, torch.cuda.graph leaves the capture
            # stream current; the steps that follow must run on the stream they ran on before
            torch.cuda.set_stream(current)
            raise
        current.wait_stream(stream)
        return graph, outputs
