#!/usr/bin/env bash
# One unattended GPU run: check the Triton kernels, benchmark them, print a short summary last.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]     (default: a new temporary directory)
#
# Needs a CUDA device, torch and triton; the package is used from this checkout (no install).
# Exits 2 without CUDA, 1 when a check fails (the benchmarks still run), else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
results="${1:-$(mktemp -d)}"
mkdir -p "$results"

echo "results in $results"
timeout 240 python benchmarks/gpu_check.py --json "$results"
status=$?
if [ "$status" -eq 2 ]; then
    exit 2
elif [ "$status" -ne 0 ]; then
    status=1
fi
timeout 200 python -m benchmarks adam flatten --full --json "$results" || status=1
python benchmarks/gpu_check.py --summary "$results"
exit "$status"
