"""Tiny random-weight GGUF files of each architecture, for the transformers reference (scripts/record_transformers.py
records transformers' logits on them into tests/data/transformers/; tests/test_archs.py compares the engine).

Deterministic for a seed: numpy's PCG64 normals, Q8_0 by the gguf package's quantizer, everything else F32.
"""
import math

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFWriter, RopeScalingType
from gguf import quants as gq

from tiny_models import add_shape

N_VOCAB = 320
E, F, H, HK, HD, L = 128, 256, 4, 2, 64, 2
ROPE_BASE = 10000.0
# Llama 3's rope scaling (rope_type "llama3"), with an original context short enough that the tiny head's 32 pairs
# span the unscaled, smoothed and scaled bands
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
ARCHS = ("llama3", "qwen2", "qwen2_yarn", "qwen3", "phi3", "phi3_longrope", "gemma2", "mistral", "qwen3moe",
         "qwen2moe", "mixtral")
GGUF_ARCH = {"llama3": "llama", "qwen2": "qwen2", "qwen2_yarn": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "phi3_longrope": "phi3", "gemma2": "gemma2", "mistral": "llama", "qwen3moe": "qwen3moe",
             "qwen2moe": "qwen2moe", "mixtral": "llama"}
MOE_ARCHS = ("qwen3moe", "qwen2moe", "mixtral")      # CPU only so far (no expert kernels on the GPU, no split over ranks)
# mixtures of experts: experts, experts per token, an expert's FFN width, Qwen 2 MoE's shared expert's width
N_EXPERT, N_EXPERT_USED, F_EXP, F_SHEXP = 4, 2, 64, 96
# YaRN (Qwen 2.5's long-context setting) with an original context short enough that the 48-token references cross it
YARN_FACTOR, YARN_ORIG_CTX = 4.0, 16
# Phi-3.5's LongRoPE on a partial rotation (Phi-4-mini's 3/4 of the head): factors for contexts up to
# LONGROPE_ORIG_CTX and above it; the 48-token references run above it, so the long factors apply
LONGROPE_ORIG_CTX, LONGROPE_N_ROT = 32, 48
LONGROPE_ATTN_FACTOR = math.sqrt(1 + math.log(1024 / LONGROPE_ORIG_CTX) / math.log(LONGROPE_ORIG_CTX))
# Gemma 2's caps and window, small enough that the tiny model's scores and logits reach them
GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP, GEMMA2_WINDOW = 5.0, 3.0, 16
# Mistral 7B v0.1's sliding window (a llama file with attention.sliding_window), short enough that the references'
# 48 positions run past it
MISTRAL_WINDOW = 16


