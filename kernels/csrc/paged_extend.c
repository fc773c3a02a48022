/* Causal attention of extend rows over the paged KV pool, read in place (CPU, float32).
 *
 * Built and loaded by radixrt.kernels.native (ctypes); the Python side is
 * radixrt.kernels.paged_extend_cpu, which states the contract. Row r has kv_len[r] keys,
 * read block by block from kv_indices[block_start[r] ...] of a pool laid out [num_blocks,
 * block_size, kv_heads, head_dim], and q_len[r] queries (its last q_len[r] tokens) at rows
 * q_start[r] ... of q; query i attends keys 0 .. kv_len - q_len + i. Query head j reads kv
 * head j / group (GQA).
 *
 * Work item: (row, kv head, chunk of up to 64 queries). An item copies its keys (up to the
 * chunk's last query's bound) into a transposed scratch, then walks the chunk in tiles of
 * ~24 query vectors (query x the group's heads, query-major): scores of 12 query vectors
 * against 16 keys at a time (24 accumulators, each key's element loaded once per 12 query
 * vectors, each query element broadcast), up to each group's causal bound rounded up to 8
 * keys (fully masked runs are never computed); softmax per query vector (max, exp, sum;
 * Cephes-style exp, relative error < 2e-7; keys past the query's bound get p = 0); then
 * P @ V of 6 query vectors x 32 output dims (24 accumulators), V read from the pool in place.
 * Those tile sizes need AVX-512VL's 32 vector registers (the code stays AVX2: 256-bit
 * vectors, but for the softmax's 16-lane exp); with 16 registers (plain AVX2, or
 * -DRADIXRT_NO_AVX512) they are 6 x 16 and 3 x 32. Accumulators are named variables, not
 * arrays (gcc keeps arrays on the stack).
 * The transpose prefetches K and V rows 48 keys ahead: a pool block can be a page of its own,
 * where the hardware prefetchers stop (32 rows x 600 keys after other work: 1.2 vs 1.9 ms).
 * Accumulation in float32. One layer of tiny Llama (32 fresh rows x 128, 6/2 heads x 32):
 * ~3.8-4.7 ms on one Zen 4 thread vs 10 ms for torch SDPA on gathered K/V
 * (benchmarks/bench_cpu_extend.py); the scores and P @ V loops alone run at ~95% of the
 * core's FMA peak on cached data.
 *
 * Two implementations: AVX2+FMA for head_dim a multiple of 8, and portable C (any CPU and
 * head_dim, or -DRADIXRT_PORTABLE; loops the compiler vectorises). Threads (num_threads > 1)
 * split the items into contiguous runs of about equal cost (queries x keys: later chunks of
 * a causal row cost more); on the OpenMP runtime when built with -fopenmp (torch's pool, as
 * in paged_decode.c), else threads started and joined per call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "simd.h"

#define TILE_VECS 24   /* query vectors a tile aims at (scores scratch: TILE_VECS x keys) */
#define CHUNK_QUERIES 64 /* queries per work item (so causal rows split into several) */
#define MAX_GROUP 64   /* query heads per kv head */
#define PREFETCH_KEYS 48 /* how far ahead the transpose prefetches K and V */
#define MAX_VECS (TILE_VECS > MAX_GROUP ? TILE_VECS : MAX_GROUP) /* query vectors a tile has */

typedef struct {
    const float *q;             /* query token t at q + t * q_stride: [kv_heads, group, d] */
    const float *k_cache;       /* [num_blocks, block_size, kv_heads, head_dim] */
    const float *v_cache;       /* same layout */
    const int32_t *kv_indices;  /* pool blocks, concatenated block tables */
    const int64_t *block_start; /* [R] index into kv_indices of the row's first block */
    const int32_t *kv_len;      /* [R] keys of the row (>= q_len) */
    const int64_t *q_start;     /* [R] the row's first query token */
    const int32_t *q_len;       /* [R] queries of the row (>= 1) */
    float *out;                 /* token t's result at out + t * out_stride, as q */
    float *lse;                 /* [T, kv_heads * group] natural log-sum-exp, or NULL */
    int64_t q_stride, out_stride;
    int kv_heads, group, head_dim, block_size, tile_queries;
    float scale;
    int64_t ldk_max;            /* scratch row length: max keys rounded up to 16 */
    const int64_t *items;       /* item i: row << 32 | kv head << 24 | chunk (see main) */
    int64_t item_begin, item_end;
    int status;                 /* 0 ok, 1 out of memory */
} ExtendArgs;

