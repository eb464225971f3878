"""Kernel choices a user, a test or a benchmark may force: one small dataclass, passed to the CUDA backend.

Every field's default (None, True) lets the dispatch chain (dispatch.py) and the launch rules (launch.py) decide, as
measured on the H200 (BENCHMARKS.md). `engine generate|serve|bench` set `mul_mat_path` (--mul-mat-path) and `graphs`
(--eager); tests and benchmarks use `forced(...)` for the rest.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

MUL_MAT_PATHS = ("mmvf", "cublas", "mmvq", "mmq_f16", "mmq", "dequant")
PREFILL_UBATCH = 2048     # the CUDA backend's prefill ubatch: each ubatch past 128 columns dequantizes every weight once
Q4_K_MMVQ_KERNELS = ("mmvq", "pairs", "pieces", "tc")


@dataclass(frozen=True)
class CudaConfig:
    mul_mat_path: str | None = None      # every mul_mat through this path (MUL_MAT_PATHS) where it can take the shape
    mmvq_q4_K: str | None = None         # Q4_K's MMVQ kernel wherever it can take the columns (Q4_K_MMVQ_KERNELS)
    mmvq_tc_splits: int | None = None    # k ranges of an mmvq_tc_q4_K launch
    mmq_splits: int | None = None        # k splits of an MMQ launch (1: none)
    mmq_q4_K: bool = True                # Q4_K's MMQ on its raw blocks (False: the generic mmq<Q4_K>)
    graphs: bool = True                  # decode and repeated prefill steps replayed as CUDA graphs
    programmatic_launch: bool = True     # in those graphs each kernel launched once all its predecessor's blocks
                                         # have started, waiting at its start for their results (sm_90+, pdl.py)
    exact_decode: bool = False           # one-column MMVQ (a sequence's decode step) on 16-bit activations: q8_1
                                         # plus an int8 residual plane (--decode-activations q16, and auto's choice
                                         # for small model files: cli.EXACT_DECODE_MAX_FILE_BYTES; BENCHMARKS.md)
    batch_invariant: bool = False        # a row's results independent of the step's other rows (--batch-invariant):
                                         # every quantized mul_mat through the generic mmvq, float ones through
                                         # mmvf (launches of 8 columns, one reduction order for any column count),
                                         # attention row by row (attention_decode's split by the row's own length)

    def __post_init__(self):
        if self.mul_mat_path not in (None, *MUL_MAT_PATHS):
            raise ValueError(f"unknown mul_mat path {self.mul_mat_path!r} (one of {', '.join(MUL_MAT_PATHS)})")
        if self.mmvq_q4_K not in (None, *Q4_K_MMVQ_KERNELS):
            raise ValueError(f"unknown Q4_K MMVQ kernel {self.mmvq_q4_K!r} (one of {', '.join(Q4_K_MMVQ_KERNELS)})")
        if self.batch_invariant and (self.mul_mat_path or self.mmvq_q4_K or self.exact_decode):
            raise ValueError("--batch-invariant chooses every mul_mat's kernel itself: it cannot be combined with "
                             "--mul-mat-path, a forced Q4_K MMVQ kernel or --decode-activations q16")


_current = CudaConfig()


def current() -> CudaConfig:
    """The configuration the launch rules follow now (the CUDA backend sets it)."""
    return _current


def configure(config: CudaConfig) -> None:
    global _current
    _current = config


@contextlib.contextmanager
def forced(**fields):
    """The current configuration with these fields replaced, inside the block: `with forced(mmvq_q4_K="tc"): ...`."""
    before = _current
    configure(dataclasses.replace(before, **fields))
    try:
        yield _current
    finally:
        configure(before)
