"""The CUDA kernel families: their sources, the kernels each one instantiates, and loading them.

Each family is one .cu file under kernels/ with common.cuh inlined. The kernels a family instantiates are listed once,
here (`name_expressions`); the .cu files hold templates only. Two ways to a loaded kernel:
- prebuilt: `pip install` runs nvcc on every family for PREBUILT_ARCHS (engine/cuda/aot.py) and ships the cubins in
  engine/cuda/prebuilt/ with a manifest of each kernel's symbol; a family loads its cubin when the manifest's source
  key equals the current source's (an edited .cu falls back) and the GPU runs one of its architectures;
- NVRTC (the fallback): one group of a family (a kernel and its first template argument, e.g. `mmvq<12, ...>`)
  compiled on first use, cached on disk by CuPy; `prepare` compiles the groups a model needs in parallel.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from . import pdl

KERNEL_DIR = Path(__file__).parent / "kernels"
PREBUILT_DIR = Path(__file__).parent / "prebuilt"
PREBUILT_ARCHS = ("sm_80", "sm_86", "sm_90")   # sm_89 (Ada) runs sm_86 cubins (prebuilt_arch); no kernel uses FP8
FAMILY_ARCHS = {"mmq_f16": ("sm_90",)}   # families built for fewer architectures: mmq_f16's blocks take up to 226 KB
                                         # of shared memory, which only sm_90 has (sm_80 163 KB, sm_86 / sm_89 99 KB)
FAMILIES = ("quantize", "dequantize", "mmvq", "mmvf", "mmq", "mmq_f16", "rms_norm", "rope", "attention",
            "attention_mma", "argmax", "sampling")
# The quantized types the kernels take, as common.cuh numbers them (its `#define T_<type> <GGML type>` lines), and
# their blocks' (values, bytes) (its TypeTraits: `TRAITS(T_<type>, values, bytes, ...)`).
_COMMON = (KERNEL_DIR / "common.cuh").read_text()
QTYPES = {name: int(v) for name, v in re.findall(r"^#define (T_\w+) (\d+)", _COMMON, re.M)}
QTRAITS = {QTYPES[name]: (int(qk), int(nbytes))
           for name, qk, nbytes in re.findall(r"^TRAITS\((T_\w+), (\d+), (\d+),", _COMMON, re.M)}
COMPILE_OPTIONS = ("--std=c++17",)
NVCC_OPTIONS = ("-ftz=true",)          # CuPy's NVRTC compiles with -ftz=true: the prebuilt cubins match its code
PREFILL_HEAD_DIMS = (64, 128, 256)     # attention_prefill (attention.cu), attention_prefill_mma instantiations
MMQ_F16_BN = (64, 128)                 # mmq_f16.cu's column tiles (mmq_f16.py takes it from here)
MMQ_F16_SMALL_NB = (1, 2, 4, 8)        # mmq_f16.cu's mmq_f16_small: its 8-column B tiles (up to 64 columns)
# ... the types it runs two blocks an SM up to MFS_PAIR_NB_LIGHT tiles: their unpacking and 4 tiles' sums fit 128
# registers (ptxas at 4 tiles, one block: 124-128; the other types 133-184)
MMQ_F16_SMALL_LIGHT = ("T_Q4_0", "T_Q4_K", "T_IQ4_NL", "T_IQ4_XS")
TC_WIDE_NCOLS = (24, 32, 40, 48, 56, 64)   # mmvq.cu's mmvq_tc_q4_K past 16 columns (launch.py takes it from here)
ATTENTION_HEAD_CHUNKS = (2, 4, 8)      # attention.cu's attention: head_dim / 32 up to this many
DECODE_HEAD_DIMS = (64, 128, 256)      # attention.cu's attention_decode: head_dim padded to one of these
DECODE_GROUPS = (1, 2, 4, 8)           # ... and the query heads of a GQA group one block takes
DECODE_MMA_HEAD_DIMS = (64, 128, 256)  # attention.cu's attention_decode_mma (tensor cores): an f16 cache's head_dim
KV_TYPES = ("u16", "float", "kvq8_0")  # attention.cu's cache value types: f16, f32, q8_0 blocks (kv_row_elems)
NORM_VALUES = (2, 4, 8, 16)            # rms_norm.cu: the values a thread holds (rows up to 16 x 1024)
TYPE_ALIASES = {"u16": "unsigned short"}     # common.cuh's typedefs as a demangled symbol spells them
# kernels whose first template argument is a quantized type
TYPED_KERNELS = ("mmvq", "mmvq_pieces", "mmq", "mmq_f16", "dequantize_f16", "dequantize_f32")
OWN_KERNELS = {"mmvq_tc_q4_K": "T_Q4_K", "mmvq_q4_K_pairs": "T_Q4_K", "mmq_q4_K": "T_Q4_K",   # one type's own
               "mmvq_q6_K": "T_Q6_K"}


class KernelBuildError(RuntimeError):
    pass


def family_archs(family: str, archs=PREBUILT_ARCHS) -> tuple[str, ...]:
    """The architectures of archs a family is built for ahead of time (FAMILY_ARCHS; else all)."""
    return tuple(a for a in archs if a in FAMILY_ARCHS.get(family, archs))


def expanded_source(family: str) -> str:
    """The family's .cu with common.cuh inlined: a self-contained translation unit."""
    common = (KERNEL_DIR / "common.cuh").read_text().replace("#pragma once", "")
    text = (KERNEL_DIR / f"{family}.cu").read_text()
    return text.replace('#include "common.cuh"', common)


