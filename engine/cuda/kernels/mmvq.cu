// MMVQ: y = x W^T for few activation columns, quantized W read once for all columns. The kernels:
//   mmvq<T, NCOLS, GLU>      every type, 1..8 columns per launch (more: launches of 8, each reading W again);
//   mmvq_q4_K_pairs / mmvq_pieces / mmvq_tc_q4_K: Q4_K's, mmvq_q6_K: Q6_K's at one column, below, each with its
//   measured reason beside it.
//   w  : [m, k] in T's blocks (row stride row_bytes)
//   qs : [ncols, k] int8 and ds : [ncols, k/16] float2, from quantize_q8_1
//   rs : [ncols, k] int8, the residual plane of qs (common.cuh warp_store_q8_1), read by the EXACT instances of mmvq
//        and mmvq_q4_K_pairs (16-bit activations: the one-column decode step, mmvq.takes_residual); else null
//   y  : [ncols, m] f32
// Kernel choice: engine/cuda/mmvq.py (should_use_mmvq, mmvq_choice). Launch rule of mmvq (mmvq.mmvq_launches):
// block of MMVQ_THREADS threads in groups of MMVQ_THREADS/groups threads (groups = 1, 2 or 4: mmvq._mmvq_groups,
// by k and for the 4-bit types by the launch's rows); each group serves mmvq_rows(NCOLS) consecutive rows (1 for one
// column, where more blocks in flight matter most; 2 above, where reusing the activations matters), each thread
// takes every (MMVQ_THREADS/groups)-th chunk of those rows, loads the chunk's activations of all NCOLS columns once
// and dots them with each row's weight chunk; grid ceil(m / (groups * mmvq_rows(NCOLS))). Registers are capped at
// 128 per thread (MMVQ_MIN_BLOCKS blocks per SM): at 6-8 columns 9-19 % faster than the 168 registers left to
// themselves (BENCHMARKS.md). At 2..8 columns a thread prefetches the weight lines of its next chunk into L1
// (MMVQ_PREFETCH_N; on the H200 up to 12 % faster there, q6_K at 8 columns equal; slower at one).
//
// One launch serves up to three matrices of the same type and k multiplied by the same activations (q, k and v):
// w0..w2 with m0..m2 rows (m = 0: absent) into y0..y2; the grid is the sum of the three grids, in order.
// GLU (1 = silu, 2 = gelu-tanh) instead computes y0 = act(x w0^T) * (x w1^T) (the gate and up matrices of a gated
// FFN, m0 = m1 rows): each group serves one output row, dotting the gate row and the up row; grid
// ceil(m0 / groups).
#include "common.cuh"

#define MMVQ_THREADS 128
// Rows per group at one column and above (the launch rules read these values: build.constants), blocks per SM the
// registers must allow (<= 128 registers each), chunk iterations ahead whose weight lines a thread prefetches into
// L1 at one column and at 2..8 columns (0: none).
#define MMVQ_ROWS_1 1
#define MMVQ_ROWS_N 2
#define MMVQ_MIN_BLOCKS 4
#define MMVQ_PREFETCH_1 0
#define MMVQ_PREFETCH_N 1
__host__ __device__ constexpr int mmvq_rows(int ncols) { return ncols == 1 ? MMVQ_ROWS_1 : MMVQ_ROWS_N; }

// The parameters every MMVQ kernel takes (mmvq.mmvq_args builds them).
#define MMVQ_PARAMS const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2, \
    const signed char* __restrict__ qs, const float2* __restrict__ ds, const signed char* __restrict__ rs, \
    float* __restrict__ y0, float* __restrict__ y1, \
    float* __restrict__ y2, int m0, int m1, int m2, int k, long long row_bytes, int groups

__device__ __forceinline__ float glu_act(int glu, float g) {
    return glu == 1 ? g / (1.0f + expf(-g))
                    : 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// Which of the launch's matrices block b serves (blocks of per_block output rows, matrix 0's first): moves b, w, y,
// m to that matrix.
__device__ __forceinline__ void select_matrix(int per_block, const u8* w1, const u8* w2, float* y1, float* y2, int m0,
                                              int m1, int m2, int& b, const u8*& w, float*& y, int& m) {
    const int nb0 = (m0 + per_block - 1) / per_block, nb1 = (m1 + per_block - 1) / per_block;
    if (b >= nb0) {
        b -= nb0; w = w1; y = y1; m = m1;
        if (b >= nb1) { b -= nb1; w = w2; y = y2; m = m2; }
    }
}

// Where a thread of a 128-thread MMVQ block in groups of 128/groups threads works: its lane in its group, the matrix
// its block serves (w, y with m rows; GLU: w0, y0) and the block's index b in it, and its group's first output row.
struct MmvqGroup {
    int lane, b, m, row0;
    const u8* w;
    float* y;
};
template <int OUT_ROWS, int GLU>
__device__ __forceinline__ MmvqGroup mmvq_group(const u8* w0, const u8* w1, const u8* w2, float* y0, float* y1,
                                                float* y2, int m0, int m1, int m2, int groups) {
    const int tpg = MMVQ_THREADS / groups;                        // threads per group
    const int group = threadIdx.x / tpg, lane = threadIdx.x % tpg;
    int b = blockIdx.x, m = m0;
    const u8* w = w0;
    float* y = y0;
    if (!GLU) select_matrix(groups * OUT_ROWS, w1, w2, y1, y2, m0, m1, m2, b, w, y, m);
    return {lane, b, m, (b * groups + group) * OUT_ROWS, w, y};
}

// The weight rows a group dots: its OUT_ROWS rows from row0 of w, or with GLU those of the gate (w0) then of the up
// matrix (w1); rows past m read row m - 1 (their sums are not written).
template <int NR, int OUT_ROWS, int GLU>
__device__ __forceinline__ void mmvq_row_ptrs(const u8* (&wr)[NR], const u8* w, const u8* w0, const u8* w1, int row0,
                                              int m, long long row_bytes) {
#pragma unroll
    for (int r = 0; r < NR; ++r)
        wr[r] = (GLU ? (r < OUT_ROWS ? w0 : w1) : w) + (long long)min(row0 + r % OUT_ROWS, m - 1) * row_bytes;
}

// Sum each group's per-thread sums acc[NR][NCOLS] over its threads (warp shuffles, then the group's warps through
// partial) and write y[j][row] for the group's OUT_ROWS rows from row (b * groups + group) * OUT_ROWS; with GLU,
// rows OUT_ROWS.. of acc are the up rows: y = act(gate) * up.
template <int NR, int OUT_ROWS, int NCOLS, int GLU>
__device__ __forceinline__ void reduce_store(const float (&acc)[NR][NCOLS],
                                             float (&partial)[NR][NCOLS][MMVQ_THREADS / 32], int groups, int b, int m,
                                             float* __restrict__ y) {
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) {
            const float a = warp_sum(acc[r][j]);
            if ((threadIdx.x & 31) == 0) partial[r][j][warp] = a;
        }
    __syncthreads();
    const int wpg = MMVQ_THREADS / groups / 32;                   // warps per group
    for (int idx = threadIdx.x; idx < groups * OUT_ROWS * NCOLS; idx += MMVQ_THREADS) {
        const int gi = idx / (OUT_ROWS * NCOLS), r = (idx / NCOLS) % OUT_ROWS, j = idx % NCOLS;
        const int out_row = (b * groups + gi) * OUT_ROWS + r;
        float a = 0.f;
        for (int q = 0; q < wpg; ++q) a += partial[r][j][gi * wpg + q];
        if (GLU) {
            float u = 0.f;
            for (int q = 0; q < wpg; ++q) u += partial[OUT_ROWS + r][j][gi * wpg + q];
            a = glu_act(GLU, a) * u;
        }
        if (out_row < m) y[(long long)j * m + out_row] = a;
    }
}

