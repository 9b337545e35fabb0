/* The LM head's greedy token without reading the whole head: an int8 screen, then the exact logits of
 * the few outputs that can still be the largest (cpu_kernels.h, "head screen", says the arithmetic and
 * why the bound holds). steps/head_screen.py calls these three in order:
 *
 *   screen_pack    once: the head's packed float panels -> W_Q8 bytes (one fp32 scale per output) and
 *                  each output's bound coefficient D[n];
 *   screen_pick    per step, after the W_Q8 linear gave the screen's logits a [M, N]: each row's
 *                  candidates, the outputs whose largest possible exact logit reaches the smallest
 *                  possible largest one;
 *   screen_exact   per step: the candidates' exact logits (the W_FLOAT chain of linear.c, bitwise),
 *                  and each row's first largest.
 *
 * Portable C only: the screen's linear is the vector code of linear.c, and these loops touch a few
 * panels and one pass over each row's N screen logits. */
#include "cpu_kernels.h"

#include <math.h>
#include <stdlib.h>

typedef struct {
    const void* head;
    int64_t N, K, K2, dt;
    int8_t* codes; /* W_Q8 panels [P][K][8] for fp32 calls, then the scales from q8_scales_at(P, K) */
    float* D;
    int64_t bad; /* panels with a value that is not finite (set by any thread: only ever made nonzero) */
} pack_job;

/* panel p's 8 values of k, widened to fp32 */
static inline void panel_k(const pack_job* j, int64_t p, int64_t k, float* w) {
    for (int c = 0; c < 8; c++) w[c] = float_w(j->head, j->K2, 8 * p + c, k, (int)j->dt);
}

/* panel p (8 outputs): scales s = max |w| / 127, codes q = w * (127 / max |w|) rounded to nearest even
 * (by adding and taking off 1.5 * 2^23, exact for |v| < 2^22: no libm call in a portable build), and
 * each output's
 *   D >= |e|_2 + g (|w|_2 + s |q|_2),  e = w - s q,  g = (K2 + 2) 2^-24 / (1 - (K2 + 2) 2^-24)
 * from the codes and scales as stored (any codes would do: the bound takes them as they are), in fp32
 * so that the loop vectorizes: each e_k computed as w - s q is off by at most u (|s q_k| + |e_k|) (u =
 * 2^-24: the product's and the difference's roundings), so |e|_2 <= (|e'|_2 + u s |q|_2) / (1 - 2u) for
 * the computed e'; a sum of K2 squares comes out short by at most a factor 1 - (K2 + 2) u (each square
 * and sum rounded once), so the sums are scaled up by more than that; the result is made an fp32 no
 * smaller. */
static void pack_panel(void* ctx, int64_t p) {
    pack_job* j = (pack_job*)ctx;
    int64_t K2 = j->K2, P = (j->N + 7) / 8;
    float* scales = (float*)((char*)j->codes + q8_scales_at(P, j->K));
    int8_t* out = j->codes + p * j->K * 8;
    double g = (double)(K2 + 2) * 0x1p-24;
    g = g / (1.0 - g);
    float e2[8] = {0}, w2[8] = {0}, q2[8] = {0};
    float amax[8] = {0}, s[8], inv[8], w[8];
    int finite = 1;
    for (int64_t k = 0; k < K2; k++) {
        panel_k(j, p, k, w);
        for (int c = 0; c < 8; c++) {
            finite &= w[c] - w[c] == 0.0f; /* (inf - inf and NaN - NaN are NaN) */
            float a = fabsf(w[c]);
            amax[c] = a > amax[c] ? a : amax[c];
        }
    }
    if (!finite) {
        j->bad = 1;
        return;
    }
    for (int c = 0; c < 8; c++) {
        s[c] = amax[c] / 127.0f;
        inv[c] = amax[c] > 0.0f ? 127.0f / amax[c] : 0.0f;
    }
    for (int64_t k = 0; k < K2; k++) {
        panel_k(j, p, k, w);
        for (int c = 0; c < 8; c++) {
            float q = (w[c] * inv[c] + 0x1.8p23f) - 0x1.8p23f;
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            if (k < j->K) out[k * 8 + c] = (int8_t)q; /* (bf16's padding value K2 - 1 is 0: its code too) */
            float e = w[c] - s[c] * q;
            e2[c] += e * e;
            w2[c] += w[c] * w[c];
            q2[c] += q * q; /* (exact: integers below 2^24) */
        }
    }
    double up = 1.0 + 2.0 * g + 0x1p-40; /* the fp32 sums' shortfall, and more */
    for (int c = 0; c < 8; c++) {
        double sq = (double)s[c] * sqrt((double)q2[c]);
        double e = (sqrt(e2[c] * up) + 0x1p-24 * sq) / (1.0 - 0x1p-23);
        double d = (e + g * (sqrt(w2[c] * up) + sq)) * (1.0 + 0x1p-40);
        float f = (float)d;
        if ((double)f < d) f = nextafterf(f, INFINITY);
        if (8 * p + c < j->N) {
            scales[8 * p + c] = s[c];
            j->D[8 * p + c] = f;
        }
    }
}

