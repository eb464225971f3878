#!/usr/bin/env python3
"""Per-kernel GPU time of one decode step, read by Nsight Compute (ncu must be on the PATH; GPU machine).

    python scripts/ncu_decode.py MODEL [B]

B: sequences per decode step (1; each first prefilled with 64 tokens).

Runs two eager decode steps (graphs off; the first compiles and loads) under
`ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum` and prints the time per kernel
name of the second step, largest first, with the step's total.
"""
import csv
import io
import os
import subprocess
import sys
from collections import defaultdict

if len(sys.argv) == 4 and sys.argv[1] == "--step":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from engine.runtime import Runtime
    n = int(sys.argv[3])
    rt = Runtime.load(sys.argv[2], device="cuda", n_ctx=512, n_seq=n)
    for seq in range(n):
        rt.prefill(list(range(100 + seq, 164 + seq)), seq=seq)
    rt.backend.synchronize()
    import cupy
    cupy.cuda.profiler.start()                           # ncu --profile-from-start off: the two steps alone
    rt.decode(list(range(n)), [200] * n, [64] * n)
    rt.decode(list(range(n)), [201] * n, [65] * n)
    rt.backend.synchronize()
    cupy.cuda.profiler.stop()
    sys.exit(0)

env = dict(os.environ, ENGINE_CUDA_GRAPHS="0")
cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw", "--metrics",
       "gpu__time_duration.sum", sys.executable, __file__, "--step", sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "1"]
r = subprocess.run(cmd, capture_output=True, text=True, env=env)
lines = [ln for ln in r.stdout.splitlines() if ln.startswith('"')]
if not lines:
    print("ncu gave no rows:", r.stdout[-2000:], r.stderr[-2000:])
    sys.exit(1)
rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
rows = [row for row in rows if row.get("ID", "").isdigit()]
key = next(k for k in rows[0] if "gpu__time_duration" in k)
# the last two decode steps launch the same kernels: take the last half of the final 2*s launches
names = [row["Kernel Name"] for row in rows]
times = [float(row[key].replace(",", "")) for row in rows]
step = None
for s in range(len(names) // 2, 0, -1):
    if names[-s:] == names[-2 * s:-s]:
        step = s
        break
if step is None:
    print("could not find two equal decode steps")
    sys.exit(1)
totals, counts = defaultdict(float), defaultdict(int)
for nm, t in zip(names[-step:], times[-step:]):
    short = nm.split("(")[0][:60]
    totals[short] += t
    counts[short] += 1
total = sum(totals.values())
print(f"{sys.argv[1]}: one decode step of {cmd[-1]} sequences = {step} kernels, {total / 1000:.1f} us of kernel time (from ncu)")
for nm in sorted(totals, key=totals.get, reverse=True):
    print(f"  {nm:<62} {counts[nm]:>4} x {totals[nm] / counts[nm] / 1000:7.2f} us = {totals[nm] / 1000:8.1f} us "
          f"{100 * totals[nm] / total:5.1f} %")