// The q8_1 activations of chunk c for NCOLS columns: its 32 int8 values in a0, a1 (the values of the residual plane
// rs in r0, r1 when EXACT) and (d, d * sum of the first 16, d, d * sum of the last 16) in sa.
template <int NCOLS, int EXACT>
__device__ __forceinline__ void load_chunk_activations(const signed char* __restrict__ qs, const float2* __restrict__ ds,
                                                       const signed char* __restrict__ rs, int k, int c,
                                                       int4 (&a0)[NCOLS], int4 (&a1)[NCOLS], int4 (&r0)[NCOLS],
                                                       int4 (&r1)[NCOLS], float4 (&sa)[NCOLS]) {
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) {
        const int4* a = (const int4*)(qs + (long long)j * k + c * 32);
        a0[j] = a[0];
        a1[j] = a[1];
        if constexpr (EXACT) {
            const int4* r = (const int4*)(rs + (long long)j * k + c * 32);
            r0[j] = r[0];
            r1[j] = r[1];
        }
        sa[j] = *(const float4*)(ds + (long long)j * (k / 16) + c * 2);
    }
}

// The dot product of four words of int8 weights with four of int8 activations (four per word), from c; of eight
__device__ __forceinline__ int dp4a4(const int* v, const int4& a, int c = 0) {
    c = dp4a(v[0], a.x, c); c = dp4a(v[1], a.y, c); c = dp4a(v[2], a.z, c); return dp4a(v[3], a.w, c);
}
__device__ __forceinline__ int dp4a8(const int* v, const int4& a0, const int4& a1) {
    return dp4a4(v + 4, a1, dp4a4(v, a0));
}

// acc[j] += (weight chunk v, s) . (activation chunk j) for each column j (EXACT: activations q + r / Q8_RESIDUAL).
template <int T, int NCOLS, int EXACT>
__device__ __forceinline__ void dot_chunk(const int (&v)[8], const ChunkScale& s, const int4 (&a0)[NCOLS],
                                          const int4 (&a1)[NCOLS], const int4 (&r0)[NCOLS], const int4 (&r1)[NCOLS],
                                          const float4 (&sa)[NCOLS], float (&acc)[NCOLS]) {
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) {
        const int d0 = dp4a4(v, a0[j]), d1 = dp4a4(v + 4, a1[j]);
        if constexpr (EXACT) {
            const float f0 = fmaf((float)dp4a4(v, r0[j]), 1.f / Q8_RESIDUAL, (float)d0);
            const float f1 = fmaf((float)dp4a4(v + 4, r1[j]), 1.f / Q8_RESIDUAL, (float)d1);
            if constexpr (TypeTraits<T>::per16)
                acc[j] += sa[j].x * (s.d[0] * f0 + s.d[1] * f1);
            else
                acc[j] += sa[j].x * s.d[0] * (f0 + f1);
        } else if constexpr (T == T_Q2_K) {     // every rounding spelled out: nvcc contracted these sums one way
                                                // at one column and another at 2..8 (batch invariance, measured)
            acc[j] = __fmaf_rn(sa[j].x, __fmaf_rn(s.d[0], (float)d0, __fmul_rn(s.d[1], (float)d1)), acc[j]);
            acc[j] = __fadd_rn(acc[j], __fmaf_rn(s.m[0], sa[j].y, __fmul_rn(s.m[1], sa[j].w)));
            continue;
        } else if constexpr (TypeTraits<T>::per16) {
            acc[j] += sa[j].x * (s.d[0] * (float)d0 + s.d[1] * (float)d1);
        } else {
            acc[j] += sa[j].x * s.d[0] * (float)(d0 + d1);
        }
        if constexpr (TypeTraits<T>::has_min) acc[j] += s.m[0] * sa[j].y + s.m[1] * sa[j].w;
    }
}

template <int T, int NCOLS, int GLU, int EXACT>
__global__ void __launch_bounds__(MMVQ_THREADS, MMVQ_MIN_BLOCKS)
mmvq(MMVQ_PARAMS) {
    PDL_WAIT();
    constexpr int MMVQ_ROWS = GLU ? 2 : mmvq_rows(NCOLS);        // rows dotted per group (GLU: gate and up row)
    constexpr int OUT_ROWS = GLU ? 1 : MMVQ_ROWS;                  // output rows per group
    __shared__ float partial[MMVQ_ROWS][NCOLS][MMVQ_THREADS / 32];
    const int tpg = MMVQ_THREADS / groups;                       // threads per group
    const auto [lane, b, m, row0, w, y] = mmvq_group<OUT_ROWS, GLU>(w0, w1, w2, y0, y1, y2, m0, m1, m2, groups);
    const int chunks = k / 32;
    float acc[MMVQ_ROWS][NCOLS];
#pragma unroll
    for (int r = 0; r < MMVQ_ROWS; ++r)
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) acc[r][j] = 0.f;
    if (row0 < m) {
        for (int c = lane; c < chunks; c += tpg) {
            constexpr int AHEAD = NCOLS == 1 ? MMVQ_PREFETCH_1 : MMVQ_PREFETCH_N;
            if (AHEAD && c + AHEAD * tpg < chunks) {
                const long long off = (long long)(c + AHEAD * tpg) * TypeTraits<T>::bytes / TypeTraits<T>::chunks;
#pragma unroll
                for (int r = 0; r < MMVQ_ROWS; ++r)
                    prefetch_l1((GLU ? (r == 0 ? w0 : w1) + (long long)row0 * row_bytes
                                     : w + (long long)min(row0 + r, m - 1) * row_bytes) + off);
            }
            int4 a0[NCOLS], a1[NCOLS], r0[NCOLS], r1[NCOLS];
            float4 sa[NCOLS];
            load_chunk_activations<NCOLS, EXACT>(qs, ds, rs, k, c, a0, a1, r0, r1, sa);
#pragma unroll
            for (int r = 0; r < MMVQ_ROWS; ++r) {
                if (!GLU && row0 + r >= m) break;
                int v[8];
                ChunkScale s;
                const u8* wr = GLU ? (r == 0 ? w0 : w1) + (long long)row0 * row_bytes
                                   : w + (long long)(row0 + r) * row_bytes;
                unpack<T>(wr, c, v, s);
                dot_chunk<T, NCOLS, EXACT>(v, s, a0, a1, r0, r1, sa, acc[r]);
            }
        }
    }
    reduce_store<MMVQ_ROWS, OUT_ROWS, NCOLS, GLU>(acc, partial, groups, b, m, y);
}

