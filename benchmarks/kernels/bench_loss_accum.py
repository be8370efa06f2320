"""Loss gathering on the device against the PyTorch reference and a per-step host read.

    python benchmarks/kernels/bench_loss_accum.py --out bench_out/run      # on a GPU
    python benchmarks/kernels/bench_loss_accum.py --device cpu --tiny      # correctness run (CI)

What a trainer pays per training step to keep its running loss, and per flush to read it:

- ``fused``: ``accumulate_loss_`` (kernels/loss_accum.py): one Triton launch adds the weighted
  loss, the sample count and the non-finite flag to four device counters (and writes the loss to
  a ring of recent values, as the cudagraph engine asks).
- ``reference``: ``accumulate_loss_reference``, the same update in PyTorch ops (one launch each).
- ``host read``: ``loss.item()`` every step and the sum kept in Python, what a trainer without
  device counters does; each call waits for the device, so it is timed as host+device only.
- ``flush``: ``LossCounters.read()``, one device-to-host copy of counters and ring.

Device time comes from CUDA-graph replays and host+device time from timed calls, as in
bench_clip.py (whose timers this script uses). The step's own work is not included: the figures
are the overhead the loss bookkeeping adds to a step.

On the CPU (``--device cpu``) it checks the fused kernel (under ``TRITON_INTERPRET=1``) against
the reference over a run with a non-finite loss and a wrapping ring, and times the host calls; no
device figures come from that.
"""
import math
import sys

import torch

from bench_clip import header_lines, kernel_bench_parser, kernel_bench_setup, write_report

RING = 64  # the cudagraph engine keeps one slot per step between flushes; 64 is a typical interval


def check_correct(device, calls=3 * RING + 5):
    """Fused and reference counters agree over ``calls`` steps: a NaN loss, a wrapping ring and
    weights that vary; raises AssertionError otherwise. Returns the number of steps checked."""
    import fasttrain.kernels as K

    fused, reference = K.LossCounters(device, RING), K.LossCounters(device, RING)
    gen = torch.Generator().manual_seed(0)
    for i in range(calls):
        loss = torch.rand((), generator=gen).to(device)
        if i == calls // 2:
            loss = torch.tensor(float("nan"), device=device)
        weight = torch.tensor(float(1 + i % 7), device=device)
        K.accumulate_loss_triton(fused.counters, loss, weight, fused.ring)
        K.accumulate_loss_reference(reference.counters, loss, weight, reference.ring)
    got, want = fused.read(), reference.read()
    assert got.calls == want.calls == calls and got.nonfinite and want.nonfinite
    assert got.weight_sum == want.weight_sum
    assert math.isnan(got.loss_sum) and math.isnan(want.loss_sum)
    torch.testing.assert_close(torch.tensor(got.recent), torch.tensor(want.recent), equal_nan=True)
    return calls


def measure(timer, device):
    """Rows ``(case, impl, device ms, host+device ms)`` per call."""
    import fasttrain.kernels as K

    loss = torch.tensor(0.5, device=device)
    weight = torch.tensor(64.0, device=device)
    rows = []
    for label, ring in (("step, with ring", RING), ("step, counters only", 0)):
        counters = K.LossCounters(device, ring)
        fused = lambda: counters.accumulate(loss, weight)  # noqa: E731
        reference = lambda: K.accumulate_loss_reference(counters.counters, loss, weight, counters.ring)  # noqa: E731
        rows.append((label, "fused", timer.device_ms(fused, "fused"), timer.host_ms(fused)))
        rows.append((label, "reference", timer.device_ms(reference, "reference"), timer.host_ms(reference)))
    total = [0.0]

    def host_read():
        total[0] += loss.item() * 64.0  # SYNC(bench): the per-step read this script prices

    rows.append(("step, counters only", "host read", None, timer.host_ms(host_read)))
    counters = K.LossCounters(device, RING)
    rows.append(("flush", "LossCounters.read", None, timer.host_ms(counters.read)))
    return rows


def render(rows, device, header):
    device_ms = {(case, impl): ms for case, impl, ms, _ in rows}
    lines = [
        "# Loss gathering: device counters vs reference vs a per-step host read",
        "",
        *header,
        "",
        "| case | impl | device ms | host+device ms | x reference (device) |",
        "|---|---|---:|---:|---:|",
    ]
    for case, impl, ms, host in rows:
        ref = device_ms.get((case, "reference"))
        ratio = f"{ref / ms:.2f}x" if device.type == "cuda" and ms and ref and impl != "reference" else ""
        lines.append(f"| {case} | {impl} | {'' if ms is None else f'{ms:.4f}'} | {host:.4f} | {ratio} |")
    if device.type != "cuda":
        lines += ["", "CPU run: correctness and host time only; device figures need a GPU run. On the CPU "
                  "`accumulate_loss_` runs the PyTorch reference, so both step rows time the same code."]
    lines += ["", "A host read waits for the device, so it has no device time of its own; a flush happens once per "
              "`log_every_n_steps` updates.", ""]
    return "\n".join(lines)


def main(argv=None):
    parser = kernel_bench_parser("bench_loss_accum", __doc__, "fewer correctness steps (CI)")
    args = parser.parse_args(argv)
    device, timer, K = kernel_bench_setup(parser, args, "bench_loss_accum")
    if device.type == "cpu" and not K.triton_interpreted():
        sys.exit("bench_loss_accum: --device cpu runs the kernel under TRITON_INTERPRET=1; set it before starting")
    checked = check_correct(device, calls=RING + 5 if args.tiny else 3 * RING + 5)
    rows = measure(timer, device)
    where, versions, _sizes, *rest = header_lines(device, args.tiny)
    checks = f"- fused vs reference: equal counters and ring over {checked} steps (one NaN loss, the ring wrapped)"
    header = [where, versions, checks, *rest] + [f"- note: {n}" for n in timer.notes]
    write_report(render(rows, device, header), args.out, "bench_loss_accum")
    return 0

if __name__ == "__main__":
    sys.exit(main())
