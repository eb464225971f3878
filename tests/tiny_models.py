"""Tiny random-weight llama and gemma3 GGUF files (a few layers, mixed quant types) for backend-vs-backend tests."""
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFWriter
from gguf import quants as gq

from engine.quants import F16_FIELDS, GGMLType, TYPES, random_blocks

N_VOCAB = 320


# The mean quant value of the k-quants with a minimum (w = d * sc * q - dmin * m, q uniform): dmin = d * this makes
# the weights' mean zero, as a trained model's are. Weights of mean ~0.06 (dmin = d) gave every gate and up row the
# same large component along the activations' mean: a 3-layer model whose logits moved by nmse 2 on some rows for
# a 5e-4 relative change of the attention's queries (tiny-chaos-cpu-2026-12-05.txt).
KQUANT_MEAN_Q = {GGMLType.Q2_K: 1.5, GGMLType.Q4_K: 7.5, GGMLType.Q5_K: 15.5}


def _kquant(t: GGMLType, rows: int, cols: int, rng) -> np.ndarray:
    """Random k-quant blocks with small positive scales (values of order 1e-2), of mean zero."""
    info = TYPES[t]
    blocks = random_blocks(t, rows * cols // info.block_size, rng)
    d = (rng.uniform(0.5, 1.5, len(blocks)) * 3e-4).astype(np.float16)
    fields = F16_FIELDS[t]
    blocks[:, fields[0]:fields[0] + 2] = d.view(np.uint8).reshape(-1, 2)
    if len(fields) > 1:                                    # dmin
        dmin = (d.astype(np.float32) * KQUANT_MEAN_Q[t]).astype(np.float16)
        blocks[:, fields[1]:fields[1] + 2] = dmin.view(np.uint8).reshape(-1, 2)
    if t == GGMLType.Q6_K:   # positive int8 sub-scales
        blocks[:, 192:208] = rng.integers(1, 64, (len(blocks), 16), dtype=np.uint8)
    return blocks.reshape(rows, cols // info.block_size * info.type_size)


def _add(w: GGUFWriter, name: str, t: GGMLType, rows: int, cols: int, rng, scale=0.05):
    if t in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q4_1):
        data = gq.quantize((rng.standard_normal((rows, cols)) * scale).astype(np.float32), GT(int(t)))
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GT(int(t)))
    elif t == GGMLType.F32:
        w.add_tensor(name, (rng.standard_normal((rows, cols)) * scale).astype(np.float32))
    else:
        data = _kquant(t, rows, cols, rng)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GT(int(t)))


def add_shape(w: GGUFWriter, n_layer: int, n_embd: int, n_ff: int, n_head: int, n_head_kv: int) -> None:
    """The block count, a 1024-token context and the transformer's sizes."""
    w.add_block_count(n_layer)
    w.add_context_length(1024)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)


def write_tiny(path, arch: str, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    E, F, H, HK, L, HD = 256, 512, 4, 2 if arch == "llama" else 1, 3 if arch == "llama" else 6, 64
    w = GGUFWriter(str(path), arch)
    add_shape(w, L, E, F, H, HK)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_vocab_size(N_VOCAB)
    if arch == "gemma3":
        w.add_sliding_window(16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(N_VOCAB)])
    w.add_token_types([1] * N_VOCAB)
    w.add_token_merges(["t 0"])
    ones = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    _add(w, "token_embd.weight", GGMLType.Q8_0, N_VOCAB, E, rng, scale=0.5)
    types = [GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q6_K, GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q5_K]
    for i in range(L):
        t = lambda j: types[(i + j) % len(types)]  # noqa: E731
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones(E))
        _add(w, f"blk.{i}.attn_q.weight", t(0), H * HD, E, rng)
        _add(w, f"blk.{i}.attn_k.weight", t(1), HK * HD, E, rng)
        _add(w, f"blk.{i}.attn_v.weight", t(2), HK * HD, E, rng)
        _add(w, f"blk.{i}.attn_output.weight", t(3), E, H * HD, rng)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones(E))
        _add(w, f"blk.{i}.ffn_gate.weight", t(4), F, E, rng)
        _add(w, f"blk.{i}.ffn_up.weight", t(5), F, E, rng)
        _add(w, f"blk.{i}.ffn_down.weight", t(0), E, F, rng)
        if arch == "gemma3":
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", ones(HD))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", ones(HD))
            w.add_tensor(f"blk.{i}.post_attention_norm.weight", ones(E))
            w.add_tensor(f"blk.{i}.post_ffw_norm.weight", ones(E))
    w.add_tensor("output_norm.weight", ones(E))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return str(path)
