"""The Lightning peers: the versions they run with agree with pyproject.toml's extras, and a
Lightning that fails to import or has another version is reported unavailable, with the reason,
while the rest of the benchmark runs."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from fasttrain.bench import peers
from fasttrain.bench.peers import FasttrainLightningPeer, LightningPeer, PeerUnavailable
from fasttrain.bench.runner import run_benchmark
from fasttrain.bench.workloads import make_workload

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")
from packaging.requirements import Requirement  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(extra: str):
    return [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]


def test_every_extra_installs_the_lightning_that_fasttrain_lightning_runs_with():
    found = {
        extra: str(req.specifier)
        for extra in PYPROJECT["project"]["optional-dependencies"]
        for req in _requirements(extra)
        if req.name == "lightning"
    }
    assert set(found) >= {"dev", "lightning", "peers"}
    pinned = SpecifierSet(peers.FASTTRAIN_LIGHTNING_REQUIRES)
    assert {extra: SpecifierSet(spec) for extra, spec in found.items()} == dict.fromkeys(found, pinned)
    # the plain Lightning peer accepts every version the extras install
    assert all(v in SpecifierSet(peers.LIGHTNING_REQUIRES) for v in ("2.6.0", "2.6.6"))


def test_the_readme_set_up_commands_name_existing_extras_and_a_torch_the_package_accepts():
    commands = re.findall(r'pip install "torch==([^"]+)" -e "\.\[(\w+)\]"', (ROOT / "README.md").read_text())
    assert {extra for _, extra in commands} >= {"peers", "dev"}
    torch_spec = next(
        Requirement(r).specifier for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == "torch"
    )
    for torch_version, extra in commands:
        assert extra in PYPROJECT["project"]["optional-dependencies"]
        assert torch_version in torch_spec
        for req in _requirements(extra):
            assert req.marker is None and len(req.specifier) > 0, f"{extra}: {req} has no version bound"


def _fake_lightning(monkeypatch, version: str):
    fake = types.ModuleType("lightning")
    fake.__version__ = version
    fake.LightningModule = torch.nn.Module
    monkeypatch.setitem(sys.modules, "lightning", fake)
    return fake


def _workload():
    return make_workload("mlp", size="tiny", device="cpu", batch_size=4, num_batches=3)


@pytest.mark.parametrize("version", ["2.5.0", "2.7.0", "3.0.0"])
def test_fasttrain_lightning_with_another_lightning_is_unavailable(monkeypatch, version):
    _fake_lightning(monkeypatch, version)
    peer = FasttrainLightningPeer(_workload())
    with pytest.raises(PeerUnavailable, match=rf"found {re.escape(version)}; pip install 'lightning>=2.6,<2.7'"):
        peer.setup()
    peer.close()


def test_the_lightning_peer_refuses_a_lightning_before_2(monkeypatch):
    _fake_lightning(monkeypatch, "1.9.5")
    with pytest.raises(PeerUnavailable, match=r"lightning runs with lightning>=2.0, found 1.9.5"):
        LightningPeer(_workload()).setup()


@pytest.fixture
def broken_lightning(tmp_path, monkeypatch):
    """A ``lightning`` package whose import raises something other than ImportError, as one
    built against another torch does."""
    package = tmp_path / "lightning"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('built for another torch\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.delitem(sys.modules, name)


def test_a_lightning_that_fails_to_import_is_unavailable_with_the_reason(broken_lightning):
    with pytest.raises(PeerUnavailable, match=r"^lightning fails to import: RuntimeError: built for another torch$"):
        LightningPeer(_workload()).setup()


def test_the_benchmark_runs_on_without_the_lightning_peers(broken_lightning):
    # the bare loop's repeat ran: timed, or dropped as invalid where the long run's extra steps
    # did not outlast the noise of a busy machine (a difference that is not positive), which even
    # 40 steps sometimes did not
    result = run_benchmark(
        _workload(), ["bare", "lightning", "fasttrain-lightning"], steps=40, warmup=1, repeats=1,
        progress=False, count_syncs=False, gpu_metrics=False,
    )
    by_name = {p.name: p for p in result.peers}
    assert by_name["bare"].status == "ok"
    assert len(by_name["bare"].step_times) + by_name["bare"].invalid_repeats == 1
    for name in ("lightning", "fasttrain-lightning"):
        assert by_name[name].status == "unavailable"
        assert by_name[name].reason == "lightning fails to import: RuntimeError: built for another torch"