/* Portable path: keys [0, nk) of kv head h of a row into kt[i * ldk + t] (transposed),
 * zero-padding columns nk .. round16(nk) - 1. */
static void transpose_keys(const ExtendArgs *a, const int32_t *blocks, int h, int nk, float *kt,
                           int64_t ldk) {
    const int d = a->head_dim, bs = a->block_size;
    const int64_t ts = (int64_t)a->kv_heads * d, blk_stride = bs * ts;
    for (int t0 = 0, b = 0; t0 < nk; t0 += bs, b++) {
        const float *kb = a->k_cache + blocks[b] * blk_stride + (int64_t)h * d;
        const int nt = nk - t0 < bs ? nk - t0 : bs;
        for (int o = 0; o < nt; o++) {
            const float *k = kb + o * ts;
            float *dst = kt + t0 + o;
            for (int i = 0; i < d; i++) dst[i * ldk] = k[i];
        }
    }
    const int pad = ((nk + 15) & ~15) - nk;
    if (pad)
        for (int i = 0; i < d; i++) memset(kt + i * ldk + nk, 0, sizeof(float) * (size_t)pad);
}

/* Softmax of scores s[0, bound) in place (p = e^(s - max), unnormalised); zero s[bound, end).
 * Returns the sum; *max_out the max. */
static float softmax_row(float *s, int bound, int end, float *max_out);

#if defined(__AVX2__) && defined(__FMA__) && !defined(RADIXRT_PORTABLE)
#include <immintrin.h>
#define HAVE_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512VL__) && !defined(RADIXRT_NO_AVX512)
#define USE_AVX512 1 /* 32 vector registers for the tiles; 16-lane softmax */
#endif

/* transpose_keys for head_dim a multiple of 8, into panels of 16 keys: key t's dim i at
 * kt[(t / 16) * d * 16 + i * 16 + t % 16] (what scores_avx2 reads, front to back). 8 keys x
 * 8 dims at a time (8 loads, an 8x8 register transpose, 8 stores); keys past nk are zeros. */
