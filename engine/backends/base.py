"""The operations a model is written in. Each backend (numpy, CUDA) implements all of them.

Arrays are the backend's own (numpy or cupy); models only reshape them and pass them back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..gguf import TensorInfo
from ..quants import TYPES, GGMLType


@dataclass
class Batch:
    """One forward pass: tokens from one or more sequences; each sequence's tokens are contiguous and in order."""
    tokens: np.ndarray        # [n] int32
    positions: np.ndarray     # [n] int32, position of each token in its sequence
    seq_ids: np.ndarray       # [n] int32, each token's sequence: its KV block when a block holds a whole context
    logit_rows: np.ndarray    # [n_out] int32, rows whose logits are wanted
    seq_ranges: list[tuple[int, int, int]] = field(default_factory=list)  # (seq_id, start, end) per sequence
    block_tables: np.ndarray | None = None   # [len(seq_ranges), width] int32: each sequence's KV blocks in order
                                             # (None: its seq_id is its one block)
    table_rows: np.ndarray | None = None     # [n] int32: each row's row of block_tables
    per_row: bool = False     # attention takes each row as its own query over the cache (a replayed mixed step's
                              # layout: its launches depend on the row count alone)

    @classmethod
    def make(cls, tokens, positions, seq_ids, logit_rows, tables: dict | None = None, width: int = 0) -> "Batch":
        """tables: sequence id -> its KV blocks (a list, or an int32 row zero past them; a paged cache), for every
        sequence in the batch; block_tables has at least width columns (a runtime's blocks per sequence: every step's
        tables the same shape)."""
        tokens = np.asarray(tokens, np.int32)
        positions = np.asarray(positions, np.int32)
        seq_ids = np.asarray(seq_ids, np.int32)
        ranges, start = [], 0
        for i in range(1, len(seq_ids) + 1):
            if i == len(seq_ids) or seq_ids[i] != seq_ids[start]:
                ranges.append((int(seq_ids[start]), start, i))
                start = i
        block_tables = table_rows = None
        if tables is not None:
            longest = max((len(tables[s]) for s, _, _ in ranges), default=1)
            block_tables = np.zeros((len(ranges), max(width, longest)), np.int32)
            table_rows = np.empty(len(seq_ids), np.int32)
            for r, (s, a, b) in enumerate(ranges):
                block_tables[r, :len(tables[s])] = tables[s]
                table_rows[a:b] = r
        return cls(tokens, positions, seq_ids, np.asarray(logit_rows, np.int32), ranges, block_tables=block_tables,
                   table_rows=table_rows)

    def is_one_run(self) -> bool:
        """One sequence at consecutive positions."""
        p = self.positions
        return len(self.seq_ranges) == 1 and int(p[-1]) - int(p[0]) == len(p) - 1 and bool(np.all(np.diff(p) == 1))

    def prefill_rows(self) -> int:
        """Rows of sequences with more than one token in the batch (prefill chunks)."""
        return sum(b - a for _, a, b in self.seq_ranges if b - a > 1)

    def n_single_prefix(self) -> int:
        """How many leading rows are sequences of one token each (a decode step's rows, placed first)."""
        n = 0
        for _, a, b in self.seq_ranges:
            if b - a != 1:
                break
            n += 1
        return n

    @classmethod
    def single(cls, tokens, start_pos: int, seq_id: int = 0, all_logits: bool = False) -> "Batch":
        n = len(tokens)
        rows = np.arange(n) if all_logits else [n - 1]
        return cls.make(tokens, np.arange(start_pos, start_pos + n), np.full(n, seq_id), rows)


