/* code2wav on CPU: the convolutional decoder (SnakeBeta and causal convolutions, channel-major,
 * chained per chunk by omni_c2w_decode) and, at the end of the file, the embedding,
 * pre-transformer and upsampler before it (time-major loops).
 *
 * Built by omni_pd/engines/hf/native_build.py (gcc -O3 -march=native -ffp-contract=off -lm) and
 * called through ctypes by code2wav_native.py.
 *
 * In the decoder every value is computed by whole vectors of 16 time steps, with no scalar
 * tail: callers pass lengths rounded up (16 for snake, 32 for conv) and buffers that wide. With
 * contraction off, each lane's result is fixed by IEEE arithmetic alone, so a sample gets the
 * same bits whatever the length of the call and wherever it sits in it: chunks of a stream add
 * up to the whole utterance exactly.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
#define LANES 16

static inline v16 load(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat(float f) { return (v16){} + f; }

/* sin(y)^2. sin^2 has period pi, so y is reduced modulo pi (Cody-Waite, pi in two parts) to
 * r in [-pi/2, pi/2], where an odd Taylor polynomial of degree 11 is within 6e-8 of sin(r). */
static inline v16 sin_squared(v16 y) {
    const v16 magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v16 k = (y * 0.318309886183790671f + magic) - magic;
    v16 r = (y - k * 3.14159274101257324f) - k * -8.74227766e-8f;
    v16 r2 = r * r;
    v16 p = splat(-2.50521083854417187751e-8f);
    p = p * r2 + 2.75573192239858906526e-6f;
    p = p * r2 + -1.98412698412698412526e-4f;
    p = p * r2 + 8.33333333333333333333e-3f;
    p = p * r2 + -1.66666666666666666667e-1f;
    v16 s = r + r * r2 * p;
    return s * s;
}

/* SnakeBeta: out[c, t] = x[c, t] + inv[c] * sin(x[c, t] * alpha[c])^2 for t < n, n a multiple
 * of 16; alpha = exp(module.alpha), inv = 1 / (exp(module.beta) + eps). out may be x. */
void omni_c2w_snake(const float *x, long ldx, float *out, long ldo, const float *alpha,
                    const float *inv, int channels, long n) {
    for (int c = 0; c < channels; c++) {
        const float *xs = x + c * ldx;
        float *os = out + c * ldo;
        for (long t = 0; t < n; t += LANES) {
            v16 v = load(xs + t);
            store(os + t, v + inv[c] * sin_squared(v * alpha[c]));
        }
    }
}

/* A stride-1 convolution over a left-padded input:
 *   out[o, t] = (res[o, t] +) (bias[o] + sum over i, then k, of w[o, i, k] * x[i, t + k * d])
 * for t < n, n a multiple of 32, c_out a multiple of 4, each sum in that order. x's rows hold
 * n + (kernel - 1) * d values (the padding first); res may be NULL. */
void omni_c2w_conv(const float *x, long ldx, float *out, long ldo, const float *w,
                   const float *bias, const float *res, long ldr, int c_in, int c_out, int kernel,
                   int d, long n) {
    const long per_out = (long)c_in * kernel;
    for (int o = 0; o < c_out; o += 4) {
        const float *w0 = w + o * per_out;
        for (long t = 0; t < n; t += 2 * LANES) {
            v16 a0 = splat(bias[o]), a1 = splat(bias[o + 1]);
            v16 a2 = splat(bias[o + 2]), a3 = splat(bias[o + 3]);
            v16 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
            for (int i = 0; i < c_in; i++) {
                const float *xs = x + i * ldx + t;
                const float *wi = w0 + i * kernel;
                for (int k = 0; k < kernel; k++) {
                    v16 lo = load(xs + k * d), hi = load(xs + k * d + LANES);
                    float q0 = wi[k], q1 = wi[per_out + k];
                    float q2 = wi[2 * per_out + k], q3 = wi[3 * per_out + k];
                    a0 += q0 * lo; a1 += q1 * lo; a2 += q2 * lo; a3 += q3 * lo;
                    b0 += q0 * hi; b1 += q1 * hi; b2 += q2 * hi; b3 += q3 * hi;
                }
            }
            if (res) {
                const float *rs = res + o * ldr + t;
                a0 = load(rs) + a0; a1 = load(rs + ldr) + a1;
                a2 = load(rs + 2 * ldr) + a2; a3 = load(rs + 3 * ldr) + a3;
                b0 = load(rs + LANES) + b0; b1 = load(rs + ldr + LANES) + b1;
                b2 = load(rs + 2 * ldr + LANES) + b2; b3 = load(rs + 3 * ldr + LANES) + b3;
            }
            float *os = out + o * ldo + t;
            store(os, a0); store(os + ldo, a1); store(os + 2 * ldo, a2); store(os + 3 * ldo, a3);
            store(os + LANES, b0); store(os + ldo + LANES, b1);
            store(os + 2 * ldo + LANES, b2); store(os + 3 * ldo + LANES, b3);
        }
    }
}

