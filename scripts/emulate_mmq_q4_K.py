#!/usr/bin/env python3
"""CPU emulation of kernels/mmq.cu mmq_q4_K: its stage loads, the PTX m16n8k32 fragment layout of its operands, the
rescale and the write-back, in numpy on a 130 x 512 Q4_K matrix and 70 columns, against dequantized weights x q8_1
activations. A desk check of the index math before a GPU run (it printed nmse 6e-15), not a test of the CUDA code.

    python scripts/emulate_mmq_q4_K.py
"""
import sys
from pathlib import Path

import numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.quants import GGMLType, random_blocks, dequantize

BM, BN, A_LD, B_LD, BD_LD = 128, 64, 160, 288, 18
rng = np.random.default_rng(1)
m, n, k = 130, 70, 512
t = GGMLType.Q4_K
blocks = random_blocks(t, m * k // 256, rng)            # [m*k/256, 144] uint8
W = dequantize(blocks, t, (m, k)).astype(np.float64)
raw = blocks.reshape(m, k // 256 * 144)
x = rng.standard_normal((n, k)).astype(np.float32)
# q8_1 (as quantize_q8_1): per 32: d = amax/127, q = round(x/d); ds per 16: (d, d*sum16)
n_pad = (n + 63) // 64 * 64
b32 = x.reshape(n, k // 32, 32)
d = (np.abs(b32).max(2, keepdims=True) / np.float32(127)).astype(np.float32)
v = np.where(d == 0, 0, b32 / np.where(d == 0, 1, d))
q = np.where(v >= 0, np.floor(v + 0.5), np.ceil(v - 0.5)).astype(np.int8)
qs = np.zeros((n_pad, k), np.int8); qs[:n] = q.reshape(n, k)
ds = np.zeros((n_pad, k // 16, 2), np.float32)
dd = np.repeat(d[:, :, 0], 2, axis=1)
ds[:n, :, 0] = dd
ds[:n, :, 1] = dd * q.reshape(n, k // 16, 16).astype(np.int32).sum(2)
xq = (q.astype(np.float64) * d.astype(np.float64)).reshape(n, k)
ref = xq @ W.T                                           # [n, m]

def f16(u16):
    return float(np.array([u16], np.uint16).view(np.float16)[0])

def k4_chunk_scale(hd, j):
    sc12 = hd[4:16]
    if j < 4:
        s, mn = sc12[j] & 63, sc12[j + 4] & 63
    else:
        s = (sc12[j + 4] & 0xF) | ((sc12[j - 4] >> 6) << 4)
        mn = (sc12[j + 4] >> 4) | ((sc12[j] >> 6) << 4)
    dd_ = f16(int(hd[0]) | int(hd[1]) << 8)
    dm = f16(int(hd[2]) | int(hd[3]) << 8)
    return np.float32(dd_ * s), np.float32(dm * mn)

def u32(b8):       # 4 bytes -> uint32 little endian
    return int(b8[0]) | int(b8[1]) << 8 | int(b8[2]) << 16 | int(b8[3]) << 24

def bytes_of(w):   # uint32 -> 4 int8
    return np.array([(w >> (8 * e)) & 0xFF for e in range(4)], np.uint8).view(np.int8)

y = np.full((n, m), np.nan)
stages = k // 256
for bx in range((m + BM - 1) // BM):
    for by in range(n_pad // BN):
        row0, col0 = bx * BM, by * BN
        acc = np.zeros((8, 32, 2, 4, 4), np.float32)      # [warp][lane][i][j][l]
        for st in range(stages):
            # mmq_q4_K_load_stage
            A = np.zeros((BM, A_LD), np.uint8)
            for idx in range(BM * 9):
                r, piece = idx // 9, idx % 9
                if row0 + r < m:
                    A[r, piece * 16:piece * 16 + 16] = raw[row0 + r, st * 144 + piece * 16: st * 144 + piece * 16 + 16]
            B = np.zeros((BN, B_LD), np.int8)
            for idx in range(BN * 16):
                cl, piece = idx // 16, idx % 16
                B[cl, piece * 16:piece * 16 + 16] = qs[col0 + cl, st * 256 + piece * 16: st * 256 + piece * 16 + 16]
            BD = np.zeros((BN, BD_LD, 2), np.float32)
            for idx in range(BN * 8):
                cl, piece = idx // 8, idx % 8
                BD[cl, piece * 2:piece * 2 + 2] = ds[col0 + cl, st * 16 + piece * 2: st * 16 + piece * 2 + 2]
            for warp in range(8):
                wm, wn = (warp >> 1) * 32, (warp & 1) * 32
                for p in range(4):
                    for cc in range(2):
                        c = 2 * p + cc
                        # per lane fragments
                        afr = np.zeros((2, 32, 4), np.int64); dw = np.zeros((2, 32, 2)); mw = np.zeros((2, 32, 2))
                        for lane in range(32):
                            g, tt = lane >> 2, lane & 3
                            for i in range(2):
                                wq = []
                                for h in range(2):
                                    row = wm + 16 * i + g + 8 * h
                                    off = 16 + 32 * p + 8 * tt
                                    wq.append((u32(A[row, off:off + 4]), u32(A[row, off + 4:off + 8])))
                                    dw[i, lane, h], mw[i, lane, h] = k4_chunk_scale(A[row, 0:16], c)
                                lo = lambda w_: (w_ >> (4 * cc)) & 0x0F0F0F0F
                                afr[i, lane] = [lo(wq[0][0]), lo(wq[1][0]), lo(wq[0][1]), lo(wq[1][1])]
                        for j in range(4):
                            bfr = np.zeros((32, 2), np.int64); dx = np.zeros((32, 2)); sx = np.zeros((32, 2))
                            for lane in range(32):
                                g, tt = lane >> 2, lane & 3
                                xb = B[wn + 8 * j + g, 32 * c + 8 * tt: 32 * c + 8 * tt + 8].view(np.uint8)
                                bfr[lane] = [u32(xb[0:4]), u32(xb[4:8])]
                                for qq in range(2):
                                    vv = BD[wn + 8 * j + 2 * tt + qq, 2 * c: 2 * c + 2].reshape(4)
                                    dx[lane, qq], sx[lane, qq] = vv[0], vv[1] + vv[3]
                            # B matrix 32 x 8 (k x col) from fragments (PTX m16n8k32 .col B layout)
                            Bm = np.zeros((32, 8), np.int64)
                            for lane in range(32):
                                g, tt = lane >> 2, lane & 3
                                Bm[4 * tt:4 * tt + 4, g] = bytes_of(bfr[lane, 0])
                                Bm[16 + 4 * tt:16 + 4 * tt + 4, g] = bytes_of(bfr[lane, 1])
                            for i in range(2):
                                Am = np.zeros((16, 32), np.int64)
                                for lane in range(32):
                                    g, tt = lane >> 2, lane & 3
                                    Am[g, 4 * tt:4 * tt + 4] = bytes_of(afr[i, lane, 0])
                                    Am[g + 8, 4 * tt:4 * tt + 4] = bytes_of(afr[i, lane, 1])
                                    Am[g, 16 + 4 * tt:16 + 4 * tt + 4] = bytes_of(afr[i, lane, 2])
                                    Am[g + 8, 16 + 4 * tt:16 + 4 * tt + 4] = bytes_of(afr[i, lane, 3])
                                C = Am @ Bm
                                for lane in range(32):
                                    g, tt = lane >> 2, lane & 3
                                    for l in range(4):
                                        h, qq = l >> 1, l & 1
                                        cv = C[g + 8 * h, 2 * tt + qq]
                                        acc[warp, lane, i, j, l] += np.float32(dw[i, lane, h] * dx[lane, qq] * cv
                                                                               - mw[i, lane, h] * sx[lane, qq])
        # mmq_store_tile
        for warp in range(8):
            wm, wn = (warp >> 1) * 32, (warp & 1) * 32
            for lane in range(32):
                g, tt = lane >> 2, lane & 3
                for i in range(2):
                    for j in range(4):
                        for l in range(4):
                            r = row0 + wm + i * 16 + g + (l >> 1) * 8
                            cl = col0 + wn + j * 8 + tt * 2 + (l & 1)
                            if r < m and cl < n:
                                y[cl, r] = acc[warp, lane, i, j, l]
print("finite:", np.isfinite(y).all(), "nmse:", float(np.sum((y - ref) ** 2) / np.sum(ref ** 2)))
