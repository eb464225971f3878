// MMQ: y = x W^T on int8 tensor cores (mma.sync m16n8k32 / m16n8k16 s8.s8.s32) for many activation columns.
//   w  : [m, k] in T's blocks (row stride row_bytes)
//   qs : [n_pad, k] int8 and ds : [n_pad, k/16] float2, from quantize_q8_1 (n_pad a multiple of MMQ_BN)
//   y  : [n, m] f32
// Each block computes a MMQ_BM x MMQ_BN tile of y^T. Stages of 256 k-values are double-buffered: while a stage is
// computed, cp.async brings the next stage's raw weight bytes and q8_1 activation tile into shared memory. A stage's
// raw weight blocks are unpacked (smem -> smem) into int8 + per-16/32 scales, then every warp runs the mma
// over its 32 x 32 sub-tile: integer accumulation over each 32-wide chunk (two k16 halves for the per-16-scale types
// Q2_K/Q3_K/Q6_K), then the fp32 rescale  acc += d_w * d_x * int_dot (+ m_w * d_x * sum(q_x) for the affine types).
// Split-k: where the tiles are fewer than the SMs, block z of gridDim.z computes stages z * split_stages .. of k
// into its own partial y (y + z * n * m), and mmq_split_sum adds the partials in the order z = 0, 1, ... (the same
// sums in the same order every run).
// Launch rule (mmq.mmq, mmq.mmq_splits): block 256 threads, grid (ceil(m / MMQ_BM), n_pad / MMQ_BN, splits),
// dynamic shared memory MMQ_SMEM_BYTES; with splits > 1 then mmq_split_sum over n * m outputs, block 256.
#include "common.cuh"

#define MMQ_BM 128
#define MMQ_BN 64
#define MMQ_KT 256                       // k-values per stage
#define MMQ_CH (MMQ_KT / 32)             // chunks per stage
#define MMQ_LD (MMQ_KT + 16)             // smem row stride in bytes: 68 words = 4 (mod 32) banks apart
#define MMQ_THREADS 256

#define MMQ_RAW_LD 320                   // raw weight bytes per row and stage: <= 272 + 2*16 alignment slack
#define MMQ_RAW_PIECES (MMQ_RAW_LD / 16)

// shared memory layout (bytes)
#define SM_RAW 0                                           // u8 [2][MMQ_BM][MMQ_RAW_LD]  raw weight blocks
#define SM_A (SM_RAW + 2 * MMQ_BM * MMQ_RAW_LD)            // int8 [MMQ_BM][MMQ_LD]        unpacked weights
#define SM_B (SM_A + MMQ_BM * MMQ_LD)                      // int8 [2][MMQ_BN][MMQ_LD]     activations
#define SM_AD (SM_B + 2 * MMQ_BN * MMQ_LD)                 // float [MMQ_BM][MMQ_CH][2]  weight scale per half
#define SM_AM (SM_AD + MMQ_BM * MMQ_CH * 2 * 4)            // float [MMQ_BM][MMQ_CH][2]  weight additive term
#define SM_BD (SM_AM + MMQ_BM * MMQ_CH * 2 * 4)            // float2 [2][MMQ_BN][MMQ_CH*2]  activation (d, d*sum16)
#define MMQ_SMEM_BYTES (SM_BD + 2 * MMQ_BN * MMQ_CH * 2 * 8)

