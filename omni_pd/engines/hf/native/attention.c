/* Decode attention on CPU: one new position per sequence, for any number of sequences, each
 * over exactly its own cached keys and values.
 *
 * Built by omni_pd/engines/hf/native_build.py (gcc -O3 -march=native -ffp-contract=off) and
 * called through ctypes by attention_native.py, once per layer per decode step, in place of one
 * cache write and one scaled_dot_product_attention call per sequence.
 *
 * Batch invariance by construction: sequence b's output is computed from its own query, keys and
 * values only, by loops whose order depends on its length and the head size alone, never on how
 * many sequences share the call or where b sits among them.
 *
 * Addressing. Position p of sequence b, kv head g, lives at
 *     base[b] + table[b][p / block] * block_stride + (p % block) * pos_stride + g * head_stride
 * (strides in floats), keys from k_base[b], values from v_base[b]. The thinker's paged cache
 * passes its block table; the talker's per-request caches pass one block as long as the cache.
 */
#include <math.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
#define LANES 16

static inline v16 load(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

/* q . k over d floats: whole vectors of 16 summed lane-wise, then the lanes in order, then any
 * remainder; the same order for every call with the same d. */
static inline float dot(const float *q, const float *k, int d) {
    int whole = d - d % LANES;
    float total = 0.0f;
    if (whole) {
        v16 acc = load(q) * load(k);
        for (int i = LANES; i < whole; i += LANES)
            acc += load(q + i) * load(k + i);
        for (int lane = 0; lane < LANES; lane++)
            total += acc[lane];
    }
    for (int i = whole; i < d; i++)
        total += q[i] * k[i];
    return total;
}

static inline const float *at(const float *base, const long *table, long block, long block_stride,
                              long pos_stride, long p) {
    return base + table[p / block] * block_stride + (p % block) * pos_stride;
}

/* For each sequence b: write k_new[b], v_new[b] ([kv_heads, d]) at position lengths[b] - 1,
 * then out[b, h] = softmax(scale * q[b, h] . K[0 .. lengths[b]]) V for each query head h
 * (kv head h / (heads / kv_heads)). q and out are [B, heads, d]. tables holds each sequence's
 * block table at table_starts[b]. scratch holds at least max(lengths) + d floats. */
void omni_attn_decode(int batch, int heads, int kv_heads, int d, float scale, const float *q,
                      const float *k_new, const float *v_new, float *out,
                      const long *k_base, const long *v_base, const long *tables,
                      const long *table_starts, const long *lengths, long block,
                      long block_stride, long pos_stride, long head_stride, float *scratch) {
    int group = heads / kv_heads;
    for (int b = 0; b < batch; b++) {
        float *keys = (float *)k_base[b], *values = (float *)v_base[b];
        const long *table = tables + table_starts[b];
        long n = lengths[b];
        float *kw = (float *)at(keys, table, block, block_stride, pos_stride, n - 1);
        float *vw = (float *)at(values, table, block, block_stride, pos_stride, n - 1);
        for (int g = 0; g < kv_heads; g++) {
            memcpy(kw + g * head_stride, k_new + ((long)b * kv_heads + g) * d, d * sizeof(float));
            memcpy(vw + g * head_stride, v_new + ((long)b * kv_heads + g) * d, d * sizeof(float));
        }
        for (int h = 0; h < heads; h++) {
            const float *qh = q + ((long)b * heads + h) * d;
            long offset = (long)(h / group) * head_stride;
            float *score = scratch, *acc = scratch + n;
            float top = -INFINITY;
            for (long p = 0; p < n; p++) {
                score[p] = dot(qh, at(keys, table, block, block_stride, pos_stride, p) + offset, d) * scale;
                if (score[p] > top)
                    top = score[p];
            }
            float total = 0.0f;
            for (long p = 0; p < n; p++) {
                score[p] = expf(score[p] - top);
                total += score[p];
            }
            for (int i = 0; i < d; i++)
                acc[i] = 0.0f;
            for (long p = 0; p < n; p++) {
                const float *vp = at(values, table, block, block_stride, pos_stride, p) + offset;
                float w = score[p] / total;
                for (int i = 0; i < d; i++)
                    acc[i] += w * vp[i];
            }
            memcpy(out + ((long)b * heads + h) * d, acc, d * sizeof(float));
        }
    }
}
