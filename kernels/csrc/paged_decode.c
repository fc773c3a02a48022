/* Paged attention of single queries over the paged KV pool, read in place (CPU, float32).
 *
 * Built and loaded by radixrt.kernels.native (ctypes); the Python side is
 * radixrt.kernels.paged_decode_cpu, which states the contract. Query q of kv head h attends
 * the first kv_len[q] keys of its row, keys taken block by block from
 * kv_indices[block_start[q] ...] of a pool laid out [num_blocks, block_size, kv_heads,
 * head_dim]; the `group` query heads that share kv head h are attended together (GQA), so
 * every key is read once per (query token, kv head). Three passes over the row's keys:
 * scores, softmax (max, exp, sum), weighted sum of values; scores are kept in a scratch buffer.
 * Accumulation in float32; exp is a Cephes-style polynomial (relative error < 2e-7).
 *
 * Two implementations: AVX2+FMA intrinsics for head_dim a multiple of 8 (a row's kv heads
 * together: a block's keys are one contiguous run; 8 keys' dot products reduced at once), and
 * portable C (any CPU and head_dim, loops the compiler vectorises). Both prefetch the next
 * block's keys and the current block's values while a block is scored: decode reads KV that
 * the step's weights have pushed out of the caches (tiny Llama, 32 rows x 150 keys, a layer:
 * 290 us with it, 380-445 us without; 120-140 us when the KV is in cache).
 * Threads (num_threads > 1) split the queries: on the OpenMP runtime when built with -fopenmp
 * (torch's pool; csrc/parallel.h), else threads started and joined per call (which
 * costs more than it saves below a few hundred microseconds of work).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "simd.h"

typedef struct {
    const float *q;            /* query t at q + t * q_stride: [kv_heads, group, head_dim] */
    const float *k_cache;      /* [num_blocks, block_size, kv_heads, head_dim] */
    const float *v_cache;      /* same layout */
    const int32_t *kv_indices; /* pool blocks, concatenated block tables */
    const int64_t *block_start;/* [nq] index into kv_indices of the query's first block */
    const int32_t *kv_len;     /* [nq] keys the query attends (>= 1) */
    float *out;                /* query t's result at out + t * out_stride, as q */
    float *lse;                /* [nq, kv_heads, group] natural log-sum-exp, or NULL */
    int64_t nq, q_stride, out_stride;
    int kv_heads, group, head_dim, block_size;
    float scale;
    int max_kv_len;
    int64_t item_begin, item_end; /* one thread's work items: queries (vector path) or
                                     (query, kv head) pairs */
    int status;                   /* 0 ok, 1 out of memory */
} DecodeArgs;

/* Prefetch `bytes` from p on (one request per 64-byte line) into the caches. */
static inline void prefetch_range(const float *p, int64_t bytes) {
    const char *c = (const char *)p;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(RADIXRT_PORTABLE)
#include <immintrin.h>
#define HAVE_AVX2 1

/* The 8 sums of a[0..7] (each summed over its lanes), in one vector. */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                         _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* Scores of query q against the n keys k, k + ts, k + 2 ts, ...: s[o] = scale * q . k_o. */
static inline void scores_avx2(const float *q, const float *k, int64_t ts, int n, int d,
                               float scale, float *s) {
    int o = 0;
    const __m256 sc = _mm256_set1_ps(scale);
    for (; o + 8 <= n; o += 8) {
        __m256 acc[8];
        for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            const __m256 qv = _mm256_loadu_ps(q + i);
            for (int u = 0; u < 8; u++)
                acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (o + u) * ts + i), acc[u]);
        }
        _mm256_storeu_ps(s + o, _mm256_mul_ps(hsum8x8(acc), sc));
    }
    for (; o < n; o++) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + o * ts + i), acc);
        s[o] = hsum8(acc) * scale;
    }
}

/* attend() for every kv head of query qi at once, for head_dim a multiple of 8: a block's
 * keys of all heads are one contiguous run of memory, read front to back, and the next
 * block's keys (and this block's values) are prefetched while this one is scored. */
