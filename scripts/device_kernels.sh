#!/usr/bin/env bash
# On the GPU machine: install the carried wheels, run the GPU kernel tests, then the kernel benchmark.
#   bash scripts/device_kernels.sh [bench args...]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_kernels.py 2>&1 | tail -25 | tee ${OUT:-/tmp}/tests.log
python3 scripts/bench_kernels.py "$@" 2>&1 | tee ${OUT:-/tmp}/bench.log
