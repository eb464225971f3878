// MMQ on f16 tensor cores: y = x W^T with the weights' raw blocks unpacked to f16 in shared memory, never in global
// memory, and f16 activations (mma.sync m16n8k16, fp32 accumulation): the products of dequantize + cuBLAS without
// writing an f16 copy of W.
//   w : [m, k] in T's blocks (row stride row_bytes)
//   x : [n, k] f16, rows 16-byte aligned (k a multiple of 32)
//   y : [n, m] f32
// Each block computes an MF_BM x BN tile of y^T over stages of MF_KT k-values. While a stage is computed, cp.async
// brings the raw weight bytes and f16 activation tiles of the next S - 1 stages into shared memory (S buffers: 4 at
// BN = 64, 3 at 128, as many as fit); the raw bytes of a stage are its "unit": the 256-value block it lies in for
// the K-quants (loaded again for the block's second half: a read from L2), else its MF_KT / 32 blocks. A landed
// stage's raw blocks are unpacked (unpack<T>, one 32-value chunk per thread and pass, consecutive threads on
// consecutive rows) into one f16 tile in f16x2 arithmetic: each int8 pair becomes two exact halves 1152 + q by a byte
// permute (f16 has unit spacing in [1024, 2048)), then (h - 1152) * d + m in one f16 fma with the chunk's d and m
// rounded to f16. (dequantize_f16 rounds d * q + m once from fp32; this takes fewer instructions and about doubles
// the weights' squared rounding error, nmse ~1e-7 against ~4e-8.) Then each of the 8 warps (4 x 2) runs ldmatrix +
// mma over its 32 x BN/2 sub-tile. Rows past m and chunks past k unpack to zeros, and activation rows past n and
// values past k are zero-filled, so partial tiles add nothing.
// Split-k as MMQ's: block z of gridDim.z computes stages z * split_stages .. of k into its own partial y
// (y + z * n * m), which mmq_split_sum (mmq.cu) adds in the order z = 0, 1, ...
// Launch rule (mmq_f16.mmq_f16): BN 64 up to 64 columns, else 128; block MF_THREADS, grid (ceil(m / MF_BM),
// ceil(n / BN), splits), dynamic shared memory MF_SMEM_BYTES_64 / _128 (sm_90, one block per SM: at most 227 KB);
// with splits > 1 then mmq_split_sum over n * m outputs.
#include "common.cuh"

#define MF_BM 128
#define MF_KT 128                        // k-values per stage
#define MF_CH (MF_KT / 32)               // chunks per stage
#define MF_THREADS 256
#define MF_LD (MF_KT + 8)                // halves per row of the f16 tiles: 68 words, rows 4 banks apart (ldmatrix)
#define MF_RAW_LD 240                    // raw bytes per row and stage: <= 210 (a Q6_K block) + 30; 60 words

#define MF_STAGES_64 4                   // stage buffers at BN = 64 and at 128
#define MF_STAGES_128 3

// shared memory layout (bytes): the f16 weight tile, then S stage buffers of raw blocks, then S of activations
#define MF_A_BYTES (MF_BM * MF_LD * 2)                       // u16 [MF_BM][MF_LD]      the stage's f16 weights
#define MF_RAW_BYTES (MF_BM * MF_RAW_LD)                     // u8 [S][MF_BM][MF_RAW_LD]  raw weight blocks
#define MF_X_BYTES(BN) ((BN) * MF_LD * 2)                    // u16 [S][BN][MF_LD]      f16 activations
#define MF_SMEM_BYTES_64 (MF_A_BYTES + MF_STAGES_64 * (MF_RAW_BYTES + 64 * MF_LD * 2))
#define MF_SMEM_BYTES_128 (MF_A_BYTES + MF_STAGES_128 * (MF_RAW_BYTES + 128 * MF_LD * 2))

template <int BN> struct MfLayout {
    static constexpr int stages = BN == 64 ? MF_STAGES_64 : MF_STAGES_128;
    static constexpr int raw = MF_A_BYTES, x = MF_A_BYTES + stages * MF_RAW_BYTES;    // offsets
};

