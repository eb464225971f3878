#!/usr/bin/env bash
# Here, once: `bash scripts/device_serving.sh wheels` downloads what the GPU machine's python3 lacks into .whl/
# (carry .whl in every call that installs or serves: carried paths exist only during their call).
# On the GPU machine, from the project root. Steps, each its own call (the machine keeps /tmp between calls while it
# stays warm: make dependent calls back to back, it is given back after 30 s idle):
#   bash scripts/device_serving.sh setup          install the carried wheels (.whl/) into /tmp/site; start building
#                                                 llama.cpp in the background when .dev/ carries its sources
#   bash scripts/device_serving.sh stage CHUNK... copy model chunks (../shared/tools/device_stage.sh) to /tmp/stage;
#                                                 a complete set is joined into /tmp/models under the hub's file name
#   bash scripts/device_serving.sh gpu-tests      pytest -m gpu tests/ with both real models, then greedy-32 recorded
#                                                 into $OUT and diffed against tests/data/greedy32.cuda.json
#   bash scripts/device_serving.sh churn [B,..]  synthetic 8B: the engine core under a server's load, no HTTP
#                                                 (bench_batched_decode.py --churn), graphs on, then off
#   bash scripts/device_serving.sh http           the HTTP front end before a stand-in core (scripts/bench_http.py)
#   bash scripts/device_serving.sh serve synth|smol [SECS]  serve_compare.sh on one model (1, 8, 32, 64 clients)
#   bash scripts/device_serving.sh bench [SECS]   synthetic 8B: engine core batched decode (raw and --scheduler) beside
#                                                 llama-batched-bench; then serve_compare.sh on the 8B and SmolLM2
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONUNBUFFERED=1 ENGINE_MODEL_DIR=/tmp/models
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/models /tmp/stage
SMOL=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf GEMMA=/tmp/models/gemma-3-270m-q4_k_m.gguf
SYNTH=/tmp/models/synth-8b.gguf LLAMA=/tmp/llamacpp/build/bin

join_if_complete() {   # name, expected chunk count, sha256, target
  local n; n=$(ls /tmp/stage/"$1".* 2>/dev/null | wc -l)
  [ "$n" -eq "$2" ] || { echo "$1: $n of $2 chunks"; return; }
  cat /tmp/stage/"$1".* > "$4" && rm /tmp/stage/"$1".* && echo "$3  $4" | sha256sum -c
}

case "${1:-}" in
wheels)
  mkdir -p .whl
  for p in gguf pyzmq msgspec fastapi starlette pydantic pydantic-core uvicorn h11 annotated-types annotated-doc \
           typing-inspection typing-extensions opentelemetry-api importlib-metadata zipp uvloop httptools prometheus-client \
           llguidance; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "$p"
  done
  ls .whl ;;
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  [ -f .dev/llama.cpp-src.tar.xz ] && bash .dev/build_on_device.sh .dev/llama.cpp-src.tar.xz
  [ -f .dev/make_synth_gguf.py ] && cp .dev/make_synth_gguf.py .dev/serve_compare.sh /tmp/
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader ;;
stage)
  shift; cp "$@" /tmp/stage/
  join_if_complete smol 3 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 $SMOL
  join_if_complete gemma 6 a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 $GEMMA ;;
gpu-tests)
  [ -f $SYNTH ] || (python3 /tmp/make_synth_gguf.py $SMOL $SYNTH --preset 8b > /tmp/synth.log 2>&1 &)
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|error|cuda vs exact|^E  |^FAILED" | head -40
  python3 scripts/record_greedy.py --device cuda --out "$OUT/greedy32.cuda.json" > "$OUT/record.log" 2>&1
  cmp -s "$OUT/greedy32.cuda.json" tests/data/greedy32.cuda.json && echo "greedy32.cuda: same tokens as recorded" \
    || echo "greedy32.cuda: tokens differ from the recorded ones" ;;
