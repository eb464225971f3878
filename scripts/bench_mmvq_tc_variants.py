#!/usr/bin/env python3
"""mmvq_tc_q4_K (kernels/mmvq.cu) compiled with other settings (-D, e.g. MMVQT_STAGES=2 or MMVQT_MIN_BLOCKS=3) and
timed as CUDA graphs at 4096 x 14336 and 14336 x 4096, n = 1, 2, 3, 4, 8, with the dispatched launch's grid and
arguments; each variant's output is checked against the default build's ("differs" where it is not). BPS=N in a
variant is not a -D: its k ranges are chosen for N blocks per SM (launch.MMVQT_BLOCKS_PER_SM) in place of the rule's.

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


def main():
    import cupy as cp

    from engine.cuda import launch
    from engine.cuda.build import NVRTC_OPTIONS, expanded_source
    from engine.cuda.weights import upload
    from engine.quants import GGMLType, random_blocks
    os.environ["ENGINE_MMVQ_TC"] = "all"
    variants = sys.argv[1].split(";") if len(sys.argv) > 1 else [""]
    rng = np.random.default_rng()
    blocks_per_sm = launch.MMVQT_BLOCKS_PER_SM
    t = GGMLType.Q4_K
    print("| m x k | variant | " + " | ".join(f"n={n}" for n in NS) + " |")
    print("| --- " * (len(NS) + 2) + "|")
    for m, k in ((4096, 14336), (14336, 4096)):
        blocks = random_blocks(t, m * k // 256, rng)
        ws = [upload(t, (m, k), blocks) for _ in range(max(2, int(np.ceil(200e6 / (m * k * 0.5625)))))]
        for v in variants:
            defines = dict(d.split("=") for d in v.split(",") if d)
            bps = int(defines.pop("BPS", blocks_per_sm))
            splits = defines.pop("SPLITS", None)               # not a -D either: the k ranges asked for
            if splits:
                os.environ["ENGINE_MMVQ_TC_SPLITS"] = splits
            else:
                os.environ.pop("ENGINE_MMVQ_TC_SPLITS", None)
            mod = cp.RawModule(code=expanded_source("mmvq"), name_expressions=[f"mmvq_tc_q4_K<{n}, 0>" for n in NS],
                               options=NVRTC_OPTIONS + tuple(f"-D{a}={b}" for a, b in defines.items()) + (
                                   "-DMMVQ_SKIP_MMA", "-DMMVQ_ONLY_TYPE=12"))
            stages = int(defines.get("MMVQT_STAGES", launch.MMVQT_STAGES))
            warm_gpu(0.5)
            cells = []
            for n in NS:
                qs, ds = launch.quantize_q8_1(cp.asarray(rng.standard_normal((n, k)).astype(np.float32)))
                out = cp.empty((n, m), cp.float32)
                fn = mod.get_function(f"mmvq_tc_q4_K<{n}, 0>")
                plans = {}
                launch.MMVQT_BLOCKS_PER_SM = bps
                for wi in ws:
                    (_, grid, block, args), = launch.mmvq_launches([wi], qs, ds, n, [out])
                    smem = launch.mmvqt_smem_bytes(k, n, grid[1], stages)
                    plans[id(wi)] = (functools.partial(launch._with_smem(fn, smem), shared_mem=smem), grid, block,
                                     args)

                def call(wi, plans=plans):
                    f, grid, block, args = plans[id(wi)]
                    f(grid, block, args)
                launch.MMVQT_BLOCKS_PER_SM = blocks_per_sm
                os.environ.pop("ENGINE_MMVQ_TC_SPLITS", None)
                ref = launch.mmvq(ws[0], qs, ds, n).get()
                call(ws[0])
                same = np.allclose(out.get(), ref, rtol=1e-4, atol=1e-3)
                cells.append(f"{time_graph(call, ws, 30):.1f}" + ("" if same else " (differs)"))
            print(f"| {m} x {k} | {v or 'default'} | " + " | ".join(cells) + " |", flush=True)
        del ws
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