// ---- MMVQ over 16-value pieces, for the types with a piece<T> below (Q4_K) at 5..8 columns (mmvq.py
// PIECES_MIN_COLS): same arguments, matrices, GLU and output as mmvq. A piece is 16 consecutive values of a row:
// lane i of a group takes pieces i, i + tpg, ... of the group's mmvqp_rows(NCOLS, GLU) rows, so one warp's
// activation loads are 512 contiguous bytes (four cache lines, where mmvq's 32-byte-per-lane chunks touch eight per
// load) and its weight loads the matching bytes of two blocks, each block's header one 16-byte load; the group's
// rows (4 at 5..8 columns) share the activations in registers. At 5..8 columns this is 0-25 % faster than mmvq
// at the benchmark models' shapes (less L1 traffic per weight byte); at one column 35 % slower (Nsight Compute: 65 %
// of issue slots busy against mmvq's 48 %: twice the decode work per value), and batching a lane's loads,
// overlapping them with the previous dots or prefetching into L1 did not change that (BENCHMARKS.md). Launch rule
// (mmvq.mmvq_launches): block 128 threads in groups of 128/groups threads (mmvq._mmvqp_groups); grid
// ceil(m / (groups * mmvqp_rows(NCOLS, GLU))) summed over the matrices (GLU: over m0, each group dotting the gate
// and up rows of its outputs: half the rows, >= 1).
#define MMVQP_ROWS_1 1
#define MMVQP_ROWS_N 2
#define MMVQP_ROWS_HI 4
__host__ __device__ constexpr int mmvqp_rows(int ncols, int glu) {   // output rows per group (GLU: half, >= 1)
    return glu ? (mmvqp_rows(ncols, 0) + 1) / 2 : ncols == 1 ? MMVQP_ROWS_1 : ncols <= 4 ? MMVQP_ROWS_N : MMVQP_ROWS_HI;
}

// Piece p of a row: piece_load<T> reads its bytes (PieceRaw<T>), piece_decode<T> turns them into v[0..3], its 16
// values as int8 four per int, with value = d * v + m (all loads of an iteration are issued before any decode).
template <int T> struct PieceRaw;
template <int T> __device__ __forceinline__ PieceRaw<T> piece_load(const u8* row, int p);
template <int T> __device__ __forceinline__ void piece_decode(const PieceRaw<T>& raw, int p, int v[4], float& d,
                                                              float& m);

// Q4_K block: d|dmin, 12 scale bytes, then 4 groups of 32 qs bytes; group g holds chunk 2g in its low nibbles and
// chunk 2g+1 in its high nibbles. Piece pi = 2 * chunk + half of its block.
template <> struct PieceRaw<T_Q4_K> { uint4 h, q; };
template <> __device__ __forceinline__ PieceRaw<T_Q4_K> piece_load<T_Q4_K>(const u8* row, int p) {
    const u8* b = row + (p >> 4) * 144;
    const int pi = p & 15;
    return {*(const uint4*)b, *(const uint4*)(b + 16 + 32 * (pi >> 2) + 16 * (pi & 1))};
}
template <> __device__ __forceinline__ void piece_decode<T_Q4_K>(const PieceRaw<T_Q4_K>& raw, int p, int v[4],
                                                                 float& d, float& m) {
    const int j = (p & 15) >> 1;
    k4_chunk_scale(raw.h, j, d, m);
    m = -m;
    const int sh = 4 * (j & 1);
    v[0] = (raw.q.x >> sh) & 0x0F0F0F0F; v[1] = (raw.q.y >> sh) & 0x0F0F0F0F;
    v[2] = (raw.q.z >> sh) & 0x0F0F0F0F; v[3] = (raw.q.w >> sh) & 0x0F0F0F0F;
}

template <int T, int NCOLS, int GLU>
__global__ void __launch_bounds__(MMVQ_THREADS, MMVQ_MIN_BLOCKS)
mmvq_pieces(MMVQ_PARAMS) {
    PDL_WAIT();
    constexpr int OUT_ROWS = mmvqp_rows(NCOLS, GLU);              // output rows per group
    constexpr int NR = GLU ? 2 * OUT_ROWS : OUT_ROWS;              // rows dotted per group (GLU: gate rows, up rows)
    __shared__ float partial[NR][NCOLS][MMVQ_THREADS / 32];
    const int tpg = MMVQ_THREADS / groups;
    const auto [lane, b, m, row0, w, y] = mmvq_group<OUT_ROWS, GLU>(w0, w1, w2, y0, y1, y2, m0, m1, m2, groups);
    const u8* wr[NR];
    mmvq_row_ptrs<NR, OUT_ROWS, GLU>(wr, w, w0, w1, row0, m, row_bytes);
    float acc[NR][NCOLS];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) acc[r][j] = 0.f;
    const int pieces = k >> 4;
    if (row0 < m) {
        for (int p = lane; p < pieces; p += tpg) {
            PieceRaw<T> raw[NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) raw[r] = piece_load<T>(wr[r], p);
            int4 a[NCOLS];
            float2 sa[NCOLS];                                     // (d, d * sum) of the piece's activations
#pragma unroll
            for (int j = 0; j < NCOLS; ++j) {
                a[j] = *(const int4*)(qs + (long long)j * k + p * 16);
                sa[j] = ds[(long long)j * (k >> 4) + p];
            }
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                int v[4];
                float d, mw;
                piece_decode<T>(raw[r], p, v, d, mw);
#pragma unroll
                for (int j = 0; j < NCOLS; ++j) {
                    int s = dp4a(v[0], a[j].x, 0); s = dp4a(v[1], a[j].y, s);
                    s = dp4a(v[2], a[j].z, s); s = dp4a(v[3], a[j].w, s);
                    acc[r][j] += sa[j].x * d * (float)s + mw * sa[j].y;
                }
            }
        }
    }
    reduce_store<NR, OUT_ROWS, NCOLS, GLU>(acc, partial, groups, b, m, y);
}