/* One residual unit, fused over tiles of 32 time steps:
 *   out = x + conv2(snake2(conv1(snake1(x))))
 * conv1 [c, c, kernel] with dilation d over a left padding of halo = (kernel - 1) * d inputs,
 * conv2 [c, c, 1]. `padded` [c, halo + n] holds the padding (the carried tail, or zeros) in its
 * first halo columns; snake1(x) is written after it as the tiles advance, so a stream can carry
 * its last halo columns on. `scratch` holds c * 32 floats. Each value is computed exactly as
 * by omni_c2w_snake and omni_c2w_conv (same operations, same order). c a multiple of 4, n of 32. */
void omni_c2w_residual_unit(const float *x, long ldx, float *padded, long ldp, float *out,
                            long ldo, float *scratch, const float *alpha1, const float *inv1,
                            const float *w1, const float *b1, int kernel, int d,
                            const float *alpha2, const float *inv2, const float *w2,
                            const float *b2, int c, long n) {
    const long halo = (long)(kernel - 1) * d;
    const int tile = 2 * LANES;
    float *y = scratch; /* [c, 32] */
    for (long t = 0; t < n; t += tile) {
        /* snake1 of this tile's inputs, into the padded input after the halo */
        omni_c2w_snake(x + t, ldx, padded + halo + t, ldp, alpha1, inv1, c, tile);
        /* conv1 over padded[:, t : t + halo + 32] */
        omni_c2w_conv(padded + t, ldp, y, tile, w1, b1, 0, 0, c, c, kernel, d, tile);
        omni_c2w_snake(y, tile, y, tile, alpha2, inv2, c, tile);
        /* conv2 (1 tap) plus the residual */
        omni_c2w_conv(y, tile, out + t, ldo, w2, b2, x + t, ldx, c, c, 1, 1, tile);
    }
}

/* ---- the whole decoder in one call ---------------------------------------------------------
 *
 * The layers above, chained for one chunk (or a whole utterance) with no return to Python in
 * between: the same calls, on the same buffers' contents, as code2wav_native.py used to make one
 * layer at a time, so the bits are those of the layer-by-layer path. Each layer's input starts
 * with its left padding: `halo` columns from the stream's carry (the previous chunk's last
 * inputs) or zeros, which the layer's last inputs then replace. */
enum { C2W_CONV = 0, C2W_TRANSPOSED = 1, C2W_UNIT = 2, C2W_SNAKE_CONV = 3 };

typedef struct {
    int kind;
    int c_in;       /* input channels */
    int rows;       /* the convolution's output rows (outputs rounded up to 4) */
    int c_out;      /* output channels after the layer (transposed: before interleaving / stride) */
    int kernel, dilation, stride;
    long carry;     /* offset of this layer's [c_in, halo] tail in the carry buffer */
    const float *w, *b, *alpha, *inv;       /* conv (unit: conv1) and the snake before it */
    const float *w2, *b2, *alpha2, *inv2;   /* unit: conv2 and the snake before it */
} c2w_layer;

static long round_up(long n, long to) { return (n + to - 1) / to * to; }

