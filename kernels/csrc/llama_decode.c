/* A whole Llama decode forward on the CPU in one call (float32): embedding, every layer, the
 * final norm. The model's own native pieces, composed: the small-row GEMM (gemm_small.c), the
 * fused elementwise ops (cpu_ops.c) and the paged decode attention (paged_decode.c), called in
 * the order the Python layers call them, so the hidden states are bitwise those of the
 * layer-by-layer path (tests/test_cpu_decode.py checks it). What it saves is Python: a decode
 * step of the tiny Llama spent ~1.8 of its ~5.4 ms of forward outside these kernels, in module
 * calls, wrappers, views and allocations.
 *
 * Built and loaded by radixrt.kernels.native; radixrt.model.cpu_decode is the Python side
 * (which steps and models it takes, and the structs' contract).
 */
#include "gemm_small.c"
#include "cpu_ops.c"
#include "paged_decode.c"

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *qkv, *qkv_bias;         /* packed (gemm_small), bias [q + 2 kv] or NULL */
    const float *o, *gate_up, *down;     /* packed */
    float *k_cache, *v_cache;            /* the layer's pool halves [blocks, bs, hkv, d] */
} LayerWeights;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter;
    int64_t block_size, num_slots, max_positions;
    float eps, scale;
    const float *embed;      /* [vocab, hidden] */
    const float *final_norm; /* [hidden] */
    const float *rope_table; /* [max_positions, 2 * head_dim] */
    const LayerWeights *layers;
    int64_t gemm_parallel_macs;  /* gemm_cpu.PARALLEL_MIN_MACS */
    int64_t attn_parallel_pairs; /* native_rows.NATIVE_MIN_PAIRS_THREADED */
    int64_t ops_parallel_elems;  /* cpu_ops.PARALLEL_MIN_ELEMENTS */
} LlamaModel;

static int gemm_t(const LlamaModel *m, const float *x, int64_t xs, int64_t n, int64_t k,
                  const float *w, int64_t nout, const float *bias, float *out, int nt) {
    int t = n * nout * k >= m->gemm_parallel_macs ? nt : 1;
    return radixrt_gemm_small_f32(x, xs, n, k, w, nout, bias, out, nout, t);
}

/* n decode rows: token t is ids[t] at positions[t], stored at slots[t], attending kv_len[t]
 * keys of blocks kv_indices[block_start[t] ...] (num_indices entries). Writes the final
 * hidden states out [n, hidden].
 * scratch: at least n * (3 hidden + (hq + 2 hkv) d + hq d + 3 inter) floats. Returns 0, or the
 * first failing piece's code (2 bad arguments, 3 an index out of range, 1 out of memory). */
int radixrt_llama_decode_f32(const LlamaModel *m, int64_t n, const int64_t *ids,
                             const int64_t *positions, const int64_t *slots,
                             const int32_t *kv_indices, const int64_t *block_start,
                             const int32_t *kv_len, int64_t num_indices, float *out,
                             float *scratch, int64_t vocab, int num_threads) {
    const int64_t h = m->hidden, hq = m->num_heads, hkv = m->num_kv_heads, d = m->head_dim;
    const int64_t inter = m->inter, qkv_w = (hq + 2 * hkv) * d, q_w = hq * d;
    if (n <= 0 || hq % hkv != 0) return 2;
    for (int64_t t = 0; t < n; t++)
        if (ids[t] < 0 || ids[t] >= vocab) return 3;
    float *x = scratch, *res = x + n * h, *hn = res + n * h, *qkv = hn + n * h;
    float *attn = qkv + n * qkv_w, *gu = attn + n * q_w, *act = gu + n * 2 * inter;
    int64_t pairs = 0;
    for (int64_t t = 0; t < n; t++) pairs += kv_len[t];
    const int attn_threads = pairs >= m->attn_parallel_pairs ? num_threads : 1;
#define OPS_T(elems) ((elems) >= m->ops_parallel_elems ? num_threads : 1)
#define CHECK(call)                                                                          \
    do {                                                                                     \
        int rc_ = (call);                                                                    \
        if (rc_ != 0) return rc_;                                                            \
    } while (0)
    for (int64_t t = 0; t < n; t++) memcpy(res + t * h, m->embed + ids[t] * h, h * sizeof(float));
    for (int64_t l = 0; l < m->num_layers; l++) {
        const LayerWeights *w = &m->layers[l];
        const float *normed = x; /* the layer's normed input */
        if (l == 0) {            /* residual = the embeddings, normed into a new buffer */
            CHECK(radixrt_add_rmsnorm_f32(res, h, NULL, 0, w->input_norm, hn, h, n, h, m->eps,
                                          OPS_T(n * h)));
            normed = hn;
        } else { /* residual += x, x = norm(residual), in place */
            CHECK(radixrt_add_rmsnorm_f32(x, h, res, h, w->input_norm, x, h, n, h, m->eps,
                                          OPS_T(n * h)));
        }
        CHECK(gemm_t(m, normed, h, n, h, w->qkv, qkv_w, w->qkv_bias, qkv, num_threads));
        CHECK(radixrt_rope_neox_f32(qkv, qkv_w, positions, m->rope_table, m->max_positions, n,
                                    (int)(hq + hkv), (int)d, OPS_T(n * (hq + hkv) * d)));
        CHECK(radixrt_store_kv_f32(qkv + q_w, qkv_w, qkv + q_w + hkv * d, qkv_w, slots,
                                   w->k_cache, w->v_cache, m->num_slots, n, hkv * d));
        CHECK(radixrt_paged_decode_f32(qkv, w->k_cache, w->v_cache, kv_indices, block_start,
                                       kv_len, attn, NULL, n, qkv_w, q_w, (int)hkv,
                                       (int)(hq / hkv), (int)d, (int)m->block_size, m->scale,
                                       num_indices, m->num_slots / m->block_size,
                                       attn_threads));
        CHECK(gemm_t(m, attn, q_w, n, q_w, w->o, h, NULL, x, num_threads));
        CHECK(radixrt_add_rmsnorm_f32(x, h, res, h, w->post_norm, x, h, n, h, m->eps,
                                      OPS_T(n * h)));
        CHECK(gemm_t(m, x, h, n, h, w->gate_up, 2 * inter, NULL, gu, num_threads));
        CHECK(radixrt_silu_mul_f32(gu, 2 * inter, gu + inter, 2 * inter, act, inter, n, inter,
                                   OPS_T(n * inter)));
        CHECK(gemm_t(m, act, inter, n, inter, w->down, h, NULL, x, num_threads));
    }
    CHECK(radixrt_add_rmsnorm_f32(x, h, res, h, m->final_norm, out, h, n, h, m->eps,
                                  OPS_T(n * h)));
#undef CHECK
#undef OPS_T
    return 0;
}
