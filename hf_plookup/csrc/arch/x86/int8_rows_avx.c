/* W_Q8B's vector code (int8_rows.c): a row's quantizing (ops.q8b_row) and the integer sums
 * (ops.i8_dots).
 *
 * The quantizing (level 1 and up): 8 values at a time, rounded to fp16 and back by F16C, the outliers
 * a compare, the codes rounded to nearest even by vroundps; the same bits as the portable code, whose
 * rintf and fp16 rounding a baseline x86-64 build cannot vectorize.
 *
 * The sums: each output's codes lie along k, as bitsandbytes keeps them, and each row's int8 codes
 * too, so a sum is a dot product of two byte rows. Sums of integers are exact in any order, so every
 * level gives the portable sums bit for bit.
 *
 * Level 1 (AVX2): 16 bytes of a row widened to 16-bit lanes, vpmaddwd's pairs added into 8 int32
 * lanes. Level 2 (AVX-512 VNNI, which every AVX-512 BF16 CPU has): vpdpbusd multiplies 64 unsigned
 * bytes by 64 signed ones into 16 int32 lanes at once; x's codes (-127 .. 127) are made unsigned by
 * adding 128 (a flip of the top bit), and 128 times the output's sum of codes (q8b_weight.code_sums)
 * is taken off after.
 *
 * Both go over tiles of outputs by rows, the tile's weight bytes loaded once for all of its rows. */
#include "simd.h"

#if HAVE_X86_KERNELS

/* ops.q8b_row (cpu_kernels.h): row m of x quantized as bitsandbytes does it alone */
AVX2 int64_t q8b_row_avx2(const void* x, int64_t m, int64_t K, int64_t Kp, int64_t dt, float threshold, int8_t* q,
                          float* r, int32_t* cols) {
    const void* row = (const char*)x + m * K * (dt == DT_F32 ? 4 : 2);
    const __m256 sign = _mm256_set1_ps(-0.0f), thr = _mm256_set1_ps(threshold > 0.0f ? threshold : NAN); /* (NaN: no lane compares >=) */
    __m256 most = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    int64_t count = 0, k = 0;
    for (; k + 8 <= K; k += 8) { /* the outliers (|a| >= threshold; none when it is not positive), the rest's largest */
        __m256 a = _mm256_andnot_ps(sign, RND_F16(ld_dt(row, k, (int)dt)));
        __m256 out = _mm256_cmp_ps(a, thr, _CMP_GE_OQ);
        for (unsigned bits = (unsigned)_mm256_movemask_ps(out); bits; bits &= bits - 1) cols[count++] = (int32_t)(k + __builtin_ctz(bits));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        most = _mm256_max_ps(most, _mm256_andnot_ps(out, a)); /* (a NaN lane keeps most: counted in nan) */
    }
    float lanes[8], top = 0.0f;
    _mm256_storeu_ps(lanes, most);
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t t = k; t < K; t++) {
        float a = fabsf(q8b_half(load1(row, t, (int)dt)));
        if (q8b_outlier(a, threshold)) {
            cols[count++] = (int32_t)t;
            continue;
        }
        any_nan |= a != a;
        top = a > top ? a : top;
    }
    *r = any_nan ? NAN : top;
    const float sc = (1.0f / *r) * 127.0f;
    const __m256 scale = _mm256_set1_ps(sc);
    for (k = 0; k + 8 <= K; k += 8) {
        __m256 a = RND_F16(ld_dt(row, k, (int)dt));
        __m256 c = _mm256_round_ps(_mm256_mul_ps(a, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 zero = _mm256_or_ps(_mm256_cmp_ps(c, c, _CMP_UNORD_Q), _mm256_cmp_ps(_mm256_andnot_ps(sign, a), thr, _CMP_GE_OQ));
        __m256i ci = _mm256_cvttps_epi32(_mm256_andnot_ps(zero, c)); /* (-127 .. 127) */
        __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(ci), _mm256_extracti128_si256(ci, 1));
        _mm_storel_epi64((__m128i*)(q + k), _mm_packs_epi16(h, h));
    }
    for (int64_t t = k; t < K; t++) q[t] = q8b_code(q8b_half(load1(row, t, (int)dt)), sc, threshold);
    for (k = K; k < Kp; k++) q[k] = 0;
    return count;
}

#define AVX2_ROWS 2 /* rows by outputs of an AVX2 tile: 8 accumulators, 4 widened weight vectors */
#define AVX2_OUTS 4

AVX2_INLINE int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* the sums of mb rows by nb outputs (mb <= AVX2_ROWS, nb <= AVX2_OUTS; constants where inlined) */
AVX2_INLINE void dots_tile_avx2(const int8_t* xq, int64_t Kp, int mb, const int8_t* w, int64_t K, int nb,
                                int32_t* sums, int64_t ld) {
    __m256i acc[AVX2_ROWS][AVX2_OUTS];
    UNROLL for (int r = 0; r < mb; r++) UNROLL for (int c = 0; c < nb; c++) acc[r][c] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256i wv[AVX2_OUTS];
        UNROLL for (int c = 0; c < nb; c++) {
            if (!(k & 63)) _mm_prefetch((const char*)(w + c * K + k) + 4 * K, _MM_HINT_T0); /* (the next tile's) */
            wv[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + c * K + k)));
        }
        UNROLL for (int r = 0; r < mb; r++) {
            __m256i xv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(xq + r * Kp + k)));
            UNROLL for (int c = 0; c < nb; c++) acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(xv, wv[c]));
        }
    }
    UNROLL for (int r = 0; r < mb; r++) UNROLL for (int c = 0; c < nb; c++) {
        int32_t s = hsum8_epi32(acc[r][c]);
        for (int64_t t = k; t < K; t++) s += (int32_t)xq[r * Kp + t] * (int32_t)w[c * K + t];
        sums[r * ld + c] = s;
    }
}

