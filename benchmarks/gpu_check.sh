#!/usr/bin/env bash
# Run blockflow's GPU check on a GPU machine in one go (the device tool's `run` command):
#   1. install the wheels carried in .whl/ (made by benchmarks/fetch_gpu_wheels.sh) into
#      /tmp/site, with no index and no dependency resolution;
#   2. run benchmarks/gpu_check.py (inventory, round trips, CuPy vs NumPy pipeline, table);
#   3. run the GPU tests (tests/test_gpu.py; tests/cluster/test_connect_gpu_errors.py skips there).
# Everything it prints also lands in $OUT (gpu_check.txt, pytest_gpu.txt) when OUT is set.
# Whole run: about 2-3 minutes on an H200, at most ~6 (hard limits below).
#
# Usage: bash benchmarks/gpu_check.sh [gpu_check.py options, e.g. --gb 8]
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

# 2. the check (soft budget 200 s inside; hard stop here)
timeout -k 10 270 $PY benchmarks/gpu_check.py "$@"
check_rc=$?
echo "== gpu_check.py exit code: $check_rc"

# 3. the GPU tests
test_rc=0
if [ "${RUN_GPU_TESTS:-1}" = "1" ]; then
    echo "== pytest tests/test_gpu.py tests/cluster/test_connect_gpu_errors.py"
    log=/dev/null
    [ -n "$OUTDIR" ] && log="$OUTDIR/pytest_gpu.txt"
    timeout -k 10 100 $PY -m pytest -q -rs -p no:cacheprovider \
        -o addopts="--strict-markers -ra" --timeout 80 \
        tests/test_gpu.py tests/cluster/test_connect_gpu_errors.py 2>&1 | tee "$log"
    test_rc=${PIPESTATUS[0]}
    echo "== pytest exit code: $test_rc"
fi

echo "== done: gpu_check rc=$check_rc, pytest rc=$test_rc"
[ "$check_rc" = 0 ] && [ "$test_rc" = 0 ]
