"""`fasttrain bench --workload hf-gpt2`: transformers' GPT-2 from a config, and the hand-written
`torch.compile(model)` loop that is its peer."""

import sys

import pytest
import torch
import torch.nn.functional as F

from fasttrain.bench.peers import PEERS, make_peer, resolve_peers
from fasttrain.bench.runner import run_benchmark
from fasttrain.bench.workloads import default_size, make_workload
from fasttrain.cli import _SCHEDULES, main


@pytest.fixture(autouse=True)
def _release_accelerate_state():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def test_tiny_on_the_cpu_124m_config_on_cuda():
    assert default_size("hf-gpt2", "cpu") == "tiny"
    assert default_size("hf-gpt2", "cuda") == "124m"
    assert default_size("gpt", "cuda") == "tiny"  # the other workloads keep their one default
    assert {("hf-gpt2", "cpu"), ("hf-gpt2", "cuda")} <= set(_SCHEDULES)


def test_gpt2_lm_head_model_from_a_config_with_the_gpt_workloads_sizes():
    transformers = pytest.importorskip("transformers")
    wl = make_workload("hf-gpt2", device="cpu", batch_size=2)
    model = wl.make_model()
    assert type(model) is transformers.GPT2LMHeadModel
    cfg = wl.config
    assert (model.config.n_layer, model.config.n_embd, model.config.vocab_size) == (2, 64, 256)
    assert model.config.use_cache is False and model.config.resid_pdrop == 0.0
    # the same FLOP count as the hand-written GPT-2 of the same size: the same architecture
    gpt = make_workload("gpt", device="cpu", batch_size=2)
    assert cfg["params"] == gpt.config["params"] and wl.flops_per_token == gpt.flops_per_token
    assert wl.items_name == "tokens" and wl.amp_dtype is None
    x, y = wl.dataset.__getitems__([0, 1])
    out = model(x)
    assert out.logits.shape == (2, cfg["seq_len"], cfg["vocab"])
    expected = F.cross_entropy(out.logits.reshape(-1, cfg["vocab"]), y.reshape(-1))
    assert torch.equal(wl.loss_func(out, y), expected)
    # seeded: every peer starts from the same weights
    again = wl.make_model()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_without_transformers_every_peer_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    wl = make_workload("hf-gpt2", device="cpu", batch_size=2)
    assert wl.flops_per_token is None
    bench = run_benchmark(
        wl, resolve_peers("compiled-model,fasttrain-compiled"), steps=2, warmup=1, repeats=1,
        progress=False, gpu_metrics=False,
    )
    assert [(p.name, p.status) for p in bench.peers] == [
        ("bare", "unavailable"), ("compiled-model", "unavailable"), ("fasttrain-compiled", "unavailable"),
    ]
    assert all(p.reason.startswith("transformers is not installed") for p in bench.peers)
    assert all("pip install transformers" in p.reason for p in bench.peers)


def test_compiled_model_loop_compiles_the_model_and_trains_like_the_bare_loop():
    assert "compiled-model" in PEERS
    wl = make_workload("mlp", size="tiny", device="cpu", batch_size=4)
    bare, compiled = make_peer("bare", wl), make_peer("compiled-model", wl)
    for peer in (bare, compiled):
        peer.setup()
        peer.run(3)
    assert isinstance(compiled.model, torch._dynamo.eval_frame.OptimizedModule)
    for a, b in zip(bare.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(bare.model.net[0].weight, wl.make_model().net[0].weight)  # it trained


def test_cli_bench_runs_hf_gpt2(tmp_path, capsys):
    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    try:
        rc = main([
            "bench", "--workload", "hf-gpt2", "--device", "cpu", "--batch-size", "2", "--steps", "2",
            "--warmup", "1", "--repeats", "1", "--peers", "fasttrain-eager", "--out", str(tmp_path),
            "--no-progress",
        ])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    text = (tmp_path / "hf-gpt2-tiny.md").read_text()
    assert "hf-gpt2 (tiny, batch 2, fp32, AdamW)" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "unavailable" not in rows["bare"] and "unavailable" not in rows["fasttrain-eager"]