static void attend_row_avx2(const DecodeArgs *a, int64_t qi, float *s) {
    const int hkv = a->kv_heads, g = a->group, d = a->head_dim, bs = a->block_size;
    const int len = a->kv_len[qi], nblk = (len + bs - 1) / bs;
    const int64_t ts = (int64_t)hkv * d, blk_stride = bs * ts, blk_bytes = blk_stride * 4;
    const float *q = a->q + qi * a->q_stride;
    const int32_t *blocks = a->kv_indices + a->block_start[qi];
    float *out = a->out + qi * a->out_stride;
    const int nqh = hkv * g; /* query heads; head i = h * g + j reads kv head h */
    float *inv_sum = s + (int64_t)nqh * a->max_kv_len; /* scratch: scores, then 1 / sums */
    for (int b = 0, t0 = 0; b < nblk; b++, t0 += bs) {
        const float *kb = a->k_cache + blocks[b] * blk_stride;
        /* the next block's keys and this block's values: without, 1.4x slower on cold KV */
        if (b + 1 < nblk) prefetch_range(a->k_cache + blocks[b + 1] * blk_stride, blk_bytes);
        prefetch_range(a->v_cache + blocks[b] * blk_stride, blk_bytes);
        const int nt = len - t0 < bs ? len - t0 : bs;
        for (int i = 0; i < nqh; i++)
            scores_avx2(q + i * d, kb + (i / g) * d, ts, nt, d, a->scale,
                        s + (int64_t)i * len + t0);
    }
    for (int i = 0; i < nqh; i++) {
        float *sj = s + (int64_t)i * len;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        int t = 0;
        for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sj + t));
        float tmp[8], m;
        _mm256_storeu_ps(tmp, mv);
        m = tmp[0];
        for (int u = 1; u < 8; u++) m = tmp[u] > m ? tmp[u] : m;
        for (; t < len; t++) m = sj[t] > m ? sj[t] : m;
        const __m256 mb = _mm256_set1_ps(m);
        __m256 sum = _mm256_setzero_ps();
        for (t = 0; t + 8 <= len; t += 8) {
            __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mb));
            _mm256_storeu_ps(sj + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        float total = hsum8(sum);
        for (; t < len; t++) {
            sj[t] = exp_nonpos(sj[t] - m);
            total += sj[t];
        }
        if (a->lse) a->lse[qi * nqh + i] = m + logf(total);
        inv_sum[i] = 1.0f / total;
    }
    /* out_i = sum_t p_i[t] v_t * inv_sum_i: two query heads of a kv head at a time, 32 output
     * dims (4 registers) at a time, so 8 independent accumulators hide the FMA latency and
     * each value vector loaded serves both heads. */
    for (int i = 0, two; i < nqh; i += 1 + two) {
        two = i + 1 < nqh && (i + 1) / g == i / g;
        const float *p0 = s + (int64_t)i * len, *p1 = two ? p0 + len : p0;
        const int64_t h_off = (int64_t)(i / g) * d;
        for (int c = 0; c < d; c += 32) {
            const int w = d - c < 32 ? (d - c) / 8 : 4;
            __m256 acc0[4], acc1[4];
            for (int u = 0; u < 4; u++) acc0[u] = acc1[u] = _mm256_setzero_ps();
            for (int b = 0, t0 = 0; b < nblk; b++, t0 += bs) {
                const float *vb = a->v_cache + blocks[b] * blk_stride + h_off + c;
                const int nt = len - t0 < bs ? len - t0 : bs;
                for (int o = 0; o < nt; o++) {
                    const __m256 w0 = _mm256_set1_ps(p0[t0 + o]), w1 = _mm256_set1_ps(p1[t0 + o]);
                    const float *v = vb + o * ts;
                    for (int u = 0; u < w; u++) {
                        const __m256 vv = _mm256_loadu_ps(v + 8 * u);
                        acc0[u] = _mm256_fmadd_ps(w0, vv, acc0[u]);
                        acc1[u] = _mm256_fmadd_ps(w1, vv, acc1[u]);
                    }
                }
            }
            const __m256 iv0 = _mm256_set1_ps(inv_sum[i]);
            for (int u = 0; u < w; u++)
                _mm256_storeu_ps(out + i * d + c + 8 * u, _mm256_mul_ps(acc0[u], iv0));
            if (two) {
                const __m256 iv1 = _mm256_set1_ps(inv_sum[i + 1]);
                for (int u = 0; u < w; u++)
                    _mm256_storeu_ps(out + (i + 1) * d + c + 8 * u, _mm256_mul_ps(acc1[u], iv1));
            }
        }
    }
}
#endif