def llama3_rope_factors(head_dim: int, base: float, p: dict) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it from a `rope_type: llama3` config."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / p["low_freq_factor"], old / p["high_freq_factor"]
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(p["factor"])
        else:
            smooth = (old / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
            factors.append(1.0 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def vocabulary() -> list[str]:
    """GPT-2's 256 byte tokens (so that any text tokenizes), "Ġt" (one merge), padding tokens, and the last three
    StarCoder's fill-in-the-middle tokens (/infill)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    tokens = [chr(c) for c in cs]
    fim = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
    return tokens + ["Ġt"] + [f"<pad{i}>" for i in range(len(tokens) + 1, N_VOCAB - len(fim))] + fim


def longrope_factors() -> tuple[np.ndarray, np.ndarray]:
    """(short, long) LongRoPE factors of the tiny rotation: short near 1, long growing to 8 (as Phi-3.5's do)."""
    i = np.arange(LONGROPE_N_ROT // 2, dtype=np.float64) / (LONGROPE_N_ROT // 2)
    return (1.0 + 0.2 * i).astype(np.float32), (1.0 + 7.0 * i ** 2).astype(np.float32)


def write_arch(path, name: str, seed: int = 0) -> str:
    """A 2-layer file of architecture `name` (ARCHS) at `path`; returns the path."""
    rng = np.random.default_rng(seed)
    arch = GGUF_ARCH[name]
    w = GGUFWriter(str(path), arch)
    add_shape(w, L, E, F, H, HK)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_dimension_count(LONGROPE_N_ROT if name == "phi3_longrope" else HD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_vocab_size(N_VOCAB)
    if name == "qwen2_yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(YARN_FACTOR)
        w.add_rope_scaling_orig_ctx_len(YARN_ORIG_CTX)
    if name == "phi3_longrope":
        w.add_rope_scaling_orig_ctx_len(LONGROPE_ORIG_CTX)
        w.add_rope_scaling_attn_factors(LONGROPE_ATTN_FACTOR)
    if name == "gemma2":
        w.add_attn_logit_softcapping(GEMMA2_ATTN_CAP)
        w.add_final_logit_softcapping(GEMMA2_FINAL_CAP)
        w.add_sliding_window(GEMMA2_WINDOW)
    if name == "mistral":
        w.add_sliding_window(MISTRAL_WINDOW)
    if name in MOE_ARCHS:
        w.add_expert_count(N_EXPERT)
        w.add_expert_used_count(N_EXPERT_USED)
        w.add_expert_feed_forward_length(F_EXP)
    if name == "qwen2moe":
        w.add_expert_shared_feed_forward_length(F_SHEXP)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocabulary())
    w.add_token_types([1] * N_VOCAB)
    w.add_token_merges(["Ġ t"])

    def q8(name_, rows, cols, scale=0.08, shape=None):
        """rows x cols Q8_0 values; shape: the leading dimensions the rows are (an experts' tensor: (n, rows/n))."""
        data = gq.quantize((rng.standard_normal((rows, cols)) * scale).astype(np.float32), GT.Q8_0)
        if shape is not None:
            data = data.reshape(*shape, data.shape[-1])
        w.add_tensor(name_, data, raw_shape=data.shape, raw_dtype=GT.Q8_0)

    def f32(name_, n, mean=0.0, scale=0.1):
        w.add_tensor(name_, (mean + scale * rng.standard_normal(n)).astype(np.float32))

    q8("token_embd.weight", N_VOCAB, E, scale=0.02 if name in ("qwen2", "qwen2_yarn", "gemma2") else 0.5)   # tied (qwen2): small, or each
                                                                                     # token predicts itself
    if name == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(HD, ROPE_BASE, LLAMA3_ROPE))
    if name == "phi3_longrope":
        short, long_ = longrope_factors()
        w.add_tensor("rope_factors_short.weight", short)
        w.add_tensor("rope_factors_long.weight", long_)
    for i in range(L):
        f32(f"blk.{i}.attn_norm.weight", E, mean=1.0)
        if name.startswith("phi3"):            # fused: [q; k; v] rows
            q8(f"blk.{i}.attn_qkv.weight", (H + 2 * HK) * HD, E)
        else:
            q8(f"blk.{i}.attn_q.weight", H * HD, E)
            q8(f"blk.{i}.attn_k.weight", HK * HD, E)
            q8(f"blk.{i}.attn_v.weight", HK * HD, E)
        q8(f"blk.{i}.attn_output.weight", E, H * HD)
        if name.startswith("qwen2"):
            f32(f"blk.{i}.attn_q.bias", H * HD, scale=0.2)
            f32(f"blk.{i}.attn_k.bias", HK * HD, scale=0.2)
            f32(f"blk.{i}.attn_v.bias", HK * HD, scale=0.2)
        if name.startswith("qwen3"):
            f32(f"blk.{i}.attn_q_norm.weight", HD, mean=1.0)
            f32(f"blk.{i}.attn_k_norm.weight", HD, mean=1.0)
        if name == "gemma2":
            f32(f"blk.{i}.post_attention_norm.weight", E, mean=1.0)
            f32(f"blk.{i}.post_ffw_norm.weight", E, mean=1.0)
        f32(f"blk.{i}.ffn_norm.weight", E, mean=1.0)
        if name.startswith("phi3"):            # fused: [gate; up] rows
            q8(f"blk.{i}.ffn_up.weight", 2 * F, E)
        elif name in MOE_ARCHS:                # the router and the experts' [n_expert, rows, cols] tensors
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", (0.3 * rng.standard_normal((N_EXPERT, E))).astype(np.float32))
            q8(f"blk.{i}.ffn_gate_exps.weight", N_EXPERT * F_EXP, E, shape=(N_EXPERT, F_EXP))
            q8(f"blk.{i}.ffn_up_exps.weight", N_EXPERT * F_EXP, E, shape=(N_EXPERT, F_EXP))
            q8(f"blk.{i}.ffn_down_exps.weight", N_EXPERT * E, F_EXP, shape=(N_EXPERT, E))
            if name == "qwen2moe":             # the shared expert and its gate
                f32(f"blk.{i}.ffn_gate_inp_shexp.weight", E, scale=0.3)
                q8(f"blk.{i}.ffn_gate_shexp.weight", F_SHEXP, E)
                q8(f"blk.{i}.ffn_up_shexp.weight", F_SHEXP, E)
                q8(f"blk.{i}.ffn_down_shexp.weight", E, F_SHEXP)
        else:
            q8(f"blk.{i}.ffn_gate.weight", F, E)
            q8(f"blk.{i}.ffn_up.weight", F, E)
        if name not in MOE_ARCHS:
            q8(f"blk.{i}.ffn_down.weight", E, F)
    f32("output_norm.weight", E, mean=1.0)
    if name not in ("qwen2", "qwen2_yarn", "gemma2"):   # Qwen2's small models, Gemma 2: output tied to embeddings
        q8("output.weight", N_VOCAB, E, scale=0.3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return str(path)


def prompt_tokens(seed: int = 1, n: int = 48) -> list[int]:
    """The token ids every reference is recorded on."""
    return np.random.default_rng(seed).integers(0, N_VOCAB, n).tolist()
