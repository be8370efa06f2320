"""Every ```python block of README.md and docs/ runs as written.

The blocks of one Markdown file run in order, in one fresh Python process, like the cells of a
notebook: a later block may use what an earlier one defined. New files under docs/ are picked up
on their own. A block that is deliberately a fragment (a signature, pseudo-code, something that
needs a GPU or a cluster) is preceded by a comment giving the reason, on the line right above
its fence:

    <!-- not-run: needs two GPUs -->

Use it sparingly: a block that can run, with tiny sizes, should.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.*?)\s*-->\s*$")


def markdown_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(text: str):
    """``(line, source, skip_reason)`` for each ```python block; ``skip_reason`` is None for a
    block that runs, the comment's reason for a ``not-run`` one."""
    blocks = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _NOT_RUN.search(before)
        blocks.append((line, match.group(1), marker.group(1) if marker else None))
    return blocks


def _files_with_blocks():
    return [p for p in markdown_files() if python_blocks(p.read_text())]


def test_block_extraction_and_the_not_run_marker():
    text = (
        "intro\n```python\nx = 1\n```\n\n<!-- not-run: needs a GPU -->\n```python\ny = x.cuda()\n```\n"
        "```bash\nls\n```\n```python\nassert x == 1\n```\n"
    )
    assert python_blocks(text) == [(2, "x = 1\n", None), (7, "y = x.cuda()\n", "needs a GPU"), (13, "assert x == 1\n", None)]


_DRIVER = """
import json, runpy, sys, traceback
results = {}
for name, script in json.loads(sys.argv[1]).items():
    try:
        runpy.run_path(script, run_name="__main__")  # a fresh namespace per Markdown file
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()[-3000:]
print("RESULTS" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def block_results(tmp_path_factory):
    """Run the blocks of every file in one interpreter (one import of torch, not one per file),
    each file from its own script and namespace."""
    work = tmp_path_factory.mktemp("docs_blocks")
    scripts, maps = {}, {}
    for path in _files_with_blocks():
        name = str(path.relative_to(ROOT))
        lines, starts = [], []
        for line, source, reason in python_blocks(path.read_text()):
            if reason is None:
                starts.append((len(lines) + 2, line + 1))
                lines.append(f"# --- {name}, block at line {line}")
                lines.extend(source.splitlines())
        folder = work / name.replace(os.sep, "_")
        folder.mkdir()
        script = folder / "blocks.py"
        script.write_text("\n".join(lines) + "\n")
        scripts[name], maps[name] = str(script), starts
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    # run where the blocks' files (checkpoints, logs) may be written
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(scripts)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout.rsplit("RESULTS", 1)
    assert len(out) == 2, proc.stderr[-3000:]
    return json.loads(out[1]), maps


@pytest.mark.parametrize("path", _files_with_blocks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_python_blocks_run(path, block_results):
    name = str(path.relative_to(ROOT))
    for line, _, reason in python_blocks(path.read_text()):
        assert reason is None or reason.strip(), f"{name}:{line}: a not-run comment must give a reason"
    results, maps = block_results
    where = ", ".join(f"script line {s} = {name} line {l}" for s, l in maps[name])
    assert results[name] is None, f"{name}: a block failed ({where})\n{results[name]}"
