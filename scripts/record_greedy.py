#!/usr/bin/env python3
"""Record the engine's own greedy-32 tokens for the golden prompts: tests/data/greedy32.<device>.json.

    python scripts/record_greedy.py --device cpu
The regression tests assert these tokens exactly; re-record only for a deliberate, explained change
(scripts/greedy_margin.py OLD NEW: where the records part, and the exact model's logits there).
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import MODEL_KEYS, read_prompts  # noqa: E402
from engine.runtime import Runtime  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


def greedy32(rt: Runtime, prompt: str) -> list[int]:
    ids = rt.tokenizer.encode(prompt)
    return list(rt.generate(ids, SamplingParams(temperature=0), max_tokens=32, ignore_eos=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = {}
    for key, name in MODEL_KEYS.items():
        rt = Runtime.load(name, device=args.device, n_ctx=1024)
        out[key] = [greedy32(rt, p) for p in read_prompts(key)]
        print(key, "done", file=sys.stderr)
    path = Path(args.out or ROOT / "tests" / "data" / f"greedy32.{args.device}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