// ---- MMVQ over Q4_K quant-group pairs (mmvq_q4_K_pairs): same arguments, matrices, GLU and output as mmvq. A lane
// takes a whole 32-byte quant group of a block (a "pair": chunk 2i in its low nibbles, 2i + 1 in its high ones, 64
// values) where mmvq's lane takes one chunk and loads the group's 32 bytes for half of them: per 64 values one
// header load and decode and two quant loads (mmvq: two, two and four), and a warp's iteration covers 8 blocks
// (1,152 bytes of one row) where mmvq's covers 4. Registers are held to what 8 blocks of 128 threads per SM allow
// at one column (64), so that a launch over 4096 rows is one wave (batching chunks took 72 registers
// and two waves).
// On the H200, one column, CUDA-graph timing: 4096 x 14336 10.8 us (3.07
// TB/s; mmvq 13.6), 14336 x 4096 11.3 (13.7), 4096 x 4096 4.8 (5.9); 4 rows per group no better; at two columns
// faster at two of those shapes and slower at the third, so not dispatched there (BENCHMARKS.md).
// Launch rule (mmvq.mmvq_launches, Q4_K at <= mmvq.PAIRS_MAX_COLS columns): as
// mmvq's (block 128 threads in groups of 128/groups threads, groups = 4; each group mmvq2_rows(NCOLS) rows; grid
// ceil(m / (groups * rows)) summed over the matrices; GLU: one output row per group, its gate and up rows).
// The EXACT instances (16-bit activations: twice the activation bytes) share them among 4 rows, registers for 4
// blocks per SM: 4096 x 14336 12.0 us against 15.4 with 2 rows and 8 blocks (q8_1 alone: 10.8; BENCHMARKS.md).
#define MMVQ2_ROWS_1 2
#define MMVQ2_ROWS_N 2
#define MMVQ2_ROWS_EXACT 4
#define MMVQ2_MIN_BLOCKS_1 8
#define MMVQ2_MIN_BLOCKS_EXACT 4
__host__ __device__ constexpr int mmvq2_rows(int ncols, int exact) {
    return exact ? MMVQ2_ROWS_EXACT : ncols == 1 ? MMVQ2_ROWS_1 : MMVQ2_ROWS_N;
}

// Chunks 2i and 2i + 1's (d * sc, dmin * m) from a Q4_K header hd (d|dmin, 12 scale bytes) for pair i = 0..3 of the
// block: both chunks' 6-bit scales and mins taken as two bytes at once.
__device__ __forceinline__ void k4_pair_scales(const uint4& hd, int i, float (&d)[2], float (&m)[2]) {
    const u32 sh = 16u * (i & 1);
    const u32 s0 = hd.y >> sh, s1 = hd.z >> sh, s2 = hd.w >> sh;
    const u32 sc = i < 2 ? s0 & 0x3F3Fu : (s2 & 0x0F0Fu) | ((s0 >> 2) & 0x3030u);
    const u32 mn = i < 2 ? s1 & 0x3F3Fu : ((s2 >> 4) & 0x0F0Fu) | ((s1 >> 2) & 0x3030u);
    const float dall = h2f((u16)hd.x), dmin = h2f((u16)(hd.x >> 16));
    d[0] = dall * (float)(sc & 0xFF); d[1] = dall * (float)((sc >> 8) & 0xFF);
    m[0] = dmin * (float)(mn & 0xFF); m[1] = dmin * (float)((mn >> 8) & 0xFF);
}

struct Q4KPair { uint4 hd, q0, q1; };                    // a pair's block header and its 32 quant bytes
__device__ __forceinline__ Q4KPair q4k_pair_load(const u8* row, int p) {
    const u8* b = row + (p >> 2) * 144;
    const uint4* q = (const uint4*)(b + 16 + 32 * (p & 3));
    return {*(const uint4*)b, q[0], q[1]};
}

template <int NCOLS, int GLU, int EXACT>
__global__ void __launch_bounds__(MMVQ_THREADS, EXACT ? MMVQ2_MIN_BLOCKS_EXACT
                                                      : NCOLS == 1 ? MMVQ2_MIN_BLOCKS_1 : MMVQ_MIN_BLOCKS)
mmvq_q4_K_pairs(MMVQ_PARAMS) {
    PDL_WAIT();
    constexpr int NR = GLU ? 2 : mmvq2_rows(NCOLS, EXACT);       // rows dotted per group (GLU: gate and up row)
    constexpr int OUT_ROWS = GLU ? 1 : NR;
    __shared__ float partial[NR][NCOLS][MMVQ_THREADS / 32];
    const int tpg = MMVQ_THREADS / groups;
    const auto [lane, b, m, row0, w, y] = mmvq_group<OUT_ROWS, GLU>(w0, w1, w2, y0, y1, y2, m0, m1, m2, groups);
    const u8* wr[NR];
    mmvq_row_ptrs<NR, OUT_ROWS, GLU>(wr, w, w0, w1, row0, m, row_bytes);
    float acc[NR][NCOLS];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) acc[r][j] = 0.f;
    const int pairs = k >> 6;
    if (row0 < m) {
        for (int p = lane; p < pairs; p += tpg) {
            Q4KPair cur[NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                cur[r] = q4k_pair_load(wr[r], p);
            }
            int4 a[NCOLS][4], ra[NCOLS][4];                        // the pair's 64 activations of each column
            float4 sa[NCOLS][2];                                   // per chunk (d, d * sum16, d, d * sum16)
#pragma unroll
            for (int j = 0; j < NCOLS; ++j) {
                const int4* ap = (const int4*)(qs + (long long)j * k + 64 * p);
                const float4* sp = (const float4*)(ds + (long long)j * (k >> 4) + 4 * p);
#pragma unroll
                for (int e = 0; e < 4; ++e) a[j][e] = ap[e];
                if constexpr (EXACT) {                             // and their residual plane
                    const int4* rp = (const int4*)(rs + (long long)j * k + 64 * p);
#pragma unroll
                    for (int e = 0; e < 4; ++e) ra[j][e] = rp[e];
                }
                sa[j][0] = sp[0];
                sa[j][1] = sp[1];
            }
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                float d[2], mn[2];
                k4_pair_scales(cur[r].hd, p & 3, d, mn);
                const u32 q[8] = {cur[r].q0.x, cur[r].q0.y, cur[r].q0.z, cur[r].q0.w,
                                  cur[r].q1.x, cur[r].q1.y, cur[r].q1.z, cur[r].q1.w};
                int lo[8], hi[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    lo[e] = (int)(q[e] & 0x0F0F0F0Fu);
                    hi[e] = (int)((q[e] >> 4) & 0x0F0F0F0Fu);
                }
#pragma unroll
                for (int j = 0; j < NCOLS; ++j) {
                    const int s0 = dp4a8(lo, a[j][0], a[j][1]), s1 = dp4a8(hi, a[j][2], a[j][3]);
                    float f0 = (float)s0, f1 = (float)s1;
                    if constexpr (EXACT) {
                        f0 = fmaf((float)dp4a8(lo, ra[j][0], ra[j][1]), 1.f / Q8_RESIDUAL, f0);
                        f1 = fmaf((float)dp4a8(hi, ra[j][2], ra[j][3]), 1.f / Q8_RESIDUAL, f1);
                    }
                    float t = acc[r][j];
                    t = fmaf(d[0] * sa[j][0].x, f0, t);
                    t = fmaf(-mn[0], sa[j][0].y + sa[j][0].w, t);
                    t = fmaf(d[1] * sa[j][1].x, f1, t);
                    t = fmaf(-mn[1], sa[j][1].y + sa[j][1].w, t);
                    acc[r][j] = t;
                }
            }
        }
    }
    reduce_store<NR, OUT_ROWS, NCOLS, GLU>(acc, partial, groups, b, m, y);
}

