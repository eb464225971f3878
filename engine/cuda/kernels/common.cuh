// Shared device helpers and the per-type "unpack one 32-value chunk" functions every quantized kernel builds on.
//
// A weight row of K values is K/32 chunks. unpack<T>(row, c, v, s) turns chunk c of a row into
//   v[0..7]  : 32 signed int8 values packed four per int (v[0..3] = values 0..15, v[4..7] = values 16..31)
//   s.d[h]   : the scale of half h (values 16h..16h+15); per-32 types set both halves alike
//   s.m[h]   : the additive term of half h (value = d*q + m); zero for the symmetric types
// The numpy dequantizers in engine/quants.py are the reference these are tested against.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// GGML type ids (engine/quants.py)
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23

// First statement of every kernel: in a CUDA graph whose edges into this kernel are programmatic (engine/cuda/pdl.py)
// the kernel is launched while its predecessor's last blocks still run, and waits here until that predecessor has
// finished and its writes are visible; launched any other way, or before sm_90, it does not wait.
#if __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PDL_WAIT() do {} while (0)
#endif

struct ChunkScale { float d[2]; float m[2]; };

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// c[0..3] += A (16 x 32 int8, a[0..3]) * B (32 x 8 int8, b[0..1]) on the tensor cores; lane = 4 * g + t holds
// a = {A[g][4t..], A[g+8][4t..], A[g][16+4t..], A[g+8][16+4t..]}, b = {B[4t..][g], B[16+4t..][g]},
// c = {C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]}
__device__ __forceinline__ void mma_k32(int c[4], const int a[4], const int b[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// mma_k32 with unsigned A (0..255: e.g. Q4 nibbles masked in place, low 0..15 or high 16 x 0..15)
__device__ __forceinline__ void mma_k32_u8(int c[4], const int a[4], const int b[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c[0..3] += A (16 x 8 tf32, a[0..3]) * B (8 x 8 tf32, b0, b1) on the tensor cores, fp32 accumulation; lane 4g + t
// holds a = {A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]}, b0 = B[t][g], b1 = B[t+4][g], c as mma_k32's
__device__ __forceinline__ void mma_tf32_k8(float c[4], const float a[4], float b0, float b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])),
                   "r"(__float_as_uint(a[3])), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}
// x's leading 11 significant bits (a tf32 value, exact), and x rounded to tf32
__device__ __forceinline__ float tf32_hi(float x) { return __uint_as_float(__float_as_uint(x) & 0xFFFFE000u); }
__device__ __forceinline__ float to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
}

