/* The decoder layers' elementwise loops (RMS norms, residual adds and products, RoPE), written once in
 * portable C and compiled once per level: layers.c for level 0, arch/x86/elementwise_avx2.c for AVX2,
 * where the compiler vectorizes the same loops eight lanes at a time. Either way they make the same
 * IEEE operations in the same order (the build keeps products and sums apart, -ffp-contract=off), so
 * the levels give the same bits.
 *
 * Each loop is written for every dtype (an ELEMENTWISE function taking B, the dtype code of
 * cpu_kernels.h) and inlined with B a constant (EACH_DTYPE), so each dtype gets its own loop, which
 * the compiler vectorizes: one loop serving all tests the dtype per value and stays scalar, which a
 * 9-token bf16 step felt in its norms, RoPE and residuals. */
#ifndef HF_PLOOKUP_ELEMENTWISE_H
#define HF_PLOOKUP_ELEMENTWISE_H

#include "cpu_kernels.h"

#define ELEMENTWISE static inline __attribute__((always_inline))
/* a value's load, store and rounding in the loops: cpu_kernels.h's, unless the including file gives
 * its own with the same results (arch/x86/elementwise_avx2.c: fp16 through the compiler's _Float16,
 * which it vectorizes with F16C's conversions) */
#ifndef EW_LOAD
#define EW_LOAD(P, I, B) load1(P, I, B)
#define EW_STORE(P, I, V, B) store1(P, I, V, B)
#define EW_RND(V, B) rnd(V, B)
#endif
#define EACH_DTYPE(CALL)             \
    do {                             \
        if (b16 == DT_BF16) {        \
            const int B = DT_BF16;   \
            CALL;                    \
        } else if (b16 == DT_F16) {  \
            const int B = DT_F16;    \
            CALL;                    \
        } else {                     \
            const int B = DT_F32;    \
            CALL;                    \
        }                            \
    } while (0)

/* RMS normalization of rows m_lo .. m_hi-1 of K values (layers.c, rms_norm, says the forms) */
ELEMENTWISE void rms_rows_n(const void* x, int64_t m_lo, int64_t m_hi, int64_t K, const void* w, float eps,
                            int64_t form, void* out, const int B) {
    for (int64_t m = m_lo; m < m_hi; m++) {
        float acc[8] = {0};
        int64_t k = 0;
        for (; k + 8 <= K; k += 8)
            for (int j = 0; j < 8; j++) {
                float v = EW_LOAD(x, m * K + k + j, B);
                acc[j] += v * v;
            }
        for (; k < K; k++) {
            float v = EW_LOAD(x, m * K + k, B);
            acc[k & 7] += v * v;
        }
        float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        float r = 1.0f / sqrtf(sum / (float)K + eps);
        if (form == 0)
            for (k = 0; k < K; k++) EW_STORE(out, m * K + k, EW_LOAD(w, k, B) * EW_RND(EW_LOAD(x, m * K + k, B) * r, B), B);
        else
            for (k = 0; k < K; k++) EW_STORE(out, m * K + k, EW_LOAD(x, m * K + k, B) * r * (1.0f + EW_LOAD(w, k, B)), B);
    }
}

/* out[i] = a[i] op b[i] (op: + or *) for n values: torch's add or mul (bf16, fp16: the fp32 result rounded) */
ELEMENTWISE void binary_n(void* out, const void* a, const void* b, int64_t n, int mul, const int B) {
    for (int64_t i = 0; i < n; i++) {
        float va = EW_LOAD(a, i, B), vb = EW_LOAD(b, i, B);
        EW_STORE(out, i, mul ? va * vb : va + vb, B);
    }
}

/* RoPE in place on T tokens of nh heads of D values, HF's rotate-half form
 * x * cos + rotate_half(x) * sin, each product rounded, then the sum (no fused multiply-add) */
ELEMENTWISE void rope_n(void* x, int64_t T, int64_t nh, int64_t D, const void* cos, const void* sin, const int B) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nh; h++) {
            int64_t o = (t * nh + h) * D;
            for (int64_t d = 0; d < half; d++) {
                float x1 = EW_LOAD(x, o + d, B), x2 = EW_LOAD(x, o + d + half, B);
                float a1 = EW_RND(x1 * EW_LOAD(cos, t * D + d, B), B);
                float b1 = EW_RND(-x2 * EW_LOAD(sin, t * D + d, B), B);
                float a2 = EW_RND(x2 * EW_LOAD(cos, t * D + d + half, B), B);
                float b2 = EW_RND(x1 * EW_LOAD(sin, t * D + d + half, B), B);
                EW_STORE(x, o + d, a1 + b1, B);
                EW_STORE(x, o + d + half, a2 + b2, B);
            }
        }
}

#endif
