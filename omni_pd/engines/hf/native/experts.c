/* An MoE layer's routed experts on CPU, batch-invariant by construction, at the cost of the
 * experts in use (the weights they read), not of every expert.
 *
 * Built by omni_pd/engines/hf/native_build.py (gcc -O3, -ffp-contract=off) and called through
 * ctypes by experts_native.py, once per MoE layer per step.
 *
 * Why a kernel. A row's result must not depend on its batch. torch's `F.linear` takes other
 * kernels for 1-5 rows than for 8 or more, so the torch path pads each expert's rows to fixed
 * 16-row tiles: exact, but an expert with one row computes 16 (2.5x the plain product's time at
 * the real thinker's shape). Here every output element is one dot product computed alone: 16
 * lane-wise partial sums over the reduction, then the lanes in order, the same sequence of IEEE
 * operations whatever the number of rows, their positions, the other rows' experts, or the
 * number of threads (a thread owns whole output elements). Blocks of 4 rows x 2 weight rows
 * only share loads. Lane sums are plain C on a fixed-width vector type, so the bits do not depend
 * on the ISA the compiler targets either.
 *
 * Layout (transformers' fused experts, float32, contiguous):
 *   gate_up [experts, 2 * inter, hidden]  rows 0..inter-1 gate, inter..2*inter-1 up
 *   down    [experts, hidden, inter]
 * The caller groups the (row, slot) pairs by expert, ascending, rows ascending in a group:
 *   xs[p] = x[row of pair p] ([pairs, hidden], gathered), experts[g] the g-th expert in use,
 *   starts[g] .. starts[g + 1] its pairs, rows[p] / weights[p] the pair's row and routing weight.
 * out ([rows, hidden], zeroed by the caller) gets, for each pair in expert order,
 *   out[row] += weight * down_e(silu(gate_e(x)) * up_e(x)),
 * so each row adds its experts in ascending order, as transformers does. hidden_act holds
 * [pairs, inter] floats of scratch.
 */
#include <math.h>
#include <pthread.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
#define LANES 16
#define ROWS 4