// ---- MMVQ for Q6_K at one column (mmvq_q6_K): same arguments, matrices and output as mmvq (no GLU). Q6_K's 210-byte
// blocks are only 2-byte aligned, so mmvq's lanes read them a word (and a halfword) at a time, each lane its own
// chunk: few bytes in flight per SM and the qh bytes read four times. Here a warp serves NR rows, a "span" of 8
// blocks of each at a time: the span's bytes are copied whole into the warp's shared memory (cp.async, 16 bytes a
// lane from the 16-byte boundary at or before the span, so that every copy is aligned; the next span's copies in
// flight while this one is used), then lane i takes quarter i % 4 of block i / 4 of the span (its half h of the
// block, and the 16-value half lh of each 32-value chunk of it: ql bytes h * 64 + lh * 16 and + 32, qh bytes
// 128 + h * 32 + lh * 16, scales h * 8 + lh + {0, 2, 4, 6}) and dots its four 16-value pieces with the activations,
// those shared by the NR rows. Values are q - 32: one dp4a chain per piece adds -32 x the activations' sum.
// Launch rule (mmvq.mmvq_launches, Q6_K at one column outside batch-invariant mode, launches of at least
// mmvq.Q6_K_MIN_ROWS = 8,192 rows): block MMVQ_THREADS threads, one row group of NR rows per warp (groups = 4); grid
// ceil(m / (4 * NR)) summed over the matrices.
#define MMVQ6_SPAN 8              // blocks of a row one warp takes at a time: a lane per quarter block
#define MMVQ6_SLOTS 106           // 16-byte slots of a staged span: 8 x 210 bytes from up to 14 bytes before them
#define MMVQ6_MIN_BLOCKS 8        // blocks per SM the registers must allow (64 registers a thread), and on 16-bit
#define MMVQ6_MIN_BLOCKS_EXACT 6  // activations (80 registers, no spills; at 8 blocks, 64 registers, it spilled)
#define MMVQ6_NEG32 0xE0E0E0E0    // -32 in each byte

// The global address of span sp of a row (its first block); the row's staged copy starts at it rounded down to 16.
__device__ __forceinline__ unsigned long long mmvq6_span(const u8* row, int sp) {
    return (unsigned long long)(row + (long long)sp * MMVQ6_SPAN * 210);
}

// Start copying span sp of each of the NR rows wr (nb blocks each) into stage (the warp's buffer for it; lane: the
// caller's lane) as one cp.async group.
template <int NR>
__device__ __forceinline__ void mmvq6_stage(uint4 (&stage)[NR][MMVQ6_SLOTS], const u8* const (&wr)[NR], int sp, int nb,
                                            int lane) {
    const int nbt = min(MMVQ6_SPAN, nb - sp * MMVQ6_SPAN);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const unsigned long long g = mmvq6_span(wr[r], sp);
        const uint4* src = (const uint4*)(g & ~15ull);
        const int slots = ((int)(g & 15) + nbt * 210 + 15) >> 4;
        const u32 dst = smem_addr(&stage[r][0]);
        for (int i = lane; i < slots; i += 32) cp_async16_at(dst + 16 * i, src + i);
    }
    cp_async_commit();
}

template <int NR, int EXACT>
__global__ void __launch_bounds__(MMVQ_THREADS, EXACT ? MMVQ6_MIN_BLOCKS_EXACT : MMVQ6_MIN_BLOCKS)
mmvq_q6_K(MMVQ_PARAMS) {
    PDL_WAIT();
    __shared__ uint4 stage[MMVQ_THREADS / 32][2][NR][MMVQ6_SLOTS];   // each warp's two spans of its NR rows
    const auto [lane, b, m, row0, w, y] = mmvq_group<NR, 0>(w0, w1, w2, y0, y1, y2, m0, m1, m2, groups);
    if (row0 >= m) return;
    const int warp = threadIdx.x / 32, nb = k >> 8, spans = (nb + MMVQ6_SPAN - 1) / MMVQ6_SPAN;
    const int bl = lane >> 2, h = (lane >> 1) & 1, lh = lane & 1;
    const u8* wr[NR];
    mmvq_row_ptrs<NR, NR, 0>(wr, w, w0, w1, row0, m, row_bytes);
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.f;
    const int n32[4] = {(int)MMVQ6_NEG32, (int)MMVQ6_NEG32, (int)MMVQ6_NEG32, (int)MMVQ6_NEG32};
    mmvq6_stage<NR>(stage[warp][0], wr, 0, nb, lane);
    for (int sp = 0; sp < spans; ++sp) {
        if (sp + 1 < spans) {
            mmvq6_stage<NR>(stage[warp][(sp + 1) & 1], wr, sp + 1, nb, lane);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncwarp();
        const int blk = sp * MMVQ6_SPAN + bl;
        if (blk < nb) {
            const long long v0 = (long long)blk * 256 + h * 128 + lh * 16;   // piece t's values: v0 + 32 t ..
            int4 a[4], ra[4];
            float da[4];
            int neg[4], rneg[4];                                             // -32 x each piece's activation sum
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                a[t] = *(const int4*)(qs + v0 + 32 * t);
                da[t] = ds[(v0 >> 4) + 2 * t].x;
                neg[t] = dp4a4(n32, a[t]);
                if constexpr (EXACT) {
                    ra[t] = *(const int4*)(rs + v0 + 32 * t);
                    rneg[t] = dp4a4(n32, ra[t]);
                }
            }
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                const u8* sb = (const u8*)&stage[warp][sp & 1][r][0] + (int)(mmvq6_span(wr[r], sp) & 15) + bl * 210;
                u32 ql0[4], ql1[4], qh[4], sc[2];
                ld_words_a2<4>(sb + h * 64 + lh * 16, ql0);
                ld_words_a2<4>(sb + h * 64 + 32 + lh * 16, ql1);
                ld_words_a2<4>(sb + 128 + h * 32 + lh * 16, qh);
                ld_words_a2<2>(sb + 192 + h * 8, sc);
                const float d = ld_f16(sb + 208);
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const u32* ql = t & 1 ? ql1 : ql0;
                    int v[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        v[e] = (int)(((ql[e] >> (4 * (t >> 1))) & 0x0F0F0F0Fu) | (((qh[e] >> (2 * t)) & 0x03030303u) << 4));
                    float f = (float)dp4a4(v, a[t], neg[t]);
                    if constexpr (EXACT) f = fmaf((float)dp4a4(v, ra[t], rneg[t]), 1.f / Q8_RESIDUAL, f);
                    const int j = 2 * t + lh;                                  // the piece's scale among the 8
                    const float s = (float)(signed char)((sc[j >> 2] >> (8 * (j & 3))) & 0xFF);
                    acc[r] = fmaf(d * s * da[t], f, acc[r]);
                }
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const float s = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < m) y[row0 + r] = s;
    }
}