class KVCache:
    """Per layer k and v: [n_blocks, block_size, n_head_kv, head_dim] arrays of the backend's array module
    (engine/kv_blocks.py), views of one array of every layer's each, so that a block is copied for all layers at
    once. With blocks of a whole context (block_size == n_ctx) a block is a sequence's slot."""

    def __init__(self, xp, n_layer, n_blocks, block_size, n_head_kv, head_dim, dtype, row_elems=None):
        """row_elems: elements of dtype one head's row of head_dim values takes (None: head_dim)."""
        shape = (n_layer, n_blocks, block_size, n_head_kv, row_elems or head_dim)
        self.k_layers = xp.zeros(shape, dtype)      # [n_layer, n_blocks, block_size, n_head_kv, row_elems]
        self.v_layers = xp.zeros(shape, dtype)
        self.k, self.v = list(self.k_layers), list(self.v_layers)        # per layer views
        self.n_blocks = n_blocks
        self.n_head_kv, self.head_dim = n_head_kv, head_dim
        self.block_size = self.n_ctx = block_size
        self.pad_slot: int | None = None    # a spare block padding rows of a replayed decode step may write

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give block dst the first n positions of block src (a prefix computed once, shared): one copy for all
        layers' keys and one for their values (a copy per layer and array took ~1 ms of launches per request on
        the GPU)."""
        self.k_layers[:, dst, :n] = self.k_layers[:, src, :n]
        self.v_layers[:, dst, :n] = self.v_layers[:, src, :n]

    def store(self, layer: int, blocks, offsets, k, v) -> None:
        """Keys and values [n, n_head_kv, head_dim] at (blocks[i], offsets[i])."""
        self.k[layer][blocks, offsets] = k
        self.v[layer][blocks, offsets] = v

    def read(self, layer: int, table, lo: int, hi: int, dtype) -> tuple:
        """Positions lo..hi-1 of the sequence whose blocks are table -> keys, values [hi - lo, n_head_kv, head_dim]
        of dtype (views when they lie in one block and the cache has that dtype)."""
        return tuple(block_positions(c[layer], table, lo, hi).astype(dtype, copy=False) for c in (self.k, self.v))


Q8_0 = TYPES[GGMLType.Q8_0]     # GGML's q8_0 block: an f16 scale and 32 int8 values
Q8_0_GROUP = Q8_0.block_size     # values per q8_0 scale


def check_q8_0_head_dim(head_dim: int) -> None:
    if head_dim % Q8_0_GROUP:
        raise ValueError(f"a q8_0 KV cache needs a head dimension that is a multiple of {Q8_0_GROUP} "
                         f"(this model's is {head_dim})")


def block_positions(cache, table, lo: int, hi: int):
    """Positions lo..hi-1 of a sequence's blocks (table) in a cache [n_blocks, block_size, ...]."""
    bs = cache.shape[1]
    j0, j1 = lo // bs, (hi - 1) // bs + 1
    blocks = table[j0:j1]
    if blocks[-1] - blocks[0] == j1 - j0 - 1 and (j1 - j0 < 3 or bool(np.all(np.diff(blocks) == 1))):
        runs = cache[blocks[0]:blocks[-1] + 1]                  # consecutive blocks: a view
    else:
        runs = cache[blocks]
    return runs.reshape(-1, *cache.shape[2:])[lo - j0 * bs:hi - j0 * bs]


WARM_UP_CHUNK = 32     # prefill rows of a warm-up step


