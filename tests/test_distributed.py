"""Multi-process training: two processes on the CPU (gloo) against one process.

One ``torchrun --nproc_per_node 2`` launch runs every scenario of ``tests/dist/scenarios.py``,
and at the same time one plain process computes the single-process references; both save their
results, which the tests below compare. Starting processes is most of the cost, so there are only
these two launches for the whole module.
"""

from __future__ import annotations

import collections
import math
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DIST = REPO / "tests" / "dist"
sys.path.insert(0, str(DIST))

import scenarios  # noqa: E402
from launching import launch_env, run_two_and_one  # noqa: E402

pytestmark = pytest.mark.multiprocess

LAUNCH_TIMEOUT_S = 240
# rank-0 vs single-process results: sums reduced in a different order, through 8-16 updates
RTOL, ATOL = 1e-5, 1e-7


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    start = time.monotonic()
    # gloo process group on the CPU (accelerate launch --cpu starts one process only here)
    loaded = run_two_and_one(DIST / "worker.py", out, launch_env(ACCELERATE_USE_CPU="1"), LAUNCH_TIMEOUT_S)
    print(f"\ndistributed launches: {time.monotonic() - start:.1f}s; scenario times (rank 0): "
          + ", ".join(f"{k} {v:.1f}s" for k, v in loaded["rank0_world2"]["timings"].items()))
    return loaded


def _ranks(results, key):
    return results["rank0_world2"][key], results["rank1_world2"][key]


def _reference(results, key):
    return results["rank0_world1"][key]


TRAIN_PARAMS = [(name, "eager") for name in scenarios.TRAIN_CASES] + [
    (name, "compiled") for name in scenarios.COMPILED_CASES
]


def _skip_missing_engine(results, engine):
    if engine not in results["rank0_world2"]["engines"]:
        pytest.skip(f"fasttrain has no {engine!r} engine in this checkout")


def _assert_engine_ran(run: dict, engine: str):
    """The engine asked for ran the steps itself, without falling back to eager."""
    assert run["engines_used"] == {"train": engine, "eval": engine}, run["engines_used"]