// The raw bytes a stage reads: the unit of UNIT values (a K-quant block, or MF_KT / 32 blocks) holding it
template <int T> struct MfUnit {
    static constexpr int qk = TypeTraits<T>::qk;
    static constexpr int values = qk > MF_KT ? qk : MF_KT;
    static constexpr int bytes = TypeTraits<T>::bytes * (values / qk);
    static constexpr int pieces = (bytes + 30) / 16;                   // 16-byte lines the unit can touch
    static_assert(pieces * 16 <= MF_RAW_LD, "a unit's raw bytes exceed the row's shared memory");
};

// Issue the copies of stage `st` (k-values st * MF_KT ..) into buffer `buf`: thread (row tid % MF_BM, lines
// tid / MF_BM + 2j) takes the 16-byte lines of its row's unit (which may start anywhere in a line), and thread
// (column tid / 16 + 16p, 8 values from 8 * (tid % 16)) the activations.
template <int T, int BN>
__device__ __forceinline__ void mf_load_stage(const u8* __restrict__ w, const u16* __restrict__ x, u8* smem, int buf,
                                              int st, int row0, int col0, int m, int n, int k, long long row_bytes) {
    using U = MfUnit<T>;
    const int tid = threadIdx.x, r = tid % MF_BM;
    if (row0 + r < m) {
        const long long start = (long long)(row0 + r) * row_bytes + (long long)(st * MF_KT / U::values) * U::bytes;
        const long long end = min(start + U::bytes, (long long)(row0 + r + 1) * row_bytes);
        const long long a0 = start & ~15LL;
        u8* dst = smem + MfLayout<BN>::raw + buf * MF_RAW_BYTES + r * MF_RAW_LD;
#pragma unroll
        for (int j = 0; j < (U::pieces + 1) / 2; ++j) {
            const int piece = tid / MF_BM + 2 * j;
            if (piece < U::pieces && a0 + piece * 16 < end) cp_async16(dst + piece * 16, w + a0 + piece * 16, 16);
        }
    }
    const int cl = tid / 16, kk = st * MF_KT + (tid % 16) * 8;
    const u16* src = x + (long long)(col0 + cl) * k + kk;
    u16* dst = (u16*)(smem + MfLayout<BN>::x + buf * MF_X_BYTES(BN)) + cl * MF_LD + (tid % 16) * 8;
#pragma unroll
    for (int p = 0; p < BN / 16; ++p) {
        const bool ok = col0 + cl + 16 * p < n && kk < k;
        cp_async16(dst + 16 * p * MF_LD, ok ? src + (long long)16 * p * k : x, ok ? 16 : 0);
    }
}

