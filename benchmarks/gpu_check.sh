#!/usr/bin/env bash
# One unattended GPU run, under 5 minutes: check the Triton kernels, check and time every ZeRO
# stage on one rank with NCCL, benchmark the kernels, print a short summary last.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]     (default: a new temporary directory)
#
# Needs a CUDA device, torch and triton; the package is used from this checkout (no install).
# The C++ comm engine is built in the background while the kernels are checked; if it does not
# build in time the stage check runs on the torch engine (its header names the engine used).
# Exits 2 without CUDA, 1 when a check fails (the rest still runs), else 0.
# Time limits, in order: 140 s kernels (build alongside), 80 s stages, 60 s benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a step stopped by its time limit still shows what it printed
results="${1:-$(mktemp -d)}"
mkdir -p "$results"

echo "results in $results"
timeout 140 python -c "from zero_kernels import _ext; _ext.load('comm')" >"$results/comm_build.log" 2>&1 &
build=$!
timeout 140 python benchmarks/gpu_check.py --json "$results"
status=$?
if [ "$status" -eq 2 ]; then
    kill "$build" 2>/dev/null
    exit 2
elif [ "$status" -ne 0 ]; then
    status=1
fi
if ! wait "$build"; then
    echo "the C++ comm engine did not build (see $results/comm_build.log): stages run on the torch engine"
    export ZERO_KERNELS_COMM=torch
fi
timeout 80 python benchmarks/gpu_stages.py --json "$results" || status=1
timeout 60 python -m benchmarks adam flatten --json "$results" || status=1
python benchmarks/gpu_check.py --summary "$results"
exit "$status"
