#!/usr/bin/env bash
# On the GPU machine, with SmolLM2 and Gemma 3 staged under /tmp/models (and the wheels installed in /tmp/site):
# run the GPU runtime tests (ops, tiny models, real-model greedy-32 against llama.cpp and against the recorded tokens,
# fidelity), record the CUDA greedy-32 tokens again into $OUT (diffed against tests/data/greedy32.cuda.json),
# build the synthetic 1B and 8B models, then `engine bench -p 512 -n 128 -r 5` and the per-step profile on all four.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONUNBUFFERED=1 ENGINE_MODEL_DIR=/tmp/models
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider -s tests/test_cuda_ops.py tests/test_tiny_models.py \
    tests/test_runtime_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|cuda vs exact|^E  |^FAILED" | head -30
python3 scripts/record_greedy.py --device cuda --out "$OUT/greedy32.cuda.json" > "$OUT/record.log" 2>&1
cmp -s "$OUT/greedy32.cuda.json" tests/data/greedy32.cuda.json && echo "greedy32.cuda: same tokens as recorded" \
    || echo "greedy32.cuda: tokens differ from the recorded ones"
for p in 1b 8b; do
  [ -f /tmp/models/synth-$p.gguf ] || python3 .dev/make_synth_gguf.py /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      /tmp/models/synth-$p.gguf --preset $p > /dev/null
done
for m in smollm2-135m gemma3-270m /tmp/models/synth-1b.gguf /tmp/models/synth-8b.gguf; do
  python3 -m engine.cli bench $m -p 512 -n 128 -r 5 --device cuda 2>&1 | tail -2
  python3 scripts/profile_step.py $m > "$OUT/profile-$(basename $m .gguf).txt" 2>&1
done 2>&1 | tee "$OUT/bench.log"
echo "# every mul_mat forced to MMQ (the prefill otherwise takes dequantize + cuBLAS above 8 tokens):"
for m in smollm2-135m gemma3-270m; do
  ENGINE_MUL_MAT_PATH=mmq python3 -m engine.cli bench $m -p 512 -n 0 -r 5 --device cuda 2>&1 | tail -1
done 2>&1 | tee -a "$OUT/bench.log"
grep -h -E "^==|prefill|decode" "$OUT"/profile-*.txt
