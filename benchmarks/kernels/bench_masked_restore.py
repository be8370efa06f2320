"""The masked skip's undo: save and restore-where-flagged kernels against per-tensor PyTorch.

    python benchmarks/kernels/bench_masked_restore.py --out bench_out/run      # on a GPU
    python benchmarks/kernels/bench_masked_restore.py --device cpu --tiny      # correctness run (CI)

What ``nonfinite="skip"`` adds to each update of a non-fused SGD/Adam/AdamW on a GPU
(fasttrain/engine/masked_step.py): the parameters and their optimizer state are saved before the
step and put back after it where the gradients were not finite. Two tensor sets: GPT-2 124M under
Adam (148 parameters, their two moments and a step counter each: 592 tensors, 1.49 GB in fp32)
and 2,000 small parameters under SGD with momentum (4,000 tensors), where launch count decides.
Each case is timed with the flag down (the update applies: what almost every step pays) and up.

- ``fused``: ``save_snapshot`` + ``restore_where_`` (kernels/masked_restore.py), one launch each.
  Bytes: 2N with the flag down (the restore reads only the flag), 4N with it up.
- ``reference``: the same two functions' PyTorch path: a multi-tensor copy, then one
  ``torch.where`` per tensor. Bytes: 5N.
- ``clone + where``: a clone per tensor, a ``torch.where`` per tensor into its clone and one
  multi-tensor copy back (the undo before the kernels). Bytes: 7N, in 2n + 1 launches.

Device time from CUDA-graph replays and host+device time from timed calls, as in bench_clip.py
(whose timers this script uses). On the CPU (``--device cpu``) it checks the kernels (under
``TRITON_INTERPRET=1``) and the other two against the saved bits with the flag down and up, and
times the host calls; no device figures come from that.
"""
import sys

import torch

from bench_clip import GPT2, GPT2_TINY, SMALL, SMALL_TINY, gpt2_grad_shapes, header_lines, small_shapes
from bench_clip import kernel_bench_parser, kernel_bench_setup, write_report

IMPLS = ("fused", "reference", "clone + where")
#: bytes each implementation moves per call, in units of the tensors' size N: (flag down, flag up)
PASSES = {"fused": (2, 4), "reference": (5, 5), "clone + where": (7, 7)}


