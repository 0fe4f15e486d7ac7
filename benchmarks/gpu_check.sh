#!/usr/bin/env bash
# One unattended GPU run, under 5 minutes by construction, ending with a one-line summary.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]     (default: a new temporary directory)
#   PYTHON=python3.12 bash benchmarks/gpu_check.sh (default interpreter: python3)
#
# Steps, in order, each under its own time limit (seconds):
#   build     both C++ extensions (ops, comm), in parallel; nothing runs beside it, nothing is timed
#             before it ends; a failed build is reported (the compiler's output is shown), the
#             ordering checks are then skipped and the stages use the torch engine
#   cuda      whether a CUDA device exists
#   kernels   the Triton kernels against their references (tests/gpu/gpu_check.py), and what each variant costs
#   ordering  the comm engine's stream ordering, input and output side, and no host syncs (tests/gpu/gpu_streams.py)
#   stages    every ZeRO stage against torch.optim.AdamW, fp16 overflow, a timed step (tests/gpu/gpu_stages.py)
#   offload   stages 2 and 3 with the optimizer state in host memory (stage 3 also with the parameter shards
#             there, offload_param): bytes over the bus per step, weights as without offload, step time with
#             and without, the share of the offload's work hidden
#             (benchmarks/gpu_offload.py)
#   timing    the kernels as the optimizer uses them (benchmarks/gpu_timing.py)
#   bench     the quick adam and flatten benchmarks (python -m benchmarks)
#   summary   every check of every JSON file, then one line: passed, failed, skipped
# Every script writes its JSON after each check (each check guarded), so a step stopped by its limit
# keeps what it finished. `timeout -k GRACE` kills a step GRACE seconds after its limit, so the worst
# case is the sum of the limits plus one GRACE per step: WORST_CASE_S below, 298 s.
# Everything the run writes is packed into RESULTS_DIR/gpu_check.tgz at the end too: one file to bring back
# from a machine that returns only a few (the run writes a dozen).
# Without CUDA the run still goes end to end: every GPU check is written as skipped (exit 2).
# Exits 1 when a check or the build failed (the rest still runs), 2 when nothing could run (no CUDA), else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD_S=80 CUDA_S=10 KERNELS_S=50 ORDERING_S=30 STAGES_S=45 OFFLOAD_S=20 TIMING_S=30 BENCH_S=10 SUMMARY_S=5 GRACE_S=2
STEPS=9
WORST_CASE_S=$((BUILD_S + CUDA_S + KERNELS_S + ORDERING_S + STAGES_S + OFFLOAD_S + TIMING_S + BENCH_S + SUMMARY_S \
    + STEPS * GRACE_S))
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a step stopped by its time limit still shows what it printed
results="${1:-$(mktemp -d)}"
mkdir -p "$results"
started=$SECONDS
failed=0

limit() {  # limit SECONDS COMMAND...: the step, killed GRACE_S after its limit
    local seconds=$1
    shift
    timeout -k "$GRACE_S" "$seconds" "$@"
}

echo "gpu_check: results in $results, worst case ${WORST_CASE_S} s ($PYTHON)"
build() {  # build EXT: the C++ extension EXT built (or loaded from the cache), its output in EXT_build.log
    ZERO_KERNELS_VERBOSE_BUILD=1 limit "$BUILD_S" "$PYTHON" -c "from zero_kernels import _ext; _ext.load('$1')" \
        >"$results/$1_build.log" 2>&1
}
built() {  # built EXT PID: wait for the build of EXT, record and show how it went
    if wait "$2"; then
        echo "built" >"$results/$1_build.status"
    else
        echo "FAILED: see $1_build.log" >"$results/$1_build.status"
        echo "== the C++ extension '$1' did not build; the end of $results/$1_build.log:"
        tail -n 40 "$results/$1_build.log"
        failed=1
    fi
}
build ops &
ops_build=$!
build comm &
comm_build=$!
built ops "$ops_build"
built comm "$comm_build"
if ! grep -q built "$results/comm_build.status"; then
    export ZERO_KERNELS_COMM=torch
fi

cuda=$(limit "$CUDA_S" "$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)

step() {  # step SECONDS COMMAND...: exit 1 (a failure) marks the run failed; 2 (skipped) does not
    limit "$@"
    local status=$?
    if [ "$status" -ne 0 ] && [ "$status" -ne 2 ]; then
        echo "== step '$*' ended with exit status $status (124, 137: stopped at its time limit)"
        failed=1
    fi
}

step "$KERNELS_S" "$PYTHON" tests/gpu/gpu_check.py --json "$results"
step "$ORDERING_S" "$PYTHON" tests/gpu/gpu_streams.py --json "$results"
step "$STAGES_S" "$PYTHON" tests/gpu/gpu_stages.py --json "$results"
step "$OFFLOAD_S" "$PYTHON" benchmarks/gpu_offload.py --json "$results"
step "$TIMING_S" "$PYTHON" benchmarks/gpu_timing.py --json "$results"
if [ "$cuda" = "1" ]; then
    step "$BENCH_S" "$PYTHON" -m benchmarks adam flatten --json "$results"
else
    echo "benchmarks: skipped: no CUDA device"
fi
limit "$SUMMARY_S" "$PYTHON" benchmarks/gpu_report.py "$results" --worst-case "$WORST_CASE_S" \
    --elapsed "$((SECONDS - started))"
tar czf "$results/gpu_check.tgz" --exclude gpu_check.tgz -C "$results" .
if [ "$failed" -ne 0 ]; then
    exit 1
fi
[ "$cuda" = "1" ] || exit 2
exit 0