// f16x2 helpers: two floats as an f16 pair, a - b and a * b + c on pairs
__device__ __forceinline__ u32 f16x2_of(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ u32 f16x2_sub(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 f16x2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// int8 values 2i, 2i + 1 of a word as an exact f16 pair, from the word with 128 added to each byte (v ^ 0x80808080):
// each byte under the exponent of 1024, less 1152
__device__ __forceinline__ u32 int8_pair_f16(u32 v_biased, int i) {
    return f16x2_sub(__byte_perm(v_biased, 0x64646464u, i ? 0x4342 : 0x4140), 0x64806480u);
}

template <int T, int BN>
__global__ void __launch_bounds__(MF_THREADS, 1)
mmq_f16(const u8* __restrict__ w, const u16* __restrict__ x, float* __restrict__ y, int m, int n, int k,
        long long row_bytes, int split_stages) {
    using U = MfUnit<T>;
    constexpr int NJ = BN / 16;                                // 8-column tiles per warp
    constexpr int S = MfLayout<BN>::stages;
    extern __shared__ __align__(16) u8 smem[];
    u16* sA = (u16*)smem;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row0 = blockIdx.x * MF_BM, col0 = blockIdx.y * BN;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * (BN / 2);     // this warp's 32 x BN/2 sub-tile
    const int chunks = k / 32, stages = (chunks + MF_CH - 1) / MF_CH;
    const int st0 = blockIdx.z * split_stages, st1 = min(stages, st0 + split_stages);   // this split's stages
    y += (long long)blockIdx.z * n * m;

    float acc[2][NJ][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int l = 0; l < 4; ++l) acc[i][j][l] = 0.f;

#pragma unroll
    for (int b = 0; b < S - 1; ++b) {                          // the first S - 1 stages (a group each, maybe empty)
        if (st0 + b < st1) mf_load_stage<T, BN>(w, x, smem, b, st0 + b, row0, col0, m, n, k, row_bytes);
        cp_async_commit();
    }
    for (int st = st0; st < st1; ++st) {
        const int buf = (st - st0) % S;
        cp_async_wait<S - 2>();                                // stage st has landed (this thread's copies)
        __syncthreads();                                       // ... everyone's; and stage st - 1 is computed
        if (st + S - 1 < st1)                                  // into the buffer stage st - 1 used
            mf_load_stage<T, BN>(w, x, smem, (st - st0 + S - 1) % S, st + S - 1, row0, col0, m, n, k, row_bytes);
        cp_async_commit();
        // ---- unpack the stage's raw blocks to f16 (smem -> smem): thread (r, ch) takes row r's chunk ch
        const int r = tid % MF_BM;
        const u8* raw = smem + MfLayout<BN>::raw + buf * MF_RAW_BYTES + r * MF_RAW_LD +
                        (int)(((long long)(row0 + r) * row_bytes + (long long)(st * MF_KT / U::values) * U::bytes) & 15);
        const int cu = (st * MF_KT) % U::values / 32;           // the stage's first chunk in its unit
#pragma unroll
        for (int p = 0; p < MF_BM * MF_CH / MF_THREADS; ++p) {
            const int ch = (tid + p * MF_THREADS) / MF_BM;
            int v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            ChunkScale s = {{0.f, 0.f}, {0.f, 0.f}};
            if (row0 + r < m && st * MF_CH + ch < chunks) unpack<T>(raw, cu + ch, v, s);
            const u32 d2[2] = {f16x2_of(s.d[0], s.d[0]), f16x2_of(s.d[1], s.d[1])};
            const u32 m2[2] = {f16x2_of(s.m[0], s.m[0]), f16x2_of(s.m[1], s.m[1])};
            uint4* dst = (uint4*)(sA + r * MF_LD + ch * 32);
#pragma unroll
            for (int q = 0; q < 4; ++q) {                 // values 8q .. 8q + 7: words 2q, 2q + 1; half q >> 1
                u32 h[4];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    h[e] = f16x2_fma(int8_pair_f16((u32)v[2 * q + (e >> 1)] ^ 0x80808080u, e & 1), d2[q >> 1],
                                     m2[q >> 1]);
                dst[q] = make_uint4(h[0], h[1], h[2], h[3]);
            }
        }
        __syncthreads();
        // ---- compute: the warp's 2 x NJ tiles of 16 x 8 over the stage's steps of k16 (ldmatrix at shared-memory
        // addresses: lane rows and halves fixed, tile and kk offsets constant)
        const u32 a_at = smem_addr(sA + (wm + (lane & 7) + ((lane >> 3) & 1) * 8) * MF_LD + (lane >> 4) * 8);
        const u32 b_at = smem_addr(smem + MfLayout<BN>::x + buf * MF_X_BYTES(BN)) +
                         ((wn + (lane & 7) + (lane >> 4) * 8) * MF_LD + ((lane >> 3) & 1) * 8) * 2;
#pragma unroll
        for (int kk = 0; kk < MF_KT; kk += 16) {
            u32 a[2][4], b[NJ / 2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) ldsm_x4_at(a[i], a_at + (16 * i * MF_LD + kk) * 2);
#pragma unroll
            for (int jp = 0; jp < NJ / 2; ++jp)           // columns wn + 16 jp + 0..7 (b[jp][0..1]), + 8..15 ([2..3])
                ldsm_x4_at(b[jp], b_at + (16 * jp * MF_LD + kk) * 2);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < NJ; ++j) mma_f16(acc[i][j], a[i], b[j >> 1][2 * (j & 1)], b[j >> 1][2 * (j & 1) + 1]);
        }
    }

    mma_store_tile(acc, y, row0 + wm, col0 + wn, lane >> 2, lane & 3, m, n);
}
