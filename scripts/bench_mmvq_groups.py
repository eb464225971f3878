#!/usr/bin/env python3
"""MMVQ time per thread-group split (groups = 1, 2, 4 rows per 128-thread block) at the matrix shapes of the
benchmark models, for the kernels of kernels/mmvq.cu (mmvq; mmvq_pieces, mmvq_mma_q4_K and mmvq_tc_q4_K for their
types; for mmvq_tc the "groups" are its k ranges, launch.mmvqt_splits): the data behind launch.py's _mmvq_groups /
_mmvqp_groups / mmvqt_splits rules and the kernel choice.

    python scripts/bench_mmvq_groups.py [--reps 30] [--types q4_K,q6_K,q4_1]
        [--kernels mmvq,mmvq_pieces,mmvq_mma,mmvq_tc]

Kernel time: a CUDA graph of 20 launches on preallocated buffers (no host cost between them, which the small
matrices would otherwise measure), weights rotated over copies that together exceed the L2; medians of reps / 20.
Each row: type, m x k, kernel, then per n the fastest split and its time, with the rule's split and its time where
the rule picks another.
"""
import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import TYPE_NAMES, time_graph  # noqa: E402

from engine.quants import TYPES, random_blocks  # noqa: E402

# (type, m, k): synthetic 8B (q, o / k, v / gate, up / down), synthetic 1B, SmolLM2 (Q4_1)
SHAPES = [("q4_K", 4096, 4096), ("q4_K", 1024, 4096), ("q4_K", 14336, 4096), ("q4_K", 4096, 14336),
          ("q6_K", 4096, 14336), ("q6_K", 1024, 4096),
          ("q4_K", 2048, 2048), ("q4_K", 512, 2048), ("q4_K", 8192, 2048), ("q4_K", 2048, 8192),
          ("q4_1", 576, 576), ("q4_1", 1536, 576), ("q4_1", 576, 1536)]


def main():
    import cupy as cp

    from engine.cuda import launch
    from engine.cuda.build import kernel
    from engine.cuda.weights import upload
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--types", default="q4_K,q6_K,q4_1")
    ap.add_argument("--kernels", default="mmvq,mmvq_pieces,mmvq_mma,mmvq_tc")
    args = ap.parse_args()
    rng = np.random.default_rng()
    print("| type | m x k | kernel | " + " | ".join(f"n={n}" for n in range(1, 9)) + " |")
    print("| --- " * 11 + "|")
    for tname, m, k in SHAPES:
        if tname not in args.types.split(","):
            continue
        t = TYPE_NAMES[tname]
        blocks = random_blocks(t, m * k // TYPES[t].block_size, rng)
        w0 = upload(t, (m, k), blocks)
        ws = [w0] + [upload(t, (m, k), blocks) for _ in range(max(1, int(np.ceil(200e6 / w0.nbytes)) - 1))]
        # (kernel, its name at n columns, rows per group, the launch rule's groups, threads, splits to time)
        kinds = [("mmvq", lambda n: f"mmvq<{int(t)}, {n}, 0>", launch.mmvq_rows, launch._mmvq_groups,
                  launch.MMVQ_THREADS, (1, 2, 4))]
        if int(t) in launch.PIECE_TYPES:
            kinds.append(("mmvq_pieces", lambda n: f"mmvq_pieces<{int(t)}, {n}, 0>", launch.mmvqp_rows,
                          launch._mmvqp_groups, launch.MMVQ_THREADS, (1, 2, 4)))
        if int(t) in launch.MMA_TYPES:
            kinds.append(("mmvq_mma", lambda n: f"mmvq_mma_q4_K<{n}, 0>", lambda n: 16, launch._one_group,
                          32 * launch.MMVQM_WARPS, (1,)))
        if int(t) in launch.TC_TYPES:            # "groups" here: k ranges (launch.mmvqt_splits, which also takes n),
            kinds.append(("mmvq_tc", None, None, None, None, (1, 2, 4, 8)))   # launched as dispatched
        for kname, name_of, rows_of, rule, threads, splits in kinds:
            if kname not in args.kernels.split(","):
                continue
            cells = []
            for n in range(1, 9):
                qs, ds = launch.quantize_q8_1(cp.asarray(rng.standard_normal((n, k)).astype(np.float32)))
                out = cp.empty((n, m), cp.float32)
                times = {}
                chosen = rule(int(t), m, k) if rule else launch.mmvqt_splits(-(-m // launch.mmvqt_rows(0, n)), k, n)
                for groups in sorted(set(splits) | {chosen}):
                    if name_of is None:              # mmvq_tc: its launches with the k ranges forced
                        os.environ["ENGINE_MMVQ_TC"], os.environ["ENGINE_MMVQ_TC_SPLITS"] = "all", str(groups)
                        plans = {id(wi): launch.mmvq_launches([wi], qs, ds, n, [out]) for wi in ws}
                        del os.environ["ENGINE_MMVQ_TC"], os.environ["ENGINE_MMVQ_TC_SPLITS"]

                        def call(wi, plans=plans):
                            for fn, grid, block, fargs in plans[id(wi)]:
                                fn(grid, block, fargs)
                    else:
                        fn = kernel("mmvq", name_of(n))
                        grid = ((m + groups * rows_of(n) - 1) // (groups * rows_of(n)),)

                        def call(wi, fn=fn, grid=grid, out=out, qs=qs, ds=ds, groups=groups):
                            fn(grid, (threads,), launch.mmvq_args([wi], qs, ds, [out], groups))
                    times[groups] = time_graph(call, ws, args.reps)
                best = min(times, key=times.get)
                cell = f"{times[best]:.1f} ({best})"
                if chosen != best:
                    cell += f" rule {chosen}: {times[chosen]:.1f}"
                cells.append(cell)
            print(f"| {tname} | {m} x {k} | {kname} | " + " | ".join(cells) + " |", flush=True)
        del ws, w0
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