static void attend(const DecodeArgs *a, int64_t item, float *s) {
    const int64_t qi = item / a->kv_heads;
    const int h = (int)(item % a->kv_heads);
    const int g = a->group, d = a->head_dim, bs = a->block_size, len = a->kv_len[qi];
    const int64_t tok_stride = (int64_t)a->kv_heads * d, blk_stride = bs * tok_stride;
    const float *q = a->q + qi * a->q_stride + (int64_t)h * g * d;
    const int32_t *blocks = a->kv_indices + a->block_start[qi];
    float *out = a->out + qi * a->out_stride + (int64_t)h * g * d;
    const float scale = a->scale;

    const int nblk = (len + bs - 1) / bs;
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) { /* scores */
        const float *kb = a->k_cache + blocks[b] * blk_stride + (int64_t)h * d;
        if (b + 1 < nblk) prefetch_range(a->k_cache + blocks[b + 1] * blk_stride, blk_stride * 4);
        prefetch_range(a->v_cache + blocks[b] * blk_stride, blk_stride * 4);
        const int nt = len - t0 < bs ? len - t0 : bs;
        for (int o = 0; o < nt; o++) {
            const float *k = kb + o * tok_stride;
            for (int j = 0; j < g; j++) {
                const float *qj = q + j * d;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int i = 0; i < d; i++) acc += qj[i] * k[i];
                s[(int64_t)j * len + t0 + o] = acc * scale;
            }
        }
    }
    float inv_sum[64];
    for (int j = 0; j < g; j++) { /* softmax numerators */
        float *sj = s + (int64_t)j * len;
        float m = sj[0];
        for (int t = 1; t < len; t++) m = sj[t] > m ? sj[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; t++) {
            float e = exp_nonpos(sj[t] - m);
            sj[t] = e;
            sum += e;
        }
        inv_sum[j] = 1.0f / sum;
        if (a->lse) a->lse[(qi * a->kv_heads + h) * g + j] = m + logf(sum);
    }
    memset(out, 0, sizeof(float) * (size_t)g * d);
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) { /* values */
        const float *vb = a->v_cache + blocks[b] * blk_stride + (int64_t)h * d;
        const int nt = len - t0 < bs ? len - t0 : bs;
        for (int o = 0; o < nt; o++) {
            const float *v = vb + o * tok_stride;
            for (int j = 0; j < g; j++) {
                const float p = s[(int64_t)j * len + t0 + o];
                float *oj = out + j * d;
#pragma omp simd
                for (int i = 0; i < d; i++) oj[i] += p * v[i];
            }
        }
    }
    for (int j = 0; j < g; j++) {
        float *oj = out + j * d;
        const float w = inv_sum[j];
#pragma omp simd
        for (int i = 0; i < d; i++) oj[i] *= w;
    }
}

static void *run_items(void *arg) {
    DecodeArgs *a = (DecodeArgs *)arg;
    const size_t heads = (size_t)a->group * (size_t)a->kv_heads;
    float *s = (float *)malloc(sizeof(float) * heads * ((size_t)a->max_kv_len + 1));
    if (s == NULL) {
        a->status = 1;
        return NULL;
    }
#ifdef HAVE_AVX2
    if (a->head_dim % 8 == 0) { /* items are rows here: every kv head at once */
        for (int64_t it = a->item_begin; it < a->item_end; it++) attend_row_avx2(a, it, s);
        free(s);
        a->status = 0;
        return NULL;
    }
#endif
    for (int64_t it = a->item_begin; it < a->item_end; it++) attend(a, it, s);
    free(s);
    a->status = 0;
    return NULL;
}

/* Returns 0 on success, 1 out of memory, 2 bad arguments (also: a query's blocks outside
 * kv_indices' num_indices entries, or a block id outside the pool's num_blocks: nothing is
 * read then). */
int radixrt_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                             const int32_t *kv_indices, const int64_t *block_start,
                             const int32_t *kv_len, float *out, float *lse, int64_t nq,
                             int64_t q_stride, int64_t out_stride, int kv_heads, int group,
                             int head_dim, int block_size, float scale, int64_t num_indices,
                             int64_t num_blocks, int num_threads) {
    if (nq < 0 || kv_heads < 1 || group < 1 || group > 64 || head_dim < 1 || block_size < 1)
        return 2;
    int max_len = 1;
    for (int64_t i = 0; i < nq; i++) {
        if (kv_len[i] < 1) return 2;
        if (kv_len[i] > max_len) max_len = kv_len[i];
        const int64_t first = block_start[i], used = (kv_len[i] + block_size - 1) / block_size;
        if (first < 0 || first + used > num_indices) return 2;
        for (int64_t b = first; b < first + used; b++)
            if (kv_indices[b] < 0 || kv_indices[b] >= num_blocks) return 2;
    }
#ifdef HAVE_AVX2
    const int64_t items = head_dim % 8 == 0 ? nq : nq * kv_heads; /* see run_items */
#else
    const int64_t items = nq * kv_heads;
#endif
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > RADIXRT_MAX_THREADS) nt = RADIXRT_MAX_THREADS;
    if (items < nt) nt = items < 1 ? 1 : (int)items;
    DecodeArgs args[RADIXRT_MAX_THREADS];
    for (int t = 0; t < nt; t++) {
        DecodeArgs *a = &args[t];
        a->q = q; a->k_cache = k_cache; a->v_cache = v_cache; a->kv_indices = kv_indices;
        a->block_start = block_start; a->kv_len = kv_len; a->out = out; a->lse = lse;
        a->nq = nq; a->q_stride = q_stride; a->out_stride = out_stride;
        a->kv_heads = kv_heads; a->group = group; a->head_dim = head_dim;
        a->block_size = block_size; a->scale = scale; a->max_kv_len = max_len;
        a->item_begin = items * t / nt;
        a->item_end = items * (t + 1) / nt;
        a->status = 0;
    }
    run_parallel(run_items, args, sizeof(args[0]), nt);
    for (int t = 0; t < nt; t++)
        if (args[t].status) return args[t].status;
    return 0;
}
