"""The mul_mat chain: y = x W^T, choosing MMVF / MMVQ / MMQ / dequantize+cuBLAS by type, columns and architecture.

    float weights, n <= 8          -> MMVF
    float weights, n > 8           -> cuBLAS
    quantized, n <= mmvq_max(T)    -> MMVQ (weights read once per launch: all n for Q4_K, 8 columns for the others)
    quantized, n <= mmq_max(T)     -> MMQ (int8 tensor cores; split-k where its tiles are fewer than the SMs)
    quantized, n <= mmq_f16_max(T) -> mmq_f16 (raw blocks unpacked to f16 on f16 tensor cores: in registers up to 64
                                      columns where a launch reads >= mmq_f16.SMALL_MIN_WEIGHTS weights, with a
                                      table of its own, else in shared memory)
    otherwise                      -> dequantize to f16 + cuBLAS

In batch-invariant mode (CudaConfig.batch_invariant) every quantized type MMVQ knows takes MMVQ and every other
weight MMVF (dequantized to f16 first where quantized), at any n, in launches of 8 columns whose per-column sums do
not depend on n.

The chain is `choose_path`: one `should_use_*` predicate per family, in order, each defined beside the family's launch
rules (launch.py, mmvq.py, mmq.py) and fed the per-architecture table below. Force a path with
`mul_mat(..., path=...)` or CudaConfig.mul_mat_path (`--mul-mat-path`, config.forced).
"""
from __future__ import annotations

from ..quants import GGMLType
from . import launch
from . import mmvq as mmvq_launch
from . import mmq as mmq_launch
from . import mmq_f16 as mmq_f16_launch
from .build import FAMILY_ARCHS, QTYPES
from .config import MUL_MAT_PATHS, current
from .weights import GPUWeight

# Per compute capability: the largest column count MMVQ takes, then the largest MMQ takes, then the largest mmq_f16
# takes (per type; types not listed take the default); dequantize + cuBLAS above. Measured on an H100 with
# `scripts/bench.py mul-mat --compare --ns 16,32,48,64,96,128,192,256,512 --reps 10` at m = 4096, k = 14336
# (BENCHMARKS.md, mmq-f16-h100-2026-12-06.txt), each n taking the fastest path with mmq_f16 (f16 activations, the
# prefill path's rounding) counted 5 % faster than it is, kernel us at 16-64 / 128 / 256 / 512 columns:
#   q4_K  MMVQ 26-86 (58 at 48), MMQ 55-57 / 102 / 191 / 360, mmq_f16 66-70 / 87 / 159 / 297,
#         dequant 143 / 149 / 156 / 178
#   q6_K  MMQ 86-87 / 165 / 315 / 629, mmq_f16 96 / 115 / 215 / 399, dequant 136 / 142 / 150 / 170
#   q4_0  MMQ 72-73 / 137 / 260 / 512, mmq_f16 59-61 / 82 / 155 / 274, dequant 139 / 145 / 156 / 176
#   q4_1, q5_1, q5_K, q2_K (no fast MMQ): mmq_f16 56-78 / 78-95 / 144-176 / 262-322 against MMQ 120-131 and dequant
#   135-192; q8_0, q5_0, q3_K, iq4_nl, iq4_xs: mmq_f16 59-89 / 87-106 against MMQ 74-86 / 138-162.
# At 16-64 columns these timings have a floor of 55-57 us (ten launches from Python: the host's launch rate), which
# MMQ on q4_K and mmq_f16 on q4_0 / q4_1 sit on, so the choices there rest partly on floors; mmq_f16 loses to
# dequantize + cuBLAS from 192-512 columns, so the long prefill ubatches keep that path. This table serves launches
# reading fewer than mmq_f16.SMALL_MIN_WEIGHTS weights, where mmq_f16 runs its 64- / 128-column tiles.
_MMVQ_MAX_SM90 = {int(GGMLType.Q4_K): 48}
_MMQ_MAX_SM90 = {int(GGMLType.Q4_K): 64, int(GGMLType.Q6_K): 64}
_MMQ_F16_MAX_SM90 = {int(t): 256 for t in (GGMLType.Q4_K, GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q5_K, GGMLType.Q4_0,
                                            GGMLType.IQ4_NL, GGMLType.IQ4_XS)}
