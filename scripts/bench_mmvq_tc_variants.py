#!/usr/bin/env python3
"""mmvq_tc_q4_K (kernels/mmvq.cu) compiled with other settings (-D, e.g. MMVQT_STAGES=2 or MMVQT_MIN_BLOCKS=3) and
timed as CUDA graphs at 4096 x 14336 and 14336 x 4096, n = 1, 2, 3, 4, 8, with the dispatched launch's grid and
arguments; each variant's output is checked against the default build's ("differs" where it is not). MMVQT_WARPS=N
is a -D the launch rule follows too. These in a variant are not -Ds:
  BPS=N     its k ranges are chosen for N blocks per SM (launch.MMVQT_BLOCKS_PER_SM) in place of the rule's
  SPLITS=N  that many k ranges
  QUANT=1   quantize_q8_1 runs before each launch, so the activations are fresh in L2 (its time alone in brackets)
  TRACE=1   builds with MMVQT_TRACE and prints the phases of the last timed launch
  SRC=name  compiles engine/cuda/kernels/name.cu (e.g. a copy of the committed file) in place of mmvq.cu: an A/B of
            two versions in one lease
  HOT=1     every launch reads the same weight copy, hot in L2, in place of copies rotated past it
TC_SHAPES=1 in the environment times the first shape only.

    python scripts/bench_mmvq_tc_variants.py "MMVQT_STAGES=3;MMVQT_MIN_BLOCKS=3,BPS=3"
"""
import functools
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import time_graph, warm_gpu  # noqa: E402

NS = (1, 2, 3, 4, 8)


def read_trace(mod, grid) -> np.ndarray:
    """mmvqt_trace (kernels/mmvq.cu MMVQT_TRACE) of the last launch: [blocks, 8] int64."""
    import cupy as cp
    blocks = min(1024, grid[0] * grid[1])
    return cp.ndarray((1024, 8), cp.uint64, memptr=mod.get_global("mmvqt_trace")).get()[:blocks].astype(np.int64)


def trace_phases(tr: np.ndarray) -> str:
    """A launch's phases (k ranges > 1): median / max over blocks in us (clock64 at the SM clock measured against
    globaltimer), the last blocks' reduction apart."""
    last = (tr[:, 7] >> 32) == 1
    end_clk = np.where(last, tr[:, 5], tr[:, 4])
    ghz = float(np.median((end_clk - tr[:, 1]) / np.maximum(tr[:, 6] - tr[:, 0], 1)))
    t0 = tr[:, 0].min()

    def us(v):
        return f"{np.median(v) / 1e3:.2f}/{np.max(v) / 1e3:.2f}"
    return (f"entry {us(tr[:, 0] - t0)}, prologue {us((tr[:, 2] - tr[:, 1]) / ghz)}, loop "
            f"{us((tr[:, 3] - tr[:, 2]) / ghz)}, sums to count {us((tr[:, 4] - tr[:, 3]) / ghz)}, last blocks' "
            f"reduction {us((tr[last, 5] - tr[last, 4]) / ghz)}, exit {us(tr[:, 6] - t0)}, last exit "
            f"{us(tr[last, 6] - t0)} (us median/max; {ghz:.2f} GHz; {int(last.sum())} last blocks)")


