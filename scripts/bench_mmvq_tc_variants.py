#!/usr/bin/env python3
"""mmvq_tc_q4_K (kernels/mmvq.cu) compiled with other settings (-D, e.g. MMVQT_STAGES=2 or MMVQT_MIN_BLOCKS=3) and
timed as CUDA graphs at 4096 x 14336 and 14336 x 4096, n = 1, 2, 3, 4, 8, with the dispatched launch's grid and
arguments; each variant's output is checked against the default build's ("differs" where it is not). MMVQT_WARPS=N
and MMVQT_WIDE_FROM=N are -Ds the launch rule follows too. These in a variant are not -Ds:
  BPS=N     its k ranges are chosen for N blocks per SM (launch.MMVQT_BLOCKS_PER_SM) in place of the rule's
  SPLITS=N  that many k ranges
  QUANT=1   quantize_q8_1 runs before each launch, so the activations are fresh in L2 (its time alone in brackets)
  TRACE=1   builds with MMVQT_TRACE and prints the phases of the last timed launch (TRACE_DUMP=dir in the
            environment also saves its raw stamps there as .npy)
  SRC=name  compiles engine/cuda/kernels/name.cu (e.g. a copy of the committed file) in place of mmvq.cu: an A/B of
            two versions in one lease
  HOT=1     every launch reads the same weight copy, hot in L2, in place of copies rotated past it
  XOFF=B    the activations' q8_1 buffers (qs, ds) start B bytes (a multiple of 16) into their allocations, and
  YOFF=B    the output's: variants with other offsets get buffers of their own (a study of what placement matters)
In the environment: TC_SHAPES=1 times the first shape only; TC_NS=5,6,7,8 other column counts. ROUNDS=R times the
variants in turn, R rounds, and prints each one's median and its median difference to the first variant (TRACE's
phases and QUANT's own time are then not printed). Every variant runs on the same activation and output buffers:
with buffers of its own (OWN_BUFFERS=1), two builds of the same code differed by up to 1.8 us at n = 8, where on
shared buffers they agree within 0.03 us (BENCHMARKS.md, fifteenth session). CHECK=0 skips the check against the
default build (whose full module takes ~100 s to compile on a fresh machine).

    python scripts/bench_mmvq_tc_variants.py "MMVQT_STAGES=3;MMVQT_MIN_BLOCKS=3,BPS=3"
"""
import functools
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import time_graph, warm_gpu  # noqa: E402

NS = tuple(int(n) for n in os.environ.get("TC_NS", "1,2,3,4,8").split(","))


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
        return f"{np.median(v) / 1e3:.2f}/{np.max(v) / 1e3:.2f}" if len(v) else "-"   # (DIAG=16: no last block)
    return (f"entry {us(tr[:, 0] - t0)}, prologue {us((tr[:, 2] - tr[:, 1]) / ghz)}, loop "
            f"{us((tr[:, 3] - tr[:, 2]) / ghz)}, sums to count {us((tr[:, 4] - tr[:, 3]) / ghz)}, last blocks' "
            f"reduction {us((tr[last, 5] - tr[last, 4]) / ghz)}, exit {us(tr[:, 6] - t0)}, last exit "
            f"{us(tr[last, 6] - t0)} (us median/max; {ghz:.2f} GHz; {int(last.sum())} last blocks)")


def offset_empty(shape, dtype, offset: int):
    """An uninitialized C-contiguous array starting `offset` bytes (a multiple of 16) into a fresh allocation (0: a
    plain cp.empty, as the runs of the fifteenth session had)."""
    import cupy as cp
    assert offset % 16 == 0, "XOFF / YOFF: a multiple of 16 bytes"
    if not offset:
        return cp.empty(shape, dtype)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return cp.empty(nbytes + offset, cp.uint8)[offset:].view(dtype).reshape(shape)


def time_rounds(prepared, ws, m, k, rounds):
    """ROUNDS=R: every variant timed in turn, R rounds (10 graph replays each), so that drifts of the GPU's state fall
    on all alike; per variant the median over rounds and the median of its difference to the first variant."""
    times = np.zeros((len(prepared), len(NS), rounds))        # [variant, n, round] us
    warm_gpu(0.5)
    for r in range(rounds):
        for j, n in enumerate(NS):
            for i, (v, mod, calls, quant, trace, hot) in enumerate(prepared):
                times[i, j, r] = time_graph(calls[n][0], ws[:1] if hot else ws, 10)
    for i, (v, mod, calls, *_) in enumerate(prepared):
        cells = [f"{np.median(times[i, j]):.2f}" + ("" if calls[n][1] else " (differs)") + (
            f" ({np.median(times[i, j] - times[0, j]):+.2f})" if i else "") for j, n in enumerate(NS)]
        print(f"| {m} x {k} | {v or 'default'} | " + " | ".join(cells) + " |", flush=True)


