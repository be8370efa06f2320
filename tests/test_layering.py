"""The dependencies point one way: cli/bench -> trainer -> engine -> kernels. Engines know the
trainer only through the StepContext it builds (fasttrain/engine/context.py)."""

import ast
from pathlib import Path

import fasttrain

PACKAGE = Path(fasttrain.__file__).parent
KERNELS = Path(fasttrain.kernels.__file__).parent
# what sits above the engines: the Trainer and everything that drives or observes it
ABOVE_ENGINE = (
    "fasttrain.trainer", "fasttrain.callbacks", "fasttrain.prepare", "fasttrain.loops",
    "fasttrain.checkpointing", "fasttrain.signals", "fasttrain.nonfinite", "fasttrain.lightning",
    "fasttrain.step_metrics", "fasttrain.resume", "fasttrain.progress",
)


def imported_modules(path: Path):
    """Every module ``path`` imports, at any depth (imports inside functions count too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            for alias in node.names:  # from fasttrain import trainer
                yield f"{node.module}.{alias.name}"


def _is_under(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def engine_files():
    return sorted((PACKAGE / "engine").glob("*.py"))


def test_engine_modules_import_nothing_above_them():
    assert len(engine_files()) >= 5
    offending = [
        (path.name, module)
        for path in engine_files()
        for module in imported_modules(path)
        if _is_under(module, ABOVE_ENGINE)
    ]
    assert offending == []


def test_kernels_import_no_engine_and_no_trainer():
    files = sorted(KERNELS.glob("*.py"))
    assert files
    offending = [
        (path.name, module)
        for path in files
        for module in imported_modules(path)
        if _is_under(module, ("fasttrain.engine",) + ABOVE_ENGINE)
    ]
    assert offending == []


def test_the_run_counters_import_nothing_from_fasttrain():
    # TrainProgress is read by the trainer, resume, checkpointing and the loops alike
    imported = list(imported_modules(PACKAGE / "progress.py"))
    assert imported and [m for m in imported if _is_under(m, ("fasttrain",))] == []


def test_engines_use_no_private_name_of_the_trainer():
    # ``trainer._x``, ``self.trainer._x`` and ``ctx.trainer._x``: the context carries all of that
    offending = []
    for path in engine_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            named_trainer = (isinstance(owner, ast.Name) and owner.id == "trainer") or (
                isinstance(owner, ast.Attribute) and owner.attr == "trainer"
            )
            if named_trainer:
                offending.append((path.name, node.lineno, node.attr))
    assert offending == []


def test_the_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from fasttrain.trainer import Trainer\nfrom fasttrain import callbacks\n")
    found = list(imported_modules(bad))
    assert "fasttrain.trainer" in found and "fasttrain.callbacks" in found
    assert _is_under("fasttrain.callbacks", ABOVE_ENGINE)
    assert not _is_under("fasttrain.callbacksx", ABOVE_ENGINE)


# The bench sits on top (cli/bench -> trainer): only it and the command line import it.
BENCH_USERS = ("bench", "cli.py", "__main__.py")


def test_nothing_below_the_bench_imports_it():
    offending = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in BENCH_USERS:
            continue
        offending += [(str(relative), m) for m in imported_modules(path) if _is_under(m, ("fasttrain.bench",))]
    assert offending == []


def test_the_hardware_module_imports_nothing_from_fasttrain():
    # the monitor (trainer level) and the bench both use it, so it must sit below both
    imported = list(imported_modules(PACKAGE / "hardware.py"))
    assert imported and [m for m in imported if _is_under(m, ("fasttrain",))] == []


def test_the_bench_checker_sees_an_import_of_the_bench(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from fasttrain import bench\n    import fasttrain.bench.hardware\n")
    found = list(imported_modules(bad))
    assert "fasttrain.bench" in found and "fasttrain.bench.hardware" in found
    assert all(_is_under(m, ("fasttrain.bench",)) for m in ("fasttrain.bench", "fasttrain.bench.hardware"))
