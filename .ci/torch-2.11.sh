#!/usr/bin/env bash
# CI job: the engine, kernel, sharding and Lightning tests on torch 2.11, the oldest torch fasttrain
# supports and the one the GPU machines run (the main job runs everything on torch 2.13).
#
# Every run starts from a fresh virtual environment under the cache folder (nothing installed by
# an earlier run can hide a missing dependency). The registry's torch 2.11 is a CUDA build (it
# imports and runs on a machine without a GPU) whose wheels weigh about 3 GB: they are kept in
# the cache folder's wheels-torch-2.11.0/ between runs, since pip's HTTP cache may not keep them
# (.ci/run's own wheels/ holds the files of its torch 2.13 run only).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
TORCH_VERSION=2.11.0
TRITON_VERSION=3.6.0
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/fasttrain-ci"
VENV="$CACHE/torch-$TORCH_VERSION"
WHEELS="$CACHE/wheels-torch-$TORCH_VERSION"
PINS=("torch==$TORCH_VERSION" "triton==$TRITON_VERSION")

start=$SECONDS
rm -rf "$VENV"
mkdir -p "$WHEELS"
python3 -m venv "$VENV"
# torch, triton and their dependencies from the kept wheels; fetched only when one is missing
if ! "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" "${PINS[@]}" 2>/dev/null; then
    "$VENV/bin/python" -m pip download -q -d "$WHEELS" "${PINS[@]}"
    "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" "${PINS[@]}"
fi
# the pins again, so that no dependency of the dev extra moves torch or triton
"$VENV/bin/python" -m pip install -q "${PINS[@]}" -e ".[dev]"
"$VENV/bin/python" - "$TORCH_VERSION" "$TRITON_VERSION" <<'EOF'
import sys
import torch
import triton

want_torch, want_triton = sys.argv[1:]
if torch.__version__.split("+")[0] != want_torch or triton.__version__ != want_triton:
    sys.exit(f"torch {torch.__version__}, triton {triton.__version__} installed; this job tests "
             f"torch {want_torch} with triton {want_triton}")
print(f"torch {torch.__version__}, triton {triton.__version__}")
EOF
echo "ci torch $TORCH_VERSION: installed in $((SECONDS - start)) s"

# the areas that lean on torch's internals (dynamo, inductor, AOTAutograd, DTensor and FSDP2,
# c10d, the Triton kernels), compiled regions (equal to eager on a model with a final norm), and
# Lightning on top of the engines; chosen by name, so that new test files of these areas run here
# too. Tests marked slow (soaks, many trainers) run on 2.13 only.
shopt -s nullglob
TESTS=(
    tests/test_differential*.py
    tests/test_engine*.py
    tests/test_finetuning.py
    tests/test_kernels*.py
    tests/test_fsdp*.py
    tests/test_distributed.py
    tests/test_lightning*.py
    tests/test_regional.py
)
if [ "${#TESTS[@]}" -eq 0 ]; then
    echo "torch $TORCH_VERSION job: no test files match" >&2
    exit 1
fi
status=0
step=$SECONDS
TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}" \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "${TESTS[@]}" || status=$?
echo "ci torch $TORCH_VERSION: the tests took $((SECONDS - step)) s"
if [ "$status" -eq 5 ]; then
    echo "torch $TORCH_VERSION job: pytest collected no tests" >&2
    exit 1
fi
exit "$status"