// shared-memory address of a generic pointer (for cp.async and ldmatrix)
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// 16-byte asynchronous copy global -> shared-memory address dst (smem_addr)
__device__ __forceinline__ void cp_async16_at(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
// the same, reading src_bytes (0..16) of src and zero-filling the rest
__device__ __forceinline__ void cp_async16_at(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// the same into shared-memory pointer dst
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    cp_async16_at(smem_addr(dst), src, src_bytes);
}
// a release and acquire fence at GPU scope (with a relaxed atomic: a counter other blocks' sums are published by)
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// hint: bring the line holding p into L1 (no register, no wait)
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// wait until at most N of this thread's newest cp.async groups are pending
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// f16 tensor cores (attention): ldmatrix of four 8x8 b16 tiles (.trans: transposed) from shared memory; c[0..3] +=
// A (16 x 16 f16, a[0..3]) * B (16 x 8 f16, b0, b1), fp32 accumulation (fragments as attention_mma.cu says);
// two floats as an f16 pair (lo in the low half)
__device__ __forceinline__ void ldsm_x4_at(u32 r[4], u32 addr) {     // at a shared-memory address (smem_addr)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4(u32 r[4], const u16* p) { ldsm_x4_at(r, smem_addr(p)); }
__device__ __forceinline__ void ldsm_x4_trans(u32 r[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void mma_f16(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) { return (u32)f2h(lo) | ((u32)f2h(hi) << 16); }

// Write a warp's 32 x 8NJ accumulator tile (mma C fragments: [row tile i][column tile j][l]) to y[col][row], rows
// from r0 and columns from c0, those inside m x n.
template <int NJ>
__device__ __forceinline__ void mma_store_tile(const float (&acc)[2][NJ][4], float* __restrict__ y, int r0, int c0,
                                               int g, int t, int m, int n) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int l = 0; l < 4; ++l) {
                const int r = r0 + i * 16 + g + (l >> 1) * 8, cl = c0 + j * 8 + t * 2 + (l & 1);
                if (r < m && cl < n) y[(long long)cl * m + r] = acc[i][j][l];
            }
}

#define NEG_INF __int_as_float(0xff800000)

// One warp's step of flash attention on f16 tensor cores over keys in shared memory (attention_mma.cu's prefill,
// attention.cu's decode): sQ holds 16 query rows (scaled to log2 units), sK and sV the tile's keys and values, rows
// padded by 8 halves (D + 8 apart); the warp takes keys kw..kw+15. S = Q K^T; score e of key tile nt (key kw + 8 nt + 2t + (e & 1)
// of the tile, query row g + 8 (e >> 1), lane = 4g + t) counts where keep(key, row) says so, capped to
// cap2 * tanh(s / cap2) when cap; then the online softmax of rows g and g + 8 in fp32 (m: their maxima, l: this
// lane's part of their sums) and O += P V with P rounded to f16 (o: rows g, g + 8 in 8-column tiles).
template <int D, typename Keep>
__device__ __forceinline__ void fa_tile_step(const u16* sQ, const u16* sK, const u16* sV, int kw, int lane, bool cap,
                                             float cap2, Keep keep, float (&o)[D / 8][4], float (&m)[2],
                                             float (&l)[2]) {
    constexpr int LDS = D + 8;
    const int t = lane & 3;
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};    // S: keys kw + 0..7, kw + 8..15
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
        u32 a[4], b[4];
        ldsm_x4(a, sQ + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + kk + (lane >> 4) * 8);
        ldsm_x4(b, sK + (kw + (lane & 7) + (lane >> 4) * 8) * LDS + kk + ((lane >> 3) & 1) * 8);
        mma_f16(s[0], a, b[0], b[1]);
        mma_f16(s[1], a, b[2], b[3]);
    }
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = e >> 1;
            s[nt][e] = keep(kw + nt * 8 + 2 * t + (e & 1), row) ? (cap ? cap2 * tanhf(s[nt][e] / cap2) : s[nt][e])
                                                                : NEG_INF;
            mx[row] = fmaxf(mx[row], s[nt][e]);
        }
    float corr[2];
#pragma unroll
    for (int row = 0; row < 2; ++row) {
        mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 1));
        mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 2));
        corr[row] = mx[row] == NEG_INF ? 1.f : exp2f(m[row] - mx[row]);
        m[row] = mx[row];
    }
    float p[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[nt][e] = s[nt][e] == NEG_INF ? 0.f : exp2f(s[nt][e] - m[e >> 1]);
    l[0] = l[0] * corr[0] + p[0][0] + p[0][1] + p[1][0] + p[1][1];
    l[1] = l[1] * corr[1] + p[0][2] + p[0][3] + p[1][2] + p[1][3];
    const u32 pa[4] = {pack_f16x2(p[0][0], p[0][1]), pack_f16x2(p[0][2], p[0][3]),
                       pack_f16x2(p[1][0], p[1][1]), pack_f16x2(p[1][2], p[1][3])};
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        o[i][0] *= corr[0]; o[i][1] *= corr[0];
        o[i][2] *= corr[1]; o[i][3] *= corr[1];
    }
