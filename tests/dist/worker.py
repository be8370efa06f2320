"""Runs the distributed scenarios in one process of a launch and saves what they produced.

Launched by ``tests/test_distributed.py`` in two ways, at the same time:

* ``ACCELERATE_USE_CPU=1 python -m torch.distributed.run --nproc_per_node 2 worker.py OUT``:
  two processes, gloo backend; every scenario;
* ``ACCELERATE_USE_CPU=1 python worker.py OUT``: one process, the reference for the scenarios
  that have one.

Each process writes ``OUT/rank{rank}_world{world}.pt``. One launch runs all scenarios because
starting processes (importing torch, setting up the process group) is the slow part.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import scenarios  # noqa: E402  (needs the path above)
from worker_common import CaseResults, example_trainer, run_worker  # noqa: E402

EXAMPLE = HERE.parents[1] / "examples" / "ddp_train.py"


def run_example() -> dict:
    trainer = example_trainer(EXAMPLE, ["--epochs", "2", "--num-samples", "256", "--batch-size", "16", "--grad-accum", "2"])
    return {
        "num_processes": trainer.run_config.num_processes,
        "eval_loss_epoch": trainer.run_history.get_metric_values("eval_loss_epoch"),
        "num_updates": trainer.num_updates,
    }


def main(argv):
    engines = scenarios.available_engines()
    results = CaseResults(engines=engines)
    record, world = results.record, results.world
    for name in scenarios.TRAIN_CASES:
        record(f"train/{name}/eager", scenarios.train_case, name, world, "eager")
    record("uneven_eval", scenarios.uneven_eval_case, world)
    if world > 1:
        record("shuffled", scenarios.shuffled_case)
        for k in (1, 2, 4):
            record(f"comm/k{k}/eager", scenarios.comm_case, k, "eager")
        record("syncs/k1/eager", scenarios.sync_case, "eager", 1)
        record("syncs/k2/eager", scenarios.sync_case, "eager", 2)
        record("example", run_example)
        if "compiled" in engines:
            for name in scenarios.COMPILED_CASES:
                record(f"train/{name}/compiled", scenarios.train_case, name, world, "compiled")
            record("syncs/k2/compiled", scenarios.sync_case, "compiled", 2)
    results.save(Path(argv[0]))


if __name__ == "__main__":
    run_worker(main, "worker")