/* A [c, halo + width] input buffer, its first halo columns the carried tail or zeros. */
static float *padded_input(const float *carry, int c, long halo, long width) {
    long ld = halo + width;
    float *p = malloc(sizeof(float) * ((size_t)c * (size_t)ld + 1));
    if (!p) return NULL;
    for (int i = 0; i < c; i++) {
        if (carry) memcpy(p + i * ld, carry + i * halo, sizeof(float) * halo);
        else memset(p + i * ld, 0, sizeof(float) * halo);
    }
    return p;
}

/* The last halo inputs (columns steps .. steps + halo of the padded buffer) into the carry. */
static void keep_tail(float *carry, const float *p, int c, long halo, long width, long steps) {
    if (!carry) return;
    long ld = halo + width;
    for (int i = 0; i < c; i++) memcpy(carry + i * halo, p + i * ld + steps, sizeof(float) * halo);
}

/* The decoder over x, time-major [steps, c0] (the upsampler's output). carry: the stream's
 * tails (NULL: zeros, nothing kept), started: the stream has decoded before (its first input
 * was trimmed then). Writes the samples, clamped to [-1, 1], to out, which holds at least
 * steps * (product of the strides); returns how many, or -1 when memory ran out. */
long omni_c2w_decode(const c2w_layer *layers, int count, const float *x, int c0, long steps,
                     float *carry, int started, float *out) {
    long width = round_up(steps, 2 * LANES);
    float *cur = calloc((size_t)c0 * (size_t)width, sizeof(float));
    if (!cur) return -1;
    for (long t = 0; t < steps; t++)
        for (int c = 0; c < c0; c++) cur[c * width + t] = x[t * c0 + c];
    long samples = -1;
    for (int l = 0; l < count; l++) {
        const c2w_layer *L = &layers[l];
        long halo = (long)(L->kernel - 1) * L->dilation;
        float *tail = carry ? carry + L->carry : NULL;
        float *p = padded_input(tail, L->c_in, halo, width);
        float *y = NULL, *next = NULL;
        if (!p) goto fail;
        long ldp = halo + width;
        if (L->kind == C2W_UNIT) {
            float *scratch = malloc(sizeof(float) * (size_t)L->c_in * 2 * LANES);
            next = malloc(sizeof(float) * ((size_t)L->c_in * (size_t)width + 1));
            if (!scratch || !next) { free(scratch); free(next); free(p); goto fail; }
            omni_c2w_residual_unit(cur, width, p, ldp, next, width, scratch, L->alpha, L->inv,
                                   L->w, L->b, L->kernel, L->dilation, L->alpha2, L->inv2,
                                   L->w2, L->b2, L->c_in, width);
            free(scratch);
            keep_tail(tail, p, L->c_in, halo, width, steps);
            free(p);
            free(cur);
            cur = next;
            continue;
        }
        /* the input after the halo: the previous output (or its snake), zeros past `steps` */
        if (L->alpha) omni_c2w_snake(cur, width, p + halo, ldp, L->alpha, L->inv, L->c_in, width);
        for (int i = 0; i < L->c_in; i++) {
            float *body = p + i * ldp + halo;
            if (!L->alpha) memcpy(body, cur + i * width, sizeof(float) * width);
            memset(body + steps, 0, sizeof(float) * (width - steps));
        }
        keep_tail(tail, p, L->c_in, halo, width, steps);
        y = malloc(sizeof(float) * ((size_t)L->rows * (size_t)width + 1));
        if (!y) { free(p); goto fail; }
        omni_c2w_conv(p, ldp, y, width, L->w, L->b, 0, 0, L->c_in, L->rows, L->kernel, L->dilation, width);
        free(p);
        free(cur);
        cur = NULL;
        if (L->kind == C2W_CONV) {
            cur = y;
        } else if (L->kind == C2W_TRANSPOSED) {
            /* row o * stride + j, column t is sample t * stride + j of channel o; the stream's
             * very first input makes no sample of its own */
            long first = started ? 0 : 1, s = L->stride;
            long n = steps > first ? (steps - first) * s : 0;
            long w2 = round_up(n, 2 * LANES);
            next = calloc((size_t)L->c_out * (size_t)w2 + 1, sizeof(float));
            if (!next) { free(y); goto fail; }
            for (int o = 0; o < L->c_out; o++)
                for (long j = 0; j < s; j++) {
                    const float *row = y + (o * s + j) * width;
                    float *dst = next + o * w2;
                    for (long t = first; t < steps; t++) dst[(t - first) * s + j] = row[t];
                }
            free(y);
            cur = next;
            steps = n;
            width = w2;
        } else { /* C2W_SNAKE_CONV: the last layer, one output channel */
            for (long t = 0; t < steps; t++) {
                float v = y[t];
                out[t] = v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v);
            }
            samples = steps;
            free(y);
        }
    }
    free(cur);
    return samples;
