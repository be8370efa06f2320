"""Checkpoints are data, never code: loads use ``weights_only=True`` and refuse pickled objects,
and the package itself never evaluates strings."""

import ast
import hashlib
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from tiny_run import build_trainer, train_kwargs  # noqa: E402

from fasttrain import checkpointing  # noqa: E402
from fasttrain.checkpointing import CheckpointError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MARKER = "fasttrain_payload_ran"


class Payload:
    """Unpickling this runs ``os.system``: what a malicious checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _malicious(path: Path, marker: Path, as_checkpoint: bool, legacy: bool = False):
    model = torch.nn.Linear(4, 4).state_dict()
    obj = {"model_state_dict": model, "extra": Payload(marker)} if as_checkpoint else {**model, "x": Payload(marker)}
    if legacy:  # a bare pickle, which torch.load also reads
        with open(path, "wb") as f:
            pickle.dump(obj, f, protocol=2)
    else:
        torch.save(obj, path)


@pytest.fixture(scope="module")
def trainer():
    trainer, _ = build_trainer()
    trainer.train(**train_kwargs(num_epochs=1, eval_data=False, scheduler=False))
    return trainer


@pytest.mark.parametrize("legacy", [False, True], ids=["torch-zip", "bare-pickle"])
def test_checkpoint_with_pickled_object_is_refused(tmp_path, trainer, legacy):
    marker = tmp_path / MARKER
    path = tmp_path / "evil.pt"
    _malicious(path, marker, as_checkpoint=True, legacy=legacy)
    with pytest.raises(CheckpointError, match="Refusing to load .*could run arbitrary code"):
        trainer.load_checkpoint(path)
    assert not marker.exists()


def test_training_state_with_pickled_object_is_refused(tmp_path, trainer):
    # even with a manifest that matches the swapped file, the load itself refuses it
    state = tmp_path / "state"
    trainer.save_training_state(state)
    marker = tmp_path / MARKER
    _malicious(state / "model.pt", marker, as_checkpoint=False)
    manifest_path = state / checkpointing.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    data = (state / "model.pt").read_bytes()
    manifest["files"]["model.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="Refusing to load"):
        trainer.load_training_state(state)
    assert not marker.exists()


def test_saved_states_load_with_weights_only(tmp_path, trainer):
    trainer.save_training_state(tmp_path / "state")
    for path in (tmp_path / "state").glob("*.pt"):
        torch.load(path, weights_only=True)  # raises if anything but plain data was saved
    trainer.save_checkpoint(tmp_path / "c.pt", checkpoint_kwargs={"note": "text", "step": 3})
    torch.load(tmp_path / "c.pt", weights_only=True)


def _sources():
    for folder in ("fasttrain", "kernels"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def _dynamic_code_calls(tree: ast.AST):
    """Calls of the eval/exec/compile builtins, however they are reached (by name,
    ``builtins.eval``, ``getattr(builtins, "exec")``)."""
    forbidden = {"eval", "exec", "compile"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in forbidden:
            yield node.lineno, func.id
        elif isinstance(func, ast.Attribute) and func.attr in forbidden:
            if isinstance(func.value, ast.Name) and func.value.id in ("builtins", "__builtins__"):
                yield node.lineno, f"builtins.{func.attr}"
        elif isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in forbidden:
                yield node.lineno, f"getattr(..., {name.value!r})"


def test_package_source_has_no_eval_or_exec():
    sources = list(_sources())
    assert len(sources) > 10
    found = []
    for path in sources:
        tree = ast.parse(path.read_text(), filename=str(path))
        found += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in _dynamic_code_calls(tree)]
    assert found == [], "dynamic code execution in the package:\n" + "\n".join(found)


def test_scanner_finds_what_it_should():
    code = "eval('1')\nbuiltins.exec('x')\ngetattr(builtins, 'eval')('2')\nmodel.eval()\ntorch.compile(f)\n"
    assert [what for _, what in _dynamic_code_calls(ast.parse(code))] == [
        "eval",
        "builtins.exec",
        "getattr(..., 'eval')",
    ]