static inline v16 load(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

static inline float lanes_sum(v16 acc) {
    float total = 0.0f;
    for (int lane = 0; lane < LANES; lane++)
        total += acc[lane];
    return total;
}

/* The tail of a reduction that is not a whole number of vectors: zero-padded lanes, so a lane's
 * sequence is the same as in a whole vector (x + 0 * 0 = x exactly, for finite x). */
static inline v16 load_tail(const float *p, int n) {
    float buf[LANES] = {0};
    memcpy(buf, p, (size_t)n * sizeof(float));
    return load(buf);
}

/* res[r][j] = a[r] . w[j] for nr <= ROWS rows of a (stride as) and 2 weight rows (stride ws). */
static inline __attribute__((always_inline)) void dots2(const float *a, long as, int nr, const float *w0, const float *w1, long k,
                  float res[ROWS][2]) {
    v16 acc0[ROWS], acc1[ROWS];
    for (int r = 0; r < ROWS; r++) {
        acc0[r] = (v16){0};
        acc1[r] = (v16){0};
    }
    long whole = k - k % LANES;
    for (long i = 0; i < whole; i += LANES) {
        v16 b0 = load(w0 + i), b1 = load(w1 + i);
        for (int r = 0; r < nr; r++) {
            v16 x = load(a + r * as + i);
            acc0[r] += x * b0;
            acc1[r] += x * b1;
        }
    }
    if (whole < k) {
        int n = (int)(k - whole);
        v16 b0 = load_tail(w0 + whole, n), b1 = load_tail(w1 + whole, n);
        for (int r = 0; r < nr; r++) {
            v16 x = load_tail(a + r * as + whole, n);
            acc0[r] += x * b0;
            acc1[r] += x * b1;
        }
    }
    for (int r = 0; r < nr; r++) {
        res[r][0] = lanes_sum(acc0[r]);
        res[r][1] = lanes_sum(acc1[r]);
    }
}

static inline __attribute__((always_inline)) void dots1(const float *a, long as, int nr, const float *w0, long k, float res[ROWS]) {
    v16 acc[ROWS];
    for (int r = 0; r < ROWS; r++)
        acc[r] = (v16){0};
    long whole = k - k % LANES;
    for (long i = 0; i < whole; i += LANES) {
        v16 b0 = load(w0 + i);
        for (int r = 0; r < nr; r++)
            acc[r] += load(a + r * as + i) * b0;
    }
    if (whole < k) {
        int n = (int)(k - whole);
        v16 b0 = load_tail(w0 + whole, n);
        for (int r = 0; r < nr; r++)
            acc[r] += load_tail(a + r * as + whole, n) * b0;
    }
    for (int r = 0; r < nr; r++)
        res[r] = lanes_sum(acc[r]);
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

typedef struct {
    const float *xs, *gate_up, *down, *weights;
    const long *experts, *starts, *rows;
    long groups, hidden, inter;
    float *hidden_act, *out;
    long lo, hi; /* this thread's slice: of inter (phase 1) or of hidden (phase 2) */
} Work;

/* Phase 1: hidden_act[p][i] = silu(gate_e[i] . xs[p]) * (up_e[i] . xs[p]) for i in [lo, hi). */
static void *gate_up_phase(void *arg) {
    Work *w = (Work *)arg;
    float res[ROWS][2];
    for (long g = 0; g < w->groups; g++) {
        const float *weights = w->gate_up + w->experts[g] * 2 * w->inter * w->hidden;
        for (long i = w->lo; i < w->hi; i++) {
            const float *gate = weights + i * w->hidden, *up = weights + (w->inter + i) * w->hidden;
            for (long p = w->starts[g]; p < w->starts[g + 1]; p += ROWS) {
                int nr = (int)(w->starts[g + 1] - p < ROWS ? w->starts[g + 1] - p : ROWS);
                if (nr == ROWS) /* a constant row count: the accumulators stay in registers */
                    dots2(w->xs + p * w->hidden, w->hidden, ROWS, gate, up, w->hidden, res);
                else
                    dots2(w->xs + p * w->hidden, w->hidden, nr, gate, up, w->hidden, res);
                for (int r = 0; r < nr; r++)
                    w->hidden_act[(p + r) * w->inter + i] = silu(res[r][0]) * res[r][1];
            }
        }
    }
    return NULL;
}

/* Phase 2: out[row][h] += weight * (down_e[h] . hidden_act[p]) for h in [lo, hi), experts in
 * ascending order. */
static void *down_phase(void *arg) {
    Work *w = (Work *)arg;
    float res[ROWS][2], one[ROWS];
    for (long g = 0; g < w->groups; g++) {
        const float *weights = w->down + w->experts[g] * w->hidden * w->inter;
        long h = w->lo;
        for (; h + 1 < w->hi; h += 2) {
            for (long p = w->starts[g]; p < w->starts[g + 1]; p += ROWS) {
                int nr = (int)(w->starts[g + 1] - p < ROWS ? w->starts[g + 1] - p : ROWS);
                const float *d0 = weights + h * w->inter, *d1 = d0 + w->inter;
                if (nr == ROWS)
                    dots2(w->hidden_act + p * w->inter, w->inter, ROWS, d0, d1, w->inter, res);
                else
                    dots2(w->hidden_act + p * w->inter, w->inter, nr, d0, d1, w->inter, res);
                for (int r = 0; r < nr; r++) {
                    float *row = w->out + w->rows[p + r] * w->hidden;
                    row[h] += w->weights[p + r] * res[r][0];
                    row[h + 1] += w->weights[p + r] * res[r][1];
                }
            }
        }
        for (; h < w->hi; h++) {
            for (long p = w->starts[g]; p < w->starts[g + 1]; p += ROWS) {
                int nr = (int)(w->starts[g + 1] - p < ROWS ? w->starts[g + 1] - p : ROWS);
                dots1(w->hidden_act + p * w->inter, w->inter, nr, weights + h * w->inter, w->inter, one);
                for (int r = 0; r < nr; r++)
                    w->out[w->rows[p + r] * w->hidden + h] += w->weights[p + r] * one[r];
            }
        }
    }
    return NULL;
}

#define MAX_THREADS 64

/* Splits [0, n) into `threads` slices (even starts, so phase 2's pairs stay whole) and runs
 * `phase` on each, the last slice on the calling thread. */
static void run(void *(*phase)(void *), Work base, long n, int threads) {
    Work work[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    long step = (n + threads - 1) / threads;
    step += step % 2;
    int used = 0;
    for (int t = 0; t < threads && t * step < n; t++) {
        work[t] = base;
        work[t].lo = t * step;
        work[t].hi = (t + 1) * step < n ? (t + 1) * step : n;
        used = t + 1;
    }
    for (int t = 0; t + 1 < used; t++)
        started[t] = pthread_create(&ids[t], NULL, phase, &work[t]) == 0;
    for (int t = 0; t + 1 < used; t++)
        if (!started[t])
            phase(&work[t]); /* no thread to be had: the same work, on this one */
    if (used)
        phase(&work[used - 1]);
    for (int t = 0; t + 1 < used; t++)
        if (started[t])
            pthread_join(ids[t], NULL);
}

void omni_moe_experts(const float *xs, const float *gate_up, const float *down,
                      const long *experts, const long *starts, long groups, const long *rows,
                      const float *weights, long hidden, long inter, float *hidden_act, float *out,
                      int threads) {
    Work base = {xs, gate_up, down, weights, experts, starts, rows, groups, hidden, inter,
                 hidden_act, out, 0, 0};
    run(gate_up_phase, base, inter, threads);
    run(down_phase, base, hidden, threads);
}
