"""The kernels' custom ops exist once, however the package is reached.

From the root of a source checkout the ``kernels/`` directory is also importable as a top-level
``kernels`` package, and transformers imports that name while it looks for the Hugging Face
``kernels`` package. A second copy of the modules registered the ``fasttrain::`` ops again; once
that copy was freed, the ops were gone from under the installed one and its next call crashed the
process (a segmentation fault in the middle of a training run).
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import gc, importlib, sys
import torch
import fasttrain.kernels as installed

probed = importlib.import_module("kernels")  # as transformers' package probe does
one_copy = probed is installed and sys.modules["kernels.clip_norm"] is sys.modules["fasttrain.kernels.clip_norm"]
for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
    del sys.modules[name]
del probed
gc.collect()
print(float(installed.clip_grad_norm_([torch.ones(3)], 1.0)))
grads = [torch.full((2,), 3.0)]
installed.clip_grad_value_(grads, 1.0)
print(grads[0].tolist())
assert one_copy, "the top-level name is another copy of the kernels"
"""


def _run(script):
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_top_level_name_is_the_installed_package_and_the_ops_survive_it():
    done = _run(SCRIPT)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    norm = float(done.stdout.split()[0])
    assert norm == pytest.approx(math.sqrt(3.0))
    assert done.stdout.split(maxsplit=1)[1].strip() == "[1.0, 1.0]"


def test_transformers_sees_no_hugging_face_kernels_package_in_a_checkout():
    pytest.importorskip("transformers")
    script = (
        "from transformers.utils import import_utils as u\n"
        "import fasttrain.kernels, sys\n"
        "print(u.is_kernels_available(), sys.modules.get('kernels') is fasttrain.kernels)\n"
    )
    done = _run(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True"]
