#!/usr/bin/env python3
"""Record HF transformers' logits on the tiny architecture files (tests/tiny_archs.py) into tests/data/transformers/,
once, so that CI compares the engine against them without torch.

    python -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install torch transformers gguf numpy sentencepiece
    /tmp/tfenv/bin/python scripts/record_transformers.py [ARCH ...]

Each architecture's file is written from its seed, loaded by transformers' own GGUF loader (float32, CPU), and run on
tests/tiny_archs.prompt_tokens(): the logits of every position, and 16 greedy tokens after the first 8. Two things
the loader does not read are given to the config (Mistral's window: the llama file's weights are loaded into
transformers' Mistral with it): the head size (attention.key_length, mapped for some
architectures only), Gemma 2's caps and query scale, and, for Llama 3, `rope_type: llama3` with the parameters the file's rope_freqs.weight was
computed from (transformers computes its own frequencies from them).
"""
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / d) for d in ("tests", "")]   # tiny_archs, engine
from tiny_archs import (ARCHS, GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP, HD, LLAMA3_ROPE, LONGROPE_N_ROT,  # noqa: E402
                        F_EXP, F_SHEXP, LONGROPE_ORIG_CTX, MISTRAL_WINDOW, ROPE_BASE, YARN_FACTOR, YARN_ORIG_CTX,
                        longrope_factors, prompt_tokens, write_arch)

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "transformers"
GREEDY_PROMPT, GREEDY_NEW = 8, 16


def record(name: str, folder: Path) -> dict:
    fname = f"{name}.gguf"
    write_arch(folder / fname, name)
    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    config.head_dim = HD                 # the loader maps attention.key_length for some architectures only
    if (getattr(config, "pad_token_id", None) or 0) >= config.vocab_size:
        config.pad_token_id = None       # Phi-3's default (32000) is past the tiny vocabulary
    if name == "gemma2":                 # the loader reads neither the caps nor the query scale
        config.attn_logit_softcapping, config.final_logit_softcapping = GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP
        config.query_pre_attn_scalar = HD
        config.tie_word_embeddings = True
    if name in ("qwen3moe", "qwen2moe"):  # the loader maps neither expert FFN width
        config.moe_intermediate_size = F_EXP
        config.shared_expert_intermediate_size = F_SHEXP
    if name == "qwen2_yarn":             # the loader does not read rope scaling
        config.rope_parameters = {"rope_type": "yarn", "rope_theta": ROPE_BASE, "factor": YARN_FACTOR,
                                  "original_max_position_embeddings": YARN_ORIG_CTX}
    if name == "phi3_longrope":          # the loader reads neither LongRoPE's factors nor the partial rotation
        short, long_ = longrope_factors()
        config.partial_rotary_factor = LONGROPE_N_ROT / HD
        config.rope_parameters = {"rope_type": "longrope", "rope_theta": ROPE_BASE, "short_factor": short.tolist(),
                                  "long_factor": long_.tolist(), "original_max_position_embeddings": LONGROPE_ORIG_CTX,
                                  "partial_rotary_factor": LONGROPE_N_ROT / HD}
        config.original_max_position_embeddings = LONGROPE_ORIG_CTX
    if name == "llama3":
        params = {**LLAMA3_ROPE, "rope_theta": ROPE_BASE}
        if hasattr(config, "rope_parameters"):          # transformers 5
            config.rope_parameters = params
        else:
            config.rope_scaling = params
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, config=config, dtype=torch.float32).eval()
    if name == "mistral":                # a llama file: its weights in transformers' Mistral, with the window
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        mistral = transformers.MistralConfig(**{**fields, "sliding_window": MISTRAL_WINDOW})
        mistral._attn_implementation = "eager"
        state = model.state_dict()
        model = transformers.MistralForCausalLM(mistral).to(torch.float32).eval()
        model.load_state_dict(state)
    tokens = prompt_tokens()
    # LongRoPE: transformers picks the factors by the sequence's length, llama.cpp and the engine by the context, so
    # the greedy run starts past the original context too
    n_prompt = LONGROPE_ORIG_CTX + 8 if name == "phi3_longrope" else GREEDY_PROMPT
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float().numpy()
        out = model.generate(torch.tensor([tokens[:n_prompt]]), max_new_tokens=GREEDY_NEW, do_sample=False,
                             min_new_tokens=GREEDY_NEW, pad_token_id=0, eos_token_id=None)
    greedy = out[0, n_prompt:].tolist()
    np.savez_compressed(OUT / f"{name}.npz", tokens=np.array(tokens, np.int32), logits=logits.astype(np.float32),
                        greedy=np.array(greedy, np.int32), greedy_prompt=np.int32(n_prompt))
    return {"model_type": model.config.model_type, "positions": len(tokens), "greedy": greedy}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    names = sys.argv[1:] or list(ARCHS)
    meta_path = OUT / "versions.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            info = record(name, Path(tmp))
            meta[name] = {**info, "transformers": transformers.__version__, "torch": torch.__version__}
            print(name, info)
    meta_path.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
