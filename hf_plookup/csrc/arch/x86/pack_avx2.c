/* Packing and unpacking weights on AVX2 (level 1 and up): pack.c's moves, 8 x 8 values at a time.
 *
 * A panel holds 8 rows' values side by side: fp32 as [K][8], bf16 as [K2/2][8] pairs of values (k, k+1)
 * of a row, which are adjacent in the row too. So both dtypes move 32-bit elements: 8 elements of 8
 * rows are one register transpose between 8 rows of the weight and 8 lines of the panel, where the
 * portable code moves one value at a time (docs/results.md, "Larger models on CPU: one copy of the
 * weights", says what that cost a prompt's GEMMs). The last, partial panel, bf16 weights of odd K
 * (whose pairs do not start on 4-byte elements) and fp16 weights (16-bit elements) go the portable way
 * (pack_range_c). */
#include "simd.h"

#if HAVE_X86_KERNELS

/* elements [0, E) of rows 8p .. 8p + 7 (each `ld` elements apart in w) and of panel `pk` */
AVX2 static void move_panel(float* w, int64_t ld, float* pk, int64_t E, int unpack) {
    int64_t e = 0;
    for (; e + 8 <= E; e += 8) {
        __m256 r[8];
        if (unpack) {
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(pk + (e + i) * 8);
            transpose8x8(r);
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(w + c * ld + e, r[c]);
        } else {
            for (int c = 0; c < 8; c++) r[c] = _mm256_loadu_ps(w + c * ld + e);
            transpose8x8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(pk + (e + i) * 8, r[i]);
        }
    }
    for (; e < E; e++)
        for (int c = 0; c < 8; c++) {
            if (unpack) w[c * ld + e] = pk[e * 8 + c];
            else pk[e * 8 + c] = w[c * ld + e];
        }
}

void pack_range_avx2(const void* w, void* packed, int64_t N, int64_t K, int64_t dt, int64_t unpack, int64_t p_lo,
                     int64_t p_hi) {
    /* (bf16 of odd K: a row's pairs would start at 2-byte offsets, and its last value pairs a zero) */
    if (dt == DT_F16 || (dt == DT_BF16 && (K & 1))) {
        pack_range_c(w, packed, N, K, dt, unpack, p_lo, p_hi);
        return;
    }
    int64_t full = N / 8 < p_hi ? N / 8 : p_hi; /* panels whose 8 rows all lie within N */
    int64_t E = dt == DT_BF16 ? K / 2 : K;     /* 32-bit elements of a row, and of a panel's lines */
    for (int64_t p = p_lo; p < full; p++)
        move_panel((float*)w + p * 8 * E, E, (float*)packed + p * E * 8, E, (int)unpack);
    if (full < p_hi) pack_range_c(w, packed, N, K, dt, unpack, full > p_lo ? full : p_lo, p_hi);
}

#endif