def main():
    import cupy as cp

    from engine.cuda import launch
    from engine.cuda.build import NVRTC_OPTIONS, expanded_source
    from engine.cuda.weights import upload
    from engine.quants import GGMLType, random_blocks
    os.environ["ENGINE_MMVQ_TC"] = "all"
    variants = sys.argv[1].split(";") if len(sys.argv) > 1 else [""]
    rng = np.random.default_rng()
    blocks_per_sm, default_warps = launch.MMVQT_BLOCKS_PER_SM, launch.MMVQT_WARPS
    t = GGMLType.Q4_K
    print("| m x k | variant | " + " | ".join(f"n={n}" for n in NS) + " |")
    print("| --- " * (len(NS) + 2) + "|")
    for m, k in ((4096, 14336), (14336, 4096))[:int(os.environ.get("TC_SHAPES", "2"))]:
        blocks = random_blocks(t, m * k // 256, rng)
        ws = [upload(t, (m, k), blocks) for _ in range(max(2, int(np.ceil(200e6 / (m * k * 0.5625)))))]
        for v in variants:
            defines = dict(d.split("=") for d in v.split(",") if d)
            bps = int(defines.pop("BPS", blocks_per_sm))
            splits = defines.pop("SPLITS", None)               # not a -D either: the k ranges asked for
            quant = defines.pop("QUANT", None)                 # nor this: quantize_q8_1 before each launch
            trace = defines.pop("TRACE", None)                 # nor this: -DMMVQT_TRACE, phases printed
            src = defines.pop("SRC", "mmvq")                   # nor this: another copy of the family's file
            hot = defines.pop("HOT", None)                     # nor this: one weight copy, hot in L2
            if splits:
                os.environ["ENGINE_MMVQ_TC_SPLITS"] = splits
            else:
                os.environ.pop("ENGINE_MMVQ_TC_SPLITS", None)
            mod = cp.RawModule(code=expanded_source(src), name_expressions=[f"mmvq_tc_q4_K<{n}, 0>" for n in NS],
                               options=NVRTC_OPTIONS + tuple(f"-D{a}={b}" for a, b in defines.items()) + (
                                   "-DMMVQ_SKIP_MMA", "-DMMVQ_ONLY_TYPE=12") + (("-DMMVQT_TRACE",) if trace else ()))
            stages = int(defines.get("MMVQT_STAGES", launch.MMVQT_STAGES))
            warps = int(defines.get("MMVQT_WARPS", launch.MMVQT_WARPS))     # a -D the launch rule follows too
            warm_gpu(0.5)
            cells, phases = [], []
            for n in NS:
                x = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
                qs, ds = launch.quantize_q8_1(x)
                out = cp.empty((n, m), cp.float32)
                fn = mod.get_function(f"mmvq_tc_q4_K<{n}, 0>")
                plans = {}
                launch.MMVQT_BLOCKS_PER_SM, launch.MMVQT_WARPS = bps, warps
                for wi in ws:
                    (_, grid, block, args), = launch.mmvq_launches([wi], qs, ds, n, [out])
                    smem = launch.mmvqt_smem_bytes(k, n, grid[1], stages)
                    plans[id(wi)] = (functools.partial(launch._with_smem(fn, smem), shared_mem=smem), grid, block,
                                     args)

                def requantize(wi=None, x=x, q8=(qs, ds)):
                    launch.quantize_q8_1(x, out=q8)

                def call(wi, plans=plans, requantize=requantize):
                    f, grid, block, args = plans[id(wi)]
                    if quant:
                        requantize()
                    f(grid, block, args)
                launch.MMVQT_BLOCKS_PER_SM, launch.MMVQT_WARPS = blocks_per_sm, default_warps
                os.environ.pop("ENGINE_MMVQ_TC_SPLITS", None)
                ref = launch.mmvq(ws[0], qs, ds, n).get()
                call(ws[0])
                same = np.allclose(out.get(), ref, rtol=1e-4, atol=1e-3)
                cells.append(f"{time_graph(call, ws[:1] if hot else ws, 30):.1f}" + ("" if same else " (differs)"))
                if trace:
                    phases.append(f"n={n}: " + trace_phases(read_trace(mod, plans[id(ws[0])][1])))
                if quant:
                    cells[-1] += f" (q {time_graph(requantize, ws, 30):.1f})"
            print(f"| {m} x {k} | {v or 'default'} | " + " | ".join(cells) + " |", flush=True)
            for line in phases:
                print(f"    {m} x {k} {line}")
        del ws
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