// ---- Tensor-core MMVQ for Q4_K over k ranges (mmvq_tc_q4_K): same arguments, matrices, GLU and output as mmvq,
// 1..16 columns, plus a partial-sum scratch and one counter per row block; groups = the k ranges ("splits"); and
// the launch's column count, which past 16 columns may be below NCOLS (then a multiple of 8, 24..64: one kernel per
// B-tile count, build.TC_WIDE_NCOLS), the missing columns read as zeros and never written.
// Block (x, z) serves 16 x mmvqt_warps(NCOLS) consecutive rows (128; 256 at 6..8 columns, where sharing the activations
// among more rows pays; with GLU half as many rows of the gate and the up matrix) over k range z, one 16-row tile per
// warp (GLU: warps 2i and 2i + 1 take tile i's gate and up rows). The block first copies its k range's
// activations of all NCOLS columns (NB = ceil(NCOLS / 8) B tiles of 8) into shared memory (cp.async), with each
// chunk's d_x and d_x sum x (their loads all in flight at once): every warp of the block, and every row, reads them
// there. Each warp then walks its tile's super-blocks in order, staging its 16 rows' 128-byte lines (cp.async, past L1;
// each instruction copies 4 whole lines) into its own window of MMVQT_WIN lines per row in shared memory, the lines of
// the next MMVQT_STAGES - 1 super-blocks in flight while it computes one (2 measured fastest of 2-4; whole lines
// measured 0.5-1.3 us faster than one 144-byte super-block per ring slot at 4096 x 14336). Per 32-value chunk:
// mma.m16n8k32 with the weights' nibbles as A (unsigned, masked in place: the high nibbles as 16 q, their d_x stored
// over 16) and the activations as B, the k order inside a chunk permuted alike in both (lane (g, t): quant bytes
// 8t..8t+7 of the chunk's group, activation bytes 8t..8t+7 of the chunk); then per (row, column) the chunk's 6-bit
// scale times the integer dot, to float, times d_x into the super-block's sum, which is scaled by d once. The mins'
// term, dmin * the sum over chunks of m * (d_x sum x), is one more product per super-block on the tensor cores
// (mma.m16n8k8 tf32: the 16 x 8 mins, exact, times the 8 x 8 activation sums as a tf32 high part plus the rest, 22 of
// their 24 bits).
// With one k range the block writes y from its warps' sums; with more, each block stores its sums in part, and the
// last of a row block's ranges to finish (counter) adds the ranges' sums in order z = 0, 1, ... and writes y (the
// same sums in the same order every run), then resets the counter for the next launch. (Distributed shared memory in
// a cluster of the ranges was measured slower: clusters of 4 or 8 do not all fit in one wave, BENCHMARKS.md.)
// Launch rule (mmvq.mmvq_launches, mmvq.mmvqt_splits): block 32 * mmvqt_warps(NCOLS) threads, grid (row blocks
// summed over the matrices (GLU: over m0), splits), dynamic shared memory mmvq.mmvqt_smem_bytes; part holds
// gridDim.x * splits * 16 * mmvqt_warps(NCOLS) * mmvqt_sums_cols(NCOLS) floats, counters gridDim.x ints, zero before
// the first launch.
#define MMVQT_WARPS 8
#define MMVQT_MIN_BLOCKS 2                     // blocks per SM the registers must allow
#define MMVQT_WIDE_FROM 6                      // from this many columns to 8: 2 x MMVQT_WARPS warps, one block per SM
                                               // (half the activation traffic: 0.3-0.7 us faster at n = 6..8,
                                               // slower at n = 1..5; BENCHMARKS.md)
// warps (16-row tiles) per block, and blocks per SM the registers must allow, at NCOLS columns (mmvq.mmvqt_warps)
__host__ __device__ constexpr bool mmvqt_wide(int ncols) { return ncols >= MMVQT_WIDE_FROM && ncols <= 8; }
__host__ __device__ constexpr int mmvqt_warps(int ncols) { return mmvqt_wide(ncols) ? 2 * MMVQT_WARPS : MMVQT_WARPS; }
__host__ __device__ constexpr int mmvqt_min_blocks(int ncols) {   // past 16 columns shared memory allows one
    return mmvqt_wide(ncols) || ncols > 16 ? 1 : MMVQT_MIN_BLOCKS;
}
#define MMVQT_STAGES 2                         // super-blocks of a warp's tile in flight (their lines) + 1
#define MMVQT_MAX_RANGE 16                     // super-blocks of a k range at most (mmvq.MMVQT_MAX_RANGE)
// A row's sums in shared memory and part: padded to 4 columns above 2, so that the last block adds them 4 (or 2)
// columns per load (16- / 8-byte loads; the adding's time grows with its loads per thread: 0.19-0.40 us faster at
// n = 4 and 8 than one column per load, BENCHMARKS.md)
__host__ __device__ constexpr int mmvqt_sums_cols(int ncols) { return ncols > 2 ? (ncols + 3) / 4 * 4 : ncols; }
template <int V> struct alignas(4 * V) FloatVec { float v[V]; };   // V consecutive floats, loaded as one

#define MMVQT_WIN (MMVQT_STAGES > 2 ? 8 : 4)   // lines per window row (holds MMVQT_STAGES super-blocks' lines)
#define MMVQT_WIN_LD (128 * MMVQT_WIN + 16)    // a window row's bytes, padded (conflict-free 8-byte reads)
static_assert((112 + 144 * MMVQT_STAGES - 1) / 128 < MMVQT_WIN, "a window holds MMVQT_STAGES super-blocks' lines");

// A lane's part in staging 128-byte lines of a 16-row tile into its window [16][MMVQT_WIN_LD] (line l in window
// line l % MMVQT_WIN): piece lane & 7 of rows 4j + lane / 8, so each cp.async instruction copies 4 whole lines.
__device__ __forceinline__ int q4k_first_line(int sb) { return (144 * sb) >> 7; }
__device__ __forceinline__ int q4k_last_line(int sb) { return (144 * sb + 143) >> 7; }
struct Q4KLineStager {
    u32 src[4], dst[4];
    int row_bytes;
    __device__ __forceinline__ Q4KLineStager(int tile0, int m, long long rb, int lane) : row_bytes((int)rb) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = 4 * j + (lane >> 3), p = lane & 7;
            src[j] = (u32)((min(tile0 + r, m - 1) - tile0) * rb) + 16 * p;
            dst[j] = r * MMVQT_WIN_LD + 16 * p;
        }
    }
    // cp.async line l of each row (pieces past the row's end: zeros, nothing read) into the window at win
    __device__ __forceinline__ void line(u32 win, const u8* tile, int l, int lane) const {
        const bool in = 128 * l + 16 * (lane & 7) < row_bytes;
        const u8* b = tile + (in ? 128 * l : 0);
        const u32 w = win + 128 * (l & (MMVQT_WIN - 1));
#pragma unroll
        for (int j = 0; j < 4; ++j) cp_async16_at(w + dst[j], b + src[j], in ? 16 : 0);
    }
    // the lines from next through super-block sb's last (next moves past them)
    __device__ __forceinline__ void lines_through(u32 win, const u8* tile, int& next, int sb, int lane) const {
        for (const int e = q4k_last_line(sb); next <= e; ++next) line(win, tile, next, lane);
    }
};

// One lane's share of a 16-row tile's super-block: rows g and g + 8 (h = 0, 1)
struct Q4KTileRows {
    uint4 hd[2];            // [h] d | dmin << 16, the 12 scale bytes
    uint2 q[2][4];          // [h][group] quant bytes 8t..8t+7 of each 32-byte group
};

