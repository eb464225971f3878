#!/usr/bin/env python3
"""Where two greedy-32 records part, and how close the exact model is there: the reason a re-record gives.

    python scripts/greedy_margin.py tests/data/greedy32.cuda.json NEW.json
For each prompt whose tokens differ: the first token where they part, and the exact (float64 CPU) path's logits of
the old token, the new one and its top three there, after the prompt and the tokens both records share.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import MODEL_KEYS, read_prompts  # noqa: E402
from engine.runtime import Runtime  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    args = ap.parse_args()
    old, new = (json.loads(Path(p).read_text()) for p in (args.old, args.new))
    for key, name in MODEL_KEYS.items():
        rt = None
        for i, (prompt, a, b) in enumerate(zip(read_prompts(key), old[key], new[key])):
            part = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)
            if part is None:
                continue
            rt = rt or Runtime.load(name, device="cpu", n_ctx=1024, exact=True)
            logits = rt.prefill(rt.tokenizer.encode(prompt) + a[:part])[-1]
            top = [(int(t), round(float(logits[t]), 3)) for t in np.argsort(logits)[::-1][:3]]
            print(f"{key} prompt {i}: parts at token {part}: old {a[part]} {logits[a[part]]:.3f}, "
                  f"new {b[part]} {logits[b[part]]:.3f}; exact top 3 {top}")


if __name__ == "__main__":
    main()
