"""Make a bare copy of this repository runnable for `run_gpu.sh`, on a machine without a registry.

    python3 benchmarks/setup_env.py [--wheels DIR] [--target DIR] [--check-only]

``fasttrain.kernels`` exists only through the ``package-dir`` mapping in pyproject.toml (the
folder is ``kernels/``), so running from the source tree is not enough: fasttrain must be
installed. This script checks the packages the GPU run needs, installs this copy with
``pip install --no-deps --no-build-isolation -e .`` when ``import fasttrain.kernels`` does not
resolve to it (setuptools is the only build requirement, and nothing is downloaded), and installs
the wheels of ``--wheels DIR`` (pytorch-accelerated 0.1.61, say) into ``--target`` with
``pip install --no-index --no-deps --target``, before anything is checked (a carried wheel
counts as present); put ``--target`` on ``PYTHONPATH`` afterwards.

Exit status 0: ready. Otherwise one line on stderr says what is missing and what to do.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: module -> distribution, needed by every part of the run
REQUIRED: Dict[str, str] = {
    "torch": "torch",
    "accelerate": "accelerate",
    "pytest": "pytest",
    "setuptools": "setuptools",
    "tqdm": "tqdm",
}
#: needed on CUDA only: the fused kernels, and the bench's NVML sampling
REQUIRED_CUDA: Dict[str, str] = {"triton": "triton", "pynvml": "nvidia-ml-py"}
#: peers and figures that are reported unavailable when missing, not fatal
OPTIONAL: Dict[str, str] = {
    "pytorch_accelerated": "pytorch-accelerated (carry its wheel: --wheels DIR)",
    "transformers": "transformers",
    "lightning": "lightning",
    "matplotlib": "matplotlib",
    "pytest_benchmark": "pytest-benchmark",
}


class SetupError(RuntimeError):
    """The copy cannot be made runnable; the message is the one line to show."""


def missing(modules: Dict[str, str], find_spec: Callable = importlib.util.find_spec) -> List[str]:
    """The distributions of ``modules`` that cannot be imported."""
    out = []
    for module, dist in modules.items():
        try:
            found = find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(dist)
    return out


def wheel_files(folder: str) -> List[str]:
    if not os.path.isdir(folder):
        raise SetupError(f"--wheels {folder}: no such folder; give the folder holding the .whl files")
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        raise SetupError(f"--wheels {folder}: the folder holds no .whl files")
    return wheels


def _pip(args: List[str], what: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SetupError(f"{what} failed: {pip_error_line(result.stderr + result.stdout, result.returncode)}")


def pip_error_line(output: str, returncode: int) -> str:
    """The line of pip's output that says what went wrong: the build's own ``error:`` line when
    there is one (pip's closing lines only point back at it)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if line.lower().startswith("error:") and "metadata-generation-failed" not in line and "subprocess-exited" not in line:
            return line
    return lines[-1] if lines else f"pip exited {returncode}"


def build_backend_problem(setuptools_version: str, has_wheel: bool) -> Optional[str]:
    """Why ``pip install --no-build-isolation -e .`` cannot build here, or None. setuptools gained
    its own ``bdist_wheel`` in 70.1; older ones need the ``wheel`` package beside them."""
    try:
        major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", setuptools_version).groups())
    except (AttributeError, ValueError):
        return None
    if (major, minor) < (70, 1) and not has_wheel:
        return (
            f"setuptools {setuptools_version} needs the 'wheel' package to install this copy; "
            "install wheel, or setuptools >= 70.1"
        )
    return None


def install_wheels(folder: str, target: str) -> None:
    """Install every wheel of ``folder`` into ``target`` without a registry or dependencies."""
    os.makedirs(target, exist_ok=True)
    _pip(["install", "--quiet", "--no-index", "--no-deps", "--upgrade", "--target", target, *wheel_files(folder)],
         f"installing the wheels of {folder}")


def fasttrain_location(extra_path: Optional[str] = None) -> Optional[str]:
    """The folder ``import fasttrain.kernels`` resolves to outside this repository's root (where
    the source folder would shadow an installed copy), or None when it does not import."""
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    code = "import os, fasttrain, fasttrain.kernels; print(os.path.dirname(os.path.abspath(fasttrain.__file__)))"
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env)
    return result.stdout.strip() if result.returncode == 0 else None


def ensure_fasttrain(check_only: bool, extra_path: Optional[str] = None) -> str:
    """Install this copy editable unless ``fasttrain.kernels`` already imports from it."""
    here = os.path.join(REPO, "fasttrain")
    where = fasttrain_location(extra_path)
    if where is not None and os.path.samefile(where, here):
        return "fasttrain: this copy is installed"
    if check_only:
        found = f"imports from {where}" if where else "does not import"
        raise SetupError(f"fasttrain {found}; run without --check-only to install this copy ({REPO})")
    import setuptools

    problem = build_backend_problem(setuptools.__version__, importlib.util.find_spec("wheel") is not None)
    if problem:
        raise SetupError(problem)
    _pip(["install", "--quiet", "--no-deps", "--no-build-isolation", "-e", REPO], "pip install -e of this copy")
    where = fasttrain_location(extra_path)
    if where is None or not os.path.samefile(where, here):
        raise SetupError(f"fasttrain.kernels still does not import from {REPO} after pip install -e")
    return "fasttrain: installed this copy (pip install --no-deps --no-build-isolation -e .)"


def setup(device: str, wheels: Optional[str], target: Optional[str], check_only: bool) -> List[str]:
    """Install the carried wheels, then check; returns notes for the log, raises SetupError with
    the one line to show. The wheels come first: a package they carry counts as present."""
    notes = []
    if wheels:
        if target is None:
            raise SetupError("--wheels needs --target, the folder to install the wheels into")
        if check_only:
            wheel_files(wheels)
        else:
            install_wheels(wheels, target)
            notes.append(f"installed {len(wheel_files(wheels))} wheel(s) from {wheels} into {target}")
        sys.path.insert(0, target)
        importlib.invalidate_caches()
    need = dict(REQUIRED, **(REQUIRED_CUDA if device == "cuda" else {}))
    absent = missing(need)
    if absent:
        raise SetupError(
            f"missing Python packages: {', '.join(absent)} (install them for {sys.executable}; "
            "without a registry, carry their wheels in the --wheels folder)"
        )
    notes.append(ensure_fasttrain(check_only, target if wheels else None))
    optional = missing(OPTIONAL)
    if optional:
        notes.append(f"not installed, reported as unavailable: {', '.join(optional)}")
    return notes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--wheels", default=None, help="folder of wheels to install without a registry")
    parser.add_argument("--target", default=None, help="folder the wheels go to (add it to PYTHONPATH)")
    parser.add_argument("--check-only", action="store_true", help="install nothing; fail if anything is missing")
    args = parser.parse_args(argv)
    try:
        notes = setup(args.device, args.wheels, args.target, args.check_only)
    except SetupError as error:
        print(f"run_gpu.sh setup: {error}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"setup: {note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