// A lane's share of the super-block at byte base of its tile's window rows (lines wrapping around the window)
__device__ __forceinline__ void q4k_window_read(Q4KTileRows& r, const u8* win, int base, int g, int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u8* row = win + (g + 8 * h) * MMVQT_WIN_LD;
        r.hd[h] = *(const uint4*)(row + base);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            r.q[h][j] = *(const uint2*)(row + ((base + 16 + 32 * j + 8 * t) & (128 * MMVQT_WIN - 1)));
    }
}

// acc[nb][l] += the lane's four (row, column) dot products of a super-block: rows g + 8 (l >> 1), columns
// 8 nb + 2t + (l & 1). The super-block's activations in shared memory: xq [chunk][8 NB][32] int8, dxs and sxs
// [chunk][8 NB] d_x (over 16 for the odd chunks, the high nibbles, which the mma takes in place: 16 x q) and
// d_x * sum x.
template <int NB>
__device__ __forceinline__ void q4k_tile_dot(const Q4KTileRows& r, const signed char* xq, const float* dxs,
                                             const float* sxs, int g, int t, float (&acc)[NB][4]) {
    float d[2], dmin[2];
    u32 sc[2][2], mn[2][2];                                       // [h][chunks 0-3 / 4-7] 6-bit scales / mins
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint4 v = r.hd[h];
        d[h] = h2f((u16)v.x);
        dmin[h] = h2f((u16)(v.x >> 16));
        sc[h][0] = v.y & 0x3F3F3F3Fu;
        mn[h][0] = v.z & 0x3F3F3F3Fu;
        sc[h][1] = (v.w & 0x0F0F0F0Fu) | ((v.y >> 2) & 0x30303030u);
        mn[h][1] = ((v.w >> 4) & 0x0F0F0F0Fu) | ((v.z >> 2) & 0x30303030u);
    }
    const u32 tsel = 0x4440u | t;                                 // the mins of chunks t and t + 4 (tf32 A)
    const float am[4] = {(float)__byte_perm(mn[0][0], 0u, tsel), (float)__byte_perm(mn[1][0], 0u, tsel),
                         (float)__byte_perm(mn[0][1], 0u, tsel), (float)__byte_perm(mn[1][1], 0u, tsel)};
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        float mins[4] = {0.f, 0.f, 0.f, 0.f};
        const float s0 = sxs[t * 8 * NB + 8 * nb + g], s1 = sxs[(t + 4) * 8 * NB + 8 * nb + g];
        const float h0 = tf32_hi(s0), h1 = tf32_hi(s1);
        mma_tf32_k8(mins, am, h0, h1);
        mma_tf32_k8(mins, am, to_tf32(s0 - h0), to_tf32(s1 - h1));
#pragma unroll
        for (int l = 0; l < 4; ++l) acc[nb][l] = fmaf(-dmin[l >> 1], mins[l], acc[nb][l]);
    }
    float dsum[NB][4];                                            // sum over chunks of d_x * sc * dot
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int l = 0; l < 4; ++l) dsum[nb][l] = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) {                                 // chunk c: group c / 2, low or high nibbles
        const int j = c >> 1;
        const u32 nib = c & 1 ? 0xF0F0F0F0u : 0x0F0F0F0Fu;
        const int a[4] = {(int)(r.q[0][j].x & nib), (int)(r.q[1][j].x & nib), (int)(r.q[0][j].y & nib),
                          (int)(r.q[1][j].y & nib)};
        const int s[2] = {(int)__byte_perm(sc[0][c >> 2], 0u, 0x4440u | (c & 3)),
                          (int)__byte_perm(sc[1][c >> 2], 0u, 0x4440u | (c & 3))};
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const uint2 bq = *(const uint2*)(xq + (c * 8 * NB + 8 * nb + g) * 32 + 8 * t);
            const float2 dx = *(const float2*)&dxs[c * 8 * NB + 8 * nb + 2 * t];     // columns 2t, 2t + 1
            const int bx[2] = {(int)bq.x, (int)bq.y};
            int dot[4] = {0, 0, 0, 0};
            mma_k32_u8(dot, a, bx);
#pragma unroll
            for (int l = 0; l < 4; ++l)
                dsum[nb][l] = fmaf(l & 1 ? dx.y : dx.x, (float)(s[l >> 1] * dot[l]), dsum[nb][l]);
        }
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int l = 0; l < 4; ++l) acc[nb][l] = fmaf(d[l >> 1], dsum[nb][l], acc[nb][l]);
}