#pragma unroll
    for (int nd = 0; nd < D / 16; ++nd) {
        u32 b[4];
        ldsm_x4_trans(b, sV + (kw + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + nd * 16 + (lane >> 4) * 8);
        mma_f16(o[2 * nd], pa, b[0], b[1]);
        mma_f16(o[2 * nd + 1], pa, b[2], b[3]);
    }
}

// After fa_tile_step's last tile: warp w's state of its 16 rows (the lanes' parts of the sums added up first) into
// shared memory, sO : [warps][16][D] outputs, sM, sL : [warps][16] maxima and sums, for fa_merge.
template <int D>
__device__ __forceinline__ void fa_publish(float* sO, float* sM, float* sL, int w, int lane, const float (&o)[D / 8][4],
                                           const float (&m)[2], float (&l)[2]) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int row = 0; row < 2; ++row) {
        l[row] += __shfl_xor_sync(0xffffffffu, l[row], 1);
        l[row] += __shfl_xor_sync(0xffffffffu, l[row], 2);
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        *(float2*)(sO + (w * 16 + g) * D + i * 8 + 2 * t) = make_float2(o[i][0], o[i][1]);
        *(float2*)(sO + (w * 16 + g + 8) * D + i * 8 + 2 * t) = make_float2(o[i][2], o[i][3]);
    }
    if (t == 0) {
        sM[w * 16 + g] = m[0]; sM[w * 16 + g + 8] = m[1];
        sL[w * 16 + g] = l[0]; sL[w * 16 + g + 8] = l[1];
    }
}

// Row r, column d of the WARPS warps' states fa_publish wrote, merged: returns sum_w f_w O_w[r][d], with sum_w f_w l_w
// in sum and the largest maximum in mx (f_w = 2^(m_w - mx), 0 for a warp that saw no key of the row).
template <int D, int WARPS>
__device__ __forceinline__ float fa_merge(const float* sO, const float* sM, const float* sL, int r, int d, float& mx,
                                          float& sum) {
    mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sM[w * 16 + r]);
    float acc = 0.f;
    sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        const float mw = sM[w * 16 + r];
        const float f = mw == NEG_INF ? 0.f : exp2f(mw - mx);
        sum += f * sL[w * 16 + r];
        acc += f * sO[(w * 16 + r) * D + d];
    }
    return acc;
}

// One q8_1 block written by a warp: lane i holds value i of 32 consecutive values; writes qs[0..31] and the halves'
// (d, d * sum of the 16 quantized values) to ds[0], ds[1], with d = max|x| / 127 and q = round(x / d) (the format
// quantize_q8_1 writes and MMVQ / MMQ read).
// With rs (not null) also the residual plane: rs[i] = round((x / d - q) * Q8_RESIDUAL), so that
// x = d * (q + rs / Q8_RESIDUAL) to within d / (2 Q8_RESIDUAL), about max|x| / 64,500 (16-bit activations for the
// MMVQ kernels that take it), and the sums are those of that value: d * (sum q + sum rs / Q8_RESIDUAL).
#define Q8_RESIDUAL 254
__device__ __forceinline__ void warp_store_q8_1(float v, int lane, signed char* qs, float2* ds,
                                                signed char* rs = nullptr) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.f;
    const int q = amax == 0.f ? 0 : (int)roundf(v / d);
    qs[lane] = (signed char)q;
    int sum = q;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);   // sums within each half
    if (rs == nullptr) {
        if ((lane & 15) == 0) ds[lane >> 4] = make_float2(d, d * (float)sum);
        return;
    }
    const int r = amax == 0.f ? 0 : (int)roundf((v / d - (float)q) * (float)Q8_RESIDUAL);
    rs[lane] = (signed char)r;
    int rsum = r;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) rsum += __shfl_xor_sync(0xffffffffu, rsum, o);
    if ((lane & 15) == 0) ds[lane >> 4] = make_float2(d, d * ((float)sum + (float)rsum * (1.f / Q8_RESIDUAL)));
}

// Sum over the 32 lanes of a warp (butterfly: every lane gets the total).
__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

