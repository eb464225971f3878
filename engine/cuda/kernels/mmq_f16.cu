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
// consecutive rows) into one f16 tile in f16x2 arithmetic: each pair of values becomes two exact halves 1024 + q (the
// types with a min, whose codes are never negative) or 1152 + q (int8 values, 128 added) by a byte permute (f16 has
// unit spacing in [1024, 2048)), then (h - 1024 or 1152) * d + m in one f16 fma with the chunk's d and m rounded to
// f16 (code_pair_f16). (dequantize_f16 rounds d * q + m once from fp32; this takes fewer instructions and about doubles
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

// The raw bytes a stage of KT values reads: the unit of U::values values (a K-quant block, or KT / 32 blocks) holding
// it
template <int T, int KT = MF_KT> struct MfUnit {
    static constexpr int qk = TypeTraits<T>::qk;
    static constexpr int values = qk > KT ? qk : KT;
    static constexpr int bytes = TypeTraits<T>::bytes * (values / qk);
    static constexpr int pieces = (bytes + 30) / 16;                   // 16-byte lines the unit can touch
};

// Where row `row`'s unit of stage st starts in the row's shared memory: its address mod 16 (the copies keep it, so
// unpack<T>'s aligned loads hold there), in 32-bit arithmetic (products mod 16 survive the wrap-around)
template <int T, int KT>
__device__ __forceinline__ int mf_unit_offset(int row, int st, long long row_bytes) {
    using U = MfUnit<T, KT>;
    return (int)(((u32)row * (u32)(row_bytes & 15) + (u32)(st * KT / U::values) * (u32)(U::bytes & 15)) & 15u);
}

// Issue the copies of the raw units of stage st of the block's MF_BM rows into dst (rows RAW_LD bytes apart): copy i
// = tid + MF_THREADS j takes 16-byte line i % pieces of row i / pieces's unit (which may start anywhere in a line), so
// that a warp's copies cover a few rows' consecutive lines (one row per thread: 32 rows and lines a copy instruction).
// Offsets are 32-bit from the block's first row wb (w + row0 * row_bytes; its address mod 16 is boff): a block's
// MF_BM rows span less than 4 GB.
template <int T, int KT, int RAW_LD>
__device__ __forceinline__ void mf_load_raw(const u8* __restrict__ wb, u32 boff, u8* dst, int st, int rows,
                                            u32 row_bytes) {
    using U = MfUnit<T, KT>;
    static_assert(U::pieces * 16 <= RAW_LD, "a unit's raw bytes exceed the row's shared memory");
    const u32 in_row = (u32)(st * KT / U::values) * U::bytes;              // the unit's first byte in its row
    const u32 in_row_end = min(in_row + U::bytes, row_bytes);
#pragma unroll
    for (int j = 0; j < (MF_BM * U::pieces + MF_THREADS - 1) / MF_THREADS; ++j) {
        const int i = threadIdx.x + MF_THREADS * j, r = i / U::pieces, piece = i % U::pieces;
        if (i >= MF_BM * U::pieces || r >= rows) continue;
        const u32 row_at = (u32)r * row_bytes;
        const int at = (int)(((boff + row_at + in_row) & ~15u) - boff) + piece * 16;   // may be -boff: in w
        if (at < (int)(row_at + in_row_end)) cp_async16(dst + r * RAW_LD + piece * 16, wb + at, 16);
    }
}

