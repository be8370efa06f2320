"""The `fasttrain` command line: version, help, errors, output folders, labels and estimates."""

import json
import os
import re

import pytest
import torch
from torch import nn

from fasttrain import __version__
from fasttrain.bench.readme import ReadmeTableError, render_table, rewrite_tables
from fasttrain.bench.report import format_markdown, format_table, summarize
from fasttrain.bench.runner import BenchResult, PeerResult
from fasttrain.bench.workloads import make_workload
from fasttrain.cli import _estimate, _out_dir, build_parser, main


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"fasttrain {__version__}"


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    # the workload's help names each choice's needs, then argparse's default
    assert re.search(r"--workload \{[^}]*\} synthetic workload \(hf-gpt2: [^)]*\) \(default: mlp\)", text)
    assert "convnet 32 (CPU) / 512 (CUDA)" in text
    assert "mlp cpu: 150/10/5" in text


def test_bench_error_prints_bench_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--channels-last"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fasttrain bench") and "convnet only" in err


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    (tmp_path / "mlp-tiny.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--out", str(tmp_path), "--steps", "1", "--repeats", "1", "--peers", "bare"])
    assert exc.value.code == 2
    assert "mlp-tiny.json already exists; pass --force" in capsys.readouterr().err
    assert (tmp_path / "mlp-tiny.json").read_text() == "{}"  # untouched


def test_default_out_is_a_new_folder_per_run():
    args = build_parser().parse_args(["bench"])
    path = _out_dir(args, "cpu", "tiny")
    assert os.path.dirname(path) == "bench_out"
    assert os.path.basename(path).startswith("mlp-tiny-cpu-")


def test_cpu_default_batch_is_small_enough():
    assert make_workload("convnet", device="cpu").batch_size == 32
    assert make_workload("convnet", device="cpu", batch_size=8).batch_size == 8
    assert make_workload("mlp", device="cpu").batch_size == 64


def test_estimate_only_for_long_runs():
    quick = PeerResult("bare", setup_s=0.5)
    assert _estimate(quick, warmup=10, steps=150, repeats=5, num_peers=8) is None
    slow = PeerResult("bare", setup_s=14 * 0.5)  # 14 set-up steps of 0.5 s
    line = _estimate(slow, warmup=2, steps=8, repeats=3, num_peers=8)
    # per peer: 7 s of set-up + 3 repeats of 12 steps at 0.5 s = 25 s; 8 peers: 200 s
    assert line.startswith("estimate: about 3 min for 8 peers (~25 s each")


def _bench_result(interrupted=False, completed=3):
    peers = [
        PeerResult("bare", step_times=[0.010, 0.012, 0.011]),
        PeerResult("fasttrain-cudagraph", step_times=[0.020, 0.024, 0.021], engine="compiled",
                   engine_fallback="CUDA graphs need a CUDA device"),
        PeerResult("fasttrain-eager", step_times=[0.011, 0.012, 0.010], engine="eager"),
    ]
    wl = {"workload": "mlp", "size": "tiny", "batch_size": 64, "amp_dtype": "fp32", "device": "cpu",
          "items": "samples", "items_per_step": 64}
    settings = {"steps": 10, "warmup": 2, "repeats": 5 if interrupted else 3, "clock": "cpu",
                "threads": 1, "command": "fasttrain bench"}
    return BenchResult(wl, settings, peers, interrupted=interrupted, completed_repeats=completed)


def test_tables_name_the_engine_that_ran():
    bench = _bench_result()
    rows = summarize(bench)
    assert [r["engine"] for r in rows] == [None, "compiled", "eager"]
    assert rows[1]["engine_fallback"] == "CUDA graphs need a CUDA device"
    # ratios paired per repeat: 0.010/0.020, 0.012/0.024, 0.011/0.021
    assert (rows[1]["ratio_vs_bare"], rows[1]["ratio_vs_bare_min"], rows[1]["ratio_vs_bare_max"]) == pytest.approx(
        (0.5, 0.5, 0.011 / 0.021)
    )
    assert "0.50 [0.50-0.52]" in format_table(bench, rows)
    for text in (format_table(bench, rows), format_markdown(bench, rows)):
        assert "fasttrain-cudagraph (ran compiled)" in text
        assert "fasttrain-eager (ran" not in text


def test_interrupted_run_is_marked():
    bench = _bench_result(interrupted=True, completed=3)
    assert "INTERRUPTED after 3 of 5 repeats" in format_table(bench, summarize(bench))


