/* code2wav's convolutional decoder on CPU: SnakeBeta and causal convolutions, channel-major.
 *
 * Built by omni_pd/engines/hf/native_build.py (gcc -O3 -march=native -ffp-contract=off) and
 * called through ctypes by code2wav_native.py.
 *
 * Every value is computed by whole vectors of 16 time steps, with no scalar tail: callers pass
 * lengths rounded up (16 for snake, 32 for conv) and buffers that wide. With contraction off,
 * each lane's result is fixed by IEEE arithmetic alone, so a sample gets the same bits whatever
 * the length of the call and wherever it sits in it: chunks of a stream add up to the whole
 * utterance exactly.
 */
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