template <int NCOLS, int GLU>
__global__ void __launch_bounds__(mmvqt_warps(NCOLS) * 32, mmvqt_min_blocks(NCOLS))
mmvq_tc_q4_K(MMVQ_PARAMS, float* __restrict__ part, int* __restrict__ counters, int ncols_arg) {
    PDL_WAIT();
    constexpr int WARPS = mmvqt_warps(NCOLS);
    const int ncols = NCOLS <= 16 ? NCOLS : ncols_arg;           // the columns present (<= NCOLS)
    constexpr int NB = (NCOLS + 7) / 8, C8 = 8 * NB;              // C8: the B tiles' columns
    constexpr int LD = mmvqt_sums_cols(NCOLS);                    // a row's sums (mmvq.mmvqt_sums_cols)
    constexpr int ROWS = 16 * WARPS / (GLU ? 2 : 1);              // output rows per block (mmvq.mmvqt_rows)
    const int splits = groups, z = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int nsb = k >> 8, per = (nsb + splits - 1) / splits;    // per: the most super-blocks of a range
    const int sb0 = z * per, count = min(per, nsb - sb0);         // range z: super-blocks sb0 .. sb0 + count - 1
    extern __shared__ float4 mmvqt_smem[];
    signed char* xq = (signed char*)mmvqt_smem;                   // [per * 8 chunks][C8][32] activations
    float* dxs = (float*)(xq + per * 8 * C8 * 32);                // [per * 8][C8] d_x (odd chunks: d_x / 16)
    float* sxs = dxs + per * 8 * C8;                              // [per * 8][C8] d_x * sum x
    float* sums = sxs + per * 8 * C8;                             // [WARPS][16][LD] the warps' tile sums
    u8* win = (u8*)(sums + WARPS * 16 * LD) + warp * 16 * MMVQT_WIN_LD;   // [16][WIN_LD] the warp's window
    int b = blockIdx.x, m = m0;
    const u8* w = w0;
    float* y = y0;
    if (!GLU) select_matrix(ROWS, w1, w2, y1, y2, m0, m1, m2, b, w, y, m);
    const int row0 = b * ROWS, tile0 = row0 + 16 * (GLU ? warp >> 1 : warp);
    if (GLU) w = warp & 1 ? w1 : w0;
    const bool live = tile0 < m;                                  // a tile past m computes nothing
    const Q4KLineStager stager(tile0, m, row_bytes, lane);
    int next_line = q4k_first_line(sb0);                         // the next line of the rows to stage
    const u8* tile = w + (long long)tile0 * row_bytes;
    const u32 win_at = smem_addr(win);
    const int chunk0 = sb0 * 8, chunks = count * 8;
    for (int i = threadIdx.x; i < chunks * C8 * 2; i += blockDim.x) {   // 16-byte halves of
        const int c = i / (C8 * 2), col = (i >> 1) % C8, half = i & 1;                   // (chunk, column)
        signed char* dst = xq + (c * C8 + col) * 32 + 16 * half;
        if (col < ncols) cp_async16_at(smem_addr(dst), qs + (long long)col * k + (chunk0 + c) * 32 + 16 * half);
        else *(uint4*)dst = make_uint4(0u, 0u, 0u, 0u);
    }
    cp_async_commit();                                            // the activations: the oldest group
    if (live)
        for (int i = 0; i < MMVQT_STAGES - 1; ++i) {              // super-block i's lines
            if (i < count) stager.lines_through(win_at, tile, next_line, sb0 + i, lane);
            cp_async_commit();
        }
    // the lane's (chunk, column) d_x and sums: DS_MAX loads in flight, then their stores (all of the range at once
    // up to 16 columns; past 16, rounds of 8)
    constexpr int DS_ALL = (MMVQT_MAX_RANGE * 8 * C8 + WARPS * 32 - 1) / (WARPS * 32);
    constexpr int DS_MAX = NCOLS <= 16 ? DS_ALL : 8;
    for (int base = 0; base < chunks * C8; base += DS_MAX * WARPS * 32) {
        float4 dsq[DS_MAX];
#pragma unroll
        for (int e = 0; e < DS_MAX; ++e) {
            const int i = base + threadIdx.x + e * blockDim.x, c = i / C8, col = i % C8;
            dsq[e] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < chunks * C8 && col < ncols)
                dsq[e] = *(const float4*)(ds + (long long)col * (k >> 4) + 2 * (chunk0 + c));
        }
#pragma unroll
        for (int e = 0; e < DS_MAX; ++e) {
            const int i = base + threadIdx.x + e * blockDim.x, c = i / C8;
            if (i < chunks * C8) {
                dxs[i] = c & 1 ? dsq[e].x * 0.0625f : dsq[e].x;
                sxs[i] = dsq[e].y + dsq[e].w;
            }
        }
    }
    if (live) cp_async_wait<MMVQT_STAGES - 1>();                  // this thread's activation copies have landed
    else cp_async_wait_all();
    float acc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int l = 0; l < 4; ++l) acc[nb][l] = 0.f;
    __syncthreads();
    if (live)
        for (int i = 0; i < count; ++i) {
            // super-block ahead's lines not staged yet, over lines read at the step before
            const int ahead = i + MMVQT_STAGES - 1;
            if (ahead < count) stager.lines_through(win_at, tile, next_line, sb0 + ahead, lane);
            cp_async_commit();
            cp_async_wait<MMVQT_STAGES - 1>();                    // super-block i has landed
            __syncwarp();
            Q4KTileRows r;
            q4k_window_read(r, win, (144 * (sb0 + i)) & (128 * MMVQT_WIN - 1), g, t);
            q4k_tile_dot<NB>(r, xq + i * 8 * C8 * 32, dxs + i * 8 * C8, sxs + i * 8 * C8, g, t, acc);
            __syncwarp();
        }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int col = 8 * nb + 2 * t + (l & 1);
            if (col < LD) sums[(warp * 16 + g + 8 * (l >> 1)) * LD + col] = acc[nb][l];   // (past NCOLS: 0)
        }
    __syncthreads();
    constexpr int P = WARPS * 16 * LD;                           // one block's sums
    const float* src = sums;                                      // the sums to add: this block's, or every range's
    long long zstride = 0;
    if (splits > 1) {
        float* mine = part + ((long long)blockIdx.x * splits + z) * P;
        for (int i = threadIdx.x; i < P / 4; i += blockDim.x) ((float4*)mine)[i] = ((const float4*)sums)[i];
        __syncthreads();
        __shared__ int last;
        if (threadIdx.x == 0) {                                   // one fence for the block (the barrier orders
            fence_acq_rel_gpu();                                  // its threads' sums before it): release, count,
            last = atomicAdd(&counters[blockIdx.x], 1) == splits - 1;
            if (last) {
                fence_acq_rel_gpu();                              // acquire (it invalidates L1, so the plain
                counters[blockIdx.x] = 0;                         // loads below read the sums from L2: 0.1-0.8
                                                                  // us faster than __ldcg's, BENCHMARKS.md)
            }
        }
        __syncthreads();
        if (!last) {
            return;
        }
        src = part + (long long)blockIdx.x * splits * P;
        zstride = P;
    }
    constexpr int V = LD % 4 == 0 ? 4 : LD % 2 == 0 ? 2 : 1;      // columns per load
    constexpr int GROUPS = ROWS * LD / V;                        // (row, V columns) groups to add
    constexpr int OUTS = (GROUPS + WARPS * 32 - 1) / (WARPS * 32);   // groups per thread
    constexpr int BATCH = OUTS < 4 / V ? OUTS : 4 / V;            // groups whose ranges' loads go together
#pragma unroll
    for (int o0 = 0; o0 < OUTS; o0 += BATCH) {
        FloatVec<V> a[BATCH], up[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u)
#pragma unroll
            for (int c = 0; c < V; ++c) a[u].v[c] = up[u].v[c] = 0.f;
        for (int q0 = 0; q0 < splits; q0 += 8) {                  // 8 ranges x BATCH groups in flight, then added
            FloatVec<V> va[BATCH][8], vu[BATCH][8];               // in order
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int idx = threadIdx.x + (o0 + u) * blockDim.x, rr = idx * V / LD, j = idx * V % LD;
                const int slot = GLU ? 2 * (rr >> 4) : rr >> 4;   // the warp that computed the row (GLU: its gate)
                const float* v = src + (slot * 16 + (rr & 15)) * LD + j;   // range 0's sum (GLU: + 16 LD, up's)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (idx < GROUPS && q0 + e < splits) {
                        const float* p = v + (q0 + e) * zstride;
                        va[u][e] = *(const FloatVec<V>*)p;
                        if (GLU) vu[u][e] = *(const FloatVec<V>*)(p + 16 * LD);
                    }
            }
#pragma unroll
            for (int u = 0; u < BATCH; ++u)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (q0 + e < splits)
#pragma unroll
                        for (int c = 0; c < V; ++c) {
                            a[u].v[c] += va[u][e].v[c];
                            if (GLU) up[u].v[c] += vu[u][e].v[c];
                        }
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int idx = threadIdx.x + (o0 + u) * blockDim.x, rr = idx * V / LD, j = idx * V % LD;
#pragma unroll
            for (int c = 0; c < V; ++c) {
                const float v = GLU ? glu_act(GLU, a[u].v[c]) * up[u].v[c] : a[u].v[c];
                if (idx < GROUPS && row0 + rr < m && j + c < ncols)            // (not the padding)
                    y[(long long)(j + c) * m + row0 + rr] = v;
            }
        }
    }
}