int64_t screen_pack(const void* head, int64_t N, int64_t K, int64_t dt, int8_t* codes, float* D, int64_t threads) {
    pack_job j = {head, N, K, dt == DT_BF16 ? K + (K & 1) : K, dt, codes, D, 0};
    run_parallel(pack_panel, &j, (N + 7) / 8, threads);
    return j.bad;
}

typedef struct {
    const void* x;
    const float* a;
    const float* D;
    const void* bias;
    int64_t K, N, dt, cap;
    int64_t* cand;
    int64_t* count;
} pick_job;

/* the screen's interval of output n in fp32, wider than B_n (cpu_kernels.h) by margins that also
 * cover this fp32 arithmetic's own roundings: lo <= a + bias - B_n and hi >= a + bias + B_n */
static inline void interval(const pick_job* j, const float* a, float xn, int64_t n, float* lo, float* hi) {
    float mid = j->bias ? a[n] + load1(j->bias, n, (int)j->dt) : a[n];
    float b = xn * j->D[n] * (1.0f + 0x1p-10f) + 0x1p-19f * (fabsf(a[n]) + fabsf(mid)) + 0x1p-126f;
    *lo = mid - b;
    *hi = mid + b;
}

/* row m: the exact logit rnd(T_n) lies in [rnd(lo_n), rnd(hi_n)] (rounding to dt is monotone), so an
 * output can be the first largest only if rnd(hi_n) >= T = rnd(max_j lo_j); rnd(hi_n) >= T holds only if
 * hi_n >= T less one unit of dt's precision at T, the test made here. count[m] = cap + 1 where more than
 * cap outputs pass, or where a bound is NaN or T is not finite (the full logits decide). */
static void pick_row(void* ctx, int64_t m) {
    pick_job* j = (pick_job*)ctx;
    const float* a = j->a + m * j->N;
    double xx = 0.0;
    for (int64_t k = 0; k < j->K; k++) {
        double v = load1(j->x, m * j->K + k, (int)j->dt);
        xx += v * v;
    }
    float xn = (float)(sqrt(xx) * (1.0 + 0x1p-20));
    float best[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int nan = 0;
    int64_t n = 0;
    for (; n + 8 <= j->N; n += 8) /* 8 independent maxima: a chain the compiler can vectorize */
        for (int i = 0; i < 8; i++) {
            float lo, hi;
            interval(j, a, xn, n + i, &lo, &hi);
            nan |= lo != lo;
            best[i] = lo > best[i] ? lo : best[i];
        }
    for (; n < j->N; n++) {
        float lo, hi;
        interval(j, a, xn, n, &lo, &hi);
        nan |= lo != lo;
        best[0] = lo > best[0] ? lo : best[0];
    }
    float top = best[0];
    for (int i = 1; i < 8; i++) top = best[i] > top ? best[i] : top;
    float T = rnd(top, (int)j->dt);
    if (nan || !isfinite(T)) {
        j->count[m] = j->cap + 1;
        return;
    }
    float unit = j->dt == DT_BF16 ? 0x1p-7f : j->dt == DT_F16 ? 0x1p-10f : 0.0f;
    float thr = T - (fabsf(T) * unit + (unit > 0.0f ? 0x1p-24f : 0.0f)); /* (fp16's subnormals: 2^-24 apart) */
    int64_t c = 0;
    for (n = 0; n < j->N; n++) {
        float lo, hi;
        interval(j, a, xn, n, &lo, &hi);
        if (hi >= thr) {
            if (c == j->cap) {
                j->count[m] = j->cap + 1;
                return;
            }
            j->cand[m * j->cap + c++] = n;
        }
    }
    j->count[m] = c;
}

void screen_pick(const void* x, int64_t M, int64_t K, const float* a, int64_t N, const float* D, const void* bias,
                 int64_t dt, int64_t cap, int64_t* cand, int64_t* count, int64_t threads) {
    pick_job j = {x, a, D, bias, K, N, dt, cap, cand, count};
    run_parallel(pick_row, &j, M, threads);
}

/* row m's candidates' exact logits, each output's W_FLOAT chain as linear.c computes it
 * (linear_output_c), and tokens[m] the first of the largest (the candidates come in increasing order).
 * -1: no memory for the widened row. */
int64_t screen_exact(const void* x, int64_t M, int64_t K, const void* head, int64_t N, const void* bias, int64_t dt,
                     const int64_t* cand, const int64_t* count, int64_t cap, int64_t* tokens) {
    int64_t K2 = dt == DT_BF16 ? K + (K & 1) : K;
    float* xm = (float*)malloc((size_t)K2 * sizeof(float));
    if (!xm) return -1;
    for (int64_t m = 0; m < M; m++) {
        x_row_rest(x, m, K, K2, (int)dt, xm, 1, 0);
        float best = -INFINITY;
        int64_t at = -1;
        for (int64_t i = 0; i < count[m]; i++) {
            int64_t n = cand[m * cap + i];
            float s = linear_output_c(xm, 1, head, W_FLOAT, K2, bias, N, n, (int)dt);
            if (at < 0 || s > best) best = s, at = n;
        }
        tokens[m] = at;
    }
    free(xm);
    return 0;
}