def name_expressions(family: str) -> list[str]:
    """Every kernel the family instantiates, spelled as the names `kernel` takes."""
    qtypes = sorted(QTYPES.values())
    if family == "quantize":
        return ["quantize_q8_1"]
    if family == "dequantize":
        return [f"dequantize_{o}<{t}>" for t in qtypes for o in ("f16", "f32")]
    if family == "mmvq":
        return [f"mmvq<{t}, {n}, {g}, 0>" for t in qtypes for n in range(1, 9) for g in range(3)] + [
            f"mmvq<{t}, 1, {g}, 1>" for t in qtypes for g in range(3)] + [
            f"mmvq_pieces<12, {n}, {g}>" for n in range(1, 9) for g in range(3)] + [
            f"mmvq_tc_q4_K<{n}, {g}>" for n in (*range(1, 17), *TC_WIDE_NCOLS) for g in range(3)] + [
            f"mmvq_q4_K_pairs<1, {g}, {e}>" for g in range(3) for e in range(2)] + [
            f"mmvq_q6_K<{r}, {e}>" for r in (1, 2) for e in range(2)]
    if family == "mmvf":
        return [f"mmvf<{w}, {n}, {v}>" for w, vec in (("float", 4), ("u16", 8)) for n in range(1, 9)
                for v in (vec, 1)]
    if family == "mmq":
        return [f"mmq<{t}>" for t in qtypes] + ["mmq_q4_K", "mmq_split_sum"]
    if family == "mmq_f16":
        return [f"mmq_f16<{t}, {bn}>" for t in qtypes for bn in MMQ_F16_BN] + [
            mmq_f16_small_name(t, nb) for t in qtypes for nb in MMQ_F16_SMALL_NB]
    if family == "argmax":
        return ["argmax_rows"]
    if family == "sampling":
        return ["apply_penalties", "sample_rows", "add_bias", "constrain_rows"]
    if family == "rope":
        return ["rope", "rope_qk"]
    if family == "rms_norm":
        return [f"{k}<{v}>" for k in ("rms_norm", "add_rms_norm") for v in NORM_VALUES]
    if family == "attention":
        return [f"kv_store<{t}>" for t in ("u16", "float")] + ["kv_store_q8_0"] + [
            f"attention<{t}, {e}, {c}>" for t in KV_TYPES for e in ATTENTION_HEAD_CHUNKS
            for c in ("false", "true")] + [
            f"attention_decode<{t}, {d}, {g}, {c}>" for t in KV_TYPES for d in DECODE_HEAD_DIMS
            for g in DECODE_GROUPS for c in ("false", "true")] + [
            f"attention_decode_mma<{d}, {c}>" for d in DECODE_MMA_HEAD_DIMS for c in ("false", "true")] + [
            f"attention_prefill<{t}, {d}>" for t in ("float", "kvq8_0") for d in PREFILL_HEAD_DIMS]
    if family == "attention_mma":
        return [f"attention_prefill_mma<{d}>" for d in PREFILL_HEAD_DIMS]
    raise KeyError(family)