_MMQ_F16_DEFAULT_SM90 = 128
THRESHOLDS = {
    (9, 0): {"mmvq_max": _MMVQ_MAX_SM90, "mmvq_default": 16, "mmq_f16_max": _MMQ_F16_MAX_SM90,
             "mmq_f16_default": _MMQ_F16_DEFAULT_SM90, "mmq_max": _MMQ_MAX_SM90, "mmq_default": 0},
}


def _per_type(**limits) -> dict[int, int]:
    return {int(GGMLType[name]): v for name, v in limits.items()}


# Launches reading at least mmq_f16.SMALL_MIN_WEIGHTS weights, where mmq_f16 runs mmq_f16_small up to 64 columns: every
# path timed from CUDA graphs on an H100, `scripts/bench.py mul-mat --compare --graph --ns
# 1,2,4,8,16,32,48,64,128,256,512 --reps 10` at m = 4096, k = 14336, the same rule (mmq_f16 counted 5 % faster;
# BENCHMARKS.md, mmq-f16-small-h100-2026-12-06.txt), kernel us at 1 / 8 / 16 / 32 / 64 columns:
#   q4_K  MMVQ 14 / 20 / 24 / 38 / 82, mmq_f16 26 / 27 / 30 / 39 / 47, MMQ 52-53 at 16-64
#   q6_K  MMVQ 23 / 41 / 83, mmq_f16 38 / 39 / 40 / 50 / 59, MMQ 82-83 at 16-64
#   q4_1  MMVQ 16 / 30 / 60, mmq_f16 25 / 26 / 27 / 35 / 46, MMQ 120
#   q8_0  MMVQ 24 / 40 / 78, mmq_f16 34 / 35 / 38 / 50 / 58, MMQ 70
# and mmq_f16 is faster than MMQ from 16 columns up for every type (q3_K from 32), so MMQ takes none of these.
_MMVQ_MAX_LARGE_SM90 = _per_type(Q4_K=16, Q6_K=4, Q4_0=4, Q4_1=4, Q5_0=4, Q5_1=4, Q8_0=4, Q2_K=2, Q3_K=8, Q5_K=4,
                                 IQ4_NL=4, IQ4_XS=4)
_MMQ_MAX_LARGE_SM90 = _MMVQ_MAX_LARGE_SM90          # (no MMQ range: it ends where MMVQ's does)
_MMQ_F16_MAX_LARGE_SM90 = _per_type(Q4_K=128, Q6_K=128, Q8_0=128, Q2_K=128, Q3_K=128, IQ4_XS=128, Q4_0=256, Q4_1=256,
                                    Q5_0=256, Q5_1=256, Q5_K=256, IQ4_NL=256)
THRESHOLDS_LARGE = {
    (9, 0): {"mmvq_max": _MMVQ_MAX_LARGE_SM90, "mmvq_default": 16, "mmq_f16_max": _MMQ_F16_MAX_LARGE_SM90,
             "mmq_f16_default": _MMQ_F16_DEFAULT_SM90, "mmq_max": _MMQ_MAX_LARGE_SM90, "mmq_default": 0},
}
# Architectures not measured: no MMQ or mmq_f16 (their tiles take more shared memory per block than sm_86 / sm_89
# have, 99 KB; mmq_f16 more than sm_80's 163 KB).
OTHER_ARCH = {"mmvq_max": {}, "mmvq_default": 16, "mmq_f16_max": {}, "mmq_f16_default": 0, "mmq_max": {},
              "mmq_default": 0}
PATHS = MUL_MAT_PATHS
SUPPORTED_QTYPES = frozenset(QTYPES.values())