// Sum over a 1-D block (a multiple of 32 threads, at most 1024); every thread gets the total.
__device__ __forceinline__ float block_sum(float s) {
    __shared__ float warp_sums[32];
    s = warp_sum(s);
    __syncthreads();                                   // warp_sums may still be read by a previous call
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
    __syncthreads();
    float total = 0.f;
    const int warps = blockDim.x >> 5;
    for (int i = 0; i < warps; ++i) total += warp_sums[i];
    return total;
}

// bytewise a - b for bytes 0..127 (no borrow between bytes)
__device__ __forceinline__ int sub_bytes(u32 a, u32 b) { return (int)(((a | 0x80808080u) - b) ^ 0x80808080u); }

// 32-bit little-endian read at a 2-byte aligned address
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}
__device__ __forceinline__ u32 ld_u32_a4(const u8* p) { return *(const u32*)p; }

// N little-endian words at a 2-byte aligned address p (the quant bytes of the types whose blocks are 2-byte
// aligned): N aligned 4-byte loads and, where p is not 4-byte aligned, a 2-byte one, funnel-shifted together (N + 1
// loads where ld_u32_a2 takes 2N). Reads no byte outside p .. p + 4N.
template <int N> __device__ __forceinline__ void ld_words_a2(const u8* p, u32 out[N]) {
    const u32 sh = ((u32)(unsigned long long)p & 2u) * 8u;          // 0 or 16
    const u32* a = (const u32*)(p - sh / 8);
    u32 w[N + 1];
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = a[i];
    w[N] = sh ? (u32)*(const u16*)(a + N) : 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = __funnelshift_r(w[i], w[i + 1], sh);
}
__device__ __forceinline__ float ld_f16(const u8* p) { return h2f(*(const u16*)p); }

// bits 0..3 of x -> bit 4 of bytes 0..3
__device__ __forceinline__ u32 spread4_to_bit4(u32 x) {
    return ((x & 1u) << 4) | ((x & 2u) << 11) | ((x & 4u) << 18) | ((x & 8u) << 25);
}

template <int T> struct TypeTraits;
#define TRAITS(T, QK, BYTES, HAS_MIN, PER16) \
    template <> struct TypeTraits<T> { \
        static constexpr int qk = QK, bytes = BYTES, chunks = QK / 32; \
        static constexpr bool has_min = HAS_MIN, per16 = PER16; };
TRAITS(T_Q4_0, 32, 18, false, false)
TRAITS(T_Q4_1, 32, 20, true, false)
TRAITS(T_Q5_0, 32, 22, false, false)
TRAITS(T_Q5_1, 32, 24, true, false)
TRAITS(T_Q8_0, 32, 34, false, false)
TRAITS(T_Q2_K, 256, 84, true, true)
TRAITS(T_Q3_K, 256, 110, false, true)
TRAITS(T_Q4_K, 256, 144, true, false)
TRAITS(T_Q5_K, 256, 176, true, false)
TRAITS(T_Q6_K, 256, 210, false, true)
TRAITS(T_IQ4_NL, 32, 18, false, false)
TRAITS(T_IQ4_XS, 256, 136, false, false)

__device__ __forceinline__ void same_halves(ChunkScale& s, float d, float m) { s.d[0] = s.d[1] = d; s.m[0] = s.m[1] = m; }

// A K-quant block's 6-bit scale and min of chunk j, from its 12 scale bytes held as three little-endian words
__device__ __forceinline__ void scale_min_k4_words(u32 sw0, u32 sw1, u32 sw2, int j, int& d, int& m) {
    auto byte = [&](int i) -> int { return (int)(((i < 4 ? sw0 : i < 8 ? sw1 : sw2) >> (8 * (i & 3))) & 0xFF); };
    if (j < 4) { d = byte(j) & 63; m = byte(j + 4) & 63; }
    else { d = (byte(j + 4) & 0xF) | ((byte(j - 4) >> 6) << 4); m = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4); }
}

