"""Tests change torch's configuration modules (``torch._inductor.config``, ``torch._dynamo.config``,
``torch._functorch.config``, ...) only through torch's own ``config.patch``. pytest's
``monkeypatch.setattr`` on such a module is undone (pytest >= 9.2) by deleting the entry, after
which every later compile in the session fails; a plain assignment stays for the rest of the
session."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _dotted(node):
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _is_torch_config(name) -> bool:
    return name is not None and name.startswith("torch.") and name.rsplit(".", 1)[-1] == "config"


def _patches_torch_config(call: ast.Call) -> bool:
    """``monkeypatch.setattr(torch.x.config, ...)``, ``setattr(torch.x.config, ...)``, their
    ``delattr`` and the string form ``monkeypatch.setattr("torch.x.config.name", ...)``."""
    function = _dotted(call.func) or ""
    if function.rsplit(".", 1)[-1] not in ("setattr", "delattr") or not call.args:
        return False
    target = call.args[0]
    if isinstance(target, ast.Constant) and isinstance(target.value, str):
        return _is_torch_config(target.value.rsplit(".", 1)[0])
    return _is_torch_config(_dotted(target))


def torch_config_changes(source: str, filename: str = "<test>"):
    """``(line, code)`` for each change of a torch configuration module made other than
    through its ``patch``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and _patches_torch_config(node):
            found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(item, ast.Attribute) and _is_torch_config(_dotted(item.value)):
                    found.append((node.lineno, ast.unparse(item)))
    return sorted(found)


def test_the_scan_finds_every_form():
    source = "\n".join([
        'monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)',
        'monkeypatch.delattr(torch._dynamo.config, "recompile_limit")',
        'setattr(torch._functorch.config, "enable_autograd_cache", False)',
        'monkeypatch.setattr("torch._inductor.config.max_autotune_gemm", False)',
        "torch._dynamo.config.recompile_limit = 2",
        "torch._dynamo.config.recompile_limit += 1",
        "torch._dynamo.config.a, torch._dynamo.config.b = limits",
        # not changes of a torch configuration module
        "with torch._inductor.config.patch(fx_graph_cache=False): pass",
        'monkeypatch.setattr(torch.Tensor, "item", counting)',
        "trainer.run_config = config",
        "limit = torch._dynamo.config.recompile_limit",
    ])
    assert [line for line, _ in torch_config_changes(source)] == [1, 2, 3, 4, 5, 6, 7, 7]


def test_tests_change_torch_configuration_only_through_its_patch():
    found = [
        f"{path.relative_to(TESTS)}:{line}: {code}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, code in torch_config_changes(path.read_text(), str(path))
    ]
    assert found == [], "use torch's config.patch(...) (a context manager or decorator) instead:\n" + "\n".join(found)
