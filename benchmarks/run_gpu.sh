#!/usr/bin/env bash
# Everything fasttrain checks and measures on a GPU, from a bare copy of the repository. `--part
# all` is one device session's run: every check and benchmark that fits, within 9 minutes from
# cold compile caches; each other part goes deeper into one area, within 8.5 minutes.
#
#   bash benchmarks/run_gpu.sh --wheels .whl --part all "$OUT"        # on the GPU machine
#   bash benchmarks/run_gpu.sh --device cpu --tiny --part bench /tmp/run   # the CPU mode
#   bash benchmarks/run_gpu.sh --part all --device cpu --gpu-sizes --dry-run   # the GPU schedule
#   python3 benchmarks/write_result.py --merge DIR... --results benchmarks/results
#
# OUT (the one argument) is the folder the results go to; it must lie outside the working copy
# and is created if missing. Nothing is written under the working copy (the installed wheels,
# logs and every step's raw output go to a scratch folder under $TMPDIR). OUT receives at most
# five files, rewritten after every step so that a part cut short keeps the steps it finished:
#   result.md   the result file (the content of benchmarks/results/<date>-<gpu>.md)
#   run.json    the same as data; write_result.py --merge joins several parts' folders
#   run.log     the end of every step's log
#   bench.csv   one row per peer and workload (bench steps)
#   check.csv   one row per engine run (check steps)
#
# Options:
#   --part PART         all | tests | check | check-gpt | bench | bench-gpt | overhead (default all)
#                       all:       ALL_SCHEDULE below: pytest -m gpu beside the engine checks on mlp
#                                  and hf-gpt2, then fasttrain bench on mlp and transformers' GPT-2
#                                  124M, fused clip, loss gathering, within ALL_BUDGET_S
#                       tests:     pytest -m gpu
#                       check:     engine checks (benchmarks/gpu_check.py) on mlp and convnet
#                       check-gpt: engine checks on gpt and the transformers GPT-2 (hf-gpt2)
#                       bench:     fasttrain bench on mlp and convnet, fused clip, loss gathering
#                       bench-gpt: fasttrain bench on GPT-2 124M and transformers GPT-2 124M
#                       overhead:  fasttrain bench --workload overhead (every engine's host time),
#                                  the host time per step by function of the graphed engine and
#                                  fasttrain.lightning on mlp (benchmarks/host_profile.py), and
#                                  what nonfinite="skip" adds to an update (the masked skip's undo)
#   --device cuda|cpu   default cuda; cpu runs every step at CPU sizes (no speed claims)
#   --wheels DIR        wheels (pytorch-accelerated 0.1.61) installed without a registry, before
#                       anything is checked, into the scratch folder, which goes on PYTHONPATH
#   --tiny              the smallest sizes and the aot_eager backend for the checks (CI)
#   --keep-scratch      keep the scratch folder (full logs, the bench's JSON) instead of removing it
#   --gpu-sizes         with --device cpu: the GPU run's sizes, to measure on a CPU what a GPU
#                       run compiles (steps too large for a CPU run out of their time)
#   --dry-run           print the schedule (each step's limit on CUDA, the worst case against
#                       the budget) and every step's command, then stop; OUT may be left out
#   -- ARGS             passed on to every `fasttrain bench` call
#
# Every step runs under its own time limit (ALL_SCHEDULE and LIMIT_S below; RUN_GPU_LIMIT_S_<STEP>
# overrides one, e.g. RUN_GPU_LIMIT_S_BENCH_GPT=300). Each bench is told its limit less
# BENCH_MARGIN_S (`fasttrain bench --time-limit`) and sizes itself to finish inside it; a TERM at
# the limit keeps what the step finished. A step that fails or runs out of time is recorded and
# the next one runs; the exit status is then 1. Exit status 2: bad options, or the machine is not
# set up (one line says what is missing).
set -uo pipefail

