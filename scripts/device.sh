#!/usr/bin/env bash
# Here, once: `bash scripts/device.sh wheels` downloads what the GPU machine's python3 lacks into .whl/ (carry .whl in
# the call that runs setup; carried paths exist only during their call). Carry engine/cuda/prebuilt (the kernels
# `pip install -e .` built here) in that call too: setup keeps a copy in /tmp/prebuilt that every command links.
# Or, here, `bash scripts/device.sh pack` (after `engine fetch`, wheels and pip install -e .): the prebuilt kernels
# as .dev/prebuilt.tar.xz (~5 MB) and both real models in .stage/0 .. .stage/5, six calls in all with the test run:
#   carry .whl .dev/prebuilt.tar.xz .stage/0: setup;  carry .stage/K (K = 1..4): chunk;  carry .stage/5: gpu-tests
# On the GPU machine, from the project root. Steps, each its own call (the machine keeps /tmp between calls while it
# stays warm: make dependent calls back to back, it is given back after 30 s idle):
#   bash scripts/device.sh setup          install the carried wheels (.whl/) into /tmp/site, keep the prebuilt
#                                         kernels; build llama.cpp in the background when .dev/ carries its sources
#                                         and LLAMA=1
#   bash scripts/device.sh stage CHUNK... copy model chunks (../shared/tools/device_stage.sh) to /tmp/stage;
#                                         a complete set is joined into /tmp/models under the hub's file name
#   bash scripts/device.sh chunk          copy the carried chunk of `pack` (.stage/K) to /tmp/stage; the last one
#                                         unpacks both models into /tmp/models (setup and gpu-tests do it too)
#   bash scripts/device.sh first-token    `engine generate smollm2-135m ... -n 32 --device cuda` with empty compiler
#                                         caches: seconds to its first output byte (the first call on a fresh machine)
#   bash scripts/device.sh gpu-tests      pytest -m gpu tests/ with both real models, then greedy-32 recorded
#                                         into $OUT and diffed against tests/data/greedy32.cuda.json (~4 min)
#   bash scripts/device.sh models [TREE]  `engine bench -p 512 -n 128 -r 5` on SmolLM2, Gemma 3 and the synthetic
#                                         1B and 8B, then bench.py decode at 1-64 sequences on the 8B; TREE: another
#                                         checkout of the project to measure the same way (before / after)
#   bash scripts/device.sh kernels [ARGS] bench.py mul-mat ARGS (the kernels at llama.cpp's shapes)
#   bash scripts/device.sh decode         the decode path at --decode-activations q16 and q8_1: fidelity.py --decode
#                                         against the exact path on both real models, engine bench on the four models
#   bash scripts/device.sh churn [B,..]   synthetic 8B: the engine core under a server's load, no HTTP
#                                         (bench.py decode --churn), graphs on, then off
#   bash scripts/device.sh http           the HTTP front end before a stand-in core (bench.py http)
#   bash scripts/device.sh invariant smol|synth [SECS]  engine serve at 1, 8, 32, 64 clients, default then
#                                         --batch-invariant: the cost of batch invariance
#   bash scripts/device.sh structured smol|synth [SECS]  the load test at 8 and 32 clients, plain and with
#                                         structured output (load_test.py --json-schema): the grammar masks' cost
#   bash scripts/device.sh prefix synth|smol [SECS] [on|off|on,off] [FLAGS]  32 clients whose prompts share a
#                                         2,000-token system text (load_test.py --shared-prefix 2000), prefix
#                                         caching on, then off (FLAGS to engine serve): TTFT;
#                                         with it on, also one client at a time (the prefix cached, no burst)
#                                         and the acceptance's burst: one request, then 32 at once (5 rounds)
#   bash scripts/device.sh serve synth|smol [SECS]  serve_compare.sh on one model (1, 8, 32, 64 clients)
#   bash scripts/device.sh bench [SECS]   synthetic 8B: engine core batched decode (raw and --scheduler) beside
#                                         llama-batched-bench; then serve_compare.sh on the 8B and SmolLM2
#   bash scripts/device.sh depth [D,..] [KV]  tg128 of one sequence after D tokens (default 4096,16384,32768) on
#                                         the 8B, after 4096 on SmolLM2 and Gemma 3, mean ± sd of 3 runs;
#                                         llama-bench -d -r 3 beside when built;
#                                         KV: the cache's type (f16, q8_0) in both, and the real models' KL at it
#   bash scripts/device.sh ubatch         the 8B's pp512 / pp4096 at --ubatch 512 and the default; llama-bench beside
#   bash scripts/device.sh attention [TREE]  decode attention alone at the three models' shapes (bench.py attention
#                                         --decode 4096,16384,32768 --rows 1,16), twice; alternated with TREE (another
#                                         checkout, its own kernels) when given: a kernel change before / after
#   bash scripts/device.sh capacity [SECS]  the 8B in the KV memory of --parallel 32 --ctx 4096, 128 clients of 500
#                                         tokens each (--parallel 128): errors, preemptions
#   bash scripts/device.sh tp [N]         (N GPUs) synthetic 8B and 70B: engine bench -p 512 -n 128 at -tp 1 and N,
#                                         llama-bench -sm layer / row beside when llama.cpp is built
#   bash scripts/device.sh tp-serve [MODEL] [SECS] [N]  32 clients: engine serve -tp N, llama-server -sm layer / row
set -uo pipefail
LOCAL_MODEL_DIR=${ENGINE_MODEL_DIR:-}     # pack reads the models from here (the hub's cache)
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONUNBUFFERED=1 ENGINE_MODEL_DIR=/tmp/models
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/models /tmp/stage
SMOL=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf GEMMA=/tmp/models/gemma-3-270m-q4_k_m.gguf
SYNTH=/tmp/models/synth-8b.gguf LLAMA=/tmp/llamacpp/build/bin
[ -e engine/cuda/prebuilt ] || { [ -d /tmp/prebuilt ] && ln -s /tmp/prebuilt engine/cuda/prebuilt; }