__device__ __forceinline__ void mma_k16(int c[4], int a0, int a1, int b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

// Issue the copies of stage `st` (chunks st*MMQ_CH ...) into buffer `buf`.
template <int T>
__device__ __forceinline__ void mmq_load_stage(const u8* __restrict__ w, const signed char* __restrict__ qs,
                                               const float2* __restrict__ ds, u8* smem, int buf, int st,
                                               int row0, int col0, int m, int k, long long row_bytes) {
    constexpr int STAGE_BYTES = TypeTraits<T>::bytes * (MMQ_KT / TypeTraits<T>::qk);
    const int tid = threadIdx.x;
    u8* raw = smem + SM_RAW + buf * MMQ_BM * MMQ_RAW_LD;
    for (int idx = tid; idx < MMQ_BM * MMQ_RAW_PIECES; idx += MMQ_THREADS) {
        const int r = idx / MMQ_RAW_PIECES, piece = idx % MMQ_RAW_PIECES;
        const long long start = (long long)(row0 + r) * row_bytes + (long long)st * STAGE_BYTES;
        const long long a0 = start & ~15LL;
        if (a0 + piece * 16 < start + STAGE_BYTES)
            cp_async16(raw + r * MMQ_RAW_LD + piece * 16, row0 + r < m ? w + a0 + piece * 16 : w, row0 + r < m ? 16 : 0);
    }
    u8* sB = smem + SM_B + buf * MMQ_BN * MMQ_LD;
#pragma unroll
    for (int p = 0; p < MMQ_BN * (MMQ_KT / 16) / MMQ_THREADS; ++p) {
        const int idx = tid + p * MMQ_THREADS, cl = idx / (MMQ_KT / 16), part = idx % (MMQ_KT / 16);
        const int kk = st * MMQ_KT + part * 16;
        cp_async16(sB + cl * MMQ_LD + part * 16, qs + (long long)(col0 + cl) * k + (kk < k ? kk : 0), kk < k ? 16 : 0);
    }
    float2* sBd = (float2*)(smem + SM_BD) + buf * MMQ_BN * MMQ_CH * 2;
#pragma unroll
    for (int p = 0; p < MMQ_BN * MMQ_CH * 2 / 2 / MMQ_THREADS; ++p) {        // two float2 per copy
        const int idx = tid + p * MMQ_THREADS, cl = idx / MMQ_CH, h2 = idx % MMQ_CH;
        const int kh = st * MMQ_CH * 2 + h2 * 2;
        cp_async16(sBd + cl * MMQ_CH * 2 + h2 * 2, ds + (long long)(col0 + cl) * (k / 16) + (kh < k / 16 ? kh : 0),
                   kh < k / 16 ? 16 : 0);
    }
}

template <int T>
__global__ void __launch_bounds__(MMQ_THREADS, 1)
mmq(const u8* __restrict__ w, const signed char* __restrict__ qs, const float2* __restrict__ ds,
    float* __restrict__ y, int m, int n, int k, long long row_bytes, int split_stages) {
    PDL_WAIT();
    extern __shared__ __align__(16) u8 smem[];
    u8* sA = smem + SM_A;
    float* sAd = (float*)(smem + SM_AD);
    float* sAm = (float*)(smem + SM_AM);
    constexpr bool PER16 = TypeTraits<T>::per16, HAS_MIN = TypeTraits<T>::has_min;
    constexpr int STAGE_BYTES = TypeTraits<T>::bytes * (MMQ_KT / TypeTraits<T>::qk);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * MMQ_BM, col0 = blockIdx.y * MMQ_BN;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;     // this warp's 32 x 32 sub-tile
    const int chunks = k / 32, stages = (chunks + MMQ_CH - 1) / MMQ_CH;
    const int st0 = blockIdx.z * split_stages, st1 = min(stages, st0 + split_stages);   // this split's stages
    y += (long long)blockIdx.z * n * m;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int l = 0; l < 4; ++l) acc[i][j][l] = 0.f;

    mmq_load_stage<T>(w, qs, ds, smem, 0, st0, row0, col0, m, k, row_bytes);
    cp_async_commit();
    for (int st = st0; st < st1; ++st) {
        const int buf = (st - st0) & 1;
        if (st + 1 < st1) mmq_load_stage<T>(w, qs, ds, smem, buf ^ 1, st + 1, row0, col0, m, k, row_bytes);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        // ---- unpack this stage's raw weight blocks (smem -> smem), one chunk per thread per pass
        const u8* raw = smem + SM_RAW + buf * MMQ_BM * MMQ_RAW_LD;
        const int c0 = st * MMQ_CH;
#pragma unroll
        for (int p = 0; p < MMQ_BM * MMQ_CH / MMQ_THREADS; ++p) {
            const int idx = tid + p * MMQ_THREADS, r = idx / MMQ_CH, ch = idx % MMQ_CH;
            int v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            ChunkScale s = {{0.f, 0.f}, {0.f, 0.f}};
            if (row0 + r < m && c0 + ch < chunks) {
                const int off = (int)(((long long)(row0 + r) * row_bytes + (long long)st * STAGE_BYTES) & 15);
                unpack<T>(raw + r * MMQ_RAW_LD + off, ch, v, s);
            }
            int4* dst = (int4*)(sA + r * MMQ_LD + ch * 32);
            dst[0] = make_int4(v[0], v[1], v[2], v[3]);
            dst[1] = make_int4(v[4], v[5], v[6], v[7]);
            *(float2*)(sAd + (r * MMQ_CH + ch) * 2) = make_float2(s.d[0], s.d[1]);
            if (HAS_MIN) *(float2*)(sAm + (r * MMQ_CH + ch) * 2) = make_float2(s.m[0], s.m[1]);
        }
        __syncthreads();
        const u8* sB = smem + SM_B + buf * MMQ_BN * MMQ_LD;
        const float2* sBd = (const float2*)(smem + SM_BD) + buf * MMQ_BN * MMQ_CH * 2;

        // ---- compute
#pragma unroll 2
        for (int ch = 0; ch < MMQ_CH; ++ch) {
            int a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u8* base = sA + (wm + i * 16 + g) * MMQ_LD + ch * 32 + t * 4;
                a[i][0] = *(const int*)(base);
                a[i][1] = *(const int*)(base + 8 * MMQ_LD);
                a[i][2] = *(const int*)(base + 16);
                a[i][3] = *(const int*)(base + 8 * MMQ_LD + 16);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u8* base = sB + (wn + j * 8 + g) * MMQ_LD + ch * 32 + t * 4;
                b[j][0] = *(const int*)(base);
                b[j][1] = *(const int*)(base + 16);
            }
            float dw[2][2][2], mw[2][2][2];     // [i][row half][k half]
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int rh = 0; rh < 2; ++rh) {
                    const int r = wm + i * 16 + g + rh * 8;
                    const float2 d2 = *(const float2*)(sAd + (r * MMQ_CH + ch) * 2);
                    dw[i][rh][0] = d2.x; dw[i][rh][1] = d2.y;
                    if (HAS_MIN) {
                        const float2 m2 = *(const float2*)(sAm + (r * MMQ_CH + ch) * 2);
                        mw[i][rh][0] = m2.x; mw[i][rh][1] = m2.y;
                    }
                }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float dx[2], sx[2][2];          // [col parity], [col parity][k half]
#pragma unroll
                for (int cp = 0; cp < 2; ++cp) {
                    const int cl = wn + j * 8 + t * 2 + cp;
                    const float4 q = *(const float4*)(sBd + cl * MMQ_CH * 2 + ch * 2);
                    dx[cp] = q.x; sx[cp][0] = q.y; sx[cp][1] = q.w;
                }
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    if (PER16) {
                        int c0v[4] = {0, 0, 0, 0}, c1v[4] = {0, 0, 0, 0};
                        mma_k16(c0v, a[i][0], a[i][1], b[j][0]);
                        mma_k16(c1v, a[i][2], a[i][3], b[j][1]);
#pragma unroll
                        for (int l = 0; l < 4; ++l) {
                            const int rh = l >> 1, cp = l & 1;
                            acc[i][j][l] += dx[cp] * (dw[i][rh][0] * (float)c0v[l] + dw[i][rh][1] * (float)c1v[l]);
                            if (HAS_MIN) acc[i][j][l] += mw[i][rh][0] * sx[cp][0] + mw[i][rh][1] * sx[cp][1];
                        }
                    } else {
                        int cv[4] = {0, 0, 0, 0};
                        mma_k32(cv, a[i], b[j]);
#pragma unroll
                        for (int l = 0; l < 4; ++l) {
                            const int rh = l >> 1, cp = l & 1;
                            acc[i][j][l] += (dw[i][rh][0] * dx[cp]) * (float)cv[l];
                            if (HAS_MIN) acc[i][j][l] += mw[i][rh][0] * (sx[cp][0] + sx[cp][1]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    mma_store_tile(acc, y, row0 + wm, col0 + wn, g, t, m, n);
}

// ---- MMQ for Q4_K on its raw blocks (mmq_q4_K): same arguments, tiles, split-k and output as mmq<T_Q4_K>, but
// shared memory holds each row's Q4_K block as it is in global memory (no unpacked int8 copy, no weight scale
// arrays): 47 KB per stage where mmq takes 92, so two blocks share an SM (16 warps where mmq has 8 to hide latency).
// A stage is one 256-value block: four 32-byte quant groups, group p holding chunk 2p in its low nibbles and 2p+1 in
// its high ones. The mma operands are plain loads with the k order inside a chunk permuted alike in A and B (as in
// mmvq_mma_q4_K): lane (g, t) takes quant bytes 8t..8t+7 of a group for rows g and g + 8 of a 16-row tile, and
// activation bytes 8t..8t+7 of the chunk for column g of an 8-column tile. Once a stage has landed the block decodes
// its 128 rows x 8 chunk scales from the headers into shared memory (k4_chunk_scale; 4 per thread), and each lane
// rescales per chunk: acc += d_w d_x dot - m_w (d_x sum x), as two fmas. (The kernel is instruction-bound: ncu,
// BENCHMARKS.md; decoding per lane and chunk cost 1.16x the time.)
// Launch rule (mmq.mmq for Q4_K unless CudaConfig.mmq_q4_K is False): block 256 threads, grid (ceil(m / MMQ_BM),
// n_pad / MMQ_BN, splits), dynamic shared memory MMQK_SMEM_BYTES, 2 blocks per SM.
#define MMQK_A_LD 160                    // smem bytes per row of a stage's weights: 144 used; 40 words apart
#define MMQK_B_LD 288                    // smem bytes per column of a stage's activations: 256 used; 72 words apart
#define MMQK_A_BYTES (MMQ_BM * MMQK_A_LD)                  // u8 [MMQ_BM][MMQK_A_LD]     raw Q4_K blocks
#define MMQK_B_BYTES (MMQ_BN * MMQK_B_LD)                  // int8 [MMQ_BN][MMQK_B_LD]   activations
#define MMQK_BD_LD 18                     // float2 per column of a stage's activation scales: 16 used; 36 words apart
#define MMQK_BD_BYTES (MMQ_BN * MMQK_BD_LD * 8)            // float2 [MMQ_BN][MMQK_BD_LD] (d, d * sum) per 16 values
#define MMQK_STAGE_BYTES (MMQK_A_BYTES + MMQK_B_BYTES + MMQK_BD_BYTES)
#define MMQK_S_LD 9                       // float2 per row of the stage's chunk scales: 8 used; rows 18 words apart
#define MMQK_S_BYTES (MMQ_BM * MMQK_S_LD * 8)              // float2 [MMQ_BM][MMQK_S_LD] (d * sc, dmin * m) per chunk
#define MMQK_SMEM_BYTES (2 * MMQK_STAGE_BYTES + MMQK_S_BYTES)

__device__ __forceinline__ void mmq_q4_K_load_stage(const u8* __restrict__ w, const signed char* __restrict__ qs,
                                                    const float2* __restrict__ ds, u8* stage, int st, int row0,
                                                    int col0, int m, int k, long long row_bytes) {
    const int tid = threadIdx.x;
    for (int idx = tid; idx < MMQ_BM * 9; idx += MMQ_THREADS) {           // 9 x 16 bytes per row
        const int r = idx / 9, piece = idx % 9;
        const bool ok = row0 + r < m;
        cp_async16(stage + r * MMQK_A_LD + piece * 16,
                   ok ? w + (long long)(row0 + r) * row_bytes + (long long)st * 144 + piece * 16 : w, ok ? 16 : 0);
    }
    u8* sB = stage + MMQK_A_BYTES;
#pragma unroll
    for (int q = 0; q < MMQ_BN * 16 / MMQ_THREADS; ++q) {                // 16 x 16 bytes per column
        const int idx = tid + q * MMQ_THREADS, cl = idx / 16, piece = idx % 16;
        cp_async16(sB + cl * MMQK_B_LD + piece * 16, qs + (long long)(col0 + cl) * k + st * 256 + piece * 16, 16);
    }
    float2* sBd = (float2*)(stage + MMQK_A_BYTES + MMQK_B_BYTES);
#pragma unroll
    for (int q = 0; q < MMQ_BN * 8 / MMQ_THREADS; ++q) {                 // 8 x (two float2) per column
        const int idx = tid + q * MMQ_THREADS, cl = idx / 8, piece = idx % 8;
        cp_async16(sBd + cl * MMQK_BD_LD + piece * 2, ds + (long long)(col0 + cl) * (k / 16) + st * 16 + piece * 2,
                   16);
    }
}

extern "C" __global__ void __launch_bounds__(MMQ_THREADS, 2)
mmq_q4_K(const u8* __restrict__ w, const signed char* __restrict__ qs, const float2* __restrict__ ds,
         float* __restrict__ y, int m, int n, int k, long long row_bytes, int split_stages) {
    PDL_WAIT();
    extern __shared__ __align__(16) u8 mmqk_smem[];  // MMQK_SMEM_BYTES: 2 stages, then the chunk scales
    float2* sS = (float2*)(mmqk_smem + 2 * MMQK_STAGE_BYTES);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * MMQ_BM, col0 = blockIdx.y * MMQ_BN;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;     // this warp's 32 x 32 sub-tile
    const int stages = k / 256;
    const int st0 = blockIdx.z * split_stages, st1 = min(stages, st0 + split_stages);   // this split's stages
    y += (long long)blockIdx.z * n * m;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int l = 0; l < 4; ++l) acc[i][j][l] = 0.f;

    mmq_q4_K_load_stage(w, qs, ds, mmqk_smem, st0, row0, col0, m, k, row_bytes);
    cp_async_commit();
    for (int st = st0; st < st1; ++st) {
        const u8* stage = mmqk_smem + ((st - st0) & 1) * MMQK_STAGE_BYTES;
        if (st + 1 < st1)
            mmq_q4_K_load_stage(w, qs, ds, mmqk_smem + ((st + 1 - st0) & 1) * MMQK_STAGE_BYTES, st + 1, row0, col0,
                                m, k, row_bytes);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
#pragma unroll
        for (int q = 0; q < MMQ_BM * 8 / MMQ_THREADS; ++q) {      // the stage's chunk scales, decoded once
            const int idx = tid + q * MMQ_THREADS, r = idx >> 3, c = idx & 7;
            float d, mn;
            k4_chunk_scale(*(const uint4*)(stage + r * MMQK_A_LD), c, d, mn);
            sS[r * MMQK_S_LD + c] = make_float2(d, mn);
        }
        __syncthreads();
        const u8* sB = stage + MMQK_A_BYTES;
        const float2* sBd = (const float2*)(stage + MMQK_A_BYTES + MMQK_B_BYTES);
#pragma unroll 1
        for (int p = 0; p < 4; ++p) {                             // quant group p: chunks 2p (low), 2p + 1 (high)
            uint2 wq[2][2];                                       // [tile][row g / g + 8]
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    wq[i][h] = *(const uint2*)(stage + (wm + 16 * i + g + 8 * h) * MMQK_A_LD + 16 + 32 * p + 8 * t);
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {                      // (unrolled: 128 registers, no spills)
                const int c = 2 * p + cc;                         // chunk of the block
                float dw[2][2], mw[2][2];                         // [tile][row g / g + 8], from the headers
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = wm + 16 * i + g + 8 * h;
                        const float2 sc = sS[r * MMQK_S_LD + c];
                        dw[i][h] = sc.x;
                        mw[i][h] = sc.y;
                    }
                int a[2][4];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    a[i][0] = (int)((wq[i][0].x >> (4 * cc)) & 0x0F0F0F0Fu);
                    a[i][1] = (int)((wq[i][1].x >> (4 * cc)) & 0x0F0F0F0Fu);
                    a[i][2] = (int)((wq[i][0].y >> (4 * cc)) & 0x0F0F0F0Fu);
                    a[i][3] = (int)((wq[i][1].y >> (4 * cc)) & 0x0F0F0F0Fu);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint2 xb = *(const uint2*)(sB + (wn + 8 * j + g) * MMQK_B_LD + 32 * c + 8 * t);
                    const int b[2] = {(int)xb.x, (int)xb.y};
                    float dx[2], sx[2];                           // columns 2t, 2t + 1 of the tile
#pragma unroll
                    for (int q = 0; q < 2; ++q) {
                        const float4 v = *(const float4*)(sBd + (wn + 8 * j + 2 * t + q) * MMQK_BD_LD + 2 * c);
                        dx[q] = v.x;
                        sx[q] = v.y + v.w;
                    }
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        int cv[4] = {0, 0, 0, 0};
                        mma_k32(cv, a[i], b);
#pragma unroll
                        for (int l = 0; l < 4; ++l) {
                            const int h = l >> 1, q = l & 1;
                            acc[i][j][l] = fmaf(dw[i][h] * dx[q], (float)cv[l], acc[i][j][l]);
                            acc[i][j][l] = fmaf(-mw[i][h], sx[q], acc[i][j][l]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    mma_store_tile(acc, y, row0 + wm, col0 + wn, g, t, m, n);
}

// y[i] = part[0][i] + part[1][i] + ... (splits partials of n * m outputs each, added in that order)
extern "C" __global__ void mmq_split_sum(const float* __restrict__ part, float* __restrict__ y, int splits,
                                         long long nm) {
    PDL_WAIT();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= nm) return;
    float s = part[i];
    for (int z = 1; z < splits; ++z) s += part[z * nm + i];
    y[i] = s;
}