# Seconds per step on CUDA. Each part's limits add up to at most PART_BUDGET_S, so with set-up
# (at most SETUP_LIMIT_S), the KILL_AFTER_S grace of each, and rewriting the result files a part
# ends within about 8 minutes even when every step runs out of time.
declare -A LIMIT_S=(
    [pytest-gpu]=400
    [check-mlp]=160 [check-convnet]=240
    [check-gpt]=210 [check-hf-gpt2]=190
    [bench-mlp]=130 [bench-convnet]=150 [bench-clip]=60 [bench-loss-accum]=25
    [bench-gpt]=210 [bench-hf-gpt2]=190
    [bench-overhead]=60 [profile-mlp]=90 [bench-masked-restore]=40
)
PART_BUDGET_S=400
SETUP_LIMIT_S=45
# a step that ignores the TERM its limit sends is killed this much later
KILL_AFTER_S=5
PARTS=(tests check check-gpt bench bench-gpt overhead)
# --part all, what one device session runs: 15 minutes of device time, machine start included,
# and at most 10 per command. One line per slot, the slots one after another; "|" separates lanes
# that run side by side (the correctness checks: measured alone on an H200 with 16 cores,
# `pytest -m gpu` took 148 s and the checks of mlp and hf-gpt2 about 170 s, side by side), the
# steps of a lane run one after another, and every step carries its limit on CUDA in seconds.
# The benches run alone, since they time the device; bench-overhead is the host-overhead workload
# (`fasttrain bench --workload overhead`: every engine against the bare loop on a step whose
# arithmetic is a few microseconds). A line commented out with "#" keeps room for a step without
# running it (shown as "reserved:"; its size and peers default to the bench's own, BENCH and
# BENCH_PEERS below may name them). The worst case, every step running out of time and killed
# after its grace, must stay within ALL_BUDGET_S, reserved lines included
# (tests/test_run_gpu_script.py reads it from --dry-run). The second GPU run (H200, cold caches,
# benchmarks/results/2026-11-28-nvidia-h200.md) moved the limits: check-mlp ran out at 45 s after
# its last check, check-hf-gpt2 took 114 s, bench-mlp 48, bench-clip ran out at 25 s, bench-hf-gpt2
# skipped two of its four peers at 78 s, bench-overhead took 51 of its 60 s (it sizes itself).
# The probe after it (2026-11-28-nvidia-h200-probe.md): GPT-2 124M's graphed engine did not finish
# compiling in the 23 s that 104 s left it after the bare loop and torch.compile(model), so
# bench-hf-gpt2 takes the time of bench-overhead, which that run measured (`--part overhead`
# runs it again), and the MLP bench of this run times only the peers its targets compare
# (BENCH_PEERS below). profile-mlp, beside the checks, profiles the host side of the graphed
# engine and of fasttrain.lightning on it (fasttrain-lightning made 0.62x the graphed engine's
# steps/s there): where a replayed step's microseconds go; the device, shared with the tests
# then, does not hold a replaying host back.
ALL_SCHEDULE='
pytest-gpu=200 | check-mlp=55 check-hf-gpt2=140 | profile-mlp=60
bench-mlp=55
bench-clip=30
bench-loss-accum=12
bench-hf-gpt2=145
'
ALL_BUDGET_S=540
# seconds allowed for rewriting OUT's files after a step, and after set-up (that first one also
# reads the environment, importing torch)
COLLECT_S=2
FIRST_COLLECT_S=8
# a bench is told its step's limit less this (--time-limit counts from its process's start; the
# margin covers writing its files and exiting)
BENCH_MARGIN_S=8
part_steps() {
    case $1 in
        tests) echo pytest-gpu ;;
        check) echo check-mlp check-convnet ;;
        check-gpt) echo check-gpt check-hf-gpt2 ;;
        bench) echo bench-mlp bench-convnet bench-clip bench-loss-accum ;;
        bench-gpt) echo bench-gpt bench-hf-gpt2 ;;
        overhead) echo bench-overhead profile-mlp bench-masked-restore ;;
    esac
}
# the CPU mode's limits are these times as long (inductor compiles for minutes on a small host)
CPU_LIMIT_FACTOR=3
# the bench's repeats on CUDA: enough for a median with a range, where the limits allow (the
# bench cuts them, then its steps, to fit its --time-limit)
BENCH_REPEATS=3

cd "$(dirname "$0")/.."
REPO=$(pwd -P)
PY=${PYTHON:-python3}
DEVICE=cuda
PART=all
DEST=""
WHEELS=""
TINY=0
GPU_SIZES=0
KEEP_SCRATCH=0
DRY_RUN=0
BENCH_EXTRA=()
COMMAND="bash benchmarks/run_gpu.sh $*"