synth() {   # preset: the synthetic model built from SmolLM2 (scripts/make_synth_gguf.py: 8B ~20 s, 70B ~1 min)
  [ -f /tmp/models/synth-$1.gguf ] || python3 scripts/make_synth_gguf.py $SMOL /tmp/models/synth-$1.gguf --preset $1 \
    > /tmp/synth-$1.log 2>&1
}

packed_chunk() {   # a carried chunk of `pack` (.stage/K/m.K, .stage/K/count) to /tmp/stage; all there: the models
  ls .stage/*/m.* > /dev/null 2>&1 || return 0
  local want; want=$(cat .stage/*/count | head -1); cp .stage/*/m.* /tmp/stage/
  local n; n=$(ls /tmp/stage/m.* | wc -l); echo "model chunks: $n of $want"
  [ "$n" -eq "$want" ] || return 0
  cat /tmp/stage/m.* | tar xf - -C /tmp/models && rm /tmp/stage/m.* && (cd /tmp/models && sha256sum -c SUMS)
}

join_if_complete() {   # name, expected chunk count, sha256, target
  local n; n=$(ls /tmp/stage/"$1".* 2>/dev/null | wc -l)
  [ "$n" -eq "$2" ] || { echo "$1: $n of $2 chunks"; return; }
  cat /tmp/stage/"$1".* > "$4" && rm /tmp/stage/"$1".* && echo "$3  $4" | sha256sum -c
}

start_engine() {   # MODEL [engine serve flags]: engine serve on port 8090 in the background (its pid in $ep), ready
  python3 -m engine.cli serve "$1" --port 8090 --device cuda --parallel 64 --ctx 512 "${@:2}" > /tmp/serve-engine.log 2>&1 &
  ep=$!
  for i in $(seq 1 240); do
    kill -0 $ep 2>/dev/null || { tail -5 /tmp/serve-engine.log; exit 1; }
    curl -sf http://127.0.0.1:8090/health > /dev/null && break; sleep 1
  done
  python3 scripts/load_test.py --url http://127.0.0.1:8090 --clients 1 --seconds 3 --max-tokens 64 > /dev/null 2>&1
}

case "${1:-}" in
pack)           # here: .dev/prebuilt.tar.xz and the real models in chunks that fit each call's 64 MiB beside the tree
  models=$(ENGINE_MODEL_DIR=$LOCAL_MODEL_DIR python3 -c "from engine import hub; print(hub.cache_dir())")
  mkdir -p .dev && grep -qx '/.stage/' .git/info/exclude 2>/dev/null || echo '/.stage/' >> .git/info/exclude
  tar cJf .dev/prebuilt.tar.xz -C engine/cuda prebuilt || exit 1
  rm -rf .stage /tmp/pack && mkdir -p /tmp/pack && (cd "$models" && sha256sum $(basename $SMOL) $(basename $GEMMA)) \
    > /tmp/pack/SUMS || exit 1
  tar chf /tmp/pack/models.tar -C /tmp/pack SUMS -C "$models" $(basename $SMOL) $(basename $GEMMA)
  limit=67108864; tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
  first=$(( limit - tree - $(du -cb .whl .dev/prebuilt.tar.xz | tail -1 | cut -f1) - 300000 ))
  rest=$(( limit - tree - 300000 ))
  mkdir -p .stage/0 && head -c $first /tmp/pack/models.tar > .stage/0/m.00
  tail -c +$(( first + 1 )) /tmp/pack/models.tar | split -b $rest -d -a 2 --numeric-suffixes=1 - /tmp/pack/m.
  for f in /tmp/pack/m.*; do k=$((10#${f##*.})); mkdir -p .stage/$k; mv $f .stage/$k/; done
  n=$(ls -d .stage/*/ | wc -l); for d in .stage/*/; do echo $n > $d/count; done; rm -rf /tmp/pack
  echo "carry [.whl, .dev/prebuilt.tar.xz, .stage/0]: setup; then .stage/1 .. .stage/$((n - 2)): chunk;" \
       "then .stage/$((n - 1)): gpu-tests" ;;
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
  [ -d engine/cuda/prebuilt ] && [ ! -L engine/cuda/prebuilt ] && rm -rf /tmp/prebuilt && cp -r engine/cuda/prebuilt /tmp/prebuilt
  if [ -f .dev/prebuilt.tar.xz ]; then
    rm -rf /tmp/prebuilt /tmp/pb && mkdir /tmp/pb && tar xJf .dev/prebuilt.tar.xz -C /tmp/pb && mv /tmp/pb/prebuilt /tmp/prebuilt
    [ -e engine/cuda/prebuilt ] || ln -s /tmp/prebuilt engine/cuda/prebuilt
  fi
  packed_chunk
  [ "${LLAMA_BUILD:-0}" = 1 ] && [ -f .dev/llama.cpp-src.tar.xz ] && bash .dev/build_on_device.sh .dev/llama.cpp-src.tar.xz
  [ -f .dev/serve_compare.sh ] && cp .dev/serve_compare.sh /tmp/
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader ;;
chunk)
  packed_chunk ;;
stage)
  shift; cp "$@" /tmp/stage/
  join_if_complete smol 3 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 $SMOL
  join_if_complete gemma 6 a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 $GEMMA ;;
first-token)
  cache=$(mktemp -d); ls engine/cuda/prebuilt/*.cubin 2>/dev/null | wc -l | xargs echo "prebuilt cubins:"
  CUPY_CACHE_DIR=$cache python3 - <<'PY' 2>&1 | tee "$OUT/first-token.log"
import subprocess, sys, time
t0 = time.time()
p = subprocess.Popen([sys.executable, "-m", "engine.cli", "generate", "smollm2-135m", "The capital of France is",
                      "-n", "32", "--device", "cuda"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
first = p.stdout.read(1)
t1 = time.time()
out, err = p.communicate()
print(f"first token after {t1 - t0:.2f} s of the command; the whole command {time.time() - t0:.2f} s; rc {p.returncode}")
print((first + out).decode().strip())
print(err.decode()[-1500:])
PY
  ls "$cache" | wc -l | xargs echo "NVRTC cache entries written:" ;;
gpu-tests)
  packed_chunk
  synth 8b &
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|error|cuda vs exact|^E  |^FAILED" | head -40
  python3 scripts/record_greedy.py --device cuda --out "$OUT/greedy32.cuda.json" > "$OUT/record.log" 2>&1
  cmp -s "$OUT/greedy32.cuda.json" tests/data/greedy32.cuda.json && echo "greedy32.cuda: same tokens as recorded" \
    || echo "greedy32.cuda: tokens differ from the recorded ones" ;;
models)         # [TREE]: engine bench on the four models and batched decode on the 8B, in this tree or TREE
  tree=${2:-$PWD}; synth 1b; synth 8b
  echo "== $(cd $tree && git log -1 --format=%h 2>/dev/null || echo "$tree")"
  for m in smollm2-135m gemma3-270m /tmp/models/synth-1b.gguf $SYNTH; do
    (cd $tree && PYTHONPATH=/tmp/site:$tree python3 -m engine.cli bench $m -p 512 -n 128 -r 5 --device cuda 2>&1 \
      | tail -2)
  done
  if [ -f $tree/scripts/bench.py ]; then bd="$tree/scripts/bench.py decode"; else bd=$tree/scripts/bench_batched_decode.py; fi
  (cd $tree && PYTHONPATH=/tmp/site:$tree python3 $bd $SYNTH --npl 1,8,16,32,64 2>&1 | tail -6) ;;
kernels)
  shift; python3 scripts/bench.py mul-mat "$@" 2>&1 | tee "$OUT/kernels.log" ;;
decode)
  synth 1b; synth 8b
  for key in smol gemma; do
    m=$SMOL; [ $key = gemma ] && m=$GEMMA
    for a in q16 q8_1; do
      python3 scripts/fidelity.py --model $m --tokens tests/data/llamacpp/apache.$key.tokens --device cuda --decode \
        --ref tests/data/exact/apache.$key.exact.lp16.bin --decode-activations $a 2>&1 | tail -1 | tee -a "$OUT/decode.log"
    done
  done
  for m in smollm2-135m gemma3-270m /tmp/models/synth-1b.gguf $SYNTH; do
    for a in q16 q8_1 q16 q8_1; do          # alternated: drift within the lease shows
      python3 -m engine.cli bench $m -p 512 -n 128 -r 5 --device cuda --decode-activations $a 2>&1 | tail -1 \
        | sed "s/^/$a /" | tee -a "$OUT/decode.log"
    done
  done ;;
bench)
  secs=${2:-10}
  synth 8b
  cat /tmp/llamacpp/build.rc 2>/dev/null || echo "llama.cpp build not finished"
  echo "== engine core, synthetic 8B (decode: greedy raw steps; scheduler: temperature 0.8, sampling on the GPU)"
  python3 scripts/bench.py decode $SYNTH --npl 1,8,16,32,64 2>&1 | tee "$OUT/batched.log"
  python3 scripts/bench.py decode $SYNTH --npl 1,8,16,32,64 --scheduler 2>&1 | tee -a "$OUT/batched.log"
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
  synth 8b
  python3 scripts/bench.py decode $SYNTH --churn --npl $npl --npp 12 --ntg 64 --seconds 6 2>&1 \
    | tee "$OUT/churn.log"
  echo "graphs off:" | tee -a "$OUT/churn.log"
  python3 scripts/bench.py decode $SYNTH --churn --eager --npl $npl --npp 12 --ntg 64 \
    --seconds 6 2>&1 | tee -a "$OUT/churn.log" ;;
http)
  python3 scripts/bench.py http $SMOL --clients 1,8,32,64 --step-ms 15 --seconds 8 2>&1 | tee "$OUT/http.log" ;;
serve)          # synth|smol|MODEL [SECS]: serve_compare.sh on one model at 1, 8, 32 and 64 clients
  m=${2:-synth}; secs=${3:-8}
  [ "$m" = synth ] && m=$SYNTH; [ "$m" = smol ] && m=$SMOL
  [ "$2" = synth ] && synth 8b
  [ -f $m ] || { echo "$m missing"; exit 1; }
  cat /tmp/llamacpp/build.rc 2>/dev/null || { echo "llama.cpp build not finished"; exit 1; }
  echo "== serve_compare $(basename $m)" | tee -a "$OUT/serve.log"
  bash /tmp/serve_compare.sh $m "1 8 32 64" "$secs" 2>&1 | tee -a "$OUT/serve.log"
  tail -c 200000 /tmp/serve-engine.log > "$OUT/serve-engine-$(basename $m .gguf).log" ;;
serve-engine)   # MODEL CLIENTS SECS [extra engine serve flags]: the load test against engine serve alone
  m=$2; clients=$3; secs=$4; shift 4
  start_engine "$m" "$@"
  for c in $clients; do
    echo "engine    $(basename $m) c=$c $(python3 scripts/load_test.py --url http://127.0.0.1:8090 --clients $c \
      --seconds $secs --max-tokens 64 2>&1 | tail -1)"
  done
  kill $ep; wait $ep 2>/dev/null
  grep -v " 200 prompt=" /tmp/serve-engine.log | tail -5 ;;
invariant)      # smol|synth|MODEL [SECS]: engine serve's load test, default then --batch-invariant
  m=${2:-smol}; secs=${3:-8}
  [ "$m" = smol ] && m=$SMOL; [ "$m" = synth ] && { synth 8b; m=$SYNTH; }
  for mode in default --batch-invariant; do
    start_engine "$m" $([ $mode = default ] || echo $mode)
    for c in 1 8 32 64; do
      echo "$(basename $m) $mode c=$c $(python3 scripts/load_test.py --url http://127.0.0.1:8090 --clients $c \
        --seconds $secs --max-tokens 64 2>&1 | tail -1)" | tee -a "$OUT/invariant.log"
    done
    kill $ep; wait $ep 2>/dev/null
  done ;;
structured)     # smol|synth|MODEL [SECS]: the load test at 8 and 32 clients, plain and --json-schema, alternated
  m=${2:-smol}; secs=${3:-8}
  [ "$m" = smol ] && m=$SMOL; [ "$m" = synth ] && { synth 8b; m=$SYNTH; }
  start_engine "$m"
  python3 scripts/load_test.py --url http://127.0.0.1:8090 --clients 8 --seconds 3 --max-tokens 64 --json-schema \
    > /dev/null 2>&1
  for c in 8 32; do
    for j in plain --json-schema plain --json-schema; do
      echo "$(basename $m) $j $(python3 scripts/load_test.py --url http://127.0.0.1:8090 --clients $c --seconds $secs \
        --max-tokens 64 $([ $j = plain ] || echo $j) 2>&1 | tail -1)" | tee -a "$OUT/structured.log"
    done
  done
  kill $ep; wait $ep 2>/dev/null ;;
prefix)         # smol|synth|MODEL [SECS] [on|off|on,off] [FLAGS]: the shared-system-prompt load test, prefix caching
                #   on then off (or the one given); FLAGS go to engine serve
  m=${2:-synth}; secs=${3:-15}; modes=${4:-on,off}; flags=("${@:5}")
  [ "$m" = smol ] && m=$SMOL; [ "$m" = synth ] && { synth 8b; m=$SYNTH; }
  for cache in ${modes//,/ }; do
    start_engine "$m" --parallel 32 --ctx 2304 $([ $cache = on ] || echo --no-prefix-cache) "${flags[@]}"
    for c in 32 $([ $cache = on ] && echo 1); do
      echo "$(basename $m) prefix cache $cache ${flags[*]} $(python3 scripts/load_test.py --url http://127.0.0.1:8090 --clients $c \
        --seconds $secs --max-tokens 32 --shared-prefix 2000 2>&1 | tail -1)" | tee -a "$OUT/prefix.log"
    done
    [ $cache = on ] && echo "$(basename $m) prefix cache on ${flags[*]} $(python3 scripts/load_test.py \
      --url http://127.0.0.1:8090 --clients 32 --burst --rounds 5 --max-tokens 16 --shared-prefix 2000 2>&1 \
      | tail -1)" | tee -a "$OUT/prefix.log"
    kill $ep; wait $ep 2>/dev/null
  done ;;
depth)          # [DEPTHS] [KV]: tg128 of one sequence after N tokens (bench.py decode --npp N --reps 3): the 8B at
                #   DEPTHS, SmolLM2 and Gemma 3 at 4096; llama-bench -d N beside when llama.cpp is built. KV (f16,
                #   q8_0): the cache's type for both engines (--kv-type, -ctk / -ctv), and the prefill KL of both real
                #   models at it
  depths=${2:-4096,16384,32768} kv=${3:-f16}; synth 8b
  for m in $SYNTH $SMOL $GEMMA; do
    ds=$depths; [ $m = $SYNTH ] || ds=4096
    for d in ${ds//,/ }; do
      echo "engine $(basename $m) d=$d $kv $(python3 scripts/bench.py decode $m --npl 1 --npp $d --ntg 128 \
        --reps 3 --kv-type $kv 2>&1 | tail -1)" | tee -a "$OUT/depth.log"
    done
    [ -x $LLAMA/llama-bench ] && $LLAMA/llama-bench -m $m -ngl 99 -fa 1 -p 0 -n 128 -r 3 -d $ds -ctk $kv -ctv $kv \
      2>&1 | grep -E "^\|" | tee -a "$OUT/depth.log"
  done
  [ $kv = f16 ] || for key in smol gemma; do m=$SMOL; [ $key = gemma ] && m=$GEMMA
    echo "fidelity $key $kv $(python3 scripts/fidelity.py --model $m --tokens tests/data/llamacpp/apache.$key.tokens \
      --ref tests/data/exact/apache.$key.exact.lp16.bin --device cuda --kv-type $kv 2>&1 | tail -1)" | tee -a "$OUT/depth.log"
  done ;;
attention)      # [TREE]: each tree's own scripts/bench.py (it imports the engine beside it), alternated twice
  for r in 1 2; do for t in . ${2:-}; do
    (cd $t && PYTHONPATH=/tmp/site:$PWD python3 scripts/bench.py attention --decode 4096,16384,32768 --rows 1,16 \
      --reps 10 2>&1 | grep -E "^\| [A-Z]" | sed "s|^|$t |" | tee -a "$OUT/attention.log")
  done; done ;;
ubatch)         # prefill of the 8B (engine bench -p 512 / 4096) at --ubatch 512 and the default, alternated twice;
                #   llama-bench -p 512,4096 beside when llama.cpp is built
  synth 8b
  for r in 1 2; do for u in 512 default; do for p in 512 4096; do
    python3 -m engine.cli bench $SYNTH -p $p -n 1 -r 3 --device cuda $([ $u = default ] || echo --ubatch $u) 2>&1 \
      | grep -E "\| pp" | tee -a "$OUT/ubatch.log"
  done; done; done
  [ -x $LLAMA/llama-bench ] && $LLAMA/llama-bench -m $SYNTH -ngl 99 -fa 1 -p 512,4096 -n 0 -r 3 2>&1 | grep -E "^\|" \
    | tee -a "$OUT/ubatch.log" ;;
capacity)       # [SECS]: the 8B served with the KV memory --parallel 32 --ctx 4096 reserves (32 x 4096 positions),
                #   --parallel 128: 128 clients each generating 500 tokens (12-token prompts)
  secs=${2:-30}; synth 8b
  gib=$(python3 -c "from engine.gguf import GGUFFile; from engine.model.config import ModelConfig as C
c = C.from_gguf(GGUFFile('$SYNTH')); print(32 * 4096 * 2 * c.n_layer * c.n_head_kv * c.head_dim * 2 / 2**30)")
  start_engine $SYNTH --parallel 128 --ctx 4096 --kv-memory $gib
  grep -m1 "model loaded" /tmp/serve-engine.log | tee -a "$OUT/capacity.log"
  echo "kv-memory $gib GiB, 128 clients, 500 tokens each: $(python3 scripts/load_test.py --url http://127.0.0.1:8090 \
    --clients 128 --seconds $secs --max-tokens 500 2>&1 | tail -1)" | tee -a "$OUT/capacity.log"
  curl -s http://127.0.0.1:8090/metrics | grep -E "^engine:(num_preemptions|kv_cache_usage)" | tee -a "$OUT/capacity.log"
  kill $ep; wait $ep 2>/dev/null ;;
tp)
  n=${2:-2}; synth 8b; synth 70b
  for m in $SYNTH /tmp/models/synth-70b.gguf; do
    for tp in 1 $n; do
      python3 -m engine.cli bench $m -p 512 -n 128 -r 3 --device cuda -tp $tp 2>&1 | tail -2 | tee -a "$OUT/tp.log"
    done
    if [ -x $LLAMA/llama-bench ]; then
      for sm in layer row; do
        $LLAMA/llama-bench -m $m -ngl 99 -fa 1 -p 512 -n 128 -r 3 -sm $sm 2>&1 | grep -E "^\|" | tee -a "$OUT/tp.log"
      done
    fi
  done ;;
tp-serve)
  m=${2:-/tmp/models/synth-70b.gguf}; secs=${3:-15}; n=${4:-2}
  bash scripts/device.sh serve-engine $m 32 $secs -tp $n | tee -a "$OUT/tp-serve.log"
  [ -x $LLAMA/llama-server ] || { echo "llama.cpp not built"; exit 0; }
  for sm in layer row; do
    $LLAMA/llama-server -m $m -ngl 99 -fa on -np 32 -c $((32 * 512)) -sm $sm --port 8091 > /tmp/serve-llama-$sm.log 2>&1 < /dev/null &
    lp=$!
    for i in $(seq 1 300); do curl -sf http://127.0.0.1:8091/health > /dev/null && break; sleep 1; done
    python3 scripts/load_test.py --url http://127.0.0.1:8091 --clients 1 --seconds 3 --max-tokens 64 > /dev/null 2>&1
    echo "llama.cpp -sm $sm $(basename $m) c=32 $(python3 scripts/load_test.py --url http://127.0.0.1:8091 --clients 32 \
      --seconds $secs --max-tokens 64 2>&1 | tail -1)" | tee -a "$OUT/tp-serve.log"
    kill $lp; wait $lp 2>/dev/null
  done ;;
*)
  echo "usage: $0 wheels | setup | stage CHUNK... | first-token | gpu-tests | models [TREE] | kernels [ARGS] | decode |"
  echo "       churn [B,..] | depth [D,..] [KV] | ubatch | capacity [SECS] | structured smol|synth [SECS] | prefix smol|synth [SECS] |"
  echo "       http | serve MODEL [SECS] | bench [SECS] | serve-engine MODEL CLIENTS SECS | tp [N] | tp-serve [MODEL] [SECS] [N]"
  exit 2 ;;
esac