fail:
    free(cur);
    return -1;
}

/* ---- before the decoder: the pre-transformer and the upsampler ------------------------------
 *
 * Time-major and per time step: every value of a frame (or an upsampled step) is computed from
 * that step's inputs and its carried left context by the same loops whatever the call's length,
 * so chunks add up to the whole utterance here as in the decoder. A linear layer is a sum over
 * inputs in ascending order, vectorised across 16 outputs at a time (weights transposed to
 * [in, out], `out` a multiple of 16). */
static void linear_t(const float *wt, const float *x, int in, int out, float *y) {
    for (int o = 0; o < out; o += LANES) {
        v16 acc = splat(0.0f);
        for (int i = 0; i < in; i++) acc += x[i] * load(wt + (long)i * out + o);
        store(y + o, acc);
    }
}

static void rms_norm(const float *x, const float *w, int n, float eps, float *y) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    float r = 1.0f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

typedef struct {
    const float *in_norm, *wq, *wk, *wv, *wo, *attn_scale;  /* wq.. transposed [in, out] */
    const float *post_norm, *wg, *wu, *wd, *mlp_scale;
} c2w_tlayer;

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, inter, window, quantizers;
    float eps, scaling, rope_scaling;
    const float *embed;      /* [codebook rows, hidden] */
    const long *offsets;     /* [quantizers]: each quantizer's first row */
    const float *inv_freq;   /* [head_dim / 2] */
    const float *final_norm;
    const c2w_tlayer *layer;
} c2w_transformer;

/* rotate_half rotary embedding of one head vector at position pos */
static void rotate(float *v, int d, long pos, const float *inv_freq, float scale) {
    int half = d / 2;
    for (int i = 0; i < half; i++) {
        float f = (float)pos * inv_freq[i];
        float c = cosf(f) * scale, s = sinf(f) * scale;
        float a = v[i], b = v[i + half];
        v[i] = a * c + (-b) * s;
        v[i + half] = b * c + a * s;
    }
}

/* The pre-transformer over frames start .. start + n - 1 of an utterance: codes [quantizers, n]
 * (row stride ldc), out [n, hidden]. kv: each layer's rotated keys then values for the window -
 * 1 frames before `start` ([layers][2][window - 1][kv_heads * head_dim], the newest last), of
 * which the last `have` are real (the rest precede the utterance); updated in place for the next
 * chunk. Returns 0, or -1 when memory ran out. */
