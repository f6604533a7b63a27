#!/usr/bin/env bash
# Run blockflow's GPU check on a GPU machine in one go (the device tool's `run` command):
#   1. install the wheels carried in .whl/ (made by benchmarks/fetch_gpu_wheels.sh) into
#      /tmp/site, with no index and no dependency resolution;
#   2. run benchmarks/gpu_check.py: inventory, round trips, the issue-40 bandwidth section
#      (one CuPy call vs blockflow at its default, naive and advised blocks vs the device's
#      copy, at 1/16, 1/8, 1/4 of device memory), the CuPy pipeline (4 GiB) checked against
#      NumPy, the NumPy pipeline (1 GiB) and the CPU-vs-GPU table;
#   3. run the GPU tests (tests/test_gpu.py; tests/cluster/test_connect_gpu_errors.py skips there).
# Everything it prints also lands in $OUT (gpu_check.txt, pytest_gpu.txt) when OUT is set;
# gpu_check.txt goes to benchmarks/results/gpu_check-gpu-<date>-<card>-issue40.txt.
# Expected: about 3 minutes on an H100 or H200 (check ~2 min of which the bandwidth section
# ~1 min, tests ~30 s); hard limits below: 250 s for the check (its soft budget is 180 s, its
# watchdog 240 s), 90 s for the tests, so at most ~6 minutes with the wheel installation.
# Device tool: `bash benchmarks/gpu_check.sh` with timeout_s 480.
#
# Usage: bash benchmarks/gpu_check.sh [gpu_check.py options, e.g. --gb 8, --bw-only]
# Environment: PYTHON (default python3), RUN_GPU_TESTS=0 to skip step 3.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUTDIR=${OUT:-}

echo "== gpu_check.sh on $(hostname) at $(date -u +%FT%TZ); $($PY --version 2>&1) at $(command -v $PY)"
command -v nvidia-smi >/dev/null && nvidia-smi -L

# 1. carried wheels. The checkout comes first on PYTHONPATH so that its blockflow code wins
#    over the (possibly older) blockflow wheel; worker processes inherit PYTHONPATH.
if compgen -G ".whl/*.whl" >/dev/null; then
    t0=$(date +%s)
    if ! $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl; then
        echo "FAILED: installing .whl/*.whl into /tmp/site"
        exit 3
    fi
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "== installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site in $(( $(date +%s) - t0 )) s"
else
    echo "== no .whl/*.whl: using the packages installed here"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

# 2. the check (soft budget 180 s inside, watchdog at 240 s; hard stop here)
timeout -k 10 250 $PY benchmarks/gpu_check.py "$@"
check_rc=$?
echo "== gpu_check.py exit code: $check_rc"

# 3. the GPU tests
test_rc=0
if [ "${RUN_GPU_TESTS:-1}" = "1" ]; then
    echo "== pytest tests/test_gpu.py tests/cluster/test_connect_gpu_errors.py"
    log=/dev/null
    [ -n "$OUTDIR" ] && log="$OUTDIR/pytest_gpu.txt"
    timeout -k 10 90 $PY -m pytest -q -rs -p no:cacheprovider \
        -o addopts="--strict-markers -ra" --timeout 75 \
        tests/test_gpu.py tests/cluster/test_connect_gpu_errors.py 2>&1 | tee "$log"
    test_rc=${PIPESTATUS[0]}
    echo "== pytest exit code: $test_rc"
fi

echo "== done: gpu_check rc=$check_rc, pytest rc=$test_rc"
[ "$check_rc" = 0 ] && [ "$test_rc" = 0 ]
