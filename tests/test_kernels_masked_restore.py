"""Saving tensors and putting them back where a flag is raised (kernels/masked_restore.py).

Both directions copy bytes, so every comparison here is of bits: NaN payloads, negative zeros and
integer tensors come back exactly as they were saved.
"""
import kernel_cases as C  # first: may set TRITON_INTERPRET before triton is imported
import pytest
import torch

import fasttrain.kernels as K
from fasttrain.kernels import _multi_tensor as multi_tensor
from fasttrain.kernels import masked_restore


def _bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same_bits(actual, expected):
    return len(actual) == len(expected) and all(torch.equal(_bits(a), _bits(e)) for a, e in zip(actual, expected))


def _tensors(device="cpu"):
    """What an optimizer step writes, and more: parameters and state of several dtypes, a 0-d
    step counter, empty tensors, a channels-last tensor, a tensor that starts off a 16-byte
    boundary, integers, and values whose bits a float round trip could change."""
    gen = torch.Generator().manual_seed(0)
    odd = torch.randn(1 + 4097, generator=gen).to(torch.float16)[1:]  # 2 bytes past an aligned start
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, 0.0])
    special.view(torch.int32)[0] = 0x7FC01234  # a NaN with a payload
    tensors = [
        torch.randn(37, 29, generator=gen),
        torch.tensor(7.0),
        torch.randn(1000, generator=gen).to(torch.bfloat16),
        torch.empty(0),
        torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
        odd,
        torch.arange(-5, 300, dtype=torch.int64),
        torch.randn(513, generator=gen, dtype=torch.float64),
        special,
        torch.zeros(3, 0, 5),
    ]
    return [t.to(device) for t in tensors]


def _overwrite(tensors):
    for t in tensors:
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(-1)


# ------------------------------------------------------------------------------------ kernels
@C.requires_interpreter
@pytest.mark.parametrize("launch", ["small", "default"])
def test_triton_saves_the_bytes_the_reference_saves_and_restores_them_only_where_flagged(launch):
    sizes = dict(chunk_size=256, block_size=64) if launch == "small" else {}
    tensors = _tensors()
    assert not all(t.data_ptr() % 16 == 0 for t in tensors if t.numel())  # the unaligned walk too
    saved = [t.clone() for t in tensors]
    snapshot = K.save_snapshot_triton(tensors, **sizes)
    reference = K.save_snapshot_reference(tensors)
    assert snapshot.shape == reference.shape == (K.snapshot_nbytes(tensors),)
    # each tensor's place holds its bytes (the padding between places is never read)
    assert _same_bits(masked_restore._views(tensors, snapshot), saved)
    assert _same_bits(masked_restore._views(tensors, reference), saved)

    _overwrite(tensors)
    after = [t.clone() for t in tensors]
    K.restore_where_triton(tensors, snapshot, torch.zeros(1), **sizes)
    assert _same_bits(tensors, after)  # flag down: nothing moves
    K.restore_where_triton(tensors, snapshot, torch.tensor([2.0]), **sizes)
    assert _same_bits(tensors, saved)  # flag up: every bit comes back


def test_reference_restores_only_where_flagged_and_handles_any_layout():
    base = torch.randn(6, 8)
    strided = base[:, ::2]  # not one block of memory: the reference keeps a contiguous copy
    tensors = _tensors() + [strided]
    between = base[:, 1::2].clone()
    saved = [t.clone() for t in tensors]
    snapshot = K.save_snapshot(tensors)
    _overwrite(tensors)
    after = [t.clone() for t in tensors]
    K.restore_where_(tensors, snapshot, torch.zeros(1))
    assert _same_bits(tensors, after)
    K.restore_where_(tensors, snapshot, torch.ones(1))
    assert _same_bits(tensors, saved)
    assert torch.equal(base[:, 1::2], between)  # the columns between the strided view's are not touched