// Issue the copies of stage `st` (k-values st * MF_KT ..) into buffer `buf`: the raw units (mf_load_raw), and thread
// (column tid / 16 + 16p, 8 values from 8 * (tid % 16)) the activations.
template <int T, int BN>
__device__ __forceinline__ void mf_load_stage(const u8* __restrict__ w, const u16* __restrict__ x, u8* smem, int buf,
                                              int st, int row0, int col0, int m, int n, int k, long long row_bytes) {
    const long long first = (long long)row0 * row_bytes;
    mf_load_raw<T, MF_KT, MF_RAW_LD>(w + first, (u32)(first & 15), smem + MfLayout<BN>::raw + buf * MF_RAW_BYTES, st,
                                     min(MF_BM, m - row0), (u32)row_bytes);
    const int tid = threadIdx.x;
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
// unpack<T>'s values as code_pair_f16 takes them: as they are where they are never negative (the types with a min,
// TypeTraits::has_min: their codes), else with 128 added to each byte
template <int T> __device__ __forceinline__ u32 code_word(int v) {
    return TypeTraits<T>::has_min ? (u32)v : (u32)v ^ 0x80808080u;
}
// values 2i, 2i + 1 of a code_word as an exact f16 pair: each byte under the exponent of 1024, less 1024 (or 1152)
template <int T> __device__ __forceinline__ u32 code_pair_f16(u32 word, int i) {
    return f16x2_sub(__byte_perm(word, 0x64646464u, i ? 0x4342 : 0x4140),
                     TypeTraits<T>::has_min ? 0x64006400u : 0x64806480u);
}

template <int T, int BN>
__global__ void __launch_bounds__(MF_THREADS, 1)
mmq_f16(const u8* __restrict__ w, const u16* __restrict__ x, float* __restrict__ y, int m, int n, int k,
        long long row_bytes, int split_stages) {
    PDL_WAIT();
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

    float acc[2][NJ][4] = {};                               // [tile][8-column tile][fragment]

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
                        mf_unit_offset<T, MF_KT>(row0 + r, st, row_bytes);
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
                    h[e] = f16x2_fma(code_pair_f16<T>(code_word<T>(v[2 * q + (e >> 1)]), e & 1), d2[q >> 1],
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

// ---- mmq_f16_small: the same product for up to 8 * NB <= 64 columns, the weights unpacked in registers straight into
// the mma's A fragments (no f16 tile in shared memory, no barrier between unpacking and multiplying).
// A stage is MFS_KT = 256 k-values (one K-quant block, eight of the others): each row's raw unit and the NB B tiles'
// activations ([8 NB columns][32 slots of 16 bytes], slot s holding values 8s .. 8s + 7 at mfs_slot(column, s): no
// padding), S stage buffers in flight (cp.async). Warp w takes rows 32 (w & 3) .. + 31 of the block's MF_BM (two
// 16-row tiles) and chunks 4 (w >> 2) .. + 3 of each stage (its "k-warp"); lane (g, t) unpacks chunk c = 4 (w >> 2)
// + t of rows g and g + 8 of each tile (unpack<T>, 32 values) and gives its values 4s .. 4s + 3 to k-step s = 0..7 as
// the fragment's k positions 2t, 2t + 1 (values 4s, 4s + 1) and 2t + 8, 2t + 9 (4s + 2, 4s + 3): the warp's k order
// is permuted inside its steps, and the activations alike, which lane (g, t) reads as values 4s .. 4s + 3 of chunk c
// of column 8 nb + g (one 16-byte load for steps s and s + 1). Weights are made as in mmq_f16 (code_pair_f16, then one
// f16 fma with the chunk's d and m rounded to f16).
// The two k-warps' sums meet in shared memory at the end (k-warp 0's + k-warp 1's). Split-k as mmq_f16's.
// Launch rule (mmq_f16.mmq_f16, where mmq_f16.takes_small): NB = 1, 2, 4 or 8 (the fewest 8-column tiles holding
// n); S stages and P blocks per SM as build.mmq_f16_small_plan(T, NB) says (two up to MFS_PAIR_NB tiles, and up to
// MFS_PAIR_NB_LIGHT for build.MMQ_F16_SMALL_LIGHT's types where MFS_PAIR_MIN_STAGES stages fit); block MF_THREADS,
// grid (ceil(m / MF_BM), ceil(n / (8 NB)), splits), dynamic shared memory S x the stage's bytes
// (mmq_f16.small_smem_bytes; the kernel traps on less); with splits > 1 then mmq_split_sum.
#define MFS_KT 256                       // k-values per stage
#define MFS_XCOL 512                     // bytes per column of a stage's activations: 32 slots of 16 bytes
#define MFS_STAGES_MAX 4                 // stage buffers at most
#define MFS_PAIR_NB 2                    // up to this many B tiles, two blocks per SM ...
#define MFS_PAIR_NB_LIGHT 4              // ... and up to this many for the light types where ...
#define MFS_PAIR_MIN_STAGES 3            // ... this many stages fit
#define MFS_SMEM_PAIR (113 * 1024)       // two blocks per SM: each with at most this much shared memory (sm_90: 228 KB)
#define MFS_SMEM_ONE (227 * 1024)        // one block per SM: at most this much

template <int T, int NB> struct MfsStage {                     // a stage's bytes: raw units, then activations
    static constexpr int raw_ld = MfUnit<T, MFS_KT>::pieces * 16;
    static constexpr int raw = MF_BM * raw_ld, bytes = raw + 8 * NB * MFS_XCOL;
};

// Where slot s (values 8s .. 8s + 7) of a stage's activation column col lies, in 16-byte slots from the column's
// start: bits 0-1 of s flipped by bit 3 of s and bit 0 of col, so that the 8 lanes (g, t) of a quarter-warp (columns
// g = 2p, 2p + 1; chunks c = 4 kw + t: slots 4c + sp) read 8 distinct bank groups
__device__ __forceinline__ int mfs_slot(int col, int s) {
    return s ^ (((s >> 3) & 1) | ((col & 1) << 1));
}

template <int T, int NB, int S, int P>
__global__ void __launch_bounds__(MF_THREADS, P)
mmq_f16_small(const u8* __restrict__ w, const u16* __restrict__ x, float* __restrict__ y, int m, int n, int k,
              long long row_bytes, int split_stages) {
    PDL_WAIT();
    using L = MfsStage<T, NB>;
    static_assert(S * L::bytes <= (P == 2 ? MFS_SMEM_PAIR : MFS_SMEM_ONE), "stages exceed shared memory");
    static_assert(4 * 2 * NB * 4 * 32 * 4 <= S * L::bytes, "the k-warps' sums exceed the stage buffers");
    extern __shared__ __align__(16) u8 smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wm = (warp & 3) * 32, kw = warp >> 2, c = 4 * kw + t;      // the warp's rows, the lane's chunk
    const int row0 = blockIdx.x * MF_BM, col0 = blockIdx.y * 8 * NB;
    const int chunks = k / 32, stages = (k + MFS_KT - 1) / MFS_KT;
    const int st0 = blockIdx.z * split_stages, st1 = min(stages, st0 + split_stages);   // this split's stages
    y += (long long)blockIdx.z * n * m;
    if (tid == 0) {                                            // launched with less shared memory than S stages take
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (u32)(S * L::bytes)) __trap();
    }

    const long long first = (long long)row0 * row_bytes;
    const u8* wb = w + first;                                  // the block's first row
    const u32 boff = (u32)(first & 15);
    const int rows = min(MF_BM, m - row0);
    const u16* xb = x + (long long)col0 * k;                   // the block's first column: [8 NB][k] 32-bit offsets
    auto load = [&](int buf, int st) {                         // issue stage st's copies into buffer buf
        u8* base = smem + buf * L::bytes;
        mf_load_raw<T, MFS_KT, L::raw_ld>(wb, boff, base, st, rows, (u32)row_bytes);
#pragma unroll
        for (int j = 0; j < (8 * NB * 32 + MF_THREADS - 1) / MF_THREADS; ++j) {   // (column, 16-byte slot)
            const int i = tid + MF_THREADS * j, col = i >> 5, kk = st * MFS_KT + (i & 31) * 8;
            if (i >= 8 * NB * 32) continue;
            const bool ok = col0 + col < n && kk < k;
            cp_async16(base + L::raw + col * MFS_XCOL + mfs_slot(col, i & 31) * 16,
                       ok ? xb + (u32)col * (u32)k + kk : x, ok ? 16 : 0);
        }
    };

    float acc[2][NB][4] = {};                               // [tile][8-column tile][fragment]

#pragma unroll
    for (int b = 0; b < S - 1; ++b) {                          // the first S - 1 stages (a group each, maybe empty)
        if (st0 + b < st1) load(b, st0 + b);
        cp_async_commit();
    }
    for (int st = st0; st < st1; ++st) {
        const int buf = (st - st0) % S;
        cp_async_wait<S - 2>();                                // stage st has landed (this thread's copies)
        __syncthreads();                                       // ... everyone's; and stage st - 1 is computed
        if (st + S - 1 < st1) load((st - st0 + S - 1) % S, st + S - 1);
        cp_async_commit();
        const u8* base = smem + buf * L::bytes;
        // the lane's chunk of rows g, g + 8 of each tile: its code words (code_word), d and m as pairs
        u32 wv[2][2][8], d2[2][2][2], m2[2][2][2];           // [tile][row g, g + 8][word] / [half]
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = wm + 16 * i + 8 * h + g;
                int v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                ChunkScale s = {{0.f, 0.f}, {0.f, 0.f}};
                if (row0 + r < m && st * 8 + c < chunks)
                    unpack<T>(base + r * L::raw_ld + mf_unit_offset<T, MFS_KT>(row0 + r, st, row_bytes), c, v, s);
#pragma unroll
                for (int e = 0; e < 8; ++e) wv[i][h][e] = code_word<T>(v[e]);
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    d2[i][h][q] = f16x2_of(s.d[q], s.d[q]);
                    m2[i][h][q] = f16x2_of(s.m[q], s.m[q]);
                }
            }
        const u8* xb = base + L::raw + g * MFS_XCOL + 4 * c * 16;   // column g's chunk c: slots 4c .. 4c + 3, each
        const int flip = mfs_slot(g, 4 * c) & 3;                          // at 4c + (sp ^ flip)
#pragma unroll
        for (int sp = 0; sp < 4; ++sp) {                       // steps 2 sp, 2 sp + 1: values 8 sp .. 8 sp + 7
            uint4 b[NB];
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) b[nb] = *(const uint4*)(xb + nb * 8 * MFS_XCOL + 16 * (sp ^ flip));
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int s = 2 * sp + e, half = s >> 2;
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    u32 a[4];
#pragma unroll
                    for (int f = 0; f < 4; ++f)                // a0, a1: values 4s, 4s + 1 of rows g, g + 8; a2, a3:
                        a[f] = f16x2_fma(code_pair_f16<T>(wv[i][f & 1][s], f >> 1), d2[i][f & 1][half],  // 4s + 2, + 3
                                         m2[i][f & 1][half]);
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb)
                        mma_f16(acc[i][nb], a, e ? b[nb].z : b[nb].x, e ? b[nb].w : b[nb].y);
                }
            }
        }
    }

    cp_async_wait_all();
    __syncthreads();                                           // every stage computed: the buffers are free
    float* sums = (float*)smem;                                // [4 row warps][2][NB][4][32] k-warp 1's sums
    float* mine = sums + (warp & 3) * 2 * NB * 4 * 32 + lane;
    if (kw == 1)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < NB; ++j)
#pragma unroll
                for (int l = 0; l < 4; ++l) mine[((i * NB + j) * 4 + l) * 32] = acc[i][j][l];
    __syncthreads();
    if (kw == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < NB; ++j)
#pragma unroll
                for (int l = 0; l < 4; ++l) acc[i][j][l] += mine[((i * NB + j) * 4 + l) * 32];
        mma_store_tile(acc, y, row0 + wm, col0, g, t, m, n);
    }
}
