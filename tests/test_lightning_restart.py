"""``fasttrain.lightning.Trainer.fit(..., ckpt_path="last")`` under ``torchrun --max-restarts 1``:
a fit that loses one of its two gloo processes (SIGKILL) restarts itself, resumes from the
``last.ckpt`` its ``ModelCheckpoint`` wrote at the last epoch's end (Lightning's meaning of
"last"), and ends with the weights and optimizer state of a fit never interrupted
(tests/lightning/restart_worker.py). Killed before any checkpoint, the restarted fit starts from
the beginning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launching import run_restartable

pytest.importorskip("lightning")
pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).resolve().parent / "lightning" / "restart_worker.py"
LAUNCH_TIMEOUT_S = 240
#: 6 batches of 4 a process and epoch, 3 epochs
BATCHES_PER_EPOCH = 6


def _launch(out: Path, kill_step: int, kill_rank: int = 0) -> list:
    seconds = run_restartable(WORKER, out, kill_step, kill_rank, max_restarts=1 if kill_step else 0,
                              timeout_s=LAUNCH_TIMEOUT_S, what=f"the Lightning fit (kill after batch {kill_step})",
                              planned="killed.pt" if kill_step else None)
    print(f"\nLightning launch, kill after batch {kill_step}: {seconds:.1f}s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("uninterrupted"), kill_step=0)


@pytest.mark.parametrize(
    "kill_step, kill_rank, resumed",
    [
        pytest.param(BATCHES_PER_EPOCH + 3, 1, True, id="in-epoch-2"),
        pytest.param(2, 0, False, id="before-any-checkpoint"),
    ],
)
def test_a_restarted_fit_resumes_from_last_and_equals_the_uninterrupted_fit(tmp_path, uninterrupted, kill_step,
                                                                             kill_rank, resumed):
    ranks = _launch(tmp_path, kill_step, kill_rank)
    assert uninterrupted[0]["attempt"] == 0 and uninterrupted[0]["ckpt_path"] is None
    for rank, (got, expected) in enumerate(zip(ranks, uninterrupted)):
        assert got["attempt"] == 1, rank  # torchrun started the pair once more, by itself
        assert got["ckpt_path"] == (str(tmp_path / "checkpoints" / "last.ckpt") if resumed else None), rank
        assert got["global_step"] == expected["global_step"] == 9
        assert got["state_dict"].keys() == expected["state_dict"].keys()
        for name, value in expected["state_dict"].items():
            assert torch.equal(got["state_dict"][name], value), (rank, name)
        assert len(got["optimizer"]) == len(expected["optimizer"]) == 4
        for i, (a, b) in enumerate(zip(got["optimizer"], expected["optimizer"])):
            assert a.keys() == b.keys() == {"momentum_buffer"}, (rank, i)
            assert torch.equal(a["momentum_buffer"], b["momentum_buffer"]), (rank, i)


def test_the_first_process_chooses_the_last_checkpoint_for_every_process(uninterrupted):
    """Process 1 alone sees a last.ckpt (as a node with a disk of its own would): the first
    process found none, so no process loads one; every process loads the same weights."""
    assert [rank["chosen_with_different_views"] for rank in uninterrupted] == [None, None]