@C.requires_interpreter
def test_the_launch_registers_its_table_and_a_capture_cannot_build_one(monkeypatch):
    tensors = [torch.randn(500), torch.tensor(1.0)]
    with K.hold_chunk_tables() as held:
        snapshot = K.save_snapshot_triton(tensors, chunk_size=256, block_size=64)
        K.restore_where_triton(tensors, snapshot, torch.ones(1), chunk_size=256, block_size=64)
    assert len(held) == 1  # one table for both directions: the snapshot's address is an argument
    table = held[0].table
    assert table[0].tolist() == [tensors[0].data_ptr() + i for i in (0, 256, 512, 768, 1024, 1280, 1536, 1792)] + [
        tensors[1].data_ptr()
    ]
    assert table[1, -1].item() == 2000 and table[2].tolist() == [256] * 7 + [208, 4]

    monkeypatch.setattr(multi_tensor, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="the snapshot table for these tensors is not built yet"):
        K.save_snapshot_triton([torch.randn(7)])


def test_prepare_builds_the_table_where_the_kernels_run(monkeypatch):
    tensors = [torch.randn(300), torch.randn(2, 2)]
    key_count = len(multi_tensor._TABLE_CACHE)
    K.prepare_snapshot_table(tensors)  # the CPU runs the reference: no table
    assert len(multi_tensor._TABLE_CACHE) == key_count
    monkeypatch.setattr(multi_tensor, "triton_targets", lambda device: True)  # as on a GPU
    K.prepare_snapshot_table(tensors)
    monkeypatch.setattr(multi_tensor, "capturing", lambda device: True)
    assert masked_restore._table(tensors, masked_restore.DEFAULT_CHUNK_BYTES).num_chunks == 2


def test_errors_say_what_to_change():
    tensors = [torch.randn(3), torch.randn(4)]
    snapshot = K.save_snapshot(tensors)
    with pytest.raises(ValueError, match="no tensors to save"):
        K.save_snapshot([])
    with pytest.raises(ValueError, match="holds 32 bytes but these tensors need 16; restore the same tensors"):
        K.restore_where_(tensors[:1], snapshot, torch.ones(1))
    with pytest.raises(TypeError, match="1-D uint8 tensor save_snapshot"):
        K.restore_where_(tensors, snapshot.float(), torch.ones(1))
    with pytest.raises(TypeError, match="found_inf must be a float32 tensor"):
        K.restore_where_(tensors, snapshot, torch.ones(1, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"tensors\[1\] is list"):
        K.save_snapshot([torch.ones(1), [1.0]])


@C.requires_interpreter
def test_the_launchers_refuse_what_the_kernel_cannot_walk():
    with pytest.raises(ValueError, match=r"tensors\[0\] is not dense in memory; use the reference"):
        K.save_snapshot_triton([torch.randn(4, 6)[:, ::2]])


def test_compiles_without_graph_breaks_and_matches_eager():
    def step(tensors, found_inf):
        snapshot = K.save_snapshot(tensors)
        for t in tensors:
            t.mul_(3.0).add_(1.0)
        K.restore_where_(tensors, snapshot, found_inf)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for flag in (0.0, 1.0):
        a = [torch.randn(5, 3), torch.tensor(2.0)]
        b = [t.clone() for t in a]
        step(a, torch.tensor([flag]))
        compiled(b, torch.tensor([flag]))
        assert _same_bits(a, b)


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@C.requires_triton_gpu
def test_gpu_kernels_match_the_reference_and_replay_in_a_graph_without_a_sync():
    tensors = _tensors("cuda") + [torch.randn(50257, 77, device="cuda")]
    saved = [t.clone() for t in tensors]
    flag = torch.zeros(1, device="cuda")
    assert masked_restore._walkable(tensors)

    def step():
        snapshot = K.save_snapshot(tensors)
        _overwrite(tensors)
        K.restore_where_(tensors, snapshot, flag)

    step()  # builds the table
    torch.cuda.synchronize()
    overwritten = [t.clone() for t in tensors]
    for t, s in zip(tensors, saved):
        t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with K.hold_chunk_tables() as held:
        with torch.cuda.graph(graph):
            step()
    assert len(held) == 1
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t, s in zip(tensors, saved):
            t.copy_(s)
        graph.replay()
        flag.fill_(1.0)
        after_down = [t.clone() for t in tensors]
        for t, s in zip(tensors, saved):
            t.copy_(s)
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert _same_bits(after_down, overwritten)
    assert _same_bits(tensors, saved)
    reference = K.save_snapshot_reference(saved)
    assert _same_bits(masked_restore._views(saved, reference), saved)