// A Q4_K / Q5_K block header held as one uint4 (d|dmin, then the 12 scale bytes) -> chunk j's scale d * sc_j and
// min dmin * m_j
__device__ __forceinline__ void k4_chunk_scale(const uint4& hd, int j, float& d, float& m) {
    int sc, mn;
    scale_min_k4_words(hd.y, hd.z, hd.w, j, sc, mn);
    d = h2f((u16)hd.x) * (float)sc;
    m = h2f((u16)(hd.x >> 16)) * (float)mn;
}

// IQ4_NL's 16 values (engine/quants.py IQ4_NL_VALUES) four int8s to a little-endian word, codes 0-3, 4-7, 8-11, 12-15
#define IQ4_NL_WORD(a, b, c, d) ((u32)(u8)(a) | (u32)(u8)(b) << 8 | (u32)(u8)(c) << 16 | (u32)(u8)(d) << 24)

// The eight 4-bit codes of q -> the int8 values of its low nibbles (lo, byte i from byte i's low nibble) and of its
// high nibbles (hi), from the table held in registers: per 4 codes, two byte permutes pick each code's value among
// codes 0-7 and among 8-15 (by its low 3 bits) and a third keeps the one its bit 3 names; two more put the low and
// the high nibbles' values apart. (A __constant__ table indexed per lane serialized the warp's differing addresses:
// IQ4_XS MMVQ took 208 us at 4096 x 14336, 150 GB/s.)
__device__ __forceinline__ void iq4_lookup8(u32 q, int& lo, int& hi) {
    constexpr u32 t0 = IQ4_NL_WORD(-127, -104, -83, -65), t1 = IQ4_NL_WORD(-49, -35, -22, -10),
                  t2 = IQ4_NL_WORD(1, 13, 25, 38), t3 = IQ4_NL_WORD(53, 69, 89, 113);
    const u32 low3 = q & 0x77777777u, pick = ((q & 0x88888888u) >> 1) | 0x32103210u;
    const u32 a = __byte_perm(__byte_perm(t0, t1, low3), __byte_perm(t2, t3, low3), pick);   // bytes 0, 1: lo hi lo hi
    const u32 b = __byte_perm(__byte_perm(t0, t1, low3 >> 16), __byte_perm(t2, t3, low3 >> 16), pick >> 16);
    lo = (int)__byte_perm(a, b, 0x6420);
    hi = (int)__byte_perm(a, b, 0x7531);
}

template <int T> __device__ __forceinline__ void unpack(const u8* row, int c, int v[8], ChunkScale& s);

template <> __device__ __forceinline__ void unpack<T_Q4_0>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + c * 18;
    same_halves(s, ld_f16(b), 0.f);
    u32 qw[4];
    ld_words_a2<4>(b + 2, qw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 q = qw[i];
        v[i] = sub_bytes(q & 0x0F0F0F0F, 0x08080808);
        v[4 + i] = sub_bytes((q >> 4) & 0x0F0F0F0F, 0x08080808);
    }
}

template <> __device__ __forceinline__ void unpack<T_Q4_1>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + c * 20;
    same_halves(s, ld_f16(b), ld_f16(b + 2));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 q = ld_u32_a4(b + 4 + 4 * i);
        v[i] = q & 0x0F0F0F0F;
        v[4 + i] = (q >> 4) & 0x0F0F0F0F;
    }
}

template <> __device__ __forceinline__ void unpack<T_Q5_0>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + c * 22;
    same_halves(s, ld_f16(b), 0.f);
    u32 qh = ld_u32_a2(b + 2), qw[4];
    ld_words_a2<4>(b + 6, qw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 q = qw[i];
        v[i] = sub_bytes((q & 0x0F0F0F0F) | spread4_to_bit4(qh >> (4 * i)), 0x10101010);
        v[4 + i] = sub_bytes(((q >> 4) & 0x0F0F0F0F) | spread4_to_bit4(qh >> (16 + 4 * i)), 0x10101010);
    }
}

