#!/usr/bin/env bash
# The GPU benchmark in one command: every peer side by side on three workloads, the fused-kernel
# micro-benchmark when present, and a result file benchmarks/results/<date>-<gpu>.md that records
# the device, driver, torch and triton versions with the tables.
#
#   bash benchmarks/run_gpu.sh              # from the repository root, fasttrain installed
#   PYTHON=/path/to/python bash benchmarks/run_gpu.sh
#
# Extra arguments are passed to every `fasttrain bench` call (e.g. --repeats 5 or --peers ...).
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "run_gpu.sh needs an NVIDIA GPU: nvidia-smi was not found" >&2
    exit 1
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "run_gpu.sh: torch sees no CUDA device (is the CPU build of torch installed?)" >&2
    exit 1
fi

DATE=$(date -u +%Y-%m-%d)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)
SLUG=$(printf '%s' "$GPU" | tr -cs 'A-Za-z0-9' '-' | sed 's/^-//; s/-$//')
OUT="bench_out/gpu-$DATE-$SLUG"
RESULT="benchmarks/results/$DATE-$SLUG.md"
mkdir -p "$OUT" benchmarks/results

VERSIONS=$("$PY" - <<'EOF'
import importlib.metadata as md
import torch
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
for dist in ("triton", "fasttrain", "pytorch-accelerated", "lightning", "accelerate"):
    print(f"{dist} {version(dist)}")
EOF
)

FAILED=()
bench() {
    local name=$1
    shift
    echo "== fasttrain bench $*" >&2
    if ! "$PY" -m fasttrain.cli bench --device cuda --no-progress --force --out "$OUT" "$@" "${EXTRA[@]}" \
        2>"$OUT/$name.stderr" | tee "$OUT/$name.txt"; then
        FAILED+=("$name (see $OUT/$name.stderr)")
    fi
}
EXTRA=("$@")

bench mlp --workload mlp --size small --batch-size 64
bench gpt-124m --workload gpt --size 124m --precision bf16
bench convnet --workload convnet --size small --channels-last

CLIP=""
if [ -f benchmarks/kernels/bench_clip.py ]; then
    echo "== benchmarks/kernels/bench_clip.py" >&2
    if ! "$PY" benchmarks/kernels/bench_clip.py >"$OUT/bench_clip.txt" 2>"$OUT/bench_clip.stderr"; then
        FAILED+=("bench_clip.py (see $OUT/bench_clip.stderr)")
    fi
    CLIP=$(cat "$OUT/bench_clip.txt")
fi

{
    echo "# fasttrain GPU benchmark, $DATE"
    echo
    echo "- device: $GPU (driver $DRIVER)"
    echo "$VERSIONS" | sed 's/^/- /'
    echo "- host: $(nproc) CPU cores, $(uname -sr)"
    echo "- command: \`bash benchmarks/run_gpu.sh $*\`"
    echo
    echo "Method: benchmarks/README.md. Ratios are medians of one interleaved run; \`x bare\` > 1"
    echo "is faster than the hand-written eager loop. Raw JSON/CSV: \`$OUT/\` (not committed)."
    echo
    for table in mlp-small gpt-124m convnet-small; do
        if [ -f "$OUT/$table.md" ]; then
            echo "## $table"
            echo
            cat "$OUT/$table.md"
            echo
        fi
    done
    if [ -n "$CLIP" ]; then
        echo "## fused gradient clipping (benchmarks/kernels/bench_clip.py)"
        echo
        echo '```'
        echo "$CLIP"
        echo '```'
        echo
    fi
    if [ ${#FAILED[@]} -gt 0 ]; then
        echo "## failed"
        echo
        printf -- '- %s\n' "${FAILED[@]}"
    fi
} >"$RESULT"

echo "wrote $RESULT" >&2
[ ${#FAILED[@]} -eq 0 ]
