#!/usr/bin/env python3
"""Teacher-forced log-probs over a token file, and top-1 agreement / KL against a reference.

    python scripts/fidelity.py --model smollm2-135m --tokens tests/data/llamacpp/apache.smol.tokens \
        --ref tests/data/llamacpp/apache.smol.cpu.lp16.bin [--device cpu|cuda] [--exact] [--decode] \
        [--decode-activations q16|q8_1] [--kv-type f16|q8_0] [--out OUT.lp16.bin]

--decode runs the text one token per step through the decode path (as generation does) instead of in ubatches.

KL is KL(engine || reference) over the engine's top 16, the reference's 16th log-prob standing in for ids it does
not list (the definition of ../shared/tools/lpcmp.py with the engine as first file).
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cuda.config import MUL_MAT_PATHS, CudaConfig  # noqa: E402
from engine.logprobs import compare, decode_logprobs, read_lp, top_k_logprobs, write_lp  # noqa: E402
from engine.model.base import KV_TYPE_BYTES  # noqa: E402
from engine.runtime import Runtime  # noqa: E402


def teacher_forced(rt: Runtime, tokens: list[int]):
    """Log-probs of every position, the whole sequence evaluated in ubatches."""
    return top_k_logprobs(rt.prefill(tokens, all_logits=True), 16)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help="whitespace-separated token ids")
    ap.add_argument("--ref", help="reference .lp16.bin")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--exact", action="store_true", help="float64 CPU path")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--decode", action="store_true", help="one token per step through the decode path")
    ap.add_argument("--decode-activations", default="q8_1", choices=("q8_1", "q16"),
                    help="the CUDA decode path's activations (engine generate's flag)")
    ap.add_argument("--kv-type", default=None, choices=tuple(KV_TYPE_BYTES),
                    help="the KV cache's type (default: the backend's)")
    ap.add_argument("--mul-mat-path", default=None, choices=MUL_MAT_PATHS,
                    help="every CUDA mul_mat through this path where it can take the shape (engine generate's flag)")
    ap.add_argument("--out", help="write the engine's log-probs here")
    args = ap.parse_args(argv)
    tokens = [int(x) for x in Path(args.tokens).read_text().split()]
    cuda = CudaConfig(exact_decode=args.decode_activations == "q16", mul_mat_path=args.mul_mat_path) \
        if args.device == "cuda" else None
    rt = Runtime.load(args.model, device=args.device, exact=args.exact, n_ctx=max(len(tokens), 512),
                      n_ubatch=args.ubatch, cuda=cuda, kv_type=args.kv_type)
    t0 = time.perf_counter()
    top = decode_logprobs(rt, tokens) if args.decode else teacher_forced(rt, tokens)
    result = {"model": args.model, "device": rt.backend.name, "exact": args.exact, "positions": len(tokens),
              "decode": args.decode, "kv_type": args.kv_type or "backend's",
              "seconds": round(time.perf_counter() - t0, 2)}
    if args.decode and args.device == "cuda":
        result["decode_activations"] = args.decode_activations
    if args.mul_mat_path:
        result["mul_mat_path"] = args.mul_mat_path
    if args.out:
        write_lp(args.out, top)
    if args.ref:
        result.update(compare(top, read_lp(args.ref)))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
