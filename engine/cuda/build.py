"""Compile the CUDA kernel families with NVRTC through cupy.RawModule, cached on disk by CuPy.

Each family is one .cu file under kernels/; common.cuh is inlined into the source (so it is part of CuPy's cache
key), and every template instantiation the file declares is named, so a second start compiles nothing.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
FAMILIES = ("quantize", "dequantize", "mmvq", "mmvf", "mmq", "rms_norm", "rope", "attention",
            "attention_mma", "argmax", "sampling")
QTYPES = {"T_Q4_0": 2, "T_Q4_1": 3, "T_Q5_0": 6, "T_Q5_1": 7, "T_Q8_0": 8, "T_Q2_K": 10, "T_Q3_K": 11,
          "T_Q4_K": 12, "T_Q5_K": 13, "T_Q6_K": 14, "T_IQ4_NL": 20, "T_IQ4_XS": 23}
PIECE_QTYPES = {"T_Q4_K": 12}           # the types mmvq.cu's mmvq_pieces serves (FOR_EACH_PIECE_QTYPE)
NVRTC_OPTIONS = ("--std=c++17",)
PREFILL_HEAD_DIMS = (64, 128, 256)     # attention_prefill (attention.cu), attention_prefill_mma instantiations
TC_WIDE_NCOLS = (24, 32, 40, 48, 56, 64)   # mmvq.cu's mmvq_tc_q4_K past 16 columns (launch.py takes it from here)
ATTENTION_HEAD_CHUNKS = (2, 4, 8)      # attention.cu's attention / attention_split: head_dim / 32 up to this many


class KernelBuildError(RuntimeError):
    pass


def expanded_source(family: str) -> str:
    """The family's .cu with common.cuh inlined: a self-contained translation unit."""
    common = (KERNEL_DIR / "common.cuh").read_text().replace("#pragma once", "")
    text = (KERNEL_DIR / f"{family}.cu").read_text()
    return text.replace('#include "common.cuh"', common)


def name_expressions(family: str) -> list[str]:
    """Every kernel the family's file instantiates, spelled as the names get_function takes."""
    qtypes = sorted(QTYPES.values())
    if family == "quantize":
        return ["quantize_q8_1"]
    if family == "dequantize":
        return [f"dequantize_{o}<{t}>" for t in qtypes for o in ("f16", "f32")]
    if family == "mmvq":
        return [f"{kind}<{t}, {n}, {g}>" for kind, types in (("mmvq", qtypes), ("mmvq_pieces", PIECE_QTYPES.values()))
                for t in types for n in range(1, 9) for g in range(3)] + [
            f"mmvq_mma_q4_K<{n}, {g}>" for n in range(1, 17) for g in range(3)] + [
            f"mmvq_tc_q4_K<{n}, {g}>" for n in (*range(1, 17), *TC_WIDE_NCOLS) for g in range(3)] + [
            f"mmvq_q4_K_pairs<1, {g}>" for g in range(3)]
    if family == "mmvf":
        return [f"mmvf<{w}, {n}, {v}>" for w, vec in (("float", 4), ("u16", 8)) for n in range(1, 9)
                for v in (vec, 1)]
    if family == "mmq":
        return [f"mmq<{t}>" for t in qtypes] + ["mmq_q4_K", "mmq_split_sum"]
    if family == "argmax":
        return ["argmax_rows"]
    if family == "sampling":
        return ["apply_penalties", "sample_rows"]
    if family == "rope":
        return ["rope", "rope_qk"]
    if family == "rms_norm":
        return ["rms_norm", "add_rms_norm"]
    if family == "attention":
        return [f"kv_store<{t}>" for t in ("u16", "float")] + [
            f"{k}<{t}, {e}>" for k in ("attention", "attention_split") for t in ("u16", "float")
            for e in ATTENTION_HEAD_CHUNKS] + [
            f"attention_prefill<float, {d}>" for d in PREFILL_HEAD_DIMS]
    if family == "attention_mma":
        return [f"attention_prefill_mma<{d}>" for d in PREFILL_HEAD_DIMS]
    raise KeyError(family)


def check_type_list() -> None:
    """The Python list of quantized types must equal the one the .cu files instantiate (FOR_EACH_QTYPE)."""
    common = (KERNEL_DIR / "common.cuh").read_text()
    listed = re.search(r"#define FOR_EACH_QTYPE\(X\)(.*?)\n\n", common + "\n\n", re.S).group(1)
    if set(re.findall(r"X\((T_\w+)\)", listed)) != set(QTYPES):
        raise KernelBuildError("FOR_EACH_QTYPE in common.cuh and QTYPES in build.py disagree")
    mmvq = (KERNEL_DIR / "mmvq.cu").read_text()
    listed = re.search(r"#define FOR_EACH_PIECE_QTYPE\(X\)(.*?)\n", mmvq).group(1)
    if set(re.findall(r"X\((T_\w+)\)", listed)) != set(PIECE_QTYPES):
        raise KernelBuildError("FOR_EACH_PIECE_QTYPE in mmvq.cu and PIECE_QTYPES in build.py disagree")


@functools.cache
def module(family: str):
    import cupy

    check_type_list()
    try:
        mod = cupy.RawModule(code=expanded_source(family), options=NVRTC_OPTIONS,
                             name_expressions=name_expressions(family))
        mod.compile()
    except cupy.cuda.compiler.CompileException as e:
        raise KernelBuildError(f"CUDA kernel family '{family}' ({family}.cu) failed to compile:\n{e}") from None
    return mod


@functools.cache
def kernel(family: str, name: str):
    return module(family).get_function(name)