class SmallPlan(NamedTuple):
    """How mmq_f16.cu's mmq_f16_small runs for a type and a count of B tiles."""
    stages: int          # stage buffers
    stage_bytes: int     # bytes per stage (its MfsStage)
    per_sm: int          # blocks per SM it is built for (1 or 2)


@functools.cache
def mmq_f16_small_plan(t: int, nb: int) -> SmallPlan:
    """mmq_f16_small's plan for type t and nb B tiles: two blocks an SM up to MFS_PAIR_NB tiles, and up to
    MFS_PAIR_NB_LIGHT for MMQ_F16_SMALL_LIGHT's types where MFS_PAIR_MIN_STAGES stages fit; as many stages as the
    shared memory of a block holds, MFS_STAGES_MAX at most."""
    f = constants("mmq_f16")
    qk, nbytes = QTRAITS[t]
    unit = nbytes * max(qk, f["MFS_KT"]) // qk                    # MfUnit<T, MFS_KT>::bytes
    stage = f["MF_BM"] * ((unit + 30) // 16 * 16) + 8 * nb * f["MFS_XCOL"]   # MfsStage<T, NB>::bytes
    light = t in {QTYPES[name] for name in MMQ_F16_SMALL_LIGHT}
    paired = nb <= f["MFS_PAIR_NB"] or (
        light and nb <= f["MFS_PAIR_NB_LIGHT"] and f["MFS_PAIR_MIN_STAGES"] * stage <= f["MFS_SMEM_PAIR"])
    cap = f["MFS_SMEM_PAIR"] if paired else f["MFS_SMEM_ONE"]
    return SmallPlan(min(f["MFS_STAGES_MAX"], cap // stage), stage, 2 if paired else 1)


def mmq_f16_small_name(t: int, nb: int) -> str:
    """The name expression of mmq_f16_small for type t and nb B tiles (its plan's stages and blocks per SM)."""
    plan = mmq_f16_small_plan(t, nb)
    return f"mmq_f16_small<{t}, {nb}, {plan.stages}, {plan.per_sm}>"


def canonical_name(name: str) -> str:
    """A kernel's name expression or demangled symbol (return type and parameters dropped) in one spelling."""
    name = re.sub(r"^void ", "", name.strip())
    depth = 0
    for i, c in enumerate(name):                      # cut the parameter list: the first '(' outside <...>
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0:
            name = name[:i]
            break
    for alias, spelled in TYPE_ALIASES.items():
        name = re.sub(rf"\b{alias}\b", spelled, name)
    return re.sub(r"\s+", "", name)


def instantiation_source(family: str) -> str:
    """The family's translation unit for nvcc: its source, then one host reference per kernel, which instantiates it."""
    refs = ",\n    ".join(f"(void*)&{n}" for n in name_expressions(family))
    return f"{expanded_source(family)}\n\nvoid* engine_instances[] = {{\n    {refs}}};\n"


def source_key(family: str) -> str:
    """A hash of what a family's binary is built from: its source, its kernel list and the compile options."""
    text = "\n".join((instantiation_source(family), *COMPILE_OPTIONS, *NVCC_OPTIONS))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def constants(family: str) -> dict[str, int]:
    """The integer #defines of a family's source (common.cuh's included), evaluated: the launch rules read the
    kernels' tiles, thread counts and shared-memory sizes here rather than keeping copies."""
    defs = dict(re.findall(r"^#define (\w+) (.+?)\s*(?://.*)?$", expanded_source(family), re.M))
    values: dict[str, int] = {}

    def value(name):
        if name not in values:
            expr = re.sub(r"[A-Za-z_]\w*", lambda mt: str(value(mt.group(0))), defs[name])
            expr = re.sub(r"\(([^()?]+)\?([^():]+):([^()]+)\)", r"((\2) if (\1) else (\3))", expr)   # a ? b : c
            values[name] = int(eval(expr.replace("/", "//"), {"__builtins__": {}}))
        return values[name]
    return {name: value(name) for name in defs if re.fullmatch(r"[\d\s()+*/<>?:A-Z_-]+", defs[name])}


def group_of(name: str) -> str:
    """The NVRTC compile group of a kernel: its name and first template argument (`mmvq<12`, `attention<u16`)."""
    return re.split(r"[,>]", name)[0]


# ---- loading ----

def _arch() -> str:
    import cupy
    return f"sm_{cupy.cuda.Device().compute_capability}"


@functools.cache
def _manifest() -> dict:
    path = PREBUILT_DIR / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def prebuilt_arch(arch: str, built: list[str]) -> str | None:
    """The built architecture whose cubins run on arch: the same one, else the newest of the same major version below
    it (CUDA runs sm_XY code on sm_XZ, Z >= Y)."""
    if arch in built:
        return arch
    major, minor = int(arch[3:-1]), int(arch[-1])
    same = [a for a in built if int(a[3:-1]) == major and int(a[-1]) <= minor]
    return max(same, key=lambda a: int(a[-1])) if same else None


class _Prebuilt:
    """A family's cubin for this GPU and its kernels' symbols."""

    def __init__(self, family: str, entry: dict, arch: str):
        import cupy
        self.module = cupy.RawModule(path=str(PREBUILT_DIR / f"{family}.{arch}.cubin"))
        self.symbols = entry["symbols"]
        self.arch = arch

    def get_function(self, name: str):
        return self.module.get_function(self.symbols[canonical_name(name)])


@functools.cache
def _prebuilt(family: str):
    """The family's prebuilt module, or None (no binary for this GPU, or built from another source)."""
    entry = _manifest().get(family)
    if entry is None or entry["key"] != source_key(family):
        return None
    arch = prebuilt_arch(_arch(), entry["archs"])
    return _Prebuilt(family, entry, arch) if arch else None


_compiled: dict[tuple[str, str], object] = {}
_compile_lock = threading.Lock()


def _nvrtc_group(family: str, group: str, announce: bool = True):
    """The NVRTC module holding every kernel of one group of a family (compiled once, cached on disk by CuPy)."""
    import cupy

    key = (family, group)
    if key in _compiled:
        return _compiled[key]
    names = [n for n in name_expressions(family) if group_of(n) == group]
    if not names:
        raise KernelBuildError(f"no kernel {group}... in family '{family}'")
    if announce:
        print(f"engine: compiling CUDA kernels {group}{'...>' if '<' in group else ''} ({family}.cu) with NVRTC for "
              f"{_arch()}", file=sys.stderr, flush=True)
    try:
        mod = cupy.RawModule(code=expanded_source(family), options=COMPILE_OPTIONS, name_expressions=names)
        mod.compile()
    except cupy.cuda.compiler.CompileException as e:
        raise KernelBuildError(f"CUDA kernel family '{family}' ({family}.cu) failed to compile:\n{e}") from None
    with _compile_lock:
        _compiled[key] = mod
    return mod


@functools.cache
def kernel(family: str, name: str):
    """The loaded kernel `name` (a name expression of name_expressions(family)); code built for sm_90 or later is
    registered as waiting at its start (PDL_WAIT), so captured graphs may launch it programmatically (pdl.py)."""
    pre = _prebuilt(family)
    fn = pre.get_function(name) if pre is not None else _nvrtc_group(family, group_of(name)).get_function(name)
    if pdl.supported(int((pre.arch if pre is not None else _arch())[3:])):
        pdl.register(fn.kernel.ptr)
    return fn


def prepare(qtypes) -> None:
    """Load every family a model of these quantized types uses: the prebuilt cubins, or else its NVRTC groups compiled
    in parallel (threads: NVRTC runs without the GIL)."""
    typed = {str(t) for t in qtypes}
    todo = []
    for family in FAMILIES:
        if _prebuilt(family) is not None:
            continue
        for g in dict.fromkeys(group_of(n) for n in name_expressions(family)):
            kernel_name, _, first_arg = g.partition("<")
            if kernel_name in TYPED_KERNELS and first_arg not in typed:
                continue                             # a quantized type the model does not have
            if kernel_name in OWN_KERNELS and str(QTYPES[OWN_KERNELS[kernel_name]]) not in typed:
                continue
            todo.append((family, g))
    if todo:
        start = time.time()
        print(f"engine: no prebuilt CUDA kernels for {_arch()}: compiling {len(todo)} kernel groups with NVRTC "
              "(cached for the next start) ...", file=sys.stderr, flush=True)
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda fg: _nvrtc_group(*fg, announce=False), todo))
        print(f"engine: compiled in {time.time() - start:.1f} s", file=sys.stderr, flush=True)
