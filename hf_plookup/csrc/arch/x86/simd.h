/* The x86 vector code's one abstraction: 8 fp32 lanes of AVX2 (+ FMA), the loads that widen bf16 and
 * fp16 into them, and the fixed tree of their horizontal sum. Every arch/x86 file builds on these.
 *
 * The package is built for the baseline x86-64 (one build for every CPU), so the vector functions
 * carry their instruction set as a target attribute (AVX2 below; AVX512 for the 16-lane quantized
 * linears of linear_avx512.c, and AVX512BF16 in attention_avx512bf16.c, both at level 2) and module.c
 * puts them in the dispatch table only where the CPU has it. */
#ifndef HF_PLOOKUP_ARCH_X86_SIMD_H
#define HF_PLOOKUP_ARCH_X86_SIMD_H

#include "../../cpu_kernels.h"

#if HAVE_X86_KERNELS
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c"))) /* (F16C: every AVX2 CPU has it) */
#define AVX2_INLINE AVX2 static inline __attribute__((always_inline))
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f"))) /* (level 2: AVX-512 BF16 CPUs, which have F) */
/* gcc 12 at -O3 kept a tile's sums in memory, a store per FMA, unless every loop over them unrolls */
#define UNROLL _Pragma("GCC unroll 16")

AVX2 static inline float hsum8(__m256 v) { /* ((0+4)+(2+6)) + ((1+5)+(3+7)), as sum8 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[u] = hsum8(v[u]) for u < 8, bitwise (the same tree: lane i + lane i+4, then (0+2) + (1+3)),
 * eight sums at once by transposing as they are added */
AVX2_INLINE __m256 hsum8x8_v(const __m256* v) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; i++) /* [v_2i: p0..p3 | v_2i+1: p0..p3], p_l = lane l + lane l+4 */
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* [p0+p2, p1+p3] of four vectors */
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    __m256 d = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
    /* d = sums of v0 v2 v4 v6 | v1 v3 v5 v7 */
    return _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
AVX2 static inline void hsum8x8(const __m256* v, float* out) { _mm256_storeu_ps(out, hsum8x8_v(v)); }

/* r[i] (8 rows of 8 values) transposed in place: r[v] becomes value v of rows 0..7 (the linears' x
 * blocks, the packing of weights into panels and back) */
AVX2_INLINE void transpose8x8(__m256* r) {
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) { /* [r_i 0, r_i+1 0, r_i 1, r_i+1 1 | 4, 5], then 2, 3 | 6, 7 */
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* values 0, 1, 2, 3 (each | value + 4) of four rows */
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int v = 0; v < 4; v++) {
        r[v] = _mm256_permute2f128_ps(s[v], s[v + 4], 0x20);
        r[v + 4] = _mm256_permute2f128_ps(s[v], s[v + 4], 0x31);
    }
}

AVX2 static inline __m256 ld_f32(const void* p, int64_t i) { return _mm256_loadu_ps((const float*)p + i); }
AVX2 static inline __m256 widen8(__m128i h) { /* 8 bf16 -> fp32, exact */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* each lane rounded to bf16 and kept as fp32, for lanes that are not NaN (finite or infinite): rnd
 * (cpu_kernels.h) of each lane, in 32-bit lanes, without bf16x8's narrowing and widen8's widening again */
AVX2 static inline __m256 rnd8_number(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
}
/* rnd8_number of every lane, a NaN kept quiet as f32_to_bf16 keeps it */
AVX2 static inline __m256 rnd8(__m256 v) {
    __m256i nan = _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32((int)0xFFFF0000u)),
                                  _mm256_set1_epi32(0x00400000));
    return _mm256_blendv_ps(rnd8_number(v), _mm256_castsi256_ps(nan), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
AVX2 static inline __m256 ld_bf16(const void* p, int64_t i) { return widen8(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i))); }
AVX2 static inline __m256 ld_f16(const void* p, int64_t i) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i))); }
/* each lane rounded to fp16 and widened back (rnd_f16: F16C's conversions round to nearest even) */
#define RND_F16(V) _mm256_cvtph_ps(_mm256_cvtps_ph(V, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
/* 8 values of a call's dtype from p + i, widened; each lane rounded to it (rnd) */
AVX2 static inline __m256 ld_dt(const void* p, int64_t i, int dt) {
    return dt == DT_BF16 ? ld_bf16(p, i) : dt == DT_F16 ? ld_f16(p, i) : ld_f32(p, i);
}
AVX2 static inline __m256 rnd8_dt(__m256 v, int dt) { return dt == DT_BF16 ? rnd8(v) : dt == DT_F16 ? RND_F16(v) : v; }
/* the first `rem` (< 8) values, zeros after: a zero lane adds 0 * 0 to its sum */
AVX2 static inline __m256 ld_part(const void* p, int64_t i, int rem, int bf16) {
    float tmp[8] = {0};
    for (int j = 0; j < rem; j++) tmp[j] = load1(p, i + j, bf16);
    return _mm256_loadu_ps(tmp);
}
/* 8 values from p + i (fp32, or bf16 or fp16 widened; `bf16` the dtype code in scope), or the first
 * rem (< 8) of them and zeros (rem > 0) */
#define LDX(P, OFF, REM) ((REM) ? ld_part(P, OFF, REM, bf16) : ld_dt(P, OFF, bf16))

/* a key block's NH x KB sums a[h][u] (8 lanes each; NH * KB is 8 or 9) to scores s[h * ld + j + u]
 * (the head groups' scores, both instruction sets) */
AVX2_INLINE void store_scores(const __m256* a, int nh, int kb, float* s, int64_t ld, int64_t j) {
    float sums[8];
    hsum8x8(a, sums);
    for (int i = 0; i < nh * kb; i++) s[i / kb * ld + j + i % kb] = i < 8 ? sums[i] : hsum8(a[i]);
}

/* a row of `bytes` bytes into L1, line by line (the attention's rows ahead of use, KEY_AHEAD) */
AVX2 static inline void prefetch_row(const char* p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    _mm_prefetch(p + bytes - 1, _MM_HINT_T0); /* the last line, when the row does not start a line */
}

#endif
#endif