die() { echo "run_gpu.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=${2:-}; shift 2 ;;
        --part) PART=${2:-}; shift 2 ;;
        --wheels) WHEELS=${2:-}; shift 2 ;;
        --tiny) TINY=1; shift ;;
        --gpu-sizes) GPU_SIZES=1; shift ;;
        --keep-scratch) KEEP_SCRATCH=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --) shift; BENCH_EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [ -z "$DEST" ] || die "one output folder only (got '$DEST' and '$1')"; DEST=$1; shift ;;
    esac
done
case "$DEVICE" in cuda|cpu) ;; *) die "--device must be cuda or cpu, not '$DEVICE'" ;; esac
case " ${PARTS[*]} all " in *" $PART "*) ;; *) die "--part must be one of ${PARTS[*]} all, not '$PART'" ;; esac
[ "$TINY$GPU_SIZES" != 11 ] || die "--tiny and --gpu-sizes exclude each other"
[ -n "$DEST" ] || [ "$DRY_RUN" = 1 ] || die "give the output folder as the argument (on the GPU machine: \"\$OUT\")"
# ----------------------------------------------------------------------------------- the schedule
# SLOTS: one line per slot ("a=L | b=L c=L"); parts run each step alone with LIMIT_S. STEP_PART:
# the part each step belongs to, recorded beside the step
SETUP_CUDA_S=$SETUP_LIMIT_S
declare -A STEP_PART=()
SLOTS=()
RESERVED=()
if [ "$PART" = all ]; then
    while IFS= read -r line; do
        line=${line%%$'\r'}
        [ -n "${line// /}" ] || continue
        if [ "${line:0:1}" = "#" ]; then
            RESERVED+=("${line#\#}")
            continue
        fi
        SLOTS+=("$line")
    done <<<"$ALL_SCHEDULE"
    for slot in "${SLOTS[@]}"; do
        for item in ${slot//|/ }; do STEP_PART[${item%%=*}]=all; done
    done
else
    for p in "${PARTS[@]}"; do
        for name in $(part_steps "$p"); do
            STEP_PART[$name]=$p
            [ "$PART" = "$p" ] && SLOTS+=("$name=${LIMIT_S[$name]}")
        done
    done
fi

# the limit a step runs under: an override from the environment, else the schedule's, longer on a CPU
step_limit() {
    local name=$1 cuda=$2
    local var="RUN_GPU_LIMIT_S_$(printf '%s' "$name" | tr 'a-z-' 'A-Z_')"
    if [ -n "${!var:-}" ]; then
        echo "${!var}"
    elif [ "$DEVICE" = cpu ]; then
        echo $(( cuda * CPU_LIMIT_FACTOR ))
    else
        echo "$cuda"
    fi
}

# the worst case of a slot: its longest lane, every step out of time, killed after its grace,
# and its result rewritten
slot_worst() {
    local worst=0 lane total item
    local IFS='|'
    for lane in $1; do
        total=0
        IFS=' '
        for item in $lane; do total=$(( total + ${item#*=} + KILL_AFTER_S + COLLECT_S )); done
        IFS='|'
        [ $total -gt $worst ] && worst=$total
    done
    echo $worst
}

print_schedule() {
    local budget worst slot
    [ "$PART" = all ] && budget=$ALL_BUDGET_S || budget=$(( 17 * 30 ))
    echo "== schedule of --part $PART: each step's limit on CUDA in seconds ('|': side by side)$([ "$DEVICE" = cpu ] && echo "; this CPU run gives each ${CPU_LIMIT_FACTOR}x")"
    worst=$(( SETUP_CUDA_S + KILL_AFTER_S + FIRST_COLLECT_S ))
    printf '   %-58s %4d s\n' "set-up=$SETUP_CUDA_S" "$worst"
    for slot in "${SLOTS[@]}"; do
        printf '   %-58s %4d s\n' "$slot" "$(slot_worst "$slot")"
        worst=$(( worst + $(slot_worst "$slot") ))
    done
    for slot in "${RESERVED[@]}"; do
        printf '   %-58s %4d s\n' "reserved: $slot" "$(slot_worst "$slot")"
        worst=$(( worst + $(slot_worst "$slot") ))
    done
    echo "   worst case (every step out of time, killed after ${KILL_AFTER_S} s, ${COLLECT_S} s to write its result): $worst s of $budget s"
}

# -------------------------------------------------------------------------------- the step commands
if [ "$TINY" = 1 ]; then
    CHECK_SIZE=(--tiny --compile-backend aot_eager)
    CLIP_SIZE=(--tiny)
    PROFILE_SIZE=(--steps 10)
    BENCH_SIZE=(--steps 4 --warmup 2 --repeats 1)
    declare -A BENCH=(
        [mlp]="--size tiny --batch-size 8" [convnet]="--size tiny --batch-size 8"
        [gpt]="--size tiny --batch-size 2" [hf-gpt2]="--size tiny --batch-size 2"
    )
    declare -A BENCH_PEERS=()
elif [ "$DEVICE" = cpu ] && [ "$GPU_SIZES" = 0 ]; then
    CHECK_SIZE=()
    CLIP_SIZE=(--tiny)
    PROFILE_SIZE=(--steps 100)
    BENCH_SIZE=(--steps 20 --warmup 5 --repeats 3)
    declare -A BENCH=(
        [mlp]="--size small --batch-size 64" [convnet]="--size tiny --batch-size 32"
        [gpt]="--size tiny --batch-size 8" [hf-gpt2]="--size tiny --batch-size 8"
    )
    declare -A BENCH_PEERS=()
else
    CHECK_SIZE=(--sizes cuda)
    CLIP_SIZE=()
    PROFILE_SIZE=(--steps 300)
    BENCH_SIZE=(--repeats "$BENCH_REPEATS")
    declare -A BENCH=(
        [mlp]="--size small --batch-size 64 --precision fp32" [convnet]="--size small --channels-last"
        [gpt]="--size 124m --batch-size 16 --precision bf16" [hf-gpt2]="--size 124m --batch-size 16 --precision bf16"
    )
    # GPT-2 124M compiles for most of a minute per compiling peer: the peers the targets compare
    # (write_result.py's TARGETS), the bare loop first, then in the order they matter (the
    # default engine first: a peer the time limit leaves no room for is the last one)
    declare -A BENCH_PEERS=(
        [gpt]=bare,compiled,fasttrain-cudagraph,fasttrain-compiled
        [hf-gpt2]=bare,compiled-model,fasttrain-cudagraph,fasttrain-compiled
    )
    # --part all's MLP bench: the peers of the MLP targets (write_result.py's TARGETS) and
    # Lightning's own loop, each set-up a compile less than all ten (the others are in the
    # host-overhead bench)
    [ "$PART" = all ] && BENCH_PEERS[mlp]=bare,cudagraph,fasttrain-cudagraph,fasttrain-lightning,pytorch-accelerated,lightning
fi
ALL_PEERS=bare,compiled,compiled-model,cudagraph,pytorch-accelerated,lightning,fasttrain-lightning,fasttrain-eager,fasttrain-compiled,fasttrain-cudagraph

# step_command NAME LIMIT: the step's command line, into CMD
step_command() {
    local name=$1 limit=$2 folder="$SCRATCH/steps/$1"
    case $name in
        pytest-gpu)
            # every test module is collected (-m filters afterwards); one whose package is
            # missing here is skipped by its importorskip, never a collection error
            # gpu_tests.py runs pytest again past a test the process dies in (an abort in native
            # code), recording it in crashes.json; the JUnit reports keep each failure's whole
            # message for the result file; the TERM of the step's limit ends pytest as Ctrl-C
            # does (tests/term_as_interrupt.py), so the summary and the report keep the tests
            # that ran before it
            CMD=("$PY" benchmarks/gpu_tests.py --out "$folder" -- -m gpu -q -p no:cacheprovider tests) ;;
        check-*)
            CMD=("$PY" benchmarks/gpu_check.py --device "$DEVICE" --workloads "${name#check-}"
                 --out "$folder" "${CHECK_SIZE[@]}") ;;
        bench-clip)
            CMD=("$PY" benchmarks/kernels/bench_clip.py --device "$DEVICE" --out "$folder" "${CLIP_SIZE[@]}") ;;
        bench-loss-accum)
            CMD=("$PY" benchmarks/kernels/bench_loss_accum.py --device "$DEVICE" --out "$folder" "${CLIP_SIZE[@]}") ;;
        bench-masked-restore)
            CMD=("$PY" benchmarks/kernels/bench_masked_restore.py --device "$DEVICE" --out "$folder" "${CLIP_SIZE[@]}") ;;
        profile-*)
            # shellcheck disable=SC2206  # the size options are words
            local size=(${BENCH[${name#profile-}]:-})
            CMD=("$PY" benchmarks/host_profile.py --device "$DEVICE" --workload "${name#profile-}" "${size[@]}"
                 "${PROFILE_SIZE[@]}" --peers fasttrain-cudagraph,fasttrain-lightning --out "$folder") ;;
        bench-*)
            local workload=${name#bench-}
            # shellcheck disable=SC2206  # the size options are words
            local size=(${BENCH[$workload]:-})
            local budget=$(( limit - BENCH_MARGIN_S ))
            [ $budget -ge 1 ] || budget=1
            CMD=("$PY" -m fasttrain.cli bench --device "$DEVICE" --no-progress --peers "${BENCH_PEERS[$workload]:-$ALL_PEERS}"
                 --out "$folder" --force --workload "$workload" "${size[@]}" "${BENCH_SIZE[@]}"
                 --time-limit "$budget" "${BENCH_EXTRA[@]}") ;;
        *) CMD=(false) ;;
    esac
}

if [ "$DRY_RUN" = 1 ]; then
    SCRATCH=SCRATCH
    print_schedule
    for slot in "${SLOTS[@]}"; do
        for item in ${slot//|/ }; do
            limit=$(step_limit "${item%%=*}" "${item#*=}")
            step_command "${item%%=*}" "$limit"
            echo "${item%%=*} (limit ${limit}s): ${CMD[*]}"
        done
    done
    exit 0
fi

# checked before it is created: nothing may be written under the working copy
DEST=$(realpath -m -- "$DEST")
case "$DEST/" in "$REPO"/*) die "the output folder $DEST lies inside the working copy; give one outside it" ;; esac
mkdir -p "$DEST" 2>/dev/null || die "cannot create the output folder $DEST"
if [ -n "$WHEELS" ]; then
    [ -d "$WHEELS" ] || die "--wheels $WHEELS: no such folder; give the folder holding the .whl files"
    WHEELS=$(cd "$WHEELS" && pwd -P)
fi

"$PY" -c "import torch" 2>/dev/null || die "torch is not importable by $PY (set PYTHON=/path/to/python)"
if [ "$DEVICE" = cuda ]; then
    command -v nvidia-smi >/dev/null 2>&1 || die "no NVIDIA GPU here: nvidia-smi was not found (use --device cpu)"
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
        || die "torch sees no CUDA device (a CPU build of torch, or no driver)"
    # the test suite's conftest interprets Triton kernels only when no GPU is present; never time them so
    unset TRITON_INTERPRET
else
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    export TRITON_INTERPRET=1
fi

# Everything but OUT's files goes here: installed wheels, raw step outputs, full logs, and the
# compile caches (fresh for every invocation, as on the GPU machine, unless set outside).
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/fasttrain-gpu-run.XXXXXX") || die "cannot create a scratch folder under ${TMPDIR:-/tmp}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$SCRATCH/inductor-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$SCRATCH/triton-cache}
# and every other temporary file of the steps (inductor's C++ backend keeps precompiled headers
# under $TMPDIR/torchinductor_<user>, whatever TORCHINDUCTOR_CACHE_DIR says)
mkdir -p "$SCRATCH/tmp" && export TMPDIR="$SCRATCH/tmp"
# the caches can take hundreds of MB; what matters of the rest is in OUT already
if [ "$KEEP_SCRATCH" = 1 ]; then
    trap 'rm -rf "$SCRATCH/inductor-cache" "$SCRATCH/triton-cache" "$SCRATCH/site"' EXIT
else
    trap 'rm -rf "$SCRATCH"' EXIT
fi
# no bytecode caches in the working copy, and no example database (hypothesis keeps one in the
# current folder unless told otherwise)
export PYTHONDONTWRITEBYTECODE=1
export HYPOTHESIS_STORAGE_DIRECTORY=$SCRATCH/hypothesis
mkdir -p "$SCRATCH/logs" "$SCRATCH/steps"

SETUP_ARGS=(--device "$DEVICE")
if [ -n "$WHEELS" ]; then
    SETUP_ARGS+=(--wheels "$WHEELS" --target "$SCRATCH/site")
    export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
fi
[ "$DEVICE" = cpu ] && SETUP_LIMIT_S=$(( SETUP_LIMIT_S * CPU_LIMIT_FACTOR ))
timeout --kill-after="$KILL_AFTER_S" "$SETUP_LIMIT_S" "$PY" benchmarks/setup_env.py "${SETUP_ARGS[@]}" 2>"$SCRATCH/logs/setup.log"
rc=$?
if [ $rc -ne 0 ]; then
    cat "$SCRATCH/logs/setup.log" >&2
    [ $rc -eq 124 ] && echo "run_gpu.sh: set-up ran out of its ${SETUP_LIMIT_S}s" >&2
    exit 2
fi
cat "$SCRATCH/logs/setup.log" >&2

collect() {
    # lanes side by side may finish at once: one writer at a time
    if command -v flock >/dev/null 2>&1; then
        flock "$SCRATCH/collect.lock" "$PY" benchmarks/write_result.py --work "$SCRATCH" --out "$DEST" --device "$DEVICE" \
            --command "$COMMAND" >>"$SCRATCH/logs/write_result.log" 2>&1
    else
        "$PY" benchmarks/write_result.py --work "$SCRATCH" --out "$DEST" --device "$DEVICE" --command "$COMMAND" \
            >>"$SCRATCH/logs/write_result.log" 2>&1
    fi
}
# the result file exists from the start, naming the set-up, so even a part killed in its first
# step leaves one
collect || die "writing the result file failed: $(tail -n 1 "$SCRATCH/logs/write_result.log")"
print_schedule >&2

# a lane runs in a subshell: a failure is recorded here
FAILED_FLAG="$SCRATCH/failed"
# step NAME LIMIT COMMAND...: runs with its time limit, logs to the scratch folder, then rewrites
# OUT's files, so the step's result is there before the next step starts
step() {
    local name=$1 limit=$2
    shift 2
    local log="$SCRATCH/logs/$name.log" start rc
    echo "== $name (limit ${limit}s): $*" >&2
    start=$(date +%s)
    # the CPU seconds of the step's processes beside the wall time: on a shared host the wall
    # time says more about the neighbours than about the step
    local TIMEFORMAT='%U %S'
    { time timeout --kill-after="$KILL_AFTER_S" "$limit" "$@" >"$log" 2>&1; } 2>"$SCRATCH/cpu-time.$name"
    rc=$?
    local cpu
    cpu=$(awk 'END { if (NF == 2) printf "%.0f", $1 + $2 }' "$SCRATCH/cpu-time.$name" 2>/dev/null)
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$limit" "${STEP_PART[$name]}" "${cpu:-}" \
        >>"$SCRATCH/steps.tsv"
    if [ $rc -ne 0 ]; then
        : >"$FAILED_FLAG"
        echo "   $name: exit $rc" >&2
        tail -n 5 "$log" >&2
    fi
    collect || { : >"$FAILED_FLAG"; echo "   writing the result file failed: $(tail -n 1 "$SCRATCH/logs/write_result.log")" >&2; }
    return 0
}

# run_lane "a=L b=L": the steps one after another
run_lane() {
    local item name limit
    for item in $1; do
        name=${item%%=*}
        limit=$(step_limit "$name" "${item#*=}")
        mkdir -p "$SCRATCH/steps/$name"
        step_command "$name" "$limit"
        step "$name" "$limit" "${CMD[@]}"
    done
}

for slot in "${SLOTS[@]}"; do
    IFS='|' read -r -a lanes <<<"$slot"
    if [ ${#lanes[@]} -eq 1 ]; then
        run_lane "${lanes[0]}"
        continue
    fi
    pids=()
    for lane in "${lanes[@]}"; do
        run_lane "$lane" &
        pids+=($!)
    done
    wait "${pids[@]}"
    collect || : >"$FAILED_FLAG"
done

echo "results: $DEST/result.md$([ "$KEEP_SCRATCH" = 1 ] && echo " (scratch: $SCRATCH)")" >&2
[ -e "$FAILED_FLAG" ] && exit 1
exit 0
