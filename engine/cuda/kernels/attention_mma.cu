// attention_prefill_mma: attention.cu's prefill attention (one sequence, many query tokens at consecutive positions,
// causal with an optional sliding window, GQA) on f16 tensor cores, for an f16 KV cache.
//
// A block takes FA_BQ = 16 queries of one head. K and V come in tiles of FA_BK = 64 keys (cp.async into shared
// memory); warp w of the 4 takes keys 16w..16w+15 of each tile: S = Q K^T (mma.sync m16n8k16, f16 in, f32
// accumulate), masked, online softmax in fp32 per query row (scores in log2 units, exp2), then O += P V with P
// rounded to f16. Each warp keeps its own (max, sum, O); at the end the four states merge through shared memory.
// Queries are scaled (scale * log2 e) and rounded to f16 once, into shared memory.
// Fragments (PTX ISA, m16n8k16): lane = 4 g + t holds A rows g and g + 8, columns 2t, 2t + 1 (+ 8); B column g,
// rows 2t, 2t + 1 (+ 8); C rows g and g + 8, columns 2t, 2t + 1. ldmatrix (.trans for V) builds the A and B
// fragments from row-major shared-memory tiles whose rows are padded by 8 halves (16 bytes): the 8 rows one
// ldmatrix reads fall on distinct banks.
//   q : [n, n_head, D] f32; out : [n, n_head, D] f32; cache_k, cache_v : [n_blocks, rows, n_kv, D] f16, paged as
//   attention.cu says (tabs, positions : [n] int32, each row's table row and position; tables, width, shift, rows)
//   tiles : [gridDim.x, 2] int32, each block's first query row and its count (at most FA_BQ rows of one sequence at
//   consecutive positions: launch.prefill_tiles), so that one launch serves the prefill chunks of many sequences;
//   or null: the n rows are one sequence's, FA_BQ a block.
//   Launch rule (backends/cuda.py attention): grid (tiles' count, or ceil(n / 16), n_head), block 128, dynamic
//   shared memory attention_mma_smem_bytes(D); D one of 64, 128, 256.
#include "common.cuh"

#define FA_BQ 16
#define FA_BK 64
#define FA_WARPS 4

__host__ __device__ constexpr int fa_row_halves(int d) { return d + 8; }
// queries, a K tile and a V tile, f16; the final merge reuses the K and V tiles' space
__host__ __device__ constexpr int attention_mma_smem_bytes(int d) { return (FA_BQ + 2 * FA_BK) * fa_row_halves(d) * 2; }

template <int D>
__global__ void __launch_bounds__(128)
attention_prefill_mma(const float* __restrict__ q, const u16* __restrict__ cache_k, const u16* __restrict__ cache_v,
                      float* __restrict__ out, const int* __restrict__ tabs, const int* __restrict__ positions,
                      const int* __restrict__ tables, int width, int shift, int rows, const int* __restrict__ tiles,
                      int n, int n_head, int n_kv, float scale, int window, float softcap) {
    PDL_WAIT();
    constexpr int LDS = fa_row_halves(D);
    extern __shared__ __align__(16) u16 fa_smem[];
    u16* sQ = fa_smem;                 // [FA_BQ][LDS] queries, scaled, f16
    u16* sK = sQ + FA_BQ * LDS;        // [FA_BK][LDS] keys of the tile
    u16* sV = sK + FA_BK * LDS;        // [FA_BK][LDS] values of the tile
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2;
    const int h = blockIdx.y, kvh = h / (n_head / n_kv);
    const int t0 = tiles ? tiles[2 * blockIdx.x] : blockIdx.x * FA_BQ;
    const int nq = tiles ? tiles[2 * blockIdx.x + 1] : min(FA_BQ, n - t0);
    const int p0 = positions[t0], p_last = p0 + nq - 1;     // positions of the block's first and last query
    const float qscale = scale * 1.4426950408889634f;
    const float cap2 = softcap * 1.4426950408889634f;       // the cap in the scores' log2 units
    for (int e = tid; e < FA_BQ * D / 2; e += 128) {
        const int r = e / (D / 2), c = (e % (D / 2)) * 2;
        float2 v = make_float2(0.f, 0.f);
        if (r < nq) v = *(const float2*)(q + ((long long)(t0 + r) * n_head + h) * D + c);
        *(u32*)(sQ + r * LDS + c) = pack_f16x2(v.x * qscale, v.y * qscale);
    }
    const int lo = window > 0 ? max(0, p0 - window + 1) : 0;
    const long long stride = (long long)n_kv * D, off = (long long)kvh * D;
    const KVRows kv(tables, width, shift, rows, tabs[t0]);
    const int qp[2] = {p0 + g, p0 + g + 8};     // positions of this lane's two query rows
    const int kw = warp * 16;                   // this warp's first key in a tile

    float o[D / 8][4];                          // O rows g, g + 8: 8-column tiles
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};   // l: this lane's part of the row sums

    for (int j0 = lo; j0 <= p_last; j0 += FA_BK) {
        __syncthreads();                        // the previous tile is consumed (and sQ written)
        for (int e = tid; e < FA_BK * D / 8; e += 128) {
            const int r = e / (D / 8), c = (e % (D / 8)) * 8, j = j0 + r;
            const bool in = j <= p_last;
            const long long at = in ? kv(j) * stride + off + c : 0;
            cp_async16(sK + r * LDS + c, cache_k + at, in ? 16 : 0);
            cp_async16(sV + r * LDS + c, cache_v + at, in ? 16 : 0);
        }
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        if (j0 + kw > p_last) continue;         // none of this warp's keys is in the tile

        fa_tile_step<D>(sQ, sK, sV, kw, lane, softcap > 0.f, cap2, [&](int key, int row) {
            const int j = j0 + key;
            return j <= qp[row] && (window <= 0 || j > qp[row] - window);
        }, o, m, l);
    }
    // merge the four warps' states: [FA_WARPS][FA_BQ][D] outputs, [FA_WARPS][FA_BQ] maxima and sums
    __syncthreads();
    float* sO = (float*)sK;
    float* sM = sO + FA_WARPS * FA_BQ * D;
    float* sL = sM + FA_WARPS * FA_BQ;
    fa_publish<D>(sO, sM, sL, warp, lane, o, m, l);
    __syncthreads();
    for (int e = tid; e < nq * D; e += 128) {
        const int r = e / D, c = e % D;
        float mx, sum;                          // every query sees at least its own key: mx is finite
        const float acc = fa_merge<D, FA_WARPS>(sO, sM, sL, r, c, mx, sum);
        out[((long long)(t0 + r) * n_head + h) * D + c] = acc / sum;
    }
}