template <> __device__ __forceinline__ void unpack<T_Q5_1>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + c * 24;
    same_halves(s, ld_f16(b), ld_f16(b + 2));
    u32 qh = ld_u32_a4(b + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 q = ld_u32_a4(b + 8 + 4 * i);
        v[i] = (q & 0x0F0F0F0F) | spread4_to_bit4(qh >> (4 * i));
        v[4 + i] = ((q >> 4) & 0x0F0F0F0F) | spread4_to_bit4(qh >> (16 + 4 * i));
    }
}

template <> __device__ __forceinline__ void unpack<T_Q8_0>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + c * 34;
    same_halves(s, ld_f16(b), 0.f);
    ld_words_a2<8>(b + 2, (u32*)v);
}

template <> __device__ __forceinline__ void unpack<T_Q2_K>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + (c >> 3) * 84;
    const int j = c & 7, h = j >> 2, sh = 2 * (j & 3);
    const float d = ld_f16(b + 80), dmin = ld_f16(b + 82);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int sc = b[h * 8 + 2 * (j & 3) + k];
        s.d[k] = d * (float)(sc & 0xF);
        s.m[k] = -(dmin * (float)(sc >> 4));
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = (ld_u32_a4(b + 16 + h * 32 + 4 * i) >> sh) & 0x03030303;
}

template <> __device__ __forceinline__ void unpack<T_Q3_K>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + (c >> 3) * 110;
    const int j = c & 7, h = j >> 2, sh = 2 * (j & 3), hbit = j;
    const float d = ld_f16(b + 108);
    const u8* sc = b + 96;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int is = h * 8 + 2 * (j & 3) + k;
        const int lo = is < 8 ? (sc[is] & 0xF) : (sc[is - 8] >> 4);
        const int hi = (sc[8 + (is & 3)] >> (2 * (is >> 2))) & 3;
        s.d[k] = d * (float)((lo | (hi << 4)) - 32);
        s.m[k] = 0.f;
    }
    u32 qw[8], hw[8];
    ld_words_a2<8>(b + 32 + h * 32, qw);
    ld_words_a2<8>(b, hw);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        u32 q = (qw[i] >> sh) & 0x03030303;
        u32 hm = ((~(hw[i] >> hbit)) & 0x01010101) << 2;   // 4 where the high bit is clear
        v[i] = sub_bytes(q, hm);
    }
}