def tensor_sets(tiny, device):
    """``(name, tensors)``: GPT-2 124M's parameters with Adam's state, small parameters with SGD's
    momentum buffers (fp32, values that are not all equal)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def filled(shape):
        return torch.randn(shape, generator=gen, device=device)

    adam = []
    for shape in gpt2_grad_shapes(**(GPT2_TINY if tiny else GPT2)):
        adam += [filled(shape), filled(shape), filled(shape).abs_(), torch.tensor(3.0, device=device)]
    count, cycle = SMALL_TINY if tiny else SMALL
    sgd = []
    for shape in small_shapes(count, cycle):
        sgd += [filled(shape), filled(shape)]
    return [("gpt2-124m adam" if not tiny else "gpt2-tiny adam", adam), (f"{count} small sgd-momentum", sgd)]


def clone_each(tensors):
    return [t.clone() for t in tensors]


def where_each(tensors, copies, found_inf):
    """The undo's restore as plain per-tensor PyTorch (after ``clone_each``): what the kernels
    are measured against."""
    skip = found_inf.reshape(()) > 0
    for tensor, copy in zip(tensors, copies):
        torch.where(skip, copy, tensor, out=copy)
    torch._foreach_copy_(tensors, copies)


def implementations(K, interpreted):
    """impl -> ``(save(tensors) -> saved, restore(tensors, saved, found_inf))``. The kernels run
    through the public functions (the custom ops pick them on CUDA) or, on the CPU under the
    interpreter, through their launchers."""
    return {
        "fused": (K.save_snapshot_triton, K.restore_where_triton) if interpreted else (K.save_snapshot, K.restore_where_),
        "reference": (K.save_snapshot_reference, K.restore_where_reference),
        "clone + where": (clone_each, where_each),
    }


def check_correct(impls, device):
    """Each implementation, around a step that writes new values (NaN where the flag is up),
    leaves the tensors as the step wrote them with the flag down and as they were saved with it
    up, bit for bit; raises AssertionError otherwise. Returns the number of tensors checked."""
    _, tensors = tensor_sets(True, device)[0]
    original = [t.clone() for t in tensors]
    for impl, (save, restore) in impls.items():
        for flag in (0.0, 1.0):
            for t, o in zip(tensors, original):
                t.copy_(o)
            saved = save(tensors)
            for t in tensors:  # the step
                t.mul_(-2.0).add_(float("nan") if flag else 1.0)
            written = [t.clone() for t in tensors]
            restore(tensors, saved, torch.tensor([flag], device=device))
            expected = original if flag else written
            same = all(torch.equal(a.reshape(-1).view(torch.int32), b.reshape(-1).view(torch.int32))
                       for a, b in zip(tensors, expected))
            assert same, f"{impl}: with the flag {'up' if flag else 'down'} the tensors are not as {'saved' if flag else 'written'}"
    return len(tensors)


def measure(sets, impls, timer, device):
    """Rows ``(set, flag, impl, device ms, host+device ms, bytes moved)`` per undo."""
    rows = []
    for set_name, tensors in sets:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        for flag in ("down", "up"):
            found_inf = torch.tensor([1.0 if flag == "up" else 0.0], device=device)
            for impl in IMPLS:
                save, restore = impls[impl]
                undo = lambda: restore(tensors, save(tensors), found_inf)  # noqa: E731
                device_ms = timer.device_ms(undo, f"{set_name} {impl}")
                moved = PASSES[impl][flag == "up"] * nbytes
                rows.append((set_name, flag, impl, device_ms, timer.host_ms(undo), moved))
        if device.type == "cuda":
            del tensors
            torch.cuda.empty_cache()
    return rows


def render(rows, device, header):
    baseline = {(s, f): ms for s, f, impl, ms, _, _ in rows if impl == "clone + where"}
    lines = [
        "# The masked skip's undo: save + restore kernels vs per-tensor PyTorch",
        "",
        *header,
        "",
        "| tensors | flag | impl | device ms | host+device ms | MB moved | GB/s | x clone + where (device) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for set_name, flag, impl, ms, host, moved in rows:
        ratio = f"{baseline[(set_name, flag)] / ms:.2f}x" if device.type == "cuda" and ms else ""
        lines.append(
            f"| {set_name} | {flag} | {impl} | {ms:.4f} | {host:.4f} | {moved / 1e6:.1f} | "
            f"{moved / (ms * 1e-3) / 1e9:.0f} | {ratio} |"
        )
    if device.type != "cuda":
        lines += ["", "CPU run: correctness and host time only; device figures need a GPU run. On the CPU the "
                  "fused row times the Triton interpreter, not a kernel."]
    lines += ["", "flag down: the update applies (almost every step); up: it is undone. MB moved counts what each "
              "implementation must read and write (see the script's docstring).", ""]
    return "\n".join(lines)


def main(argv=None):
    parser = kernel_bench_parser("bench_masked_restore", __doc__, "small tensor sets (CI)")
    args = parser.parse_args(argv)
    device, timer, K = kernel_bench_setup(parser, args, "bench_masked_restore")
    interpreted = device.type == "cpu"
    if interpreted and not K.triton_interpreted():
        sys.exit("bench_masked_restore: --device cpu runs the kernels under TRITON_INTERPRET=1; set it before starting")
    impls = implementations(K, interpreted)
    checked = check_correct(impls, device)
    rows = measure(tensor_sets(args.tiny, device), impls, timer, device)
    where, versions, _sizes, *rest = header_lines(device, args.tiny)
    sizes = ("- tiny sizes (a check, not a measurement)" if args.tiny else
             "- GPT-2 124M with Adam's state (592 tensors, 373.2M fp32 elements); 2,000 small parameters with momentum (4,000 tensors)")
    checks = f"- every implementation vs the saved and the written bits, flag down and up: equal over {checked} tensors"
    header = [where, versions, sizes, checks, *rest] + [f"- note: {n}" for n in timer.notes]
    write_report(render(rows, device, header), args.out, "bench_masked_restore")
    return 0


if __name__ == "__main__":
    sys.exit(main())