# ------------------------------------------------------------------------------------ sharding
@pytest.mark.parametrize("name", ["k1", "k2_clip_norm", "k4_clip_value"])
def test_each_update_sees_the_union_of_the_per_process_batches(results, name):
    """Update ``u`` of the two processes together covers exactly the samples of update ``u`` of
    the one-process reference (batch 8): process 0 takes global batches 0, 2, ..., process 1
    batches 1, 3, ..., and their micro-steps of one update form one contiguous block."""
    k = scenarios.TRAIN_CASES[name][1]["k"]
    per_update = collections.defaultdict(list)
    for rank_result in _ranks(results, f"train/{name}/eager"):
        for epoch, step, _, indices in rank_result["train_steps"]:
            per_update[(epoch, step // k)].extend(indices)
    reference = {(epoch, step): indices for epoch, step, _, indices in _reference(results, f"train/{name}/eager")["train_steps"]}
    assert sorted(per_update) == sorted(reference)
    for update, indices in per_update.items():
        assert sorted(indices) == reference[update], f"update {update}"
    # the per-process batches interleave: process 0 takes the first batch, process 1 the second
    bs = scenarios.TRAIN_CASES[name][1]["bs"]
    rank0, rank1 = _ranks(results, f"train/{name}/eager")
    assert rank0["train_steps"][0][3] == list(range(0, bs))
    assert rank1["train_steps"][0][3] == list(range(bs, 2 * bs))


def test_shuffled_epochs_cover_the_dataset_once(results):
    """With shuffling and a different seed in each process, the processes still draw the same
    permutation (accelerate synchronises the sampler's generator), so together they take every
    sample once per epoch, in a new order each epoch."""
    rank0, rank1 = _ranks(results, "shuffled")
    orders = {}
    for epoch in (1, 2):
        taken = [i for run in (rank0, rank1) for e, _, _, indices in run["train_steps"] if e == epoch for i in indices]
        assert sorted(taken) == list(range(scenarios.N_TRAIN)), f"epoch {epoch}"
        orders[epoch] = [i for e, _, _, indices in rank0["train_steps"] if e == epoch for i in indices]
    assert orders[1] != orders[2]


# ------------------------------------------------------------------------------------ equivalence
@pytest.mark.parametrize("name,engine", TRAIN_PARAMS)
def test_two_processes_match_one(results, name, engine):
    """Same weights (and epoch losses) as one process taking the union of the batches: DDP
    averages the gradients once per update, clipping sees the all-reduced gradient, and
    token-normalised losses are scaled by the number of processes."""
    _skip_missing_engine(results, engine)
    rank0, rank1 = _ranks(results, f"train/{name}/{engine}")
    reference = _reference(results, f"train/{name}/eager")
    _assert_engine_ran(rank0, engine)
    assert rank0["graphs_compiled_after_epoch_1"] == 0
    for param, value in rank0["weights"].items():
        assert torch.equal(value, rank1["weights"][param]), f"{param} differs between the processes"
        torch.testing.assert_close(value, reference["weights"][param], rtol=RTOL, atol=ATOL, msg=lambda m: f"{param}: {m}")
    assert rank0["num_updates"] == rank1["num_updates"] == reference["num_updates"]
    # epoch losses: one all-reduce per epoch makes them equal on both processes
    assert rank0["eval_loss_epoch"] == rank1["eval_loss_epoch"]
    assert rank0["train_loss_epoch"] == rank1["train_loss_epoch"]
    assert rank0["eval_loss_epoch"] == pytest.approx(reference["eval_loss_epoch"], rel=RTOL)
    if scenarios.TRAIN_CASES[name][0] == "mse":
        # batch-size-weighted mean over all samples: the same whatever the batching
        assert rank0["train_loss_epoch"] == pytest.approx(reference["train_loss_epoch"], rel=RTOL)


@pytest.mark.parametrize("name,engine", TRAIN_PARAMS)
def test_flushed_epoch_loss_is_the_mean_over_all_processes(results, name, engine):
    """The loss counters are summed over the processes at the flushes (in the same collective as
    the stop decisions): at each epoch end both processes were handed the epoch loss that the
    run history records, which is the all-process mean."""
    _skip_missing_engine(results, engine)
    for rank in _ranks(results, f"train/{name}/{engine}"):
        flushed = rank["epoch_end_global_means"]
        assert flushed["train"] == pytest.approx(rank["train_loss_epoch"], rel=1e-12)
        if rank["eval_loss_epoch"]:
            assert flushed["eval"] == pytest.approx(rank["eval_loss_epoch"], rel=1e-12)


@pytest.mark.parametrize("name", ["k2_clip_norm", "k4_clip_value"])
def test_clipping_changes_the_result(results, name):
    """The clipping thresholds of the equivalence cases are active, so those cases do check
    that clipping happens once, after the all-reduce."""
    clipped = _reference(results, f"train/{name}/eager")["weights"]
    plain = _reference(results, "train/k1/eager")["weights"]
    assert any(not torch.allclose(clipped[p], plain[p], rtol=1e-3) for p in plain)


# ------------------------------------------------------------------------------------ run config
@pytest.mark.parametrize("name", ["k1", "k2_clip_norm", "k4_clip_value", "max_steps"])
def test_run_config(results, name):
    cfg = scenarios.TRAIN_CASES[name][1]
    bs, k, processes = cfg["bs"], cfg["k"], 2
    local_batches = math.ceil(math.ceil(scenarios.N_TRAIN / bs) / processes)
    for rank_result in _ranks(results, f"train/{name}/eager"):
        rc = rank_result["run_config"]
        assert rc["num_processes"] == processes and rc["is_distributed"]
        assert rc["train_total_batch_size"] == bs * processes * k
        assert rc["eval_total_batch_size"] == bs * processes
        # pytorch-accelerated's formula: batches of all processes over the accumulation steps
        assert rc["num_update_steps_per_epoch"] == math.ceil(local_batches * processes / k)
        assert rc["num_local_update_steps_per_epoch"] == math.ceil(local_batches / k)
    reference_rc = _reference(results, f"train/{name}/eager")["run_config"]
    assert reference_rc["num_processes"] == 1 and not reference_rc["is_distributed"]
    # every process performs the same optimizer updates as the reference
    assert rc["num_local_update_steps_per_epoch"] == reference_rc["num_local_update_steps_per_epoch"]


@pytest.mark.parametrize("name", ["k1"])
def test_loaders_have_a_device_at_every_world_size(results, name):
    # callbacks written for pytorch-accelerated read trainer._eval_dataloader.device
    for rank_result in [*_ranks(results, f"train/{name}/eager"), _reference(results, f"train/{name}/eager")]:
        assert rank_result["loader_devices"] == [rank_result["device"]] * 2
        assert rank_result["device"].startswith("cpu")


def test_max_num_train_steps_counts_updates_of_each_process(results):
    """6 updates with 4 updates per epoch on each process: 2 epochs, the second stopped after 2
    updates, on both processes; the result equals one process stopped after 6 updates."""
    for rank_result in _ranks(results, "train/max_steps/eager"):
        assert rank_result["num_updates"] == 6
        assert rank_result["run_config"]["max_num_train_steps"] == 6
        assert rank_result["run_config"]["num_epochs"] == 2 == len(rank_result["train_loss_epoch"])
        last_epoch_steps = [s for s in rank_result["train_steps"] if s[0] == 2]
        assert len(last_epoch_steps) == 2 * 2  # 2 updates of k=2 micro-steps
    assert _reference(results, "train/max_steps/eager")["num_updates"] == 6


# ------------------------------------------------------------------------------------ gradient syncs
def _assert_one_round_per_update(run: dict, updates: int, rounds: int, calls: int):
    assert run["num_updates"] == updates
    assert rounds == updates, run
    # one round = one hook call per bucket; the toy models fit DDP's first bucket (1 MiB)
    assert calls == rounds, run


@pytest.mark.parametrize("k,updates", [(1, 6), (2, 3), (4, 2)])
def test_one_gradient_all_reduce_per_update(results, k, updates):
    """A comm hook counts DDP's all-reduces: micro-steps that do not update run under
    ``no_sync``, so there is one all-reduce round per optimizer update (6 micro-batches per
    process; with k=4 the second update is the 2-micro-step tail)."""
    for run in _ranks(results, f"comm/k{k}/eager"):
        _assert_one_round_per_update(run, updates, run["rounds"], run["calls"])


@pytest.mark.parametrize("name,engine", TRAIN_PARAMS)
def test_one_gradient_all_reduce_per_update_in_every_training_case(results, name, engine):
    _skip_missing_engine(results, engine)
    for run in _ranks(results, f"train/{name}/{engine}"):
        _assert_engine_ran(run, engine)
        _assert_one_round_per_update(run, run["num_updates"], run["all_reduce_rounds"], run["all_reduce_calls"])


# ------------------------------------------------------------------------------------ evaluation
def test_uneven_evaluation_is_the_exact_mean(results):
    """13 samples in batches of 2 over two processes: process 0 evaluates 7 samples, process 1
    six, none twice, and the loss equals the one-process mean over the 13 samples."""
    rank0, rank1 = _ranks(results, "uneven_eval")
    reference = _reference(results, "uneven_eval")
    assert len(rank0["eval_indices"]) == 7 and len(rank1["eval_indices"]) == 6
    assert sorted(rank0["eval_indices"] + rank1["eval_indices"]) == list(range(scenarios.N_EVAL))
    assert reference["evaluation_loss"] == pytest.approx(reference["direct_mean"], rel=1e-6)
    assert rank0["evaluation_loss"] == rank1["evaluation_loss"] == pytest.approx(reference["evaluation_loss"], rel=1e-6)
    # after training with batch norm (DDP broadcasts its buffers) an uneven evaluation epoch
    # finishes and agrees between the processes
    assert rank0["trained_eval_loss"] == rank1["trained_eval_loss"]
    assert sorted(rank0["trained_eval_indices"] + rank1["trained_eval_indices"]) == list(range(scenarios.N_EVAL))


def test_evaluation_during_training_covers_every_sample_once_per_epoch(results):
    rank0, rank1 = _ranks(results, "train/k4_clip_value/eager")  # eval batch 1: 7 + 6 batches
    counts = collections.Counter(rank0["eval_indices"] + rank1["eval_indices"])
    assert counts == {i: 2 for i in range(scenarios.N_EVAL)}  # two epochs


# ------------------------------------------------------------------------------------ host syncs
SYNC_KEYS = [("k1", "eager"), ("k2", "eager"), ("k2", "compiled")]


# reads allowed at the end of an epoch phase, a constant however long the epoch: the last flush
# of the step metrics, the interrupt agreement that accompanies each training flush (in
# distributed runs), the epoch-end flush when the last update was itself a flush point, and the
# one all-reduce of the epoch loss
EPOCH_END_READS = 4


@pytest.mark.parametrize("k,engine", SYNC_KEYS)
def test_host_reads_only_at_flushes_and_epoch_ends(results, k, engine):
    """In each process, fasttrain reads device values on the host only when it flushes the step
    metrics (every 50 updates) and at epoch ends: fewer than 0.05 reads per step inside an epoch,
    and a few at each epoch end (a count that does not grow with the epoch)."""
    _skip_missing_engine(results, engine)
    for run in _ranks(results, f"syncs/{k}/{engine}"):
        _assert_engine_ran(run, engine)
        events = run["events"]
        where = collections.Counter((e[0], e[1], e[2], e[3]) for e in events)
        every = run["log_every_n_steps"]
        within, train_end, eval_end = [], [], []
        for event in events:
            method, filename, line, function, (phase, updates, step_in_epoch, eval_batches) = event
            if phase == "train":
                at_end = step_in_epoch == run["train_batches"]
                at_flush = updates % every == 0 and step_in_epoch % int(k[1:]) == 0
            else:
                at_end = eval_batches == run["eval_batches"]
                at_flush = eval_batches % every == 0
            assert phase in ("train", "eval") and (at_flush or at_end), (
                f"{method} from {filename}:{line} ({function}) in {phase} at update {updates}, "
                f"step {step_in_epoch}, eval batch {eval_batches}"
            )
            (within if not at_end else train_end if phase == "train" else eval_end).append(event)
        assert len(within) / run["train_steps"] < 0.05, where
        assert len(train_end) <= EPOCH_END_READS and len(eval_end) <= EPOCH_END_READS, where
        assert run["flushes"] >= run["num_updates"] // every
        # the epoch losses come with the epoch-end flush, whose one shared read also carries
        # the stop decisions: recording them reads nothing more
        assert [e[3] for e in events].count("add_epoch_loss_to_run_history") == 0, where


# ------------------------------------------------------------------------------------ example
def test_example_trains_with_two_processes(results):
    rank0, rank1 = _ranks(results, "example")
    assert rank0["num_processes"] == rank1["num_processes"] == 2
    assert rank0["eval_loss_epoch"] == rank1["eval_loss_epoch"]
    assert rank0["eval_loss_epoch"][-1] < math.log(4)  # better than chance after two epochs
    assert rank0["num_updates"] == 2 * math.ceil(256 / 16 / 2 / 2)  # 2 epochs, 2 processes, k=2


def test_compiled_engine_is_covered(results):
    """Reports (as a skip) when the compiled engine is missing, so the gap shows in the summary."""
    _skip_missing_engine(results, "compiled")
    assert all(f"train/{name}/compiled" in results["rank0_world2"] for name in scenarios.COMPILED_CASES)