static void transpose_keys_avx2(const ExtendArgs *a, const int32_t *blocks, int h, int nk,
                                float *kt) {
    const int d = a->head_dim, bs = a->block_size;
    const int64_t ts = (int64_t)a->kv_heads * d, blk_stride = bs * ts;
    static const float zeros[8] = {0};
    const int nk16 = (nk + 15) & ~15;
    for (int t0 = 0; t0 < nk16; t0 += 8) {
        const float *kp[8];
        for (int u = 0; u < 8; u++) {
            const int t = t0 + u;
            kp[u] = t < nk ? a->k_cache + blocks[t / bs] * blk_stride + (t % bs) * ts + h * d
                           : NULL;
            /* K and V rows PREFETCH_KEYS ahead: blocks are scattered (a block can be a page
             * of its own, where the hardware prefetchers stop); V is read after the scores */
            const int tp = t + PREFETCH_KEYS;
            if (tp < nk) {
                const int64_t off = blocks[tp / bs] * blk_stride + (tp % bs) * ts + h * d;
                for (int c = 0; c < d; c += 16) {
                    __builtin_prefetch(a->k_cache + off + c, 0, 3);
                    __builtin_prefetch(a->v_cache + off + c, 0, 2);
                }
            }
        }
        for (int i = 0; i < d; i += 8) {
            __m256 r[8];
            for (int u = 0; u < 8; u++) r[u] = _mm256_loadu_ps(kp[u] ? kp[u] + i : zeros);
            const __m256 t0a = _mm256_unpacklo_ps(r[0], r[1]);
            const __m256 t1a = _mm256_unpackhi_ps(r[0], r[1]);
            const __m256 t2a = _mm256_unpacklo_ps(r[2], r[3]);
            const __m256 t3a = _mm256_unpackhi_ps(r[2], r[3]);
            const __m256 t4a = _mm256_unpacklo_ps(r[4], r[5]);
            const __m256 t5a = _mm256_unpackhi_ps(r[4], r[5]);
            const __m256 t6a = _mm256_unpacklo_ps(r[6], r[7]);
            const __m256 t7a = _mm256_unpackhi_ps(r[6], r[7]);
            const __m256 u0 = _mm256_shuffle_ps(t0a, t2a, 0x44);
            const __m256 u1 = _mm256_shuffle_ps(t0a, t2a, 0xEE);
            const __m256 u2 = _mm256_shuffle_ps(t1a, t3a, 0x44);
            const __m256 u3 = _mm256_shuffle_ps(t1a, t3a, 0xEE);
            const __m256 u4 = _mm256_shuffle_ps(t4a, t6a, 0x44);
            const __m256 u5 = _mm256_shuffle_ps(t4a, t6a, 0xEE);
            const __m256 u6 = _mm256_shuffle_ps(t5a, t7a, 0x44);
            const __m256 u7 = _mm256_shuffle_ps(t5a, t7a, 0xEE);
            float *dst = kt + (int64_t)(t0 >> 4) * d * 16 + (int64_t)i * 16 + (t0 & 15);
            _mm256_storeu_ps(dst + 0 * 16, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(dst + 1 * 16, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(dst + 2 * 16, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(dst + 3 * 16, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(dst + 4 * 16, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(dst + 5 * 16, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(dst + 6 * 16, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(dst + 7 * 16, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    }
}

#ifdef USE_AVX512
static inline __m512 exp_nonpos16(__m512 x) {
    /* exp_nonpos on 16 lanes; 2^n by scalef */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, fx);
}

/* softmax_row on 16 lanes (the tail masked): a quarter faster than 8 lanes on Zen 4. */
static float softmax_row(float *s, int bound, int end, float *max_out) {
    int t = 0;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= bound; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
    const __mmask16 k = (__mmask16)((1u << (bound - t)) - 1);
    mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + t));
    const float m = _mm512_reduce_max_ps(mv);
    const __m512 mb = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t + 16 <= bound; t += 16) {
        const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mb));
        _mm512_storeu_ps(s + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (t < bound) {
        const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), mb);
        const __m512 e = _mm512_maskz_mov_ps(k, exp_nonpos16(x));
        _mm512_mask_storeu_ps(s + t, k, e);
        sum = _mm512_add_ps(sum, e);
        t = bound;
    }
    for (; t < end; t++) s[t] = 0.0f;
    *max_out = m;
    return _mm512_reduce_add_ps(sum);
}
#else
static float softmax_row(float *s, int bound, int end, float *max_out) {
    /* s has room (and finite values) up to bound rounded up to 8: the tail is one vector */
    const int full = bound & ~7, tail = bound - full;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(tail), lane));
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 mv = ninf;
    int t = 0;
    for (; t < full; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    if (tail) mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + t), keep));
    const float m = hmax8(mv);
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (t = 0; t < full; t += 8) {
        const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (tail) {
        const __m256 x = _mm256_blendv_ps(_mm256_set1_ps(-100.0f),
                                          _mm256_sub_ps(_mm256_loadu_ps(s + t), mb), keep);
        const __m256 e = _mm256_and_ps(exp_nonpos8(x), keep);
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
        t += 8;
    }
    for (; t + 8 <= end; t += 8) _mm256_storeu_ps(s + t, _mm256_setzero_ps());
    for (; t < end; t++) s[t] = 0.0f;
    *max_out = m;
    return hsum8(sum);
}
#endif

/* Query vectors a scores pass takes: 12 x 2 accumulators where there are 32 vector registers
 * (AVX-512VL), else 6 x 2. */
#ifdef USE_AVX512
#define SC_VECS 12
#else
#define SC_VECS 6
#endif

