#!/usr/bin/env bash
# CPU benchmarks on a quiet many-core machine (the GPU device machine's 16 cores are quiet,
# where the 2-core development machine is shared): part "a" = the scale benchmark (issue 28)
# after gpu_check.sh; part "b" = the straggler scenarios of issue 27 and the pools benchmark;
# part "c" = all at once on disjoint cores (taskset): scale N=8 (7 pairs) and 32 on cores 0-1,
# then the GPU tests; scale N=128 and 256 on cores 2-3; pools on 4-7; the Zipf skew on 8-15
# (the scale runs are single-threaded, the others sleep-based simulations). QUICK=1: tiny sizes.
# Part "d" = the scale benchmark alone: N=8 (7 pairs) then 32 on cores 0-1; N=32 without
# distributed's NVML metrics, then 128, on cores 2-3; N=256 on cores 4-5. Part "e" = a short
# re-check (under 3 min): N=8 (6 pairs); N=32 (3) then 128 (1); N=256 (1).
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
  c)
    pin() { local cores=$1; shift; if [ "${PIN:-1}" = 1 ] && command -v taskset >/dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
    Q=${QUICK:-0}
    if [ "$Q" = 1 ]; then T=500 R8=1 R32=1 R128=1 W2=16,24 PR=1 ZR=1; else T=5000 R8=7 R32=3 R128=2 W2=128 PR=3 ZR=3; fi
    uptime
    ( pin 0-1 timeout -k 5 230 $PY benchmarks/scale.py --parts cluster --workers 8 --tasks $T --reps $R8 > "$O/scale-8.txt" 2>&1
      pin 0-1 timeout -k 5 110 $PY benchmarks/scale.py --parts cluster --workers 32 --tasks $T --reps $R32 > "$O/scale-32.txt" 2>&1
      pin 0-3 timeout -k 5 110 $PY -m pytest -q -rs -p no:cacheprovider -o addopts="--strict-markers -ra" \
          --timeout 100 -m gpu tests/test_gpu.py tests/ml/test_parallel.py tests/ml/test_inference.py \
          tests/ml/test_ml_glm.py tests/data/test_backends.py > "$O/pytest-gpu.txt" 2>&1
      echo "pytest gpu exit $?" >> "$O/pytest-gpu.txt" ) &
    ( pin 2-3 timeout -k 5 150 $PY benchmarks/scale.py --parts cluster --workers $W2 --tasks $T --reps $R128 > "$O/scale-128.txt" 2>&1
      [ "$Q" = 1 ] || pin 2-3 timeout -k 5 240 $PY benchmarks/scale.py --parts cluster --workers 256 --tasks $T --reps 1 > "$O/scale-256.txt" 2>&1 ) &
    pin 4-7 timeout -k 5 390 $PY benchmarks/pools.py --reps $PR > "$O/pools.txt" 2>&1 &
    pin 8-15 timeout -k 5 390 $PY benchmarks/stragglers.py --workloads zipf-skew --repeat $ZR > "$O/zipf.txt" 2>&1 &
    wait
    uptime
    tail -n 4 "$O"/scale-*.txt; grep -E "^(configuration|cost |budget|split|all-fast|default)" "$O/pools.txt"
    grep -E "zipf-skew" "$O/zipf.txt" | head -8; tail -n 5 "$O/pytest-gpu.txt" ;;
  d)
    pin() { local cores=$1; shift; if [ "${PIN:-1}" = 1 ] && command -v taskset >/dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
    if [ "${QUICK:-0}" = 1 ]; then T=500 R8=1 R32=1 R128=1 W3=16 W4=24; else T=5000 R8=7 R32=4 R128=2 W3=128 W4=256; fi
    uptime
    S="benchmarks/scale.py --parts cluster --tasks $T"
    ( pin 0-1 timeout -k 5 230 $PY $S --workers 8 --reps $R8 > "$O/scale-8.txt" 2>&1
      pin 0-1 timeout -k 5 150 $PY $S --workers 32 --reps $R32 > "$O/scale-32.txt" 2>&1 ) &
    ( DASK_DISTRIBUTED__DIAGNOSTICS__NVML=False pin 2-3 timeout -k 5 150 $PY $S --workers 32 \
          --reps $R32 > "$O/scale-32-no-nvml.txt" 2>&1
      pin 2-3 timeout -k 5 200 $PY $S --workers $W3 --reps $R128 > "$O/scale-128.txt" 2>&1 ) &
    pin 4-5 timeout -k 5 380 $PY $S --workers $W4 --reps $R128 > "$O/scale-256.txt" 2>&1 &
    wait
    uptime
    for f in "$O"/scale-*.txt; do echo "== $f"; grep -E "^ +[0-9]+ " "$f"; grep -c "decisions=0" "$f"; done ;;
  e)
    pin() { local cores=$1; shift; if [ "${PIN:-1}" = 1 ] && command -v taskset >/dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
    if [ "${QUICK:-0}" = 1 ]; then T=500 R8=1 R32=1 W3=16 W4=24; else T=5000 R8=6 R32=3 W3=128 W4=256; fi
    uptime
    S="benchmarks/scale.py --parts cluster --tasks $T"
    pin 0-1 timeout -k 5 170 $PY $S --workers 8 --reps $R8 > "$O/scale-8.txt" 2>&1 &
    ( pin 2-3 timeout -k 5 90 $PY $S --workers 32 --reps $R32 > "$O/scale-32.txt" 2>&1
      pin 2-3 timeout -k 5 80 $PY $S --workers $W3 --reps 1 > "$O/scale-128.txt" 2>&1 ) &
    pin 4-5 timeout -k 5 170 $PY $S --workers $W4 --reps 1 > "$O/scale-256.txt" 2>&1 &
    wait
    uptime
    for f in "$O"/scale-*.txt; do echo "== $f"; grep -E "^ +[0-9]+ " "$f"; grep -c "decisions=0" "$f"; done ;;
esac