bench)
  secs=${2:-10}
  [ -f $SYNTH ] || python3 /tmp/make_synth_gguf.py $SMOL $SYNTH --preset 8b > /tmp/synth.log 2>&1
  cat /tmp/llamacpp/build.rc 2>/dev/null || echo "llama.cpp build not finished"
  echo "== engine core, synthetic 8B (decode: greedy raw steps; scheduler: temperature 0.8, sampling on the GPU)"
  python3 scripts/bench_batched_decode.py $SYNTH --npl 1,8,16,32,64 2>&1 | tee "$OUT/batched.log"
  python3 scripts/bench_batched_decode.py $SYNTH --npl 1,8,16,32,64 --scheduler 2>&1 | tee -a "$OUT/batched.log"
  echo "== llama-batched-bench"
  $LLAMA/llama-batched-bench -m $SYNTH -ngl 99 -fa on -npp 128 -ntg 128 -npl 1,8,16,32,64 -c 20000 2>&1 \
    | grep -E "^\|" | tee -a "$OUT/batched.log"
  for m in $SYNTH $SMOL; do
    echo "== serve_compare $(basename $m)"
    bash /tmp/serve_compare.sh $m "1 8 32 64" "$secs" 2>&1 | tee -a "$OUT/serve.log"
    tail -c 200000 /tmp/serve-engine.log > "$OUT/serve-engine-$(basename $m .gguf).log"
  done ;;
churn)
  npl=${2:-1,8,32,64}
  [ -f $SYNTH ] || python3 /tmp/make_synth_gguf.py $SMOL $SYNTH --preset 8b > /tmp/synth.log 2>&1
  python3 scripts/bench_batched_decode.py $SYNTH --churn --npl $npl --npp 12 --ntg 64 --seconds 6 2>&1 \
    | tee "$OUT/churn.log"
  echo "graphs off:" | tee -a "$OUT/churn.log"
  ENGINE_CUDA_GRAPHS=0 python3 scripts/bench_batched_decode.py $SYNTH --churn --npl $npl --npp 12 --ntg 64 \
    --seconds 6 2>&1 | tee -a "$OUT/churn.log" ;;
http)
  python3 scripts/bench_http.py $SMOL --clients 1,8,32,64 --step-ms 15 --seconds 8 2>&1 | tee "$OUT/http.log" ;;
serve)          # synth|smol|MODEL [SECS]: serve_compare.sh on one model at 1, 8, 32 and 64 clients
  m=${2:-synth}; secs=${3:-8}
  [ "$m" = synth ] && m=$SYNTH; [ "$m" = smol ] && m=$SMOL
  [ -f $m ] || { echo "$m missing (synth: see /tmp/synth.log)"; exit 1; }
  cat /tmp/llamacpp/build.rc 2>/dev/null || { echo "llama.cpp build not finished"; exit 1; }
  echo "== serve_compare $(basename $m)" | tee -a "$OUT/serve.log"
  bash /tmp/serve_compare.sh $m "1 8 32 64" "$secs" 2>&1 | tee -a "$OUT/serve.log"
  tail -c 200000 /tmp/serve-engine.log > "$OUT/serve-engine-$(basename $m .gguf).log" ;;
serve-engine)   # MODEL CLIENTS SECS [extra engine serve flags]: the load test against engine serve alone
  m=$2; clients=$3; secs=$4; shift 4
  python3 -m engine.cli serve "$m" --port 8090 --device cuda --parallel 64 --ctx 512 "$@" > /tmp/serve-engine.log 2>&1 &
  ep=$!
  for i in $(seq 1 240); do
    kill -0 $ep 2>/dev/null || { tail -5 /tmp/serve-engine.log; exit 1; }
    curl -sf http://127.0.0.1:8090/health > /dev/null && break; sleep 1
  done
  python3 scripts/load_test.py --url http://127.0.0.1:8090 --clients 1 --seconds 3 --max-tokens 64 > /dev/null 2>&1
  for c in $clients; do
    echo "engine    $(basename $m) c=$c $(python3 scripts/load_test.py --url http://127.0.0.1:8090 --clients $c \
      --seconds $secs --max-tokens 64 2>&1 | tail -1)"
  done
  kill $ep; wait $ep 2>/dev/null
  grep -v " 200 prompt=" /tmp/serve-engine.log | tail -5 ;;
*)
  echo "usage: $0 wheels | setup | stage CHUNK... | gpu-tests | churn [B,..] | http | serve MODEL [SECS] | bench [SECS] | serve-engine"
  exit 2 ;;
esac