def _arch() -> tuple[int, int]:
    import cupy
    cc = cupy.cuda.Device().compute_capability
    return int(cc[:-1]), int(cc[-1])


def choose_path(w: GPUWeight, n: int, arch: tuple[int, int] | None = None) -> str:
    if current().batch_invariant:             # one reduction order per row for any n: MMVQ, or MMVF on float rows
        return "mmvq" if w.quantized and int(w.type) in SUPPORTED_QTYPES else "mmvf"
    if launch.should_use_mmvf(w, n):
        return "mmvf"
    if not w.quantized:
        return "cublas"
    if int(w.type) not in SUPPORTED_QTYPES:
        return "dequant"
    arch = arch or _arch()
    large = mmq_f16_launch.is_large(w) and arch in THRESHOLDS_LARGE
    table = THRESHOLDS_LARGE[arch] if large else THRESHOLDS.get(arch, OTHER_ARCH)
    if mmvq_launch.should_use_mmvq(w, n, table):
        return "mmvq"
    if mmq_launch.should_use_mmq(w, n, table):
        return "mmq"
    return "mmq_f16" if mmq_f16_launch.should_use_mmq_f16(w, n, table) else "dequant"


def residual_rows(n: int) -> bool:
    """Whether an activation array of n rows is multiplied on 16-bit activations where MMVQ takes them (q8_1 and its
    residual plane, CudaConfig.exact_decode): what the kernels that write q8_1 blocks for the next mul_mat (the norm,
    decode attention) also write the residual plane for."""
    return current().exact_decode and n <= mmvq_launch.RESIDUAL_MAX_COLS


F16_FORM_MIN_ROWS = 9     # from this many rows the kernels that write an activation (the norms, decode attention, the
                          # GLU activations) also write its f16 form for the next mul_mat: past a decode step's MMVQ
                          # columns (their q8_1 blocks), where mmq_f16 and dequantize + cuBLAS take f16


def writes_f16(rows: int) -> bool:
    """Whether a kernel writing an activation of `rows` rows also writes its f16 form (F16_FORM_MIN_ROWS)."""
    return rows >= F16_FORM_MIN_ROWS


class Activations:
    """Forms of the last activation array multiplied (q8_1 blocks, with its residual plane, f16), reused while the
    next mul_mats take the same array (q, k and v; gate and up). Arrays are treated as immutable."""

    def __init__(self):
        self.x, self.forms = None, {}

    def _forms_of(self, x) -> dict:
        if self.x is not x:
            self.x, self.forms = x, {}
        return self.forms

    def _get(self, x, key, make):
        forms = self._forms_of(x)
        if key not in forms:
            forms[key] = make()
        return forms[key]

    def q8_1(self, x, n_pad=None):
        return self._get(x, ("q8_1", n_pad), lambda: launch.quantize_q8_1(x, n_pad))

    def q8_1_residual(self, x):
        """(qs, ds, rs): x's q8_1 blocks, their residual plane and the sums of both (16-bit activations)."""
        return self._get(x, "q8_1r", lambda: launch.quantize_q8_1(x, residual=True))

    def put_q8_1(self, x, q8) -> None:
        """x's q8_1 blocks (qs, ds), or (qs, ds, rs) with the residual plane, made by the kernel that wrote x."""
        self._forms_of(x)["q8_1r" if len(q8) == 3 else ("q8_1", None)] = tuple(q8)

    def put_f16(self, x, h) -> None:
        """x's f16 form (x.astype(float16), bit for bit), made by the kernel that wrote x."""
        self._forms_of(x)["f16"] = h

    def f16(self, x):
        import cupy
        return self._get(x, "f16", lambda: x.astype(cupy.float16))

    def clear(self):
        self.x, self.forms = None, {}


