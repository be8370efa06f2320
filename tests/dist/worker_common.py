"""What the multi-process test workers share: recording their cases, running an example, and ending."""

import faulthandler
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch


class CaseResults:
    """A worker's results for the test that launched it: what each case returned, under its
    key, with the seconds it took under ``"timings"``; saved as ``rank{rank}_world{world}.pt``."""

    def __init__(self, **fields):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.results = {"world": self.world, **fields, "timings": {}}

    def record(self, key, fn, *args, **kwargs):
        start = time.perf_counter()
        self.results[key] = fn(*args, **kwargs)
        self.results["timings"][key] = seconds = time.perf_counter() - start
        print(f"[rank {self.rank}/{self.world}] {key}: {seconds:.2f}s", file=sys.stderr, flush=True)

    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(self.results, out_dir / f"rank{self.rank}_world{self.world}.pt")


def example_trainer(path: Path, argv):
    """Runs ``main(argv)`` of the example script at ``path`` in this process; returns the trainer
    it returns."""
    spec = importlib.util.spec_from_file_location(f"{path.stem}_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def run_worker(main, label: str) -> None:
    """``main(sys.argv[1:])``, then :func:`finish_worker`."""
    start = time.perf_counter()
    main(sys.argv[1:])
    print(f"[{label}] done in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    finish_worker()


def dump_stacks_when_stalled(seconds: float) -> None:
    """Write the stacks of all this process's threads to stderr every ``seconds`` while it runs.
    A worker whose peer waits in a collective until the process group's timeout (and then fails,
    ending the launch before the launcher's own deadline dumps the stacks) shows where it was."""
    faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.stderr)


def finish_worker() -> None:
    """End the process group and the process. The interpreter's teardown sometimes aborts in
    gloo ("terminate called without an active exception"), even after the group is destroyed;
    the exit code of the teardown is not what the tests check, the written results are."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