AVX2 void i8_dots_avx2(const int8_t* xq, int64_t M, int64_t Kp, const int8_t* w, const int32_t* code_sums, int64_t K,
                       int64_t n_lo, int64_t n_hi, int32_t* sums, int64_t ld) {
    (void)code_sums;
    for (int64_t n = n_lo; n < n_hi; n += AVX2_OUTS) {
        int nb = n_hi - n < AVX2_OUTS ? (int)(n_hi - n) : AVX2_OUTS;
        for (int64_t m = 0; m < M; m += AVX2_ROWS) {
            const int8_t *x = xq + m * Kp, *wn = w + n * K;
            int32_t* s = sums + m * ld + n;
            if (M - m >= 2 && nb == 4) dots_tile_avx2(x, Kp, 2, wn, K, 4, s, ld);
            else if (nb == 4) dots_tile_avx2(x, Kp, 1, wn, K, 4, s, ld);
            else
                for (int r = 0; r < (M - m < AVX2_ROWS ? M - m : AVX2_ROWS); r++)
                    for (int c = 0; c < nb; c++) dots_tile_avx2(x + r * Kp, Kp, 1, wn + c * K, K, 1, s + r * ld + c, ld);
        }
    }
}

#endif

#if HAVE_AVX512BF16_KERNELS

#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vnni")))
#define VNNI_INLINE VNNI static inline __attribute__((always_inline))
#define VNNI_ROWS 4 /* rows by outputs of a tile: 16 accumulators, 4 weight and 4 row vectors */
#define VNNI_OUTS 4

/* the lane sums of v[0..3], as one vector */
VNNI_INLINE __m128i sum4_epi32(const __m512i* v) {
    __m256i h[4];
    UNROLL for (int i = 0; i < 4; i++) h[i] = _mm256_add_epi32(_mm512_castsi512_si256(v[i]), _mm512_extracti64x4_epi64(v[i], 1));
    __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(h[0], h[1]), _mm256_hadd_epi32(h[2], h[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

/* the sums of mb rows by nb outputs (mb <= VNNI_ROWS, nb <= VNNI_OUTS; constants where inlined); the
 * last block of k reads the weights masked (zeros past K), x's rows being padded with zeros to Kp */
VNNI_INLINE void dots_tile_vnni(const int8_t* xq, int64_t Kp, int mb, const int8_t* w, const int32_t* code_sums,
                                int64_t K, int nb, int32_t* sums, int64_t ld) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[VNNI_ROWS][VNNI_OUTS];
    UNROLL for (int r = 0; r < mb; r++) UNROLL for (int c = 0; c < nb; c++) acc[r][c] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
        __mmask64 in = K - k >= 64 ? ~(__mmask64)0 : (~(__mmask64)0) >> (64 - (K - k));
        __m512i wv[VNNI_OUTS];
        UNROLL for (int c = 0; c < nb; c++) {
            _mm_prefetch((const char*)(w + c * K + k) + 4 * K, _MM_HINT_T0); /* (the next tile's) */
            wv[c] = _mm512_maskz_loadu_epi8(in, w + c * K + k);
        }
        UNROLL for (int r = 0; r < mb; r++) {
            __m512i xv = _mm512_xor_si512(_mm512_loadu_si512(xq + r * Kp + k), flip); /* x + 128, unsigned */
            UNROLL for (int c = 0; c < nb; c++) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], xv, wv[c]);
        }
    }
    if (nb == 4) { /* a row's 4 sums at once, less 128 times each output's sum of codes */
        const __m128i offsets = _mm_slli_epi32(_mm_loadu_si128((const __m128i*)code_sums), 7);
        UNROLL for (int r = 0; r < mb; r++)
            _mm_storeu_si128((__m128i*)(sums + r * ld), _mm_sub_epi32(sum4_epi32(acc[r]), offsets));
    } else
        UNROLL for (int r = 0; r < mb; r++) UNROLL for (int c = 0; c < nb; c++)
            sums[r * ld + c] = _mm512_reduce_add_epi32(acc[r][c]) - 128 * code_sums[c];
}

VNNI void i8_dots_vnni(const int8_t* xq, int64_t M, int64_t Kp, const int8_t* w, const int32_t* code_sums, int64_t K,
                       int64_t n_lo, int64_t n_hi, int32_t* sums, int64_t ld) {
    for (int64_t n = n_lo; n < n_hi; n += VNNI_OUTS) {
        int nb = n_hi - n < VNNI_OUTS ? (int)(n_hi - n) : VNNI_OUTS;
        const int8_t* wn = w + n * K;
        for (int64_t m = 0; m < M; m += VNNI_ROWS) {
            const int8_t* x = xq + m * Kp;
            int32_t* s = sums + m * ld + n;
            int mb = M - m < VNNI_ROWS ? (int)(M - m) : VNNI_ROWS;
            if (nb == 4 && mb == 4) dots_tile_vnni(x, Kp, 4, wn, code_sums + n, K, 4, s, ld);
            else if (nb == 4 && mb == 3) dots_tile_vnni(x, Kp, 3, wn, code_sums + n, K, 4, s, ld);
            else if (nb == 4 && mb == 2) dots_tile_vnni(x, Kp, 2, wn, code_sums + n, K, 4, s, ld);
            else if (nb == 4) dots_tile_vnni(x, Kp, 1, wn, code_sums + n, K, 4, s, ld);
            else
                for (int r = 0; r < mb; r++)
                    for (int c = 0; c < nb; c++)
                        dots_tile_vnni(x + r * Kp, Kp, 1, wn + c * K, code_sums + n + c, K, 1, s + r * ld + c, ld);
        }
    }
}

#endif