def resolve_path(w: GPUWeight, n: int, path: str | None = None) -> str:
    """The path a mul_mat of n columns takes: forced (argument, CudaConfig.mul_mat_path) or chosen."""
    path = path or current().mul_mat_path or choose_path(w, n)
    if path == "mmvq" and n > mmvq_launch.mmvq_max_cols(int(w.type)):
        raise ValueError(f"MMVQ takes at most {mmvq_launch.mmvq_max_cols(int(w.type))} columns of this type")
    if path == "mmq_f16" and "sm_%d%d" % _arch() not in FAMILY_ARCHS["mmq_f16"]:
        raise ValueError(f"the mmq_f16 path runs on {', '.join(FAMILY_ARCHS['mmq_f16'])} only (its shared memory: "
                         f"up to {max(mmq_f16_launch.SMEM_BYTES.values()) // 1024} KB a block)")
    if path in ("mmvq", "mmq", "mmq_f16") and not w.quantized:
        path = "mmvf" if n <= 8 else "cublas"
    if path not in PATHS:
        raise ValueError(f"unknown mul_mat path {path!r} (one of {', '.join(PATHS)})")
    return path


def mul_mat(w: GPUWeight, x, path: str | None = None, out=None, acts: Activations | None = None):
    """x: [n, k] f32 -> [n, m] f32."""
    n = x.shape[0]
    if n == 0:
        import cupy
        return cupy.empty((0, w.m), cupy.float32)
    acts = acts or Activations()
    path = resolve_path(w, n, path)
    if path == "mmvf":                        # a quantized w here: a type without MMVQ, batch-invariant mode
        return launch.mmvf(launch.dequantize(w, "f16") if w.quantized else w.data, x, out)
    if path == "cublas":
        return launch.gemm_xwt(x, w.data, out)
    if path == "mmvq":
        qs, ds, rs = _mmvq_activations(acts, x, int(w.type), n)
        return mmvq_launch.mmvq(w, qs, ds, n, out, rs)
    if path == "mmq_f16":
        return mmq_f16_launch.mmq_f16(w, acts.f16(x), out)
    if path == "mmq":
        qs, ds = acts.q8_1(x, mmq_launch.mmq_n_pad(n))
        return mmq_launch.mmq(w, qs, ds, n, out)
    return launch.gemm_xwt(acts.f16(x), launch.dequantize(w, "f16"), out)      # dequant


def mul_mats(ws: list[GPUWeight], x, acts: Activations | None = None) -> list:
    """[mul_mat(w, x) for w in ws]; on the MMVQ path, matrices of one type and k share a launch (up to 3)."""
    n = x.shape[0]
    acts = acts or Activations()
    if n == 0 or any(resolve_path(w, n) != "mmvq" for w in ws):
        return [mul_mat(w, x, acts=acts) for w in ws]
    outs, i = [], 0
    while i < len(ws):
        j = i + 1
        while j < len(ws) and j - i < 3 and (ws[j].type, ws[j].k) == (ws[i].type, ws[i].k):
            j += 1
        qs, ds, rs = _mmvq_activations(acts, x, int(ws[i].type), n)
        outs += mmvq_launch.mmvq_multi(ws[i:j], qs, ds, n, rs=rs)
        i = j
    return outs


def glu(gate: GPUWeight, up: GPUWeight, x, act: str, acts: Activations | None = None):
    """act(x gate^T) * (x up^T) in one MMVQ launch when both take that path and match; None otherwise."""
    n = x.shape[0]
    if n == 0 or resolve_path(gate, n) != "mmvq" or resolve_path(up, n) != "mmvq" or \
            (gate.type, gate.m, gate.k) != (up.type, up.m, up.k):
        return None
    qs, ds, rs = _mmvq_activations(acts or Activations(), x, int(gate.type), n)
    return mmvq_launch.mmvq_glu(gate, up, qs, ds, n, act, rs=rs)


def _mmvq_activations(acts: Activations, x, t: int, n: int) -> tuple:
    """(qs, ds, rs) for an MMVQ mul_mat of type t at n columns: rs the residual plane where the kernel takes 16-bit
    activations (mmvq.takes_residual), else None."""
    if mmvq_launch.takes_residual(t, n):
        return acts.q8_1_residual(x)
    return (*acts.q8_1(x), None)