template <> __device__ __forceinline__ void unpack<T_Q4_K>(const u8* row, int c, int v[8], ChunkScale& s) {
    // blocks are 144 bytes (16-byte aligned): d|dmin and the 12 scale bytes in one 16-byte load (faster than four
    // word loads, measured), the chunk's 32 qs bytes in two
    const u8* b = row + (c >> 3) * 144;
    const int j = c & 7;
    const uint4 hd = *(const uint4*)b;
    const uint4 q0 = *(const uint4*)(b + 16 + (j >> 1) * 32), q1 = *(const uint4*)(b + 32 + (j >> 1) * 32);
    float d, m;
    k4_chunk_scale(hd, j, d, m);
    same_halves(s, d, -m);
    const int sh = 4 * (j & 1);
    const u32 q[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = (q[i] >> sh) & 0x0F0F0F0F;
}
// Q5_K block (176 bytes, 16-byte aligned): d, dmin, 12 scale bytes, qh[32] (bit j of byte i: value i of chunk j),
// qs[128] as Q4_K's; the header, the qh bytes and the chunk's qs bytes in five 16-byte loads (blocks 16-byte aligned)
template <> __device__ __forceinline__ void unpack<T_Q5_K>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + (c >> 3) * 176;
    const int j = c & 7;
    const int sh = 4 * (j & 1);
    const uint4 hd = *(const uint4*)b;
    const uint4 h0 = *(const uint4*)(b + 16), h1 = *(const uint4*)(b + 32);
    const uint4 q0 = *(const uint4*)(b + 48 + (j >> 1) * 32), q1 = *(const uint4*)(b + 64 + (j >> 1) * 32);
    float d, m;
    k4_chunk_scale(hd, j, d, m);
    same_halves(s, d, -m);
    const u32 q[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    const u32 qh[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ((q[i] >> sh) & 0x0F0F0F0F) | (((qh[i] >> j) & 0x01010101) << 4);
}

// Q6_K block (210 bytes, so blocks are only 2-byte aligned): ql[128], qh[64], 16 int8 scales, d. Chunk j (32 values)
// of the block: ql bytes h * 64 + (k & 1) * 32 .. in nibble k >> 1, qh bytes 128 + h * 32 .. at bits 2k, h = j / 4,
// k = j % 4; its two 16-value halves have scales 2k and 2k + 1 of the h-th 8.
template <> __device__ __forceinline__ void unpack<T_Q6_K>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + (c >> 3) * 210;
    const int j = c & 7, h = j >> 2, k = j & 3;
    const float d = ld_f16(b + 208);
    const u16 sc2 = *(const u16*)(b + 192 + h * 8 + 2 * k);            // scales 2k, 2k + 1 (int8 each)
    s.d[0] = d * (float)(signed char)(sc2 & 0xFF);
    s.d[1] = d * (float)(signed char)(sc2 >> 8);
    s.m[0] = s.m[1] = 0.f;
    const int shl = 4 * (k >> 1), shh = 2 * k;
    u32 ql[8], qh[8];
    ld_words_a2<8>(b + h * 64 + (k & 1) * 32, ql);
    ld_words_a2<8>(b + 128 + h * 32, qh);
#pragma unroll
    for (int i = 0; i < 8; ++i)
        v[i] = sub_bytes(((ql[i] >> shl) & 0x0F0F0F0F) | (((qh[i] >> shh) & 0x03030303) << 4), 0x20202020);
}

template <> __device__ __forceinline__ void unpack<T_IQ4_NL>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + c * 18;
    same_halves(s, ld_f16(b), 0.f);
    u32 qw[4];
    ld_words_a2<4>(b + 2, qw);
#pragma unroll
    for (int i = 0; i < 4; ++i) iq4_lookup8(qw[i], v[i], v[4 + i]);
}

template <> __device__ __forceinline__ void unpack<T_IQ4_XS>(const u8* row, int c, int v[8], ChunkScale& s) {
    const u8* b = row + (c >> 3) * 136;             // 8-byte aligned: d|scales_h|scales_l, the chunk's 16 qs bytes
    const int j = c & 7;
    const uint2 hd = *(const uint2*)b, q0 = *(const uint2*)(b + 8 + 16 * j), q1 = *(const uint2*)(b + 16 + 16 * j);
    const u32 scales_h = hd.x >> 16;
    const int ls = ((hd.y >> (4 * j)) & 0xF) | (((scales_h >> (2 * j)) & 3) << 4);
    same_halves(s, h2f((u16)hd.x) * (float)(ls - 32), 0.f);
    const u32 qw[4] = {q0.x, q0.y, q1.x, q1.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) iq4_lookup8(qw[i], v[i], v[4 + i]);
}

// The KV-cache rows of one sequence's positions (attention.cu's paging): position j of the sequence whose block table
// is row tab of tables ([*, width] int32) sits in row tables[tab * width + (j >> shift)] * rows + (j & (2^shift - 1)).
struct KVRows {
    const int* table;    // the sequence's block table
    int shift, rows;
    __device__ __forceinline__ KVRows(const int* tables, int width, int shift_, int rows_, int tab)
        : table(tables + (long long)tab * width), shift(shift_), rows(rows_) {}
    __device__ __forceinline__ long long operator()(int j) const {
        return (long long)table[j >> shift] * rows + (j & (int)((1u << shift) - 1u));
    }
};
