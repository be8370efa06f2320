#!/usr/bin/env bash
# Everything fasttrain checks and measures on a GPU, from a bare copy of the repository.
#
#   bash benchmarks/run_gpu.sh --wheels /path/to/wheels --part check   # invocation 1 (< 9 min)
#   bash benchmarks/run_gpu.sh --wheels /path/to/wheels --part bench   # invocation 2 (< 9 min)
#   bash benchmarks/run_gpu.sh --device cpu --tiny                     # the CPU mode (minutes)
#
# Options:
#   --device cuda|cpu   default cuda; cpu runs every step at CPU sizes (no speed claims)
#   --part check|bench|all
#                       check: set-up, `pytest -m gpu`, engine checks (benchmarks/gpu_check.py)
#                       bench: the bench tables of the three workloads with every peer, and the
#                              fused-clip and loss-gathering kernel benchmarks.  all (default): both, one after the other
#   --out DIR           logs and results (default bench_out/<device>-<date>-<gpu>); give both
#                       invocations the same folder (the default does, on the same day)
#   --wheels DIR        a folder of wheels (pytorch-accelerated 0.1.61), installed without a registry
#                       into OUT/site, which is put on PYTHONPATH
#   --results DIR       where the dated result file goes (default benchmarks/results; cpu: none)
#   --tiny              the smallest sizes and the aot_eager compile backend (what CI runs)
#   -- ARGS             passed on to every `fasttrain bench` call
#
# Every step runs under its own time limit (the *_LIMIT_S constants below) so one invocation ends
# within 9 minutes; a step that fails or runs out of time is recorded and makes the exit status 1.
# Exit status 2: the machine is not set up (one line says what is missing).
set -uo pipefail

# seconds per step on CUDA; each part's steps add up to at most 510 s
PYTEST_LIMIT_S=200
CHECK_LIMIT_S=310
BENCH_MLP_LIMIT_S=110
BENCH_GPT_LIMIT_S=220
BENCH_CONVNET_LIMIT_S=120
CLIP_LIMIT_S=45
LOSS_ACCUM_LIMIT_S=15
# the CPU mode's limits are these times as long
CPU_LIMIT_FACTOR=3
# the bench's repeats on CUDA: enough for a median with a range, within the limits above
BENCH_REPEATS=3

cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
DEVICE=cuda
PART=all
OUT=""
WHEELS=""
RESULTS=""
TINY=0
BENCH_EXTRA=()
COMMAND="bash benchmarks/run_gpu.sh $*"

die() { echo "run_gpu.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=${2:-}; shift 2 ;;
        --part) PART=${2:-}; shift 2 ;;
        --out) OUT=${2:-}; shift 2 ;;
        --wheels) WHEELS=${2:-}; shift 2 ;;
        --results) RESULTS=${2:-}; shift 2 ;;
        --tiny) TINY=1; shift ;;
        --) shift; BENCH_EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
case "$DEVICE" in cuda|cpu) ;; *) die "--device must be cuda or cpu, not '$DEVICE'" ;; esac
case "$PART" in check|bench|all) ;; *) die "--part must be check, bench or all, not '$PART'" ;; esac

"$PY" -c "import torch" 2>/dev/null || die "torch is not importable by $PY (set PYTHON=/path/to/python)"
if [ "$DEVICE" = cuda ]; then
    command -v nvidia-smi >/dev/null 2>&1 || die "no NVIDIA GPU here: nvidia-smi was not found (use --device cpu)"
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
        || die "torch sees no CUDA device (a CPU build of torch, or no driver)"
    # the test suite's conftest interprets Triton kernels only when no GPU is present; never time them so
    unset TRITON_INTERPRET
    GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
else
    GPU=cpu
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    export TRITON_INTERPRET=1
    # inductor compiles for minutes on a small CPU host; the CPU mode checks that everything runs
    for limit in PYTEST_LIMIT_S CHECK_LIMIT_S BENCH_MLP_LIMIT_S BENCH_GPT_LIMIT_S BENCH_CONVNET_LIMIT_S CLIP_LIMIT_S LOSS_ACCUM_LIMIT_S; do
        printf -v "$limit" '%s' $(( ${!limit} * CPU_LIMIT_FACTOR ))
    done
fi
SLUG=$(printf '%s' "$GPU" | tr -cs 'A-Za-z0-9' '-' | sed 's/^-//; s/-$//' | tr 'A-Z' 'a-z')
OUT=${OUT:-bench_out/$DEVICE-$(date -u +%Y-%m-%d)-$SLUG}
mkdir -p "$OUT/logs" || die "cannot create --out $OUT"
OUT=$(cd "$OUT" && pwd)
[ -z "$RESULTS" ] && [ "$DEVICE" = cuda ] && RESULTS="$REPO/benchmarks/results"