def main():
    import cupy as cp

    from engine.cuda import launch
    from engine.cuda.build import NVRTC_OPTIONS, expanded_source
    from engine.cuda.weights import upload
    from engine.quants import GGMLType, random_blocks
    os.environ["ENGINE_MMVQ_TC"] = "all"
    variants = sys.argv[1].split(";") if len(sys.argv) > 1 else [""]
    rng = np.random.default_rng()
    blocks_per_sm, default_warps, default_wide = launch.MMVQT_BLOCKS_PER_SM, launch.MMVQT_WARPS, launch.MMVQT_WIDE_FROM
    rounds = int(os.environ.get("ROUNDS", "0"))
    share = os.environ.get("OWN_BUFFERS") != "1"
    t = GGMLType.Q4_K
    print("| m x k | variant | " + " | ".join(f"n={n}" for n in NS) + " |")
    print("| --- " * (len(NS) + 2) + "|")
    for m, k in ((4096, 14336), (14336, 4096))[:int(os.environ.get("TC_SHAPES", "2"))]:
        blocks = random_blocks(t, m * k // 256, rng)
        ws = [upload(t, (m, k), blocks) for _ in range(max(2, int(np.ceil(200e6 / (m * k * 0.5625)))))]
        # per variant: (label, module, {n: (call, same, requantize, grid)}, quant, trace, hot)
        prepared = []
        buffers = {}                       # (n, xoff, yoff): activations, their q8_1 (qs, ds), the output
        for v in variants:
            defines = dict(d.split("=") for d in v.split(",") if d)
            bps = int(defines.pop("BPS", blocks_per_sm))
            splits = defines.pop("SPLITS", None)               # not a -D either: the k ranges asked for
            quant = defines.pop("QUANT", None)                 # nor this: quantize_q8_1 before each launch
            trace = defines.pop("TRACE", None)                 # nor this: -DMMVQT_TRACE, phases printed
            src = defines.pop("SRC", "mmvq")                   # nor this: another copy of the family's file
            hot = defines.pop("HOT", None)                     # nor this: one weight copy, hot in L2
            xoff = int(defines.pop("XOFF", 0))                 # nor these: the buffers' offsets
            yoff = int(defines.pop("YOFF", 0))
            mod = cp.RawModule(code=expanded_source(src), name_expressions=[f"mmvq_tc_q4_K<{n}, 0>" for n in NS],
                               options=NVRTC_OPTIONS + tuple(f"-D{a}={b}" for a, b in defines.items()) + (
                                   "-DMMVQ_SKIP_MMA", "-DMMVQ_ONLY_TYPE=12") + (("-DMMVQT_TRACE",) if trace else ()))
            stages = int(defines.get("MMVQT_STAGES", launch.MMVQT_STAGES))
            warps = int(defines.get("MMVQT_WARPS", launch.MMVQT_WARPS))     # -Ds the launch rule follows too
            wide = int(defines.get("MMVQT_WIDE_FROM", launch.MMVQT_WIDE_FROM))
            calls = {}
            for n in NS:
                key = (n, xoff, yoff)
                if key not in buffers or not share:
                    x = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
                    q8 = (offset_empty((n, k), cp.int8, xoff), offset_empty((n, k // 8), cp.float32, xoff))
                    buffers[key] = (x, *launch.quantize_q8_1(x, out=q8), offset_empty((n, m), cp.float32, yoff))
                x, qs, ds, out = buffers[key]
                fn = mod.get_function(f"mmvq_tc_q4_K<{n}, 0>")
                plans = {}
                launch.MMVQT_BLOCKS_PER_SM, launch.MMVQT_WARPS, launch.MMVQT_WIDE_FROM = bps, warps, wide
                if splits:                                     # (set per n: before the sixteenth session's fix
                    os.environ["ENGINE_MMVQ_TC_SPLITS"] = splits   # it held for the first n only)
                else:
                    os.environ.pop("ENGINE_MMVQ_TC_SPLITS", None)
                for wi in ws:
                    (_, grid, block, args), = launch.mmvq_launches([wi], qs, ds, n, [out])
                    smem = launch.mmvqt_smem_bytes(k, n, grid[1], stages)
                    plans[id(wi)] = (functools.partial(launch._with_smem(fn, smem), shared_mem=smem), grid, block,
                                     args)

                def requantize(wi=None, x=x, q8=(qs, ds)):
                    launch.quantize_q8_1(x, out=q8)

                def call(wi, plans=plans, requantize=requantize, quant=quant):
                    f, grid, block, args = plans[id(wi)]
                    if quant:
                        requantize()
                    f(grid, block, args)
                launch.MMVQT_BLOCKS_PER_SM, launch.MMVQT_WARPS, launch.MMVQT_WIDE_FROM = \
                    blocks_per_sm, default_warps, default_wide
                os.environ.pop("ENGINE_MMVQ_TC_SPLITS", None)
                call(ws[0])
                same = os.environ.get("CHECK") == "0" or np.allclose(out.get(), launch.mmvq(ws[0], qs, ds, n).get(),
                                                                      rtol=1e-4, atol=1e-3)
                calls[n] = (call, same, requantize, plans[id(ws[0])][1])
            prepared.append((v, mod, calls, quant, trace, hot))
        if rounds:
            time_rounds(prepared, ws, m, k, rounds)
        for v, mod, calls, quant, trace, hot in ([] if rounds else prepared):
            warm_gpu(0.5)
            cells, phases = [], []
            for n in NS:
                call, same, requantize, grid = calls[n]
                cells.append(f"{time_graph(call, ws[:1] if hot else ws, 30):.1f}" + ("" if same else " (differs)"))
                if trace:
                    tr = read_trace(mod, grid)
                    phases.append(f"n={n}: " + trace_phases(tr))
                    if os.environ.get("TRACE_DUMP"):               # the raw stamps, for a closer look
                        np.save(Path(os.environ["TRACE_DUMP"]) / f"trace-{v.replace(',', '_').replace('=', '')}"
                                f"-{m}x{k}-n{n}.npy", tr)
                if quant:
                    cells[-1] += f" (q {time_graph(requantize, ws, 30):.1f})"
            print(f"| {m} x {k} | {v or 'default'} | " + " | ".join(cells) + " |", flush=True)
            for line in phases:
                print(f"    {m} x {k} {line}")
        del ws
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
