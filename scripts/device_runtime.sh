#!/usr/bin/env bash
# On the GPU machine, with the real models staged under /tmp/models: record the CUDA greedy-32 tokens, run the GPU
# tests (kernels, ops, tiny models, real-model greedy-32 and fidelity), then engine bench on both models.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONUNBUFFERED=1 ENGINE_MODEL_DIR=/tmp/models
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 scripts/record_greedy.py --device cuda --out "$OUT/greedy32.cuda.json" && cp "$OUT/greedy32.cuda.json" tests/data/
python3 -m pytest -q -p no:cacheprovider -s tests/test_tiny_models.py tests/test_cuda_ops.py \
    tests/test_runtime_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|cuda vs exact|^E |^FAILED" | head -30
for m in smollm2-135m gemma3-270m; do python3 -m engine.cli bench $m -p 512 -n 128 -r 3 --device cuda; done 2>&1 | tee "$OUT/bench.log"
