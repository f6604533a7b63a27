#!/usr/bin/env bash
# CPU benchmarks on a quiet many-core machine (the GPU device machine's 16 cores are quiet,
# where the 2-core development machine is shared): part "a" = the scale benchmark (issue 28)
# after gpu_check.sh; part "b" = the straggler scenarios of issue 27 and the pools benchmark.
# Usage on the device machine (carry: [".whl"]):  bash benchmarks/quiet_check.sh a|b
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
O=${OUT:-/tmp}
if ! python3 -c "import distributed" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 3
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
echo "== $(hostname) $(nproc) cores, $($PY --version)"
case "${1:-a}" in
  a)
    RUN_GPU_TESTS=1 timeout -k 5 230 bash benchmarks/gpu_check.sh 2>&1 | tail -60
    timeout -k 5 300 $PY benchmarks/scale.py --workers 8,32,128 --tasks 5000 --reps 3 \
        --plot "$O/scale.png" 2>&1 | tee "$O/scale.txt" ;;
  b)
    timeout -k 5 330 $PY benchmarks/stragglers.py --workloads brief-pause,coarse-slow,uneven \
        --pause-repeat 5 --worst-of 5 2>&1 | tee "$O/stragglers.txt"
    timeout -k 5 200 $PY benchmarks/pools.py --reps 3 2>&1 | tee "$O/pools.txt" ;;
esac