class Backend:
    """The interface; see backends/cpu.py for the reference semantics of each operation."""
    name = "abstract"
    comm = None      # the tensor-parallel group's communicator (engine/parallel/comm.py); None: one rank
    failure = None   # why this backend can no longer run any step (a tensor-parallel group's lost rank), or None
    supports_moe = False   # implements moe() (mixture-of-experts FFNs)
    kv_types: tuple = ()   # KV-cache types it can hold besides its own (Runtime's kv_type)
    prefill_ubatch = 512   # tokens of one prefill ubatch when the caller names none (Runtime's n_ubatch)
    paged_kv = False       # attention reads a sequence's KV positions through its block table (Batch.block_tables);
                           # else through one block of a whole context per sequence (its seq_id)

    def weight(self, info: TensorInfo, data: np.ndarray):
        """A weight tensor (raw GGUF bytes) in whatever form this backend computes with."""
        raise NotImplementedError

    def embed(self, table, tokens: np.ndarray, first: int | None = None):
        """Rows of an embedding table: -> [n, n_embd]. With `first`, the table holds the rows of tokens first..
        first + len(table) - 1 (a tensor-parallel rank's vocabulary): other tokens get zero rows."""
        raise NotImplementedError

    def mul_mat(self, w, x):
        """x: [n, k] times the weight w: [m, k] -> [n, m]."""
        raise NotImplementedError

    def mul_mats(self, ws, x) -> list:
        """[mul_mat(w, x) for w in ws] (q, k, v from one input: a backend may launch them together)."""
        return [self.mul_mat(w, x) for w in ws]

    def all_reduce(self, x):
        """The sum of x [n, d] over the tensor-parallel ranks (each holds a partial product); x on one rank."""
        return x if self.comm is None else self.comm.all_reduce(x)

    def gather_vocab(self, x):
        """Logits [n, n_vocab] from every rank's columns [n, its vocabulary rows], in rank order; x on one rank."""
        return x if self.comm is None else self.comm.gather_columns(x)

    def glu(self, gate, up, x, act: str):
        """The gated FFN's first half: act(x gate^T) * (x up^T), act "silu" (SwiGLU) or "gelu" (GeGLU, tanh)."""
        g, u = self.mul_mat(gate, x), self.mul_mat(up, x)
        return self.swiglu(g, u) if act == "silu" else self.geglu(g, u)

    def moe(self, router, gates: list, ups: list, downs: list, x, k: int, act: str, norm: bool = True,
            shared: tuple | None = None):
        """A mixture-of-experts FFN on x [n, d] -> [n, d]: router [n_expert, d] scores each row's experts, softmax
        over all of them, the k best taken with their probabilities (renormalized to sum to one with norm); the
        row's output is the weighted sum of those experts' glu(gates[e], ups[e], x, act) times downs[e]. shared:
        (gate_inp [d], gate, up, down) of an expert every row also takes, times sigmoid(x . gate_inp)."""
        raise NotImplementedError(f"the {self.name} backend has no mixture-of-experts layers")

    def rms_norm(self, x, w, eps: float):
        """RMS norm over the last axis, times w."""
        raise NotImplementedError

    def add_rms_norm(self, x, r, w, eps: float, r_norm=None):
        """The residual add and the norm after it: s = x + r (r first RMS-normed with weight r_norm when given);
        -> (s, rms_norm(s) * w)."""
        if r_norm is not None:
            r = self.rms_norm(r, r_norm, eps)
        s = self.add(x, r)
        return s, self.rms_norm(s, w, eps)

    def rope(self, x, positions: np.ndarray, inv_freq: np.ndarray, neox: bool, mscale: float = 1.0):
        """x: [n, heads, head_dim]: the first 2 len(inv_freq) dims rotated, pair i by position * inv_freq[i]
        (engine/model/rope.py; float64, kept by the model); adjacent pairs, or halves (neox); the rotated dims
        times mscale (LongRoPE's attention factor)."""
        raise NotImplementedError

    def attention(self, q, k, v, cache, layer: int, batch: Batch, scale: float, window: int | None,
                  softcap: float = 0.0):
        """Store k, v in the cache, then causal (optionally sliding-window) GQA attention: -> [n, heads*head_dim].
        softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) before the mask and softmax."""
        raise NotImplementedError

    def rope_qk(self, q, k, positions: np.ndarray, inv_freq: np.ndarray, neox: bool, q_norm=None, k_norm=None,
                eps: float = 0.0, mscale: float = 1.0):
        """rope of q and k, each head first RMS-normed with q_norm / k_norm when given -> (q, k)."""
        if q_norm is not None:
            q = self.rms_norm(q, q_norm, eps)
        if k_norm is not None:
            k = self.rms_norm(k, k_norm, eps)
        return self.rope(q, positions, inv_freq, neox, mscale), self.rope(k, positions, inv_freq, neox, mscale)

    def kv_cache(self, n_layer: int, n_blocks: int, block_size: int, n_head_kv: int, head_dim: int, **kv_type):
        """A KVCache of n_blocks blocks of block_size positions (a backend without paged_kv: one block per sequence,
        of the whole context); kv_type="..." one of kv_types."""
        raise NotImplementedError

    def swiglu(self, gate, up):
        """silu(gate) * up."""
        raise NotImplementedError

    def geglu(self, gate, up):
        """gelu_tanh(gate) * up."""
        raise NotImplementedError

    def add(self, a, b):
        raise NotImplementedError

    def softcap(self, x, cap: float):
        """cap * tanh(x / cap), elementwise (Gemma 2's final logits)."""
        raise NotImplementedError

    def scale(self, x, s: float):
        raise NotImplementedError

    def rows(self, x, idx: np.ndarray):
        """x[idx]."""
        raise NotImplementedError

    def forward(self, model, batch: Batch, cache):
        """One forward pass of the model: -> logits [n_out, n_vocab] (None when no rows are asked for).
        The CUDA backend replays decode steps as CUDA graphs here."""
        return model.forward(batch, cache)

    def prepare_kernels(self) -> None:
        """Load (or compile) the kernels the loaded weights need, before the first step; nothing on the CPU."""

    def warm_up_shapes(self, n_seq: int, max_rows: int) -> list[tuple[int, int]]:
        """(decode rows, prefill rows) of the steps a server runs before its first request so that none waits for a
        compiler or a graph capture: here a prefill chunk, a mixed step and decode steps of one and of every
        slot."""
        chunk = min(WARM_UP_CHUNK, max_rows)
        return [(0, chunk)] + ([(1, chunk)] if n_seq > 1 else []) + [(b, 0) for b in sorted({1, n_seq})]

    def argmax(self, logits) -> np.ndarray:
        """Row-wise argmax of backend logits [n, n_vocab] -> int64 [n] (the first maximum, as numpy)."""
        return np.argmax(self.to_numpy(logits), axis=-1)

    def constrain(self, logits, rows: np.ndarray, masks: np.ndarray | None, bias: tuple | None):
        """logits [n, n_vocab] with the bias entries (bias_rows, ids, values: logits[r, id] += value) added, then
        row rows[j] keeping only the tokens whose bit is set in masks[j] (int32 [len(rows), words], bit i % 32 of
        word i // 32; the others -inf) -> those logits (changed in place where the backend can). masks / bias may be
        None."""
        from ..grammar import mask_flags
        x = logits
        if bias is not None:
            np.add.at(x, (bias[0], bias[1]), bias[2])
        if masks is not None:
            flags = mask_flags(masks, x.shape[1])
            for j, r in enumerate(rows):
                x[r, ~flags[j]] = -np.inf
        return x

    def sample(self, logits, samplers: list, histories: list[list[int]]) -> np.ndarray:
        """One token per row of logits [n, n_vocab] -> int64 [n]: row i drawn by samplers[i] (engine/sampling.py)
        with histories[i] for its penalties. The rows may be changed in place."""
        if all(s.is_greedy for s in samplers):
            return self.argmax(logits)
        rows = self.to_numpy(logits)
        return np.array([s(rows[i], h) for i, (s, h) in enumerate(zip(samplers, histories))], np.int64)

    def to_numpy(self, x) -> np.ndarray:
        """float32 numpy copy of a backend array (logits)."""
        raise NotImplementedError
