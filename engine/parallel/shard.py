"""Tensor parallelism's split of a model: which heads, FFN columns and vocabulary rows each rank owns, and each
tensor's part of a rank, cut from the file's raw blocks.

Megatron's layout: q/k/v and gate/up are split by rows (column-parallel: each rank computes its heads and its FFN
columns; every expert the same way, the router whole on each rank), attn_output and ffn_down by columns (row-parallel: each rank's product is a partial sum, all-reduced), the
output matrix by vocabulary rows (each rank's logits gathered). Every other tensor (norms, embeddings) is whole on
every rank.

- Heads: when the model has at least as many KV heads as ranks, the KV heads are dealt out (as evenly as possible)
  and each query head goes with its KV head. Otherwise the query heads are dealt out and each rank holds the KV heads
  its query heads read (copies of one KV head on several ranks); where those are not one group size, one KV head per
  query head, so a rank's attention is always plain GQA.
- A row split never cuts a block. A column split does when the boundary is not a multiple of the type's block size:
  that part is then held as f32 (said by `Shard.expanded`), not requantized.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd

import numpy as np

from ..gguf import GGUFFile, TensorInfo
from ..quants import GGMLType, block_layout, dequantize

# How a rank cuts each tensor (by the tensor name's suffix after blk.N.): rows or columns, of which dimension.
Q_ROWS, KV_ROWS, FF_ROWS, VOCAB_ROWS, Q_COLS, FF_COLS = "q_rows", "kv_rows", "ff_rows", "vocab_rows", "q_cols", "ff_cols"
EXP_ROWS, EXP_COLS, SHEXP_ROWS, SHEXP_COLS = "exp_rows", "exp_cols", "shexp_rows", "shexp_cols"   # each expert's
ROLES = {
    "attn_q.weight": Q_ROWS, "attn_q.bias": Q_ROWS,
    "attn_k.weight": KV_ROWS, "attn_k.bias": KV_ROWS, "attn_v.weight": KV_ROWS, "attn_v.bias": KV_ROWS,
    "attn_output.weight": Q_COLS,
    "ffn_gate.weight": FF_ROWS, "ffn_up.weight": FF_ROWS, "ffn_down.weight": FF_COLS,
    "output.weight": VOCAB_ROWS,
    "ffn_gate_exps.weight": EXP_ROWS, "ffn_up_exps.weight": EXP_ROWS, "ffn_down_exps.weight": EXP_COLS,
    "ffn_gate_shexp.weight": SHEXP_ROWS, "ffn_up_shexp.weight": SHEXP_ROWS, "ffn_down_shexp.weight": SHEXP_COLS,
}


class ShardError(ValueError):
    pass


def even_parts(n: int, k: int) -> list[range]:
    """0..n in k consecutive ranges whose sizes differ by at most one."""
    return [range(i * n // k, (i + 1) * n // k) for i in range(k)]


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` owns. The whole model is rank 0 of 1."""
    rank: int
    size: int
    head_dim: int
    q_heads: range             # the query heads it computes
    kv_heads: tuple[int, ...]  # the KV heads it holds, in order (query head i of q_heads reads kv_heads[i // group])
    ff: range                  # its columns of the FFN's hidden dimension
    vocab: range               # its rows of the output matrix (logit columns)
    ff_exp: range = range(0)   # its columns of each expert's hidden dimension (mixtures of experts)
    ff_shexp: range = range(0)  # its columns of the shared expert's
    expanded: list[str] = field(default_factory=list, compare=False)   # parts held as f32 (a split inside blocks)

    @classmethod
    def whole(cls, cfg) -> "Shard":
        return cls(0, 1, cfg.head_dim, range(cfg.n_head), tuple(range(cfg.n_head_kv)), range(cfg.n_ff),
                   range(cfg.n_vocab), range(cfg.n_ff_exp), range(cfg.n_ff_shexp))

    def role(self, name: str) -> str | None:
        return ROLES.get(name.split(".", 2)[2] if name.startswith("blk.") else name)

    def rows(self, role: str) -> list[range]:
        hd = self.head_dim
        if role == Q_ROWS:
            return [range(self.q_heads.start * hd, self.q_heads.stop * hd)]
        if role == KV_ROWS:
            return [range(h * hd, (h + 1) * hd) for h in self.kv_heads]
        return [{FF_ROWS: self.ff, VOCAB_ROWS: self.vocab, EXP_ROWS: self.ff_exp, SHEXP_ROWS: self.ff_shexp}[role]]

    def cols(self, role: str) -> range:
        hd = self.head_dim
        if role == Q_COLS:
            return range(self.q_heads.start * hd, self.q_heads.stop * hd)
        return {FF_COLS: self.ff, EXP_COLS: self.ff_exp, SHEXP_COLS: self.ff_shexp}[role]

    def cut(self, info: TensorInfo, data: np.ndarray, role: str | None) -> tuple[TensorInfo, np.ndarray]:
        """This rank's part of a tensor (raw bytes in, raw bytes out): rows or columns as `role` says; the whole
        tensor when it has no role or the model is not split."""
        if self.size == 1 or role is None:
            return info, data
        if role in (Q_COLS, FF_COLS, EXP_COLS, SHEXP_COLS):
            return self._cut_cols(info, data, self.cols(role))
        return _cut_rows(info, data, self.rows(role))

    def _cut_cols(self, info: TensorInfo, data: np.ndarray, cols: range) -> tuple[TensorInfo, np.ndarray]:
        n_rows, n_cols = info.np_shape
        bs, bb = block_layout(info.type)
        name = f"{info.name}[:, {cols.start}:{cols.stop}]"
        if cols.start % bs == 0 and cols.stop % bs == 0:
            blocks = np.ascontiguousarray(data).reshape(n_rows, n_cols // bs, bb)
            part = np.ascontiguousarray(blocks[:, cols.start // bs:cols.stop // bs]).reshape(-1)
            return TensorInfo(name, info.type, (len(cols), n_rows), info.offset, part.nbytes), part
        self.expanded.append(name)
        part = np.ascontiguousarray(dequantize(data, info.type, (n_rows, n_cols))[:, cols.start:cols.stop])
        return TensorInfo(name, GGMLType.F32, (len(cols), n_rows), info.offset, part.nbytes), part.view(np.uint8).reshape(-1)


def _cut_rows(info: TensorInfo, data: np.ndarray, rows: list[range]) -> tuple[TensorInfo, np.ndarray]:
    """Rows (elements of a vector) of a tensor, concatenated in the order given."""
    shape = info.np_shape
    n_rows = shape[0]
    if len(shape) == 1:                                             # a bias: its elements, as f32
        v = dequantize(data, info.type, shape)
        part = np.ascontiguousarray(np.concatenate([v[r.start:r.stop] for r in rows]))
        return (TensorInfo(f"{info.name}[rows]", GGMLType.F32, (len(part),), info.offset, part.nbytes),
                part.view(np.uint8).reshape(-1))
    raw = np.ascontiguousarray(data).reshape(n_rows, -1)
    part = np.concatenate([raw[r.start:r.stop] for r in rows]).reshape(-1)
    n = sum(len(r) for r in rows)
    return TensorInfo(f"{info.name}[rows]", info.type, (*info.shape[:-1], n), info.offset, part.nbytes), part


def ffn_unit(gguf: GGUFFile, n_ff: int, down: str = "ffn_down.weight") -> int:
    """An FFN split's granularity: the largest block size of the `down` tensors (ffn_down, or an expert's), so that
    no split cuts a block, or 1 when n_ff is not a multiple of it."""
    unit = 1
    for name, info in gguf.tensors.items():
        if name.endswith(down):
            bs = block_layout(info.type)[0]
            unit = unit * bs // gcd(unit, bs)
    return unit if n_ff % unit == 0 else 1


def ffn_units(gguf: GGUFFile, cfg) -> tuple[int, int, int]:
    """ffn_unit of the dense FFN, the experts, the shared expert."""
    return (ffn_unit(gguf, cfg.n_ff), ffn_unit(gguf, cfg.n_ff_exp, "ffn_down_exps.weight"),
            ffn_unit(gguf, cfg.n_ff_shexp, "ffn_down_shexp.weight"))


def split_columns(n: int, unit: int, size: int) -> list[range]:
    """0..n over `size` ranks in multiples of `unit` (of 1 when there are fewer units than ranks)."""
    if n // unit < size:
        unit = 1
    return [range(p.start * unit, p.stop * unit) for p in even_parts(n // unit, size)]


def plan(cfg, size: int, ff_unit: int | tuple[int, int, int] = 1) -> list[Shard]:
    """The shards of a model over `size` ranks (see the module's docstring); ff_unit: ffn_units(), or the dense
    FFN's alone."""
    if size < 1:
        raise ShardError(f"tensor parallelism over {size} ranks")
    if size == 1:
        return [Shard.whole(cfg)]
    if cfg.n_head < size:
        raise ShardError(f"--tensor-parallel {size}: the model has {cfg.n_head} attention heads, fewer than the ranks")
    group = cfg.n_head // cfg.n_head_kv
    if cfg.n_head_kv >= size:
        kv_parts = even_parts(cfg.n_head_kv, size)
        heads = [(range(p.start * group, p.stop * group), tuple(p)) for p in kv_parts]
    else:
        heads = []
        for q in even_parts(cfg.n_head, size):
            reads = [h // group for h in q]                   # the KV head each query head reads
            distinct = sorted(set(reads))
            uniform = all(reads.count(k) == len(q) // len(distinct) for k in distinct)
            heads.append((q, tuple(distinct) if uniform else tuple(reads)))
    units = ff_unit if isinstance(ff_unit, tuple) else (ff_unit, 1, 1)
    ff, ff_exp, ff_shexp = (split_columns(n, u, size) for n, u in zip((cfg.n_ff, cfg.n_ff_exp, cfg.n_ff_shexp), units))
    vocab = even_parts(cfg.n_vocab, size)
    return [Shard(r, size, cfg.head_dim, heads[r][0], heads[r][1], ff[r], vocab[r], ff_exp[r], ff_shexp[r])
            for r in range(size)]
