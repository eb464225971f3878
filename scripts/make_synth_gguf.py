#!/usr/bin/env python3
"""Write a random-weight llama-architecture GGUF with a Q4_K_M-like type mix.

For speed measurements only: quantized GEMM speed does not depend on the values.
The tokenizer is copied from a real GPT-2-style GGUF (SmolLM2) and padded to n_vocab.
usage: make_synth_gguf.py TOKENIZER.gguf OUT.gguf [--preset 8b|1b|70b]

The 70B (~40 GB) repeats one layer's random blocks in every layer (each layer still its own tensors in the file), so
that it is written in about a minute.
"""
import sys, argparse
import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

PRESETS = {
    # Llama-3.1-8B shape
    "8b": dict(n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, n_layer=32, n_vocab=128256, rope=500000.0),
    # Llama-3.2-1B shape
    "1b": dict(n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8, n_layer=16, n_vocab=128256, rope=500000.0),
    # Llama-3.1-70B shape
    "70b": dict(n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8, n_layer=80, n_vocab=128256, rope=500000.0,
                repeat_layers=True),
}

rng = np.random.default_rng(1234)

def q4_k(rows, cols):
    nb = rows * cols // 256
    blk = np.empty((nb, 144), np.uint8)
    d = (rng.uniform(0.5, 1.5, nb) * 1.4e-4).astype(np.float16)
    dmin = (rng.uniform(0.5, 1.5, nb) * 1.0e-3).astype(np.float16)
    blk[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    blk[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    blk[:, 4:144] = rng.integers(0, 256, (nb, 140), dtype=np.uint8)
    return blk.reshape(rows, cols // 256 * 144)

def q6_k(rows, cols):
    nb = rows * cols // 256
    blk = np.empty((nb, 210), np.uint8)
    blk[:, 0:192] = rng.integers(0, 256, (nb, 192), dtype=np.uint8)
    blk[:, 192:208] = rng.integers(1, 64, (nb, 16), dtype=np.uint8)  # positive int8 scales
    d = (rng.uniform(0.5, 1.5, nb) * 3.5e-5).astype(np.float16)
    blk[:, 208:210] = d.view(np.uint8).reshape(nb, 2)
    return blk.reshape(rows, cols // 256 * 210)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tok")
    ap.add_argument("out")
    ap.add_argument("--preset", default="8b", choices=PRESETS)
    a = ap.parse_args()
    p = PRESETS[a.preset]
    E, F, H, HK, L, V = p["n_embd"], p["n_ff"], p["n_head"], p["n_head_kv"], p["n_layer"], p["n_vocab"]
    hd = E // H
    r = gguf.GGUFReader(a.tok)
    def field(k):
        return r.fields[k].contents()
    toks = field("tokenizer.ggml.tokens")
    ttype = field("tokenizer.ggml.token_type")
    merges = field("tokenizer.ggml.merges")
    n0 = len(toks)
    toks = list(toks) + [f"<|synth_pad_{i}|>" for i in range(V - n0)]
    ttype = list(ttype) + [4] * (V - n0)  # USER_DEFINED
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(f"synthetic-llama-{a.preset}-q4_k_m")
    w.add_block_count(L); w.add_context_length(8192); w.add_embedding_length(E)
    w.add_feed_forward_length(F); w.add_head_count(H); w.add_head_count_kv(HK)
    w.add_rope_freq_base(p["rope"]); w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd); w.add_vocab_size(V); w.add_file_type(15)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("smollm")
    w.add_token_list(toks); w.add_token_types(ttype); w.add_token_merges(merges)
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_add_bos_token(False)
    ones = np.ones(E, np.float32)
    made = {}
    def add(name, arr_fn, qt, shape):
        """arr_fn(): the tensor's blocks; made once per shape and type when the preset repeats its layers."""
        key = (qt, shape)
        if not p.get("repeat_layers") or key not in made or not name.startswith("blk."):
            made[key] = arr_fn()
        w.add_tensor(name, made[key], raw_shape=shape, raw_dtype=qt)
    add("token_embd.weight", lambda: q4_k(V, E), T.Q4_K, (V, E // 256 * 144))
    for i in range(L):
        more = i < L // 8 or i >= 7 * L // 8 or (i - L // 8) % 3 == 2
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        add(f"blk.{i}.attn_q.weight", lambda: q4_k(E, E), T.Q4_K, (E, E // 256 * 144))
        add(f"blk.{i}.attn_k.weight", lambda: q4_k(HK * hd, E), T.Q4_K, (HK * hd, E // 256 * 144))
        if more:
            add(f"blk.{i}.attn_v.weight", lambda: q6_k(HK * hd, E), T.Q6_K, (HK * hd, E // 256 * 210))
        else:
            add(f"blk.{i}.attn_v.weight", lambda: q4_k(HK * hd, E), T.Q4_K, (HK * hd, E // 256 * 144))
        add(f"blk.{i}.attn_output.weight", lambda: q4_k(E, E), T.Q4_K, (E, E // 256 * 144))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        add(f"blk.{i}.ffn_gate.weight", lambda: q4_k(F, E), T.Q4_K, (F, E // 256 * 144))
        add(f"blk.{i}.ffn_up.weight", lambda: q4_k(F, E), T.Q4_K, (F, E // 256 * 144))
        if more:
            add(f"blk.{i}.ffn_down.weight", lambda: q6_k(E, F), T.Q6_K, (E, F // 256 * 210))
        else:
            add(f"blk.{i}.ffn_down.weight", lambda: q4_k(E, F), T.Q4_K, (E, F // 256 * 144))
    w.add_tensor("output_norm.weight", ones)
    add("output.weight", lambda: q6_k(V, E), T.Q6_K, (V, E // 256 * 210))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(progress=False)
    w.close()

if __name__ == "__main__":
    main()