SETUP_ARGS=(--device "$DEVICE")
if [ -n "$WHEELS" ]; then
    SETUP_ARGS+=(--wheels "$WHEELS" --target "$OUT/site")
    export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" benchmarks/setup_env.py "${SETUP_ARGS[@]}" || exit 2
echo "$COMMAND" >>"$OUT/commands.txt"

FAILED=0
# step NAME LIMIT_S COMMAND...: runs with a time limit, logs to $OUT/logs/NAME.log
step() {
    local name=$1 limit=$2
    shift 2
    local log="$OUT/logs/$name.log" start rc
    echo "== $name (limit ${limit}s): $*" >&2
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$log" >>"$OUT/steps.tsv"
    if [ $rc -ne 0 ]; then
        FAILED=1
        echo "   $name: exit $rc, see $log" >&2
        tail -n 5 "$log" >&2
    fi
    return 0
}

if [ "$TINY" = 1 ]; then
    CHECK_SIZE=(--tiny --compile-backend aot_eager)
    CLIP_SIZE=(--tiny)
    BENCH_SIZE=(--steps 4 --warmup 2 --repeats 1)
    MLP=(--workload mlp --size tiny --batch-size 8)
    GPT=(--workload gpt --size tiny --batch-size 2)
    CONVNET=(--workload convnet --size tiny --batch-size 8)
elif [ "$DEVICE" = cpu ]; then
    CHECK_SIZE=()
    CLIP_SIZE=(--tiny)
    BENCH_SIZE=(--steps 20 --warmup 5 --repeats 3)
    MLP=(--workload mlp --size small --batch-size 64)
    GPT=(--workload gpt --size tiny --batch-size 8)
    CONVNET=(--workload convnet --size tiny --batch-size 32)
else
    CHECK_SIZE=()
    CLIP_SIZE=()
    BENCH_SIZE=(--repeats "$BENCH_REPEATS")
    MLP=(--workload mlp --size small --batch-size 64 --precision fp32)
    GPT=(--workload gpt --size 124m --batch-size 16 --precision bf16)
    CONVNET=(--workload convnet --size small --channels-last)
fi
ALL_PEERS=bare,compiled,cudagraph,pytorch-accelerated,lightning,fasttrain-lightning,fasttrain-eager,fasttrain-compiled,fasttrain-cudagraph

if [ "$PART" = check ] || [ "$PART" = all ]; then
    # rc 5 (nothing collected) cannot happen: the gpu-marked tests exist and are collected
    step pytest-gpu "$PYTEST_LIMIT_S" "$PY" -m pytest -m gpu -q -p no:cacheprovider tests
    step gpu-check "$CHECK_LIMIT_S" "$PY" benchmarks/gpu_check.py --device "$DEVICE" --out "$OUT/check" "${CHECK_SIZE[@]}"
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
    for spec in mlp gpt convnet; do
        case $spec in
            mlp) args=("${MLP[@]}"); limit=$BENCH_MLP_LIMIT_S ;;
            gpt) args=("${GPT[@]}"); limit=$BENCH_GPT_LIMIT_S ;;
            convnet) args=("${CONVNET[@]}"); limit=$BENCH_CONVNET_LIMIT_S ;;
        esac
        step "bench-$spec" "$limit" "$PY" -m fasttrain.cli bench --device "$DEVICE" --no-progress \
            --peers "$ALL_PEERS" --out "$OUT" --force "${args[@]}" "${BENCH_SIZE[@]}" "${BENCH_EXTRA[@]}"
    done
    step bench-clip "$CLIP_LIMIT_S" "$PY" benchmarks/kernels/bench_clip.py --device "$DEVICE" --out "$OUT" "${CLIP_SIZE[@]}"
    step bench-loss-accum "$LOSS_ACCUM_LIMIT_S" "$PY" benchmarks/kernels/bench_loss_accum.py --device "$DEVICE" --out "$OUT" "${CLIP_SIZE[@]}"
fi

RESULT_ARGS=(--out "$OUT" --device "$DEVICE")
[ -n "$RESULTS" ] && RESULT_ARGS+=(--results "$RESULTS")
"$PY" benchmarks/write_result.py "${RESULT_ARGS[@]}" || FAILED=1
echo "results: $OUT/result.md" >&2
exit $FAILED
