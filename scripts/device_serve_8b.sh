#!/usr/bin/env bash
# On the GPU machine, SmolLM2 staged under /tmp/models: build the synthetic 8B model, serve it with `engine serve`,
# and run scripts/load_test.py at 1, 8 and 32 concurrent clients.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONUNBUFFERED=1 ENGINE_MODEL_DIR=/tmp/models
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f /tmp/models/synth-8b.gguf ] || python3 .dev/make_synth_gguf.py /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/models/synth-8b.gguf --preset 8b
setsid python3 -m engine.cli serve /tmp/models/synth-8b.gguf --port 8090 --device cuda --parallel 32 --ctx 256 \
    > "$OUT/serve.log" 2>&1 < /dev/null &
for i in $(seq 120); do curl -sf http://127.0.0.1:8090/health > /dev/null && break; sleep 1; done
curl -s http://127.0.0.1:8090/health; echo
for c in 1 8 32; do
  python3 scripts/load_test.py --url http://127.0.0.1:8090 --clients $c --seconds ${SECONDS_PER_RUN:-12} --max-tokens 64 \
      2>&1 | tee -a "$OUT/load.log"
done
curl -s http://127.0.0.1:8090/metrics | grep -v "^#" | tee -a "$OUT/load.log"