/* s[r * lds + t] = scale * q_r . k_t for R query vectors qp[r], keys t in [0, nk8) (a
 * multiple of 8) of the key panels kt (see transpose_keys_avx2), 16 keys at a time, then 8.
 * Accumulators are named variables (not an array, which gcc keeps on the stack across the
 * loop), dead ones removed for constant R. */
#define SC_FMA(r)                                                                          \
    if (R > r) {                                                                           \
        const __m256 qb = _mm256_broadcast_ss(qp[r] + i);                                  \
        x##r = _mm256_fmadd_ps(qb, ka, x##r);                                              \
        y##r = _mm256_fmadd_ps(qb, kb, y##r);                                              \
    }
#define SC_STORE(r)                                                                        \
    if (R > r) {                                                                           \
        _mm256_storeu_ps(s + r * lds + k0, _mm256_mul_ps(x##r, sc));                       \
        _mm256_storeu_ps(s + r * lds + k0 + 8, _mm256_mul_ps(y##r, sc));                   \
    }
#define SC_FMA8(r)                                                                         \
    if (R > r) x##r = _mm256_fmadd_ps(_mm256_broadcast_ss(qp[r] + i), ka, x##r);
#define SC_STORE8(r)                                                                       \
    if (R > r) _mm256_storeu_ps(s + r * lds + k0, _mm256_mul_ps(x##r, sc));
static inline __attribute__((always_inline)) void scores_avx2(
    const int R, const float *const *qp, const float *kt, int d, int nk8,
    float scale, float *s, int64_t lds) {
    const __m256 sc = _mm256_set1_ps(scale);
    const int nk16 = nk8 & ~15;
    for (int k0 = 0; k0 < nk16; k0 += 16) {
        __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0, x4 = x0, x5 = x0;
        __m256 x6 = x0, x7 = x0, x8 = x0, x9 = x0, x10 = x0, x11 = x0;
        __m256 y0 = x0, y1 = x0, y2 = x0, y3 = x0, y4 = x0, y5 = x0;
        __m256 y6 = x0, y7 = x0, y8 = x0, y9 = x0, y10 = x0, y11 = x0;
        const float *kp = kt + (int64_t)k0 * d;
        for (int i = 0; i < d; i++, kp += 16) {
            const __m256 ka = _mm256_loadu_ps(kp), kb = _mm256_loadu_ps(kp + 8);
            SC_FMA(0) SC_FMA(1) SC_FMA(2) SC_FMA(3) SC_FMA(4) SC_FMA(5)
            SC_FMA(6) SC_FMA(7) SC_FMA(8) SC_FMA(9) SC_FMA(10) SC_FMA(11)
        }
        SC_STORE(0) SC_STORE(1) SC_STORE(2) SC_STORE(3) SC_STORE(4) SC_STORE(5)
        SC_STORE(6) SC_STORE(7) SC_STORE(8) SC_STORE(9) SC_STORE(10) SC_STORE(11)
    }
    if (nk8 > nk16) { /* 8 more keys */
        const int k0 = nk16;
        __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0, x4 = x0, x5 = x0;
        __m256 x6 = x0, x7 = x0, x8 = x0, x9 = x0, x10 = x0, x11 = x0;
        const float *kp = kt + (int64_t)k0 * d;
        for (int i = 0; i < d; i++, kp += 16) {
            const __m256 ka = _mm256_loadu_ps(kp);
            SC_FMA8(0) SC_FMA8(1) SC_FMA8(2) SC_FMA8(3) SC_FMA8(4) SC_FMA8(5)
            SC_FMA8(6) SC_FMA8(7) SC_FMA8(8) SC_FMA8(9) SC_FMA8(10) SC_FMA8(11)
        }
        SC_STORE8(0) SC_STORE8(1) SC_STORE8(2) SC_STORE8(3) SC_STORE8(4) SC_STORE8(5)
        SC_STORE8(6) SC_STORE8(7) SC_STORE8(8) SC_STORE8(9) SC_STORE8(10) SC_STORE8(11)
    }
}

static void scores_dispatch(int R, const float *const *qp, const float *kt, int d,
                            int nk8, float scale, float *s, int64_t lds) {
#define SC_CASE(n)                                                                         \
    case n: scores_avx2(n, qp, kt, d, nk8, scale, s, lds); break;
    switch (R) {
        SC_CASE(1) SC_CASE(2) SC_CASE(3) SC_CASE(4) SC_CASE(5)
#if SC_VECS > 6
        SC_CASE(6) SC_CASE(7) SC_CASE(8) SC_CASE(9) SC_CASE(10) SC_CASE(11)
    default: scores_avx2(12, qp, kt, d, nk8, scale, s, lds); break;
#else
    default: scores_avx2(6, qp, kt, d, nk8, scale, s, lds); break;
#endif
    }
}

/* Query vectors a P @ V pass takes: 6 x 4 accumulators where there are 32 vector registers
 * (AVX-512VL), else 3 x 4 (16 registers). */
#ifdef USE_AVX512
#define PV_VECS 6
#else
#define PV_VECS 3
#endif

/* acc_r[c .. c + 8W) = sum_{t < nk} p_r[t] v_t[c ...] for R query vectors, V of kv head h
 * read from the pool through the row's blocks; stored times inv[r] into op[r] + c. Named
 * accumulators a<r><u> (not an array, which gcc keeps on the stack across the loop), the
 * dead ones removed for constant R and W. */
#define PV_R(r)                                                                            \
    if (R > r) {                                                                           \
        const __m256 w = _mm256_broadcast_ss(p##r + t);                                    \
        if (W > 0) a##r##0 = _mm256_fmadd_ps(w, v0, a##r##0);                              \
        if (W > 1) a##r##1 = _mm256_fmadd_ps(w, v1, a##r##1);                              \
        if (W > 2) a##r##2 = _mm256_fmadd_ps(w, v2, a##r##2);                              \
        if (W > 3) a##r##3 = _mm256_fmadd_ps(w, v3, a##r##3);                              \
    }
#define PV_ST(r)                                                                           \
    if (R > r) {                                                                           \
        const __m256 iv = _mm256_set1_ps(inv[r]);                                          \
        if (W > 0) _mm256_storeu_ps(op[r] + c, _mm256_mul_ps(a##r##0, iv));                \
        if (W > 1) _mm256_storeu_ps(op[r] + c + 8, _mm256_mul_ps(a##r##1, iv));            \
        if (W > 2) _mm256_storeu_ps(op[r] + c + 16, _mm256_mul_ps(a##r##2, iv));           \
        if (W > 3) _mm256_storeu_ps(op[r] + c + 24, _mm256_mul_ps(a##r##3, iv));           \
    }
#define PV_DECL(r) __m256 a##r##0 = z, a##r##1 = z, a##r##2 = z, a##r##3 = z;
static inline __attribute__((always_inline)) void pv_avx2(
    const int R, const int W, const ExtendArgs *a, const int32_t *blocks, int h, int c,
    const float *const *pp, int nk, const float *inv, float *const *op) {
    const int d = a->head_dim, bs = a->block_size;
    const int64_t ts = (int64_t)a->kv_heads * d, blk_stride = bs * ts;
    const __m256 z = _mm256_setzero_ps();
    PV_DECL(0) PV_DECL(1) PV_DECL(2) PV_DECL(3) PV_DECL(4) PV_DECL(5)
    const float *p0 = pp[0], *p1 = pp[R > 1 ? 1 : 0], *p2 = pp[R > 2 ? 2 : 0];
    const float *p3 = pp[R > 3 ? 3 : 0], *p4 = pp[R > 4 ? 4 : 0], *p5 = pp[R > 5 ? 5 : 0];
    for (int t0 = 0, b = 0; t0 < nk; t0 += bs, b++) {
        const float *v = a->v_cache + blocks[b] * blk_stride + (int64_t)h * d + c;
        const int nt = nk - t0 < bs ? nk - t0 : bs;
        for (int t = t0; t < t0 + nt; t++, v += ts) {
            const __m256 v0 = _mm256_loadu_ps(v);
            const __m256 v1 = W > 1 ? _mm256_loadu_ps(v + 8) : z;
            const __m256 v2 = W > 2 ? _mm256_loadu_ps(v + 16) : z;
            const __m256 v3 = W > 3 ? _mm256_loadu_ps(v + 24) : z;
            PV_R(0) PV_R(1) PV_R(2) PV_R(3) PV_R(4) PV_R(5)
        }
    }
    PV_ST(0) PV_ST(1) PV_ST(2) PV_ST(3) PV_ST(4) PV_ST(5)
}

#define PV_CASE(R)                                                                         \
    switch (W) {                                                                           \
    case 1: pv_avx2(R, 1, a, blocks, h, c, pp, nk, inv, op); break;                        \
    case 2: pv_avx2(R, 2, a, blocks, h, c, pp, nk, inv, op); break;                        \
    case 3: pv_avx2(R, 3, a, blocks, h, c, pp, nk, inv, op); break;                        \
    default: pv_avx2(R, 4, a, blocks, h, c, pp, nk, inv, op); break;                       \
    }

static void pv_dispatch(int R, int W, const ExtendArgs *a, const int32_t *blocks, int h, int c,
                        const float *const *pp, int nk, const float *inv, float *const *op) {
    switch (R) {
    case 1: PV_CASE(1) break;
    case 2: PV_CASE(2) break;
#if PV_VECS > 3
    case 3: PV_CASE(3) break;
    case 4: PV_CASE(4) break;
    case 5: PV_CASE(5) break;
    default: PV_CASE(6) break;
#else
    default: PV_CASE(3) break;
#endif
    }
}
#else
static float softmax_row(float *s, int bound, int end, float *max_out) {
    float m = s[0];
    for (int t = 1; t < bound; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < bound; t++) {
        const float e = exp_nonpos(s[t] - m);
        s[t] = e;
        sum += e;
    }
    for (int t = bound; t < end; t++) s[t] = 0.0f;
    *max_out = m;
    return sum;
}
#endif

/* Query vector v of a tile starting at query qa (query-major: v = (qi - qa) * group + j). */
static void run_item(const ExtendArgs *a, int64_t item, float *kt, float *s) {
    const int r = (int)(item >> 32), h = (int)((item >> 24) & 0xff);
    const int chunk = (int)(item & 0xffffff);
    const int g = a->group, d = a->head_dim, hq = a->kv_heads * g;
    const int qlen = a->q_len[r], prefix = a->kv_len[r] - qlen;
    const int qa0 = chunk * CHUNK_QUERIES;
    const int qb0 = qa0 + CHUNK_QUERIES < qlen ? qa0 + CHUNK_QUERIES : qlen;
    const int32_t *blocks = a->kv_indices + a->block_start[r];
    const int nk_item = prefix + qb0; /* keys the chunk's last query attends */
    const int64_t ldk = a->ldk_max;
    const int64_t tok0 = a->q_start[r];
#ifdef HAVE_AVX2
    if (d % 8 == 0)
        transpose_keys_avx2(a, blocks, h, nk_item, kt);
    else
#endif
        transpose_keys(a, blocks, h, nk_item, kt, ldk);
    const int tq = a->tile_queries;
    for (int qa = qa0; qa < qb0; qa += tq) {
        const int qb = qa + tq < qb0 ? qa + tq : qb0;
        const int nv = (qb - qa) * g;
        const int tile_nk = prefix + qb; /* the tile's largest bound */
        const float *qp[MAX_VECS];
        float *op[MAX_VECS];
        float inv[MAX_VECS];
        for (int v = 0; v < nv; v++) {
            const int64_t tok = tok0 + qa + v / g, head = (int64_t)h * g + v % g;
            qp[v] = a->q + tok * a->q_stride + head * d;
            op[v] = a->out + tok * a->out_stride + head * d;
        }
        /* scores, up to each group's causal bound */
#ifdef HAVE_AVX2
        if (d % 8 == 0) {
            for (int v0 = 0; v0 < nv; v0 += SC_VECS) {
                const int R = nv - v0 < SC_VECS ? nv - v0 : SC_VECS;
                const int bound = prefix + qa + (v0 + R - 1) / g + 1;
                scores_dispatch(R, qp + v0, kt, d, (bound + 7) & ~7, a->scale,
                                s + (int64_t)v0 * ldk, ldk);
            }
        } else
#endif
        {
            for (int v = 0; v < nv; v++) {
                const int bound = prefix + qa + v / g + 1;
                float *sv = s + (int64_t)v * ldk;
                const float *qv = qp[v];
                memset(sv, 0, sizeof(float) * (size_t)bound);
                for (int i = 0; i < d; i++) {
                    const float qi = qv[i] * a->scale;
                    const float *kr = kt + i * ldk;
#pragma omp simd
                    for (int t = 0; t < bound; t++) sv[t] += qi * kr[t];
                }
            }
        }
        /* softmax per query vector; masked keys up to the tile's bound get p = 0 */
        for (int v = 0; v < nv; v++) {
            const int bound = prefix + qa + v / g + 1;
            float m;
            const float total = softmax_row(s + (int64_t)v * ldk, bound, tile_nk, &m);
            inv[v] = 1.0f / total;
            if (a->lse) a->lse[(tok0 + qa + v / g) * hq + (int64_t)h * g + v % g] = m + logf(total);
        }
        /* P @ V */
        const float *pp[MAX_VECS];
        for (int v = 0; v < nv; v++) pp[v] = s + (int64_t)v * ldk;
#ifdef HAVE_AVX2
        if (d % 8 == 0) {
            for (int v0 = 0; v0 < nv; v0 += PV_VECS) {
                const int R = nv - v0 < PV_VECS ? nv - v0 : PV_VECS;
                const int nk = prefix + qa + (v0 + R - 1) / g + 1;
                for (int c = 0; c < d; c += 32) {
                    const int W = d - c < 32 ? (d - c) / 8 : 4;
                    pv_dispatch(R, W, a, blocks, h, c, pp + v0, nk, inv + v0, op + v0);
                }
            }
            continue;
        }
#endif
        {
            const int bs = a->block_size;
            const int64_t ts = (int64_t)a->kv_heads * d, blk_stride = bs * ts;
            for (int v = 0; v < nv; v++) {
                const int nk = prefix + qa + v / g + 1;
                float *o = op[v];
                const float *p = pp[v];
                for (int i = 0; i < d; i++) o[i] = 0.0f;
                for (int t0 = 0, b = 0; t0 < nk; t0 += bs, b++) {
                    const float *vb = a->v_cache + blocks[b] * blk_stride + (int64_t)h * d;
                    const int nt = nk - t0 < bs ? nk - t0 : bs;
                    for (int u = 0; u < nt; u++) {
                        const float w = p[t0 + u];
                        const float *vr = vb + u * ts;
#pragma omp simd
                        for (int i = 0; i < d; i++) o[i] += w * vr[i];
                    }
                }
                const float w = inv[v];
#pragma omp simd
                for (int i = 0; i < d; i++) o[i] *= w;
            }
        }
    }
}

static void *run_items(void *arg) {
    ExtendArgs *a = (ExtendArgs *)arg;
    if (a->item_begin >= a->item_end) {
        a->status = 0;
        return NULL;
    }
    const size_t ldk = (size_t)a->ldk_max, nv = (size_t)a->tile_queries * (size_t)a->group;
    float *kt = (float *)malloc(sizeof(float) * ldk * ((size_t)a->head_dim + nv));
    if (kt == NULL) {
        a->status = 1;
        return NULL;
    }
    float *s = kt + ldk * (size_t)a->head_dim;
    for (int64_t it = a->item_begin; it < a->item_end; it++) {
        run_item(a, a->items[it], kt, s);
    }
    free(kt);
    a->status = 0;
    return NULL;
}

/* Returns 0 on success, 1 out of memory, 2 bad arguments. */
int radixrt_paged_extend_f32(const float *q, const float *k_cache, const float *v_cache,
                             const int32_t *kv_indices, const int64_t *block_start,
                             const int32_t *kv_len, const int64_t *q_start, const int32_t *q_len,
                             float *out, float *lse, int64_t num_rows, int64_t num_tokens,
                             int64_t num_indices, int64_t num_blocks, int64_t q_stride,
                             int64_t out_stride, int kv_heads, int group, int head_dim,
                             int block_size, float scale, int num_threads) {
    if (num_rows < 0 || num_tokens < 0 || kv_heads < 1 || kv_heads > 255 || group < 1 ||
        group > MAX_GROUP || head_dim < 1 || block_size < 1 || num_rows > INT32_MAX)
        return 2;
    int max_len = 1;
    int64_t num_items = 0;
    for (int64_t r = 0; r < num_rows; r++) {
        const int ql = q_len[r], kl = kv_len[r];
        if (ql < 1 || kl < ql || q_start[r] < 0 || q_start[r] > num_tokens - ql) return 2;
        const int64_t nblk = (kl + block_size - 1) / block_size;
        if (block_start[r] < 0 || block_start[r] > num_indices - nblk) return 2;
        for (int64_t b = 0; b < nblk; b++) {
            const int32_t blk = kv_indices[block_start[r] + b];
            if (blk < 0 || blk >= num_blocks) return 2;
        }
        if (kl > max_len) max_len = kl;
        num_items += (int64_t)kv_heads * ((ql + CHUNK_QUERIES - 1) / CHUNK_QUERIES);
    }
    if (num_items == 0) return 0;
    int64_t *items = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)num_items);
    if (items == NULL) return 1;
    int64_t *cost = items + num_items; /* cumulative cost (queries x keys) through item i */
    int64_t n = 0, total = 0;
    for (int64_t r = 0; r < num_rows; r++) {
        const int ql = q_len[r], prefix = kv_len[r] - ql;
        for (int c = 0; c * CHUNK_QUERIES < ql; c++) {
            const int qa = c * CHUNK_QUERIES;
            const int qb = qa + CHUNK_QUERIES < ql ? qa + CHUNK_QUERIES : ql;
            /* keys attended by the chunk's queries, plus the transpose and per-query work */
            const int64_t w = (int64_t)(qb - qa) * (prefix + (qa + qb + 1) / 2 + 16) + prefix + qb;
            for (int h = 0; h < kv_heads; h++) {
                items[n] = r << 32 | (int64_t)h << 24 | c;
                total += w;
                cost[n++] = total;
            }
        }
    }
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > RADIXRT_MAX_THREADS) nt = RADIXRT_MAX_THREADS;
    if (num_items < nt) nt = (int)num_items;
    ExtendArgs args[RADIXRT_MAX_THREADS];
    int64_t begin = 0;
    for (int t = 0; t < nt; t++) {
        ExtendArgs *a = &args[t];
        a->q = q; a->k_cache = k_cache; a->v_cache = v_cache; a->kv_indices = kv_indices;
        a->block_start = block_start; a->kv_len = kv_len; a->q_start = q_start;
        a->q_len = q_len; a->out = out; a->lse = lse; a->q_stride = q_stride;
        a->out_stride = out_stride; a->kv_heads = kv_heads; a->group = group;
        a->head_dim = head_dim; a->block_size = block_size; a->scale = scale;
        a->tile_queries = group >= TILE_VECS ? 1 : TILE_VECS / group;
        a->ldk_max = ((int64_t)max_len + 15) & ~(int64_t)15;
        a->items = items;
        /* thread t takes the items whose cumulative cost ends in (total t/nt, total (t+1)/nt] */
        int64_t end = begin;
        const int64_t limit = t == nt - 1 ? total : total * (t + 1) / nt;
        while (end < num_items && cost[end] <= limit) end++;
        if (end == begin && end < num_items && t == nt - 1) end = num_items;
        a->item_begin = begin;
        a->item_end = end;
        begin = end;
        a->status = 0;
    }
    run_parallel(run_items, args, sizeof(args[0]), nt);
    free(items);
    for (int t = 0; t < nt; t++)
        if (args[t].status) return args[t].status;
    return 0;
}
