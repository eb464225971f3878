#!/usr/bin/env python3
"""Record HF transformers' logits on the tiny architecture files (tests/tiny_archs.py) into tests/data/transformers/,
once, so that CI compares the engine against them without torch.

    python -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install torch transformers gguf numpy sentencepiece
    /tmp/tfenv/bin/python scripts/record_transformers.py [ARCH ...]

Each architecture's file is written from its seed, loaded by transformers' own GGUF loader (float32, CPU), and run on
tests/tiny_archs.prompt_tokens(): the logits of every position, and 16 greedy tokens after the first 8. Two things
the loader does not read are given to the config (Mistral's window: the llama file's weights are loaded into
transformers' Mistral with it; Mixtral, which the loader cannot read, is built from the file by mixtral_from_gguf):
the head size (attention.key_length, mapped for some
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
                        N_EXPERT, N_EXPERT_USED, F_EXP, F_SHEXP, LONGROPE_ORIG_CTX, MISTRAL_WINDOW, ROPE_BASE, YARN_FACTOR, YARN_ORIG_CTX,
                        longrope_factors, prompt_tokens, write_arch)

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "transformers"
GREEDY_PROMPT, GREEDY_NEW = 8, 16


def mixtral_from_gguf(path: Path):
    """transformers' Mixtral with the tiny llama-with-experts file's weights (its GGUF loader reads a llama file as
    Llama and has no Mixtral): every tensor dequantized by the gguf package, q and k rows put back in transformers'
    order (the reverse of llama.cpp's converter's permutation, as transformers' own llama loader does)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    t = {x.name: np.asarray(dequantize(x.data, x.tensor_type), np.float32).reshape([int(d) for d in
                                                                                    reversed(x.shape)])
         for x in GGUFReader(str(path)).tensors}
    n_layer, n_embd = 1 + max(int(k.split(".")[1]) for k in t if k.startswith("blk.")), t["token_embd.weight"].shape[1]
    config = transformers.MixtralConfig(
        vocab_size=t["token_embd.weight"].shape[0], hidden_size=n_embd, intermediate_size=F_EXP,
        num_hidden_layers=n_layer, num_attention_heads=t["blk.0.attn_q.weight"].shape[0] // HD,
        num_key_value_heads=t["blk.0.attn_k.weight"].shape[0] // HD, head_dim=HD, num_local_experts=N_EXPERT,
        num_experts_per_tok=N_EXPERT_USED, rms_norm_eps=1e-6, rope_theta=ROPE_BASE, max_position_embeddings=1024,
        tie_word_embeddings=False, sliding_window=None)
    config._attn_implementation = "eager"

    def unpermute(w, n_head):
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
    state = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"],
             "lm_head.weight": t["output.weight"]}
    for i in range(n_layer):
        b, m = f"blk.{i}.", f"model.layers.{i}."
        state |= {m + "input_layernorm.weight": t[b + "attn_norm.weight"],
                  m + "post_attention_layernorm.weight": t[b + "ffn_norm.weight"],
                  m + "self_attn.q_proj.weight": unpermute(t[b + "attn_q.weight"], config.num_attention_heads),
                  m + "self_attn.k_proj.weight": unpermute(t[b + "attn_k.weight"], config.num_key_value_heads),
                  m + "self_attn.v_proj.weight": t[b + "attn_v.weight"],
                  m + "self_attn.o_proj.weight": t[b + "attn_output.weight"],
                  m + "mlp.gate.weight": t[b + "ffn_gate_inp.weight"],
                  m + "mlp.experts.gate_up_proj": np.concatenate([t[b + "ffn_gate_exps.weight"],
                                                                  t[b + "ffn_up_exps.weight"]], axis=1),
                  m + "mlp.experts.down_proj": t[b + "ffn_down_exps.weight"]}
    model = transformers.MixtralForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.array(v))
                                                 for k, v in state.items()}, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    return config, model


def record(name: str, folder: Path) -> dict:
    fname = f"{name}.gguf"
    write_arch(folder / fname, name)
    if name == "mixtral":
        config, model = mixtral_from_gguf(folder / fname)
        return run_and_save(name, config, model)
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
    return run_and_save(name, config, model)


def run_and_save(name: str, config, model) -> dict:
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