def test_readme_table_from_result_file(tmp_path):
    bench = _bench_result()
    result = {"environment": {"device_name": "Test CPU", "torch": "2.x"}, **bench.to_dict()}
    (tmp_path / "res.json").write_text(json.dumps(result))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench-table: res.json -->\nstale\n<!-- /bench-table -->\nend\n")
    assert rewrite_tables(str(readme), check=True) == ["res.json"]
    assert "stale" in readme.read_text()  # --check writes nothing
    assert rewrite_tables(str(readme)) == ["res.json"]
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("<!-- /bench-table -->\nend\n")
    assert rewrite_tables(str(readme), check=True) == []
    table = render_table(result, "res.json")
    assert "3 interleaved repeats" in table
    # per-repeat ratios bare/peer: 0.5, 0.5, 0.5238 -> median 0.50 [0.50-0.52]
    assert "| fasttrain-cudagraph (ran compiled) | 47.6 [41.7-50] | 0.50 [0.50-0.52] | n/a |" in table
    assert "| bare | 90.9 [83.3-100] | 1.00 [1.00-1.00] |" in table
    assert ": mlp tiny, batch 64, fp32; 10 steps" in table  # no optimizer recorded: none named
    # a workload that records its optimizer names it, as the report's title does
    result["workload"]["optimizer"] = "AdamW(fused=True)"
    assert ": mlp tiny, batch 64, fp32, AdamW(fused=True); 10 steps" in render_table(result, "res.json")


def test_readme_section_quoted_verbatim_from_a_markdown_result_file(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "gpu.md").write_text(
        "# run\n\n- device: X\n\n## Engine checks\n\n| a | b |\n|---|---|\n| 1.82e-06 | 0.2710 |\n\n"
        "### failed\n\n- one\n\n## Loss gathering\n\nother\n"
    )
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- result-section: results/gpu.md#Engine checks -->\nstale\n<!-- /result-section -->\nend\n")
    assert rewrite_tables(str(readme), check=True) == ["results/gpu.md#Engine checks"]
    assert rewrite_tables(str(readme)) == ["results/gpu.md#Engine checks"]
    # everything under the heading down to the next level-2 heading, deeper headings included
    assert readme.read_text() == (
        "intro\n<!-- result-section: results/gpu.md#Engine checks -->\n| a | b |\n|---|---|\n| 1.82e-06 | 0.2710 |\n\n"
        "### failed\n\n- one\n<!-- /result-section -->\nend\n"
    )
    assert rewrite_tables(str(readme), check=True) == []
    readme.write_text("<!-- result-section: results/gpu.md#Kernels -->\n<!-- /result-section -->\n")
    with pytest.raises(ReadmeTableError, match="no '## Kernels' section; its sections: Engine checks, Loss gathering"):
        rewrite_tables(str(readme))
    readme.write_text("<!-- result-section: results/none.md#Kernels -->\n<!-- /result-section -->\n")
    with pytest.raises(ReadmeTableError, match="names results/none.md, which does not exist"):
        rewrite_tables(str(readme))


def test_committed_readme_matches_its_result_files():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert rewrite_tables(os.path.join(root, "README.md"), check=True) == []


@pytest.mark.parametrize("callbacks", [None, []])
def test_trainer_accepts_no_callbacks(callbacks):
    from fasttrain import Trainer

    m = nn.Linear(2, 1)
    trainer = Trainer(m, nn.MSELoss(), torch.optim.SGD(m.parameters(), lr=0.1), callbacks=callbacks)
    assert trainer.callback_handler.callbacks == []
    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    trainer.train(data, num_epochs=1, per_device_batch_size=4)
    assert trainer.num_updates == 2


def test_trainer_callbacks_error_says_what_to_pass():
    from fasttrain import Trainer

    m = nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"callbacks must be a list of callback classes or instances \(or None"):
        Trainer(m, nn.MSELoss(), torch.optim.SGD(m.parameters(), lr=0.1), callbacks=3)


def test_missing_matplotlib_says_how_to_get_the_chart(tmp_path, monkeypatch, capsys):
    import fasttrain.bench.report as report
    import fasttrain.cli as cli

    monkeypatch.setattr(cli, "_has_matplotlib", lambda: False)
    monkeypatch.setattr(report, "_write_png", lambda *a: False)
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "--steps", "2", "--warmup", "1", "--repeats", "1", "--peers", "bare",
                   "--out", str(tmp_path), "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count("pip install 'fasttrain[plot]'") == 1
    assert not (tmp_path / "mlp-tiny.png").exists()