long omni_c2w_transformer(const c2w_transformer *P, const long *codes, long ldc, long n,
                          long start, float *kv, long have, float *out) {
    const int H = P->hidden, d = P->head_dim, kvd = P->kv_heads * d, qd = P->heads * d;
    const long W = P->window - 1, total = have + n;
    float *x = malloc(sizeof(float) * (size_t)(n * H + 1));
    float *q = malloc(sizeof(float) * (size_t)(n * qd + 1));
    float *keys = malloc(sizeof(float) * (size_t)(total * kvd + 1));
    float *values = malloc(sizeof(float) * (size_t)(total * kvd + 1));
    float *h = malloc(sizeof(float) * (size_t)(H + qd + 2 * P->inter + P->window + 16));
    if (!x || !q || !keys || !values || !h) {
        free(x); free(q); free(keys); free(values); free(h);
        return -1;
    }
    float *attended = h + H, *gate = attended + qd, *up = gate + P->inter, *scores = up + P->inter;
    for (long t = 0; t < n; t++) {  /* the mean of the quantizers' embeddings */
        float *xt = x + t * H;
        for (int i = 0; i < H; i++) xt[i] = 0.0f;
        for (int k = 0; k < P->quantizers; k++) {
            const float *e = P->embed + (codes[k * ldc + t] + P->offsets[k]) * H;
            for (int i = 0; i < H; i++) xt[i] += e[i];
        }
        for (int i = 0; i < H; i++) xt[i] /= (float)P->quantizers;
    }
    for (int l = 0; l < P->layers; l++) {
        const c2w_tlayer *L = &P->layer[l];
        float *carried_k = kv + (long)l * 2 * W * kvd, *carried_v = carried_k + W * kvd;
        memcpy(keys, carried_k + (W - have) * kvd, sizeof(float) * have * kvd);
        memcpy(values, carried_v + (W - have) * kvd, sizeof(float) * have * kvd);
        for (long t = 0; t < n; t++) {
            float *kt = keys + (have + t) * kvd, *vt = values + (have + t) * kvd, *qt = q + t * qd;
            rms_norm(x + t * H, L->in_norm, H, P->eps, h);
            linear_t(L->wq, h, H, qd, qt);
            linear_t(L->wk, h, H, kvd, kt);
            linear_t(L->wv, h, H, kvd, vt);
            for (int j = 0; j < P->heads; j++) rotate(qt + j * d, d, start + t, P->inv_freq, P->rope_scaling);
            for (int j = 0; j < P->kv_heads; j++) rotate(kt + j * d, d, start + t, P->inv_freq, P->rope_scaling);
        }
        for (long t = 0; t < n; t++) {  /* each query over its window of keys */
            long last = have + t, first = last - W < 0 ? 0 : last - W;
            for (int j = 0; j < P->heads; j++) {
                const float *qj = q + t * qd + j * d;
                int g = j / (P->heads / P->kv_heads);
                float top = -INFINITY, sum = 0.0f;
                for (long s = first; s <= last; s++) {
                    const float *ks = keys + s * kvd + g * d;
                    float dot = 0.0f;
                    for (int i = 0; i < d; i++) dot += qj[i] * ks[i];
                    scores[s - first] = dot * P->scaling;
                    if (scores[s - first] > top) top = scores[s - first];
                }
                for (long s = first; s <= last; s++) {
                    scores[s - first] = expf(scores[s - first] - top);
                    sum += scores[s - first];
                }
                float *a = attended + j * d;
                for (int i = 0; i < d; i++) a[i] = 0.0f;
                for (long s = first; s <= last; s++) {
                    const float *vs = values + s * kvd + g * d;
                    float p = scores[s - first] / sum;
                    for (int i = 0; i < d; i++) a[i] += p * vs[i];
                }
            }
            float *xt = x + t * H;
            linear_t(L->wo, attended, qd, H, h);
            for (int i = 0; i < H; i++) xt[i] += L->attn_scale[i] * h[i];
        }
        for (long t = 0; t < n; t++) {
            float *xt = x + t * H;
            rms_norm(xt, L->post_norm, H, P->eps, h);
            linear_t(L->wg, h, H, P->inter, gate);
            linear_t(L->wu, h, H, P->inter, up);
            for (int i = 0; i < P->inter; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
            linear_t(L->wd, gate, P->inter, H, h);
            for (int i = 0; i < H; i++) xt[i] += L->mlp_scale[i] * h[i];
        }
        long keep = total < W ? total : W;  /* the newest frames stay, aligned to the end */
        memcpy(carried_k + (W - keep) * kvd, keys + (total - keep) * kvd, sizeof(float) * keep * kvd);
        memcpy(carried_v + (W - keep) * kvd, values + (total - keep) * kvd, sizeof(float) * keep * kvd);
    }
    for (long t = 0; t < n; t++) rms_norm(x + t * H, P->final_norm, H, P->eps, out + t * H);
    free(x); free(q); free(keys); free(values); free(h);
    return 0;
}

typedef struct {
    int c, stride, inter, kernel;
    float eps;
    const float *up_w;   /* the transposed conv (kernel == stride) as [stride][c_in][c_out] */
    const float *up_b;   /* [c_out] */
    const float *dw_w;   /* the ConvNeXt's depthwise causal conv [c][kernel] */
    const float *dw_b, *ln_w, *ln_b;
    const float *pw1, *pw1_b, *pw2, *pw2_b, *gamma;  /* pw1 [c, inter], pw2 [inter, c] transposed */
} c2w_upblock;

/* The upsampler: per block a transposed conv (kernel == stride, no overlap) then a ConvNeXt
 * block, time-major. x [steps, c]; carry: each block's depthwise input tail [kernel - 1, c]
 * (NULL: zeros, nothing kept); out holds steps * (product of strides) rows. Returns the rows
 * written, or -1 when memory ran out. */
long omni_c2w_upsample(const c2w_upblock *B, int count, const float *x, long steps, float *carry,
                       float *out) {
    const int c = B[0].c;
    long rows = steps;
    for (int b = 0; b < count; b++) rows *= B[b].stride;
    float *cur = malloc(sizeof(float) * (size_t)(rows * c + 1));
    float *nxt = malloc(sizeof(float) * (size_t)(rows * c + 1));
    float *padded = malloc(sizeof(float) * (size_t)((rows + 16) * c + 1));
    float *h = malloc(sizeof(float) * (size_t)(c + B[0].inter + 16));
    if (!cur || !nxt || !padded || !h) {
        free(cur); free(nxt); free(padded); free(h);
        return -1;
    }
    memcpy(cur, x, sizeof(float) * steps * c);
    long n = steps;
    for (int b = 0; b < count; b++) {
        const c2w_upblock *U = &B[b];
        const int s = U->stride, halo = U->kernel - 1;
        for (long t = 0; t < n; t++)
            for (int j = 0; j < s; j++) {
                float *y = nxt + (t * s + j) * c;
                linear_t(U->up_w + (long)j * c * c, cur + t * c, c, c, y);
                for (int o = 0; o < c; o++) y[o] += U->up_b[o];
            }
        n *= s;
        float *tail = carry ? carry + (long)b * halo * c : NULL;
        if (tail) memcpy(padded, tail, sizeof(float) * halo * c);
        else memset(padded, 0, sizeof(float) * halo * c);
        memcpy(padded + halo * c, nxt, sizeof(float) * n * c);
        if (tail) memcpy(tail, padded + n * c, sizeof(float) * halo * c);
        for (long t = 0; t < n; t++) {
            float *xt = nxt + t * c, *dw = cur + t * c;  /* cur is free now: the block's output */
            for (int i = 0; i < c; i++) {
                float v = padded[t * c + i] * U->dw_w[i * U->kernel];
                for (int k = 1; k < U->kernel; k++) v += padded[(t + k) * c + i] * U->dw_w[i * U->kernel + k];
                h[i] = v + U->dw_b[i];
            }
            float mean = 0.0f, var = 0.0f;
            for (int i = 0; i < c; i++) mean += h[i];
            mean /= (float)c;
            for (int i = 0; i < c; i++) var += (h[i] - mean) * (h[i] - mean);
            var /= (float)c;
            float r = 1.0f / sqrtf(var + U->eps);
            for (int i = 0; i < c; i++) h[i] = (h[i] - mean) * r * U->ln_w[i] + U->ln_b[i];
            float *mid = h + c;
            linear_t(U->pw1, h, c, U->inter, mid);
            for (int i = 0; i < U->inter; i++) {
                float v = mid[i] + U->pw1_b[i];
                mid[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752440f));
            }
            linear_t(U->pw2, mid, U->inter, c, dw);
            for (int i = 0; i < c; i++) dw[i] = xt[i] + U->gamma[i] * (dw[i] + U->pw2_b[i]);
        }
    }
    memcpy(out, cur, sizeof(float) * n * c);
    free(cur); free(nxt); free(padded); free(h);
    return n;
}
