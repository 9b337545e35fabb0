/* Linears on AVX2 + FMA (level 1 and up): tiles over the packed weights (cpu_kernels.h says the layout
 * and each output's arithmetic; linear.c has the portable loop with the same bits).
 *
 * A tile of MB rows x NP panels keeps MB x NP vectors of 8 sums and makes one FMA per 8 outputs: no
 * horizontal sums, a bf16 pair widened by one shift and one mask, 8 fp16 values by one F16C
 * conversion, and each panel read as one
 * sequential stream, which the tile prefetches PACK_AHEAD bytes ahead into L2. A tile's shape changes
 * which outputs are computed together, never an output's arithmetic. Against the row-along-K tiles
 * this replaced, SmolLM2's linears took less time at 1 to 9 rows in both dtypes (docs/results.md,
 * "Packed linears: weights packed by output column"). The shapes keep within AVX2's 16 registers
 * (sums, weights, one broadcast). */
#include "simd.h"

#if HAVE_X86_KERNELS

/* 4 KB ahead in both dtypes (and int8): bf16 16 KB ahead was as fast on the AMD EPYCs and slower on an Intel Xeon,
 * whose 1-row linears then streamed the weights well below its read bandwidth (docs/results.md, "Larger
 * models on CPU") */
#define PACK_AHEAD_F32 4096
#define PACK_AHEAD_BF16 4096
#define PACK_AHEAD_F16 4096
#define PACK_AHEAD_Q8 4096
/* a tile: sums over values [0, kn) of panels K values long (wp and xt at the first of them), into o
 * [MB][NP * 8], from 0 or (init) from o's sums: a chain cut at a block of K goes on bitwise */
typedef void (*ptile_fn)(const float* xt, int64_t ldx, const void* wp, int64_t K, int64_t kn, float* o, int init);
/* a tile of one k a step: the 8 columns' values at k of each panel as 8 fp32 lanes (LOAD(p), p their
 * first), one prefetch per 64-byte line of a panel (every PF_EVERY values of k) */
#define PTILE_1K(NAME, WT, LOAD, PF_EVERY, AHEAD, MB, NP)                                               \
    AVX2 static void NAME##_##MB##x##NP(const float* xt, int64_t ldx, const void* wp, int64_t K, int64_t kn, float* o, int init) { \
        const WT* w = (const WT*)wp;                                                                    \
        __m256 acc[MB][NP];                                                                             \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) acc[i][j] = init ? _mm256_loadu_ps(o + (i * NP + j) * 8) : _mm256_setzero_ps(); \
        for (int64_t k = 0; k < kn; k++) {                                                              \
            __m256 wv[NP];                                                                              \
            UNROLL for (int j = 0; j < NP; j++) {                                                       \
                const WT* p = w + (j * K + k) * 8;                                                      \
                if (!(k & (PF_EVERY - 1))) _mm_prefetch((const char*)p + AHEAD, _MM_HINT_T1);           \
                wv[j] = LOAD(p);                                                                        \
            }                                                                                           \
            UNROLL for (int i = 0; i < MB; i++) {                                                       \
                __m256 xb = _mm256_broadcast_ss(xt + k * ldx + i);                                      \
                UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xb, acc[i][j]);  \
            }                                                                                           \
        }                                                                                               \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) _mm256_storeu_ps(o + (i * NP + j) * 8, acc[i][j]); \
    }
/* W_Q8: 8 bytes a k (the 8 columns' integers), widened to int32 then fp32, both exact */
#define LOAD_Q8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p))))
#define PTILE_F32(MB, NP) PTILE_1K(pf32, float, _mm256_loadu_ps, 2, PACK_AHEAD_F32, MB, NP)
#define PTILE_Q8(MB, NP) PTILE_1K(pq8, int8_t, LOAD_Q8, 8, PACK_AHEAD_Q8, MB, NP)
/* fp16: 16 bytes a k, widened by F16C (exact) */
#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#define PTILE_F16(MB, NP) PTILE_1K(pf16, uint16_t, LOAD_F16, 4, PACK_AHEAD_F16, MB, NP)
/* K here is K2 (even); values k and k + 1 of 8 columns are one 32-byte load */
#define PTILE_BF16(MB, NP)                                                                              \
    AVX2 static void pbf16_##MB##x##NP(const float* xt, int64_t ldx, const void* wp, int64_t K, int64_t kn, float* o, int init) { \
        const uint16_t* w = (const uint16_t*)wp;                                                        \
        const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);                                         \
        __m256 acc[MB][NP];                                                                             \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) acc[i][j] = init ? _mm256_loadu_ps(o + (i * NP + j) * 8) : _mm256_setzero_ps(); \
        for (int64_t k = 0; k < kn; k += 2) {                                                           \
            __m256 wv[NP]; /* value k of each column, then value k + 1 (read again: fewer registers held) */ \
            UNROLL for (int j = 0; j < NP; j++) {                                                       \
                const uint16_t* p = w + (j * K + k) * 8;                                                \
                if (!(k & 3)) _mm_prefetch((const char*)p + PACK_AHEAD_BF16, _MM_HINT_T1);              \
                wv[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)p), 16)); \
            }                                                                                           \
            UNROLL for (int i = 0; i < MB; i++) {                                                       \
                __m256 xb = _mm256_broadcast_ss(xt + k * ldx + i);                                      \
                UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xb, acc[i][j]);  \
            }                                                                                           \
            /* 10 sums or more (5 x 2): the address hidden from gcc, whose redundancy elimination     \
             * otherwise kept a sum in memory, a store and a load on its FMA chain (docs/results.md,  \
             * "Attention and tile cuts: five cuts that keep every bit"); fewer: hiding it slowed     \
             * 1-row calls */                                                                          \
            const uint16_t* w2 = w;                                                                     \
            if (MB * NP >= 10) __asm__("" : "+r"(w2));                                                  \
            UNROLL for (int j = 0; j < NP; j++)                                                         \
                wv[j] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)(w2 + (j * K + k) * 8)), hi)); \
            UNROLL for (int i = 0; i < MB; i++) {                                                       \
                __m256 xb = _mm256_broadcast_ss(xt + (k + 1) * ldx + i);                                \
                UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xb, acc[i][j]);  \
            }                                                                                           \
        }                                                                                               \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) _mm256_storeu_ps(o + (i * NP + j) * 8, acc[i][j]); \
    }
#define PTILES_X1(T) T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(5, 1) T(6, 1) T(7, 1) T(8, 1) T(9, 1)
PTILES_X1(PTILE_F32) PTILE_F32(1, 4) PTILE_F32(2, 4) PTILE_F32(3, 3) PTILE_F32(4, 3) PTILE_F32(5, 2) PTILE_F32(6, 2)
PTILES_X1(PTILE_BF16) PTILE_BF16(1, 4) PTILE_BF16(2, 3) PTILE_BF16(3, 3) PTILE_BF16(4, 2) PTILE_BF16(5, 2)
PTILE_F32(1, 3) PTILE_F32(2, 3)
PTILES_X1(PTILE_Q8) PTILE_Q8(1, 4) PTILE_Q8(2, 4) PTILE_Q8(3, 3) PTILE_Q8(4, 3) PTILE_Q8(5, 2) PTILE_Q8(6, 2)
PTILES_X1(PTILE_F16) PTILE_F16(1, 4) PTILE_F16(2, 4) PTILE_F16(3, 3) PTILE_F16(4, 3) PTILE_F16(5, 2) PTILE_F16(6, 2)
/* by rows (1-9): the tile of one pass over the panels, and its panels; the 1-panel tile of as many rows */
static const ptile_fn pf32_wide[] = {0, pf32_1x4, pf32_2x4, pf32_3x3, pf32_4x3, pf32_5x2, pf32_6x2, pf32_7x1, pf32_8x1, pf32_9x1};
static const int pf32_np[] = {0, 4, 4, 3, 3, 2, 2, 1, 1, 1};
static const ptile_fn pf32_one[] = {0, pf32_1x1, pf32_2x1, pf32_3x1, pf32_4x1, pf32_5x1, pf32_6x1, pf32_7x1, pf32_8x1, pf32_9x1};
static const ptile_fn pbf16_wide[] = {0, pbf16_1x4, pbf16_2x3, pbf16_3x3, pbf16_4x2, pbf16_5x2, pbf16_6x1, pbf16_7x1, pbf16_8x1, pbf16_9x1};
static const int pbf16_np[] = {0, 4, 3, 3, 2, 2, 1, 1, 1, 1};
static const ptile_fn pbf16_one[] = {0, pbf16_1x1, pbf16_2x1, pbf16_3x1, pbf16_4x1, pbf16_5x1, pbf16_6x1, pbf16_7x1, pbf16_8x1, pbf16_9x1};
static const ptile_fn pq8_wide[] = {0, pq8_1x4, pq8_2x4, pq8_3x3, pq8_4x3, pq8_5x2, pq8_6x2, pq8_7x1, pq8_8x1, pq8_9x1};
static const ptile_fn pq8_one[] = {0, pq8_1x1, pq8_2x1, pq8_3x1, pq8_4x1, pq8_5x1, pq8_6x1, pq8_7x1, pq8_8x1, pq8_9x1};
static const ptile_fn pf16_wide[] = {0, pf16_1x4, pf16_2x4, pf16_3x3, pf16_4x3, pf16_5x2, pf16_6x2, pf16_7x1, pf16_8x1, pf16_9x1};
static const ptile_fn pf16_one[] = {0, pf16_1x1, pf16_2x1, pf16_3x1, pf16_4x1, pf16_5x1, pf16_6x1, pf16_7x1, pf16_8x1, pf16_9x1};
/* fp32 calls of more than 9 rows: MANY_ROWS rows x MANY_PANELS panels (the 4 x 3 tile has the fewest
 * broadcasts per FMA), fewer rows in the last block */
static const ptile_fn pf32_many[] = {0, pf32_1x3, pf32_2x3, pf32_3x3, pf32_4x3};

/* out[m0 + i][n] = o[i][c] + bias[n] (rounded to the call's dtype dt) for the columns n = 8 p + c < N of a
 * tile's sums o [mb][np * 8]: 8 columns a vector where a panel lies within N, the same bits as one at a
 * time (store1), which had taken a large share of the 9-row bf16 tiles' time (docs/results.md, "Linear
 * stores and transposes: the linears' own overheads") */
AVX2 static inline __m128i bf16x8(__m256 v) { /* f32_to_bf16 of each lane */
    __m256i u = _mm256_castps_si256(v), top = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1))));
    r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_or_si256(top, _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* values below 2^16: packus keeps them; its lanes come as [0-3, 0-3 | 4-7, 4-7], quadwords 0 and 2 wanted */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
AVX2 void packed_store_avx2(const float* o, int mb, int np, int64_t m0, int64_t p, const void* bias, void* out,
                             int64_t N, int dt) {
    for (int j = 0; j < np; j++) {
        int64_t n0 = (p + j) * 8;
        if (n0 + 8 > N) { /* the last panel's columns within N, one at a time */
            for (int i = 0; i < mb; i++)
                for (int64_t n = n0; n < N; n++) {
                    float s = o[(i * np + j) * 8 + n - n0];
                    if (bias) s += load1(bias, n, dt);
                    store1(out, (m0 + i) * N + n, s, dt);
                }
            continue;
        }
        __m256 b = bias ? ld_dt(bias, n0, dt) : _mm256_setzero_ps();
        for (int i = 0; i < mb; i++) {
            __m256 s = _mm256_loadu_ps(o + (i * np + j) * 8);
            if (bias) s = _mm256_add_ps(s, b);
            if (dt == DT_BF16) _mm_storeu_si128((__m128i*)((uint16_t*)out + (m0 + i) * N + n0), bf16x8(s));
            else if (dt == DT_F16) /* (F16C: to nearest even, a NaN made quiet, as f32_to_f16) */
                _mm_storeu_si128((__m128i*)((uint16_t*)out + (m0 + i) * N + n0),
                                 _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            else _mm256_storeu_ps((float*)out + (m0 + i) * N + n0, s);
        }
    }
}

/* a W_Q8 tile's sums o [mb][np * 8] of panels p.. scaled in place as q8_scaled (linear.c) does each:
 * rnd(rnd(s) * scale), 8 columns a vector (the scales run on to a whole panel, zeros past N) */
AVX2 void q8_scale_avx2(float* o, int mb, int np, int64_t p, const float* scales, int dt) {
    for (int j = 0; j < np; j++) {
        __m256 sc = _mm256_loadu_ps(scales + (p + j) * 8);
        for (int i = 0; i < mb; i++) {
            float* q = o + (i * np + j) * 8;
            __m256 v = _mm256_loadu_ps(q);
            v = rnd8_dt(_mm256_mul_ps(rnd8_dt(v, dt), sc), dt);
            _mm256_storeu_ps(q, v);
        }
    }
}

/* W_Q4 and W_Q8G: values [k0, k0 + kn) of panels p .. p + np - 1 dequantized (q4_value, cpu_kernels.h)
 * into d [np][kn][8], the layout of fp32 panels kn values long, for the fp32 tiles to read from L1. A
 * pair of k is one 8-byte load of 4-bit codes, or one 16-byte load of 8-bit ones, widened to 8 lanes. */
#define Q4_KBLOCK 128
#define PACK_AHEAD_Q4 2048
/* the constants the two ways of reading codes use, from q4_meta M: an affine form's code q becomes
 * the float q - offset exactly by setting it under the exponent of 2^23 and subtracting 2^23 + offset;
 * Q4_LUT's codebook sits in two vectors, codes 0-7 and 8-15 */
#define Q4_CONSTANTS(M)                                                                                 \
    const __m256i low = _mm256_set1_epi32(15), magic = _mm256_set1_epi32(0x4B000000);                   \
    const __m256 base = _mm256_set1_ps(8388608.0f + (M)->offset);                                       \
    const __m256 lut_lo = _mm256_loadu_ps((M)->lut), lut_hi = _mm256_loadu_ps((M)->lut + 8);                  \
    (void)low, (void)magic, (void)base, (void)lut_lo, (void)lut_hi /* (each form reads some of them) */
/* a pair of k of 8 columns from the 8 bytes at P: F0, F1, the floats of the codes at k and k + 1, as
 * q - offset (Q4_AFFINE) or as the codebook's values (Q4_LUT: a permute of each half of the codebook by
 * the code's low 3 bits, and the code's bit 3, shifted to the sign, picking one) */
#define Q4_AFFINE(P, F0, F1)                                                                            \
    __m256i b_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(P)));                            \
    __m256 F0 = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(b_, low), magic)), base); \
    __m256 F1 = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_srli_epi32(b_, 4), magic)), base)
/* W_Q8G: the 16 bytes at P, the codes at k, then at k + 1, as Q4_AFFINE's floats */
#define Q8_AFFINE(P, F0, F1)                                                                            \
    __m128i b_ = _mm_loadu_si128((const __m128i*)(P));                                                  \
    __m256 F0 = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_cvtepu8_epi32(b_), magic)), base); \
    __m256 F1 = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_cvtepu8_epi32(_mm_srli_si128(b_, 8)), magic)), base)
#define Q4_PICK(I) _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, I), _mm256_permutevar8x32_ps(lut_hi, I), \
                                    _mm256_castsi256_ps(_mm256_slli_epi32(I, 28)))
#define Q4_LUT_CODES(P, F0, F1)                                                                         \
    __m256i b_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(P))), h_ = _mm256_srli_epi32(b_, 4); \
    __m256 F0 = Q4_PICK(b_), F1 = Q4_PICK(h_)
/* each form's dequantization of F with scales S and shifts Z (q4_value) */
#define DEQ_FMA(F, S, Z) _mm256_fmadd_ps(F, S, Z)
#define DEQ_MUL_SUB(F, S, Z) _mm256_sub_ps(_mm256_mul_ps(F, S), Z)
#define DEQ_MUL_SUB_BF16(F, S, Z) rnd8(_mm256_sub_ps(rnd8(_mm256_mul_ps(F, S)), Z))
#define DEQ_LUT(F, S, Z) ((void)(Z), _mm256_mul_ps(F, S)) /* (no shift) */
/* (a codebook value times a finite scale is never NaN: cpu.kernels reads no weight with another scale) */
#define DEQ_LUT_BF16(F, S, Z) ((void)(Z), rnd8_number(_mm256_mul_ps(F, S)))
#define DEQ_SUB_MUL_F16(F, S, Z) RND_F16(_mm256_mul_ps(_mm256_sub_ps(F, Z), S))
#define DEQ_SUB_MUL_F16_BF16(F, S, Z) rnd8_number(DEQ_SUB_MUL_F16(F, S, Z))
#define DEQ_SUB_MUL(F, S, Z) _mm256_mul_ps(_mm256_sub_ps(F, Z), S)
/* (finite scales times small integers are never NaN: cpu.kernels reads no such weight with another scale) */
#define DEQ_SUB_MUL_BF16(F, S, Z) rnd8_number(DEQ_SUB_MUL(F, S, Z))
/* fp16 calls (DEQ_SUB_MUL_F16 and DEQ_FMA as fp32's: a value rounded to fp16 stays so; Q4_SUB_MUL's
 * fp16 form is DEQ_SUB_MUL_F16) */
#define DEQ_MUL_SUB_F16(F, S, Z) RND_F16(_mm256_sub_ps(RND_F16(_mm256_mul_ps(F, S)), Z))
#define DEQ_LUT_F16(F, S, Z) ((void)(Z), RND_F16(_mm256_mul_ps(F, S)))
/* NAME_dequant: the dequantization above for one form and dtype (CODES and DEQ) of panels KB bytes a
 * k (q4_kbytes; the tables below pick it, as they pick the tiles) */
#define Q4_DEQUANT(NAME, CODES, DEQ, KB)                                                                \
    AVX2 static void NAME##_dequant(const void* wp, int64_t P, int64_t K, int64_t p, int np, int64_t k0, int64_t kn, \
                                    float* d) {                                                         \
        const q4_meta* m = (const q4_meta*)((const char*)wp + q4_meta_at(P, K, KB));                    \
        const int64_t G = m->group;                                                                     \
        Q4_CONSTANTS(m);                                                                                \
        for (int j = 0; j < np; j++) {                                                                  \
            const uint8_t* src = (const uint8_t*)wp + (p + j) * K * KB;                                 \
            float* dj = d + j * kn * 8 - k0 * 8;                                                        \
            for (int64_t k = k0; k < k0 + kn;) {                                                        \
                int64_t end = (k / G + 1) * G < k0 + kn ? (k / G + 1) * G : k0 + kn;                    \
                const float* sz = q4_scales(wp, P, K, KB, p + j, k / G);                                \
                __m256 sc = _mm256_loadu_ps(sz), sh = _mm256_loadu_ps(sz + 8);                          \
                for (; k < end; k += 2) {                                                               \
                    if (!(k & (64 / KB - 1))) _mm_prefetch((const char*)(src + k * KB) + PACK_AHEAD_Q4, _MM_HINT_T1); \
                    CODES(src + k * KB, f0, f1);                                                        \
                    _mm256_storeu_ps(dj + k * 8, DEQ(f0, sc, sh));                                      \
                    _mm256_storeu_ps(dj + (k + 1) * 8, DEQ(f1, sc, sh));                                \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }
typedef void (*q4deq_fn)(const void* wp, int64_t P, int64_t K, int64_t p, int np, int64_t k0, int64_t kn, float* d);

/* a W_Q4 (or W_Q8G) tile of up to 9 rows (no K blocks): the panels' codes dequantized in registers,
 * pair by pair, each value then one FMA per row into the same chains as the fp32 tile's; CODES, DEQ
 * and KB say the form (the same arithmetic as NAME_dequant's) */
#define PTILE_Q4(NAME, CODES, DEQ, KB, MB, NP)                                                          \
    AVX2 static void NAME##_##MB##x##NP(const float* xt, int64_t ldx, const uint8_t* wp, int64_t K, const float* sz, \
                                        int64_t szld, const q4_meta* m, float* o) {                     \
        Q4_CONSTANTS(m);                                                                                \
        const int64_t G = m->group;                                                                     \
        __m256 acc[MB][NP];                                                                             \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm256_setzero_ps(); \
        for (int64_t g0 = 0; g0 < K; g0 += G) {                                                         \
            __m256 sc[NP], sh[NP];                                                                      \
            UNROLL for (int j = 0; j < NP; j++) {                                                       \
                sc[j] = _mm256_loadu_ps(sz + j * szld + g0 / G * 16);                                   \
                sh[j] = _mm256_loadu_ps(sz + j * szld + g0 / G * 16 + 8);                               \
            }                                                                                           \
            for (int64_t k = g0; k < g0 + G; k += 2) {                                                  \
                __m256 w0[NP], w1[NP];                                                                  \
                UNROLL for (int j = 0; j < NP; j++) {                                                   \
                    const uint8_t* p = wp + (j * K + k) * KB;                                           \
                    if (!(k & (64 / KB - 1))) _mm_prefetch((const char*)p + PACK_AHEAD_Q4, _MM_HINT_T1); \
                    CODES(p, f0, f1);                                                                   \
                    w0[j] = DEQ(f0, sc[j], sh[j]);                                                      \
                    w1[j] = DEQ(f1, sc[j], sh[j]);                                                      \
                }                                                                                       \
                UNROLL for (int i = 0; i < MB; i++) {                                                   \
                    __m256 xb = _mm256_broadcast_ss(xt + k * ldx + i);                                  \
                    UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm256_fmadd_ps(w0[j], xb, acc[i][j]); \
                }                                                                                       \
                UNROLL for (int i = 0; i < MB; i++) {                                                   \
                    __m256 xb = _mm256_broadcast_ss(xt + (k + 1) * ldx + i);                            \
                    UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm256_fmadd_ps(w1[j], xb, acc[i][j]); \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) _mm256_storeu_ps(o + (i * NP + j) * 8, acc[i][j]); \
    }
typedef void (*q4tile_fn)(const float* xt, int64_t ldx, const uint8_t* wp, int64_t K, const float* sz, int64_t szld,
                          const q4_meta* m, float* o);
#define Q4_TILES_KB(NAME, CODES, DEQ, KB)                                                               \
    Q4_DEQUANT(NAME, CODES, DEQ, KB)                                                                    \
    PTILE_Q4(NAME, CODES, DEQ, KB, 1, 1) PTILE_Q4(NAME, CODES, DEQ, KB, 2, 1)                           \
    PTILE_Q4(NAME, CODES, DEQ, KB, 3, 1) PTILE_Q4(NAME, CODES, DEQ, KB, 4, 1)                           \
    PTILE_Q4(NAME, CODES, DEQ, KB, 5, 1) PTILE_Q4(NAME, CODES, DEQ, KB, 6, 1)                           \
    PTILE_Q4(NAME, CODES, DEQ, KB, 7, 1) PTILE_Q4(NAME, CODES, DEQ, KB, 8, 1)                           \
    PTILE_Q4(NAME, CODES, DEQ, KB, 9, 1) PTILE_Q4(NAME, CODES, DEQ, KB, 1, 4)                           \
    PTILE_Q4(NAME, CODES, DEQ, KB, 2, 4) PTILE_Q4(NAME, CODES, DEQ, KB, 3, 3)                           \
    PTILE_Q4(NAME, CODES, DEQ, KB, 4, 3) PTILE_Q4(NAME, CODES, DEQ, KB, 5, 2)                           \
    PTILE_Q4(NAME, CODES, DEQ, KB, 6, 2)                                                                \
    static const q4tile_fn NAME##_wide[] = {0, NAME##_1x4, NAME##_2x4, NAME##_3x3, NAME##_4x3, NAME##_5x2, \
                                            NAME##_6x2, NAME##_7x1, NAME##_8x1, NAME##_9x1};             \
    static const q4tile_fn NAME##_one[] = {0, NAME##_1x1, NAME##_2x1, NAME##_3x1, NAME##_4x1, NAME##_5x1, \
                                           NAME##_6x1, NAME##_7x1, NAME##_8x1, NAME##_9x1};
#define Q4_TILES(NAME, CODES, DEQ) Q4_TILES_KB(NAME, CODES, DEQ, 4)
Q4_TILES(pq4fma, Q4_AFFINE, DEQ_FMA)
Q4_TILES(pq4ms, Q4_AFFINE, DEQ_MUL_SUB)
Q4_TILES(pq4msb, Q4_AFFINE, DEQ_MUL_SUB_BF16)
Q4_TILES(pq4lut, Q4_LUT_CODES, DEQ_LUT)
Q4_TILES(pq4lutb, Q4_LUT_CODES, DEQ_LUT_BF16)
Q4_TILES(pq4smh, Q4_AFFINE, DEQ_SUB_MUL_F16)
Q4_TILES(pq4smhb, Q4_AFFINE, DEQ_SUB_MUL_F16_BF16)
Q4_TILES(pq4msh, Q4_AFFINE, DEQ_MUL_SUB_F16)
Q4_TILES(pq4luth, Q4_LUT_CODES, DEQ_LUT_F16)
Q4_TILES(pq4sm, Q4_AFFINE, DEQ_SUB_MUL)
Q4_TILES(pq4smb, Q4_AFFINE, DEQ_SUB_MUL_BF16)
Q4_TILES_KB(pq8gsm, Q8_AFFINE, DEQ_SUB_MUL, 8)
Q4_TILES_KB(pq8gsmb, Q8_AFFINE, DEQ_SUB_MUL_BF16, 8)
Q4_TILES_KB(pq8gsmh, Q8_AFFINE, DEQ_SUB_MUL_F16, 8)
/* by form (Q4_MUL_SUB, Q4_FMA, Q4_LUT, Q4_SUB_MUL_F16, Q4_SUB_MUL) and dtype (DT_F32, DT_BF16, DT_F16): the tiles
 * of up to 9 rows, as pf32_wide and pf32_one, and the dequantization of more rows' K blocks */
static const q4tile_fn* const q4_wide[5][3] = {{pq4ms_wide, pq4msb_wide, pq4msh_wide},
                                               {pq4fma_wide, pq4fma_wide, pq4fma_wide},
                                               {pq4lut_wide, pq4lutb_wide, pq4luth_wide},
                                               {pq4smh_wide, pq4smhb_wide, pq4smh_wide},
                                               {pq4sm_wide, pq4smb_wide, pq4smh_wide}};
static const q4tile_fn* const q4_one[5][3] = {{pq4ms_one, pq4msb_one, pq4msh_one},
                                              {pq4fma_one, pq4fma_one, pq4fma_one},
                                              {pq4lut_one, pq4lutb_one, pq4luth_one},
                                              {pq4smh_one, pq4smhb_one, pq4smh_one},
                                              {pq4sm_one, pq4smb_one, pq4smh_one}};
static const q4deq_fn q4_deq[5][3] = {{pq4ms_dequant, pq4msb_dequant, pq4msh_dequant},
                                      {pq4fma_dequant, pq4fma_dequant, pq4fma_dequant},
                                      {pq4lut_dequant, pq4lutb_dequant, pq4luth_dequant},
                                      {pq4smh_dequant, pq4smhb_dequant, pq4smh_dequant},
                                      {pq4sm_dequant, pq4smb_dequant, pq4smh_dequant}};
/* W_Q8G's (its one form, Q4_SUB_MUL) by dtype */
static const q4tile_fn* const q8g_wide[3] = {pq8gsm_wide, pq8gsmb_wide, pq8gsmh_wide};
static const q4tile_fn* const q8g_one[3] = {pq8gsm_one, pq8gsmb_one, pq8gsmh_one};
static const q4deq_fn q8g_deq[3] = {pq8gsm_dequant, pq8gsmb_dequant, pq8gsmh_dequant};

/* linear_range_avx2 for a W_Q4 or W_Q8G weight: up to 9 rows by its tiles; more by the fp32 tiles over
 * its values dequantized Q4_KBLOCK values of k at a time (once for every MANY_BLOCK_ROWS rows), each tile's
 * chains going on from its stored sums (init). Either way every output is the W_FLOAT chain over
 * the dequantized weight. */
AVX2 static void linear_range_q4(const float* xt, int64_t M, const void* wp, int64_t wkind, int64_t K,
                                 const void* bias, int64_t p_lo, int64_t p_hi, void* out, int64_t N, int64_t dt) {
    int64_t P = (N + 7) / 8, kb = q4_kbytes(wkind);
    const q4_meta* m = (const q4_meta*)((const char*)wp + q4_meta_at(P, K, kb));
    int g8 = wkind == W_Q8G;
    if (M <= 9) {
        const q4tile_fn *wide = g8 ? q8g_wide[dt] : q4_wide[m->form][dt], *one = g8 ? q8g_one[dt] : q4_one[m->form][dt];
        float o[9 * 32];
        int np = pf32_np[M];
        for (int64_t p = p_lo; p < p_hi;) {
            int n = p + np <= p_hi ? np : 1;
            (n == np ? wide : one)[M](xt, M, (const uint8_t*)wp + p * K * kb, K, q4_scales(wp, P, K, kb, p, 0),
                                      K / m->group * 16, m, o);
            packed_store_avx2(o, (int)M, n, 0, p, bias, out, N, (int)dt);
            p += n;
        }
        return;
    }
    float d[MANY_PANELS * Q4_KBLOCK * 8];
    int64_t B = x_block(M, dt), blocks = (M + B - 1) / B;
    float acc[MANY_BLOCK_ROWS * MANY_PANELS * 8];
    for (int64_t p = p_lo; p < p_hi;) {
        int n = dt == DT_F32 && p + MANY_PANELS <= p_hi ? MANY_PANELS : 1;
        for (int64_t b0 = 0; b0 < blocks; b0 += MANY_BLOCK_ROWS / B) {
            int64_t b1 = b0 + MANY_BLOCK_ROWS / B < blocks ? b0 + MANY_BLOCK_ROWS / B : blocks;
            for (int64_t k0 = 0; k0 < K; k0 += Q4_KBLOCK) {
                int64_t kn = K - k0 < Q4_KBLOCK ? K - k0 : Q4_KBLOCK;
                (g8 ? q8g_deq[dt] : q4_deq[m->form][dt])(wp, P, K, p, n, k0, kn, d);
                for (int64_t b = b0; b < b1; b++) {
                    int64_t mb, at = x_at(M, B, K, b * B, &mb), m0 = b * B;
                    (n == MANY_PANELS ? pf32_many : pf32_one)[mb](xt + at + k0 * mb, mb, d, kn, kn,
                                                                  acc + (m0 - b0 * B) * n * 8, k0 > 0);
                }
            }
            int64_t r1 = b1 * B < M ? b1 * B : M;
            packed_store_avx2(acc, (int)(r1 - b0 * B), n, b0 * B, p, bias, out, N, (int)dt);
        }
        p += n;
    }
}

/* W_Q4K (cpu_kernels.h): a tile of MB rows (x's rows ldx apart) over NC columns from c0 of one half of
 * a panel (its codes at wq, its scales and shifts of group 0 at sz): 1 row over all 4, 2 rows over 2
 * at a time. Each 16-lane chain is two vectors here (lanes 0-7, 8-15). A code becomes its value as
 * LOOK says: Q4K_PICK looks it up in its group's table of 16 values as Q4_PICK does (the table's
 * halves A, B made at each group's first block: DEQ over FB_LO, FB_HI, the codes as floats), where
 * DEQ is dear (bf16 rounding) or the form a codebook; Q4K_DIRECT computes DEQ on it (A, B then the
 * group's scale and shift), where DEQ is an instruction or two, since the lookup's two permutes a
 * vector use the one shuffle port. Both give each code q4_value's bits, and the sums are those of the
 * AVX-512 tile (linear_avx512.c), lane for lane. Sums o[i * NC + c]. */
#define Q4K_PICK(DEQ, A, B, I) _mm256_blendv_ps(_mm256_permutevar8x32_ps(A, I), _mm256_permutevar8x32_ps(B, I), \
                                                _mm256_castsi256_ps(_mm256_slli_epi32(I, 28)))
#define Q4K_LOOK_0 Q4K_PICK
#define Q4K_LOOK_1 Q4K_DIRECT
#define Q4K_DIRECT(DEQ, A, B, I)                                                                        \
    DEQ(_mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(I, low), magic)), base), A, B)
/* what a W_Q4K tile of form DEQ needs from q4_meta M: Q4K_DIRECT's constants, and the 16 codes as
 * floats (q - offset, or the codebook) in two halves, fb_lo and fb_hi; `direct` says how codes become
 * values (DIRECT: Q4K_DIRECT, else Q4K_PICK) */
#define Q4K_CONSTANTS(M, DIRECT)                                                                        \
    const __m256i low = _mm256_set1_epi32(15), magic = _mm256_set1_epi32(0x4B000000);                   \
    const __m256 base = _mm256_set1_ps(8388608.0f + (M)->offset), off = _mm256_set1_ps((M)->offset);    \
    const __m256 fb_lo = (M)->form == Q4_LUT ? _mm256_loadu_ps((M)->lut)                                \
                                             : _mm256_sub_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), off); \
    const __m256 fb_hi = (M)->form == Q4_LUT ? _mm256_loadu_ps((M)->lut + 8)                            \
                                             : _mm256_sub_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), off); \
    const int direct = DIRECT;                                                                          \
    (void)low, (void)magic, (void)base
/* at a group's first block, a[c] and b[c] of NC columns from their scales at S (shifts at S + 8): the
 * table's halves (Q4K_PICK), or the scale and shift themselves (Q4K_DIRECT) */
#define Q4K_GROUP(S, NC, DEQ)                                                                           \
    UNROLL for (int c = 0; c < NC; c++) {                                                               \
        __m256 S_ = _mm256_set1_ps((S)[c]), Z_ = _mm256_set1_ps((S)[8 + c]);                            \
        (void)Z_;                                                                                       \
        a[c] = direct ? S_ : DEQ(fb_lo, S_, Z_);                                                        \
        b[c] = direct ? Z_ : DEQ(fb_hi, S_, Z_);                                                        \
    }
#define PTILE_Q4K(NAME, DIRECT, DEQ, MB, NC)                                                            \
    AVX2 static void NAME##_##MB(const float* x, int64_t ldx, const uint8_t* wq, int64_t K, const float* sz, \
                                 int64_t G, const q4_meta* m, int c0, float* o) {                       \
        Q4K_CONSTANTS(m, DIRECT);                                                                       \
        __m256 acc[MB][NC][2], a[NC], b[NC];                                                            \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int c = 0; c < NC; c++)                         \
            acc[i][c][0] = acc[i][c][1] = _mm256_setzero_ps();                                          \
        UNROLL for (int c = 0; c < NC; c++) a[c] = b[c] = _mm256_setzero_ps(); /* (made at k = 0) */    \
        for (int64_t k = 0; k < K; k += Q4K_BLOCK) {                                                    \
            const uint8_t* bytes = wq + k * 2;                                                          \
            if (k % G == 0) {                                                                           \
                Q4K_GROUP(sz + k / G * 16 + c0, NC, DEQ);                                               \
            }                                                                                           \
            if (!c0) _mm_prefetch((const char*)bytes + PACK_AHEAD_Q4, _MM_HINT_T0);                     \
            UNROLL for (int c = 0; c < NC; c++) {                                                       \
                __m128i raw = _mm_loadu_si128((const __m128i*)(bytes + (c0 + c) * 16));                 \
                __m256i v[2] = {_mm256_cvtepu8_epi32(raw), _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))}; \
                UNROLL for (int nib = 0; nib < 2; nib++) /* low nibbles at k + l, high ones at k + 16 + l */ \
                    UNROLL for (int u = 0; u < 2; u++) {                                                \
                        __m256 w = Q4K_LOOK_##DIRECT(DEQ, a[c], b[c], nib ? _mm256_srli_epi32(v[u], 4) : v[u]); \
                        UNROLL for (int i = 0; i < MB; i++)                                             \
                            acc[i][c][u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + i * ldx + k + 16 * nib + 8 * u), \
                                                           acc[i][c][u]);                               \
                    }                                                                                   \
            }                                                                                           \
        }                                                                                               \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int c = 0; c < NC; c++)                         \
            o[i * NC + c] = hsum8(_mm256_add_ps(acc[i][c][0], acc[i][c][1]));                           \
    }
typedef void (*q4ktile_fn)(const float* x, int64_t ldx, const uint8_t* wq, int64_t K, const float* sz, int64_t G,
                           const q4_meta* m, int c0, float* o);
static const int q4k_columns[] = {0, 4, 2}; /* by rows: the columns of one tile */
#define Q4K_TILES(NAME, DIRECT, DEQ)                                                                    \
    PTILE_Q4K(NAME, DIRECT, DEQ, 1, 4) PTILE_Q4K(NAME, DIRECT, DEQ, 2, 2)                               \
    static const q4ktile_fn NAME[] = {0, NAME##_1, NAME##_2};
Q4K_TILES(kq4fma, 1, DEQ_FMA)
Q4K_TILES(kq4ms, 1, DEQ_MUL_SUB)
Q4K_TILES(kq4msb, 0, DEQ_MUL_SUB_BF16)
Q4K_TILES(kq4msh, 0, DEQ_MUL_SUB_F16)
Q4K_TILES(kq4lut, 0, DEQ_LUT)
Q4K_TILES(kq4lutb, 0, DEQ_LUT_BF16)
Q4K_TILES(kq4luth, 0, DEQ_LUT_F16)
Q4K_TILES(kq4smh, 0, DEQ_SUB_MUL_F16)
Q4K_TILES(kq4smhb, 0, DEQ_SUB_MUL_F16_BF16)
Q4K_TILES(kq4sm, 1, DEQ_SUB_MUL)
Q4K_TILES(kq4smb, 0, DEQ_SUB_MUL_BF16)
/* NAME_kdequant: a half's 4 columns' values of k in [k0, k0 + kc) (whole blocks), as the tile above
 * makes them, into d [4][kc] in order of k: for calls of many rows, whose tiles then read them from L1 */
#define Q4K_DEQUANT(NAME, DIRECT, DEQ)                                                                  \
    AVX2 static void NAME##_kdequant(const uint8_t* wq, const float* sz, int64_t G, const q4_meta* m, int64_t k0, \
                                     int64_t kc, float* d) {                                            \
        Q4K_CONSTANTS(m, DIRECT);                                                                       \
        __m256 a[4], b[4];                                                                              \
        UNROLL for (int c = 0; c < 4; c++) a[c] = b[c] = _mm256_setzero_ps(); /* (made at k0) */        \
        for (int64_t k = k0; k < k0 + kc; k += Q4K_BLOCK) {                                             \
            if (k == k0 || k % G == 0) {                                                                \
                Q4K_GROUP(sz + k / G * 16, 4, DEQ);                                                     \
            }                                                                                           \
            UNROLL for (int c = 0; c < 4; c++) {                                                        \
                __m128i raw = _mm_loadu_si128((const __m128i*)(wq + k * 2 + c * 16));                   \
                __m256i v[2] = {_mm256_cvtepu8_epi32(raw), _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))}; \
                UNROLL for (int nib = 0; nib < 2; nib++) UNROLL for (int u = 0; u < 2; u++)             \
                    _mm256_storeu_ps(d + c * kc + (k - k0) + 16 * nib + 8 * u,                          \
                                     Q4K_LOOK_##DIRECT(DEQ, a[c], b[c], nib ? _mm256_srli_epi32(v[u], 4) : v[u])); \
            }                                                                                           \
        }                                                                                               \
    }
typedef void (*q4kdeq_fn)(const uint8_t* wq, const float* sz, int64_t G, const q4_meta* m, int64_t k0, int64_t kc,
                          float* d);
Q4K_DEQUANT(kq4fma, 1, DEQ_FMA)
Q4K_DEQUANT(kq4ms, 1, DEQ_MUL_SUB)
Q4K_DEQUANT(kq4msb, 0, DEQ_MUL_SUB_BF16)
Q4K_DEQUANT(kq4msh, 0, DEQ_MUL_SUB_F16)
Q4K_DEQUANT(kq4lut, 0, DEQ_LUT)
Q4K_DEQUANT(kq4lutb, 0, DEQ_LUT_BF16)
Q4K_DEQUANT(kq4luth, 0, DEQ_LUT_F16)
Q4K_DEQUANT(kq4smh, 0, DEQ_SUB_MUL_F16)
Q4K_DEQUANT(kq4smhb, 0, DEQ_SUB_MUL_F16_BF16)
Q4K_DEQUANT(kq4sm, 1, DEQ_SUB_MUL)
Q4K_DEQUANT(kq4smb, 0, DEQ_SUB_MUL_BF16)
static const q4kdeq_fn q4k_deq[5][3] = {{kq4ms_kdequant, kq4msb_kdequant, kq4msh_kdequant},
                                        {kq4fma_kdequant, kq4fma_kdequant, kq4fma_kdequant},
                                        {kq4lut_kdequant, kq4lutb_kdequant, kq4luth_kdequant},
                                        {kq4smh_kdequant, kq4smhb_kdequant, kq4smh_kdequant},
                                        {kq4sm_kdequant, kq4smb_kdequant, kq4smh_kdequant}};

/* MB (1-3) rows' chains of columns c0, c0 + 1 of a half go on over kc values d [4][kc] (kdequant's),
 * from and back to s [MB][4][16] (each chain's 16 lanes): the same FMAs, in the same order, as the
 * register tile's */
#define PTILE_Q4K_D(MB)                                                                                 \
    AVX2 static void q4k_dot_##MB(const float* x, int64_t ldx, const float* d, int64_t kc, int c0, float* s) { \
        __m256 acc[MB][2][2];                                                                           \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int c = 0; c < 2; c++) UNROLL for (int u = 0; u < 2; u++) \
            acc[i][c][u] = _mm256_loadu_ps(s + (i * 4 + c0 + c) * 16 + 8 * u);                         \
        for (int64_t k = 0; k < kc; k += 16)                                                            \
            UNROLL for (int u = 0; u < 2; u++) { /* (each value of x and d loaded once) */              \
                __m256 w[2] = {_mm256_loadu_ps(d + c0 * kc + k + 8 * u), _mm256_loadu_ps(d + (c0 + 1) * kc + k + 8 * u)}; \
                UNROLL for (int i = 0; i < MB; i++) {                                                   \
                    __m256 xv = _mm256_loadu_ps(x + i * ldx + k + 8 * u);                               \
                    UNROLL for (int c = 0; c < 2; c++) acc[i][c][u] = _mm256_fmadd_ps(w[c], xv, acc[i][c][u]); \
                }                                                                                       \
            }                                                                                           \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int c = 0; c < 2; c++) UNROLL for (int u = 0; u < 2; u++) \
            _mm256_storeu_ps(s + (i * 4 + c0 + c) * 16 + 8 * u, acc[i][c][u]);                          \
    }
PTILE_Q4K_D(1) PTILE_Q4K_D(2) PTILE_Q4K_D(3)
static void (*const q4k_dot[])(const float*, int64_t, const float*, int64_t, int, float*) = {0, q4k_dot_1, q4k_dot_2, q4k_dot_3};
#define Q4K_CHUNK 512 /* values of k a many-row pass dequantizes at a time (4 columns: 8 KB) */

/* by form and dtype, as q4_wide */
static const q4ktile_fn* const q4k_tiles[5][3] = {{kq4ms, kq4msb, kq4msh},
                                                  {kq4fma, kq4fma, kq4fma},
                                                  {kq4lut, kq4lutb, kq4luth},
                                                  {kq4smh, kq4smhb, kq4smh},
                                                  {kq4sm, kq4smb, kq4smh}};

/* a W_Q4K linear's panels [p_lo, p_hi), every row (x's rows, fp32), by the tiles above: 2 rows at a
 * time (the last alone), each pass over a panel's halves */
AVX2 static void linear_range_q4k(const float* x, int64_t M, const void* wp, int64_t K, const void* bias,
                                  int64_t p_lo, int64_t p_hi, void* out, int64_t N, int64_t dt) {
    int64_t P = (N + 7) / 8;
    const q4_meta* m = (const q4_meta*)((const char*)wp + q4_meta_at(P, K, 4));
    const q4ktile_fn* tile = q4k_tiles[m->form][dt];
    if (M > 2) { /* each half's values dequantized Q4K_CHUNK at a time, once for MANY_BLOCK_ROWS rows */
        float d[4 * Q4K_CHUNK], s[MANY_BLOCK_ROWS * 4 * 16], o[MANY_BLOCK_ROWS * 8];
        const q4kdeq_fn deq = q4k_deq[m->form][dt];
        for (int64_t p = p_lo; p < p_hi; p++)
            for (int64_t m0 = 0; m0 < M; m0 += MANY_BLOCK_ROWS) {
                int64_t mb = M - m0 < MANY_BLOCK_ROWS ? M - m0 : MANY_BLOCK_ROWS;
                for (int h = 0; h < 2; h++) {
                    const uint8_t* wq = (const uint8_t*)wp + (2 * p + h) * K * 2;
                    memset(s, 0, sizeof(float) * (size_t)(mb * 4 * 16));
                    for (int64_t k0 = 0; k0 < K; k0 += Q4K_CHUNK) {
                        int64_t kc = K - k0 < Q4K_CHUNK ? K - k0 : Q4K_CHUNK;
                        deq(wq, q4_scales(wp, P, K, 4, p, 0) + 4 * h, m->group, m, k0, kc, d);
                        for (int64_t i = 0; i < mb; i += 3)
                            for (int c0 = 0; c0 < 4; c0 += 2)
                                q4k_dot[mb - i < 3 ? mb - i : 3](x + (m0 + i) * K + k0, K, d, kc, c0, s + i * 64);
                    }
                    for (int64_t i = 0; i < mb; i++)
                        for (int c = 0; c < 4; c++) {
                            const float* a = s + (i * 4 + c) * 16;
                            float t[8];
                            for (int l = 0; l < 8; l++) t[l] = a[l] + a[l + 8];
                            o[i * 8 + h * 4 + c] = sum8(t);
                        }
                }
                packed_store_avx2(o, (int)mb, 1, m0, p, bias, out, N, (int)dt);
            }
        return;
    }
    float o[2 * 8], oc[2 * 4];
    for (int64_t p = p_lo; p < p_hi; p++)
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            int mb = M - m0 < 2 ? (int)(M - m0) : 2, nc = q4k_columns[mb];
            for (int h = 0; h < 2; h++)
                for (int c0 = 0; c0 < 4; c0 += nc) {
                    tile[mb](x + m0 * K, K, (const uint8_t*)wp + (2 * p + h) * K * 2, K,
                             q4_scales(wp, P, K, 4, p, 0) + 4 * h, m->group, m, c0, oc);
                    for (int i = 0; i < mb; i++)
                        for (int c = 0; c < nc; c++) o[i * 8 + h * 4 + c0 + c] = oc[i * nc + c];
                }
            packed_store_avx2(o, mb, 1, m0, p, bias, out, N, (int)dt);
        }
}

/* the tiles' part of linear_range_c (linear.c): up to 9 rows in one pass over the panels, more in
 * blocks of rows (MANY_ROWS, cpu_kernels.h) */
void linear_range_avx2(const float* xt, int64_t M, const void* wp, int64_t wkind, int64_t K2, const void* bias,
                       int64_t p_lo, int64_t p_hi, void* out, int64_t N, int64_t dt) {
    if (wkind == W_Q4 || wkind == W_Q8G) {
        linear_range_q4(xt, M, wp, wkind, K2, bias, p_lo, p_hi, out, N, dt);
        return;
    }
    if (wkind == W_Q4K) {
        linear_range_q4k(xt, M, wp, K2, bias, p_lo, p_hi, out, N, dt);
        return;
    }
    int q8 = wkind == W_Q8;
    const ptile_fn *wide = q8 ? pq8_wide : dt == DT_BF16 ? pbf16_wide : dt == DT_F16 ? pf16_wide : pf32_wide;
    const ptile_fn *one = q8 ? pq8_one : dt == DT_BF16 ? pbf16_one : dt == DT_F16 ? pf16_one : pf32_one;
    int64_t panel = K2 * 8 * (q8 ? 1 : dt == DT_F32 ? 4 : 2); /* bytes */
    const float* scales = q8 ? (const float*)((const char*)wp + q8_scales_at((N + 7) / 8, K2)) : NULL;
    float o[9 * 32];
    if (M <= 9) {
        int np = (dt == DT_BF16 && !q8 ? pbf16_np : pf32_np)[M]; /* (W_Q8 and fp16 hold as many registers as fp32) */
        for (int64_t p = p_lo; p < p_hi;) {
            int n = p + np <= p_hi ? np : 1;
            (n == np ? wide : one)[M](xt, M, (const char*)wp + p * panel, K2, K2, o, 0);
            if (q8) q8_scale_avx2(o, (int)M, n, p, scales, (int)dt);
            packed_store_avx2(o, (int)M, n, 0, p, bias, out, N, (int)dt);
            p += n;
        }
        return;
    }
    /* more rows: fp32 weights by MANY_PANELS panels and K blocks, bf16, fp16 and W_Q8 (each pass widens
     * the panel again) one panel at a time over its whole K */
    int64_t B = x_block(M, dt), blocks = (M + B - 1) / B;
    float acc[MANY_BLOCK_ROWS * MANY_PANELS * 8];
    for (int64_t p = p_lo; p < p_hi;) {
        int n = dt == DT_F32 && !q8 && p + MANY_PANELS <= p_hi ? MANY_PANELS : 1;
        int64_t kb = n == MANY_PANELS ? MANY_KBLOCK : K2;
        for (int64_t b0 = 0; b0 < blocks; b0 += MANY_BLOCK_ROWS / B) {
            int64_t b1 = b0 + MANY_BLOCK_ROWS / B < blocks ? b0 + MANY_BLOCK_ROWS / B : blocks;
            for (int64_t k0 = 0; k0 < K2; k0 += kb)
                for (int64_t b = b0; b < b1; b++) {
                    int64_t mb, at = x_at(M, B, K2, b * B, &mb), m0 = b * B;
                    (n == MANY_PANELS ? pf32_many : one)[mb](xt + at + k0 * mb, mb,
                        (const char*)wp + p * panel + k0 * 8 * 4, K2, /* (k0 > 0: fp32 panels alone) */
                        K2 - k0 < kb ? K2 - k0 : kb, acc + (m0 - b0 * B) * n * 8, k0 > 0);
                }
            int64_t r1 = b1 * B < M ? b1 * B : M;
            if (q8) q8_scale_avx2(acc, (int)(r1 - b0 * B), n, p, scales, (int)dt);
            packed_store_avx2(acc, (int)(r1 - b0 * B), n, b0 * B, p, bias, out, N, (int)dt);
        }
        p += n;
    }
}

/* x's rows m .. m + R - 1 (R = 8, 4 or 1), values [0, K - K % R) (bf16, fp16 widened), into a block of the
 * transposed x: value k of row m + i at dst[k * ld + i]; by R x R transposes, not one scalar store per
 * value, which kept a 9-row call's caller busy while the other threads waited (docs/results.md,
 * "Linear stores and transposes: the linears' own overheads") */
AVX2 static void transpose8(const void* x, int64_t m, int64_t K, int dt, float* dst, int64_t ld) {
    for (int64_t k0 = 0; k0 + 8 <= K; k0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = ld_dt(x, (m + i) * K + k0, dt);
        transpose8x8(r);
        for (int v = 0; v < 8; v++) _mm256_storeu_ps(dst + (k0 + v) * ld, r[v]);
    }
}
AVX2 static int64_t transpose1(const void* x, int64_t m, int64_t K, int dt, float* dst) { /* one row: as it is */
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, ld_dt(x, m * K + k, dt));
    return k;
}
AVX2 static void transpose4(const void* x, int64_t m, int64_t K, int dt, float* dst, int64_t ld) {
    for (int64_t k0 = 0; k0 + 4 <= K; k0 += 4) {
        __m128 r[4];
        for (int i = 0; i < 4; i++) {
            const __m128i* h = (const __m128i*)((const uint16_t*)x + (m + i) * K + k0);
            r[i] = dt == DT_BF16 ? _mm256_castps256_ps128(widen8(_mm_loadl_epi64(h)))
                 : dt == DT_F16  ? _mm_cvtph_ps(_mm_loadl_epi64(h))
                                 : _mm_loadu_ps((const float*)x + (m + i) * K + k0);
        }
        _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
        for (int v = 0; v < 4; v++) _mm_storeu_ps(dst + (k0 + v) * ld, r[v]);
    }
}

/* pack_x_c (linear.c) by register transposes: a block's rows go by eights, then fours, then alone */
void pack_x_avx2(const void* x, int64_t M, int64_t K, int64_t K2, int64_t dt, float* xt) {
    int64_t B = x_block(M, dt);
    for (int64_t m = 0; m < M; m++) {
        int64_t ld, k = 0, i = m % B; /* i: the row's place in its block */
        float* xm = xt + x_at(M, B, K2, m, &ld);
        if (ld == 1) /* one row: its values in a line */
            k = transpose1(x, m, K, (int)dt, xm);
        else if (i / 8 * 8 + 8 <= ld) {
            if (i % 8 == 0) transpose8(x, m, K, (int)dt, xm, ld);
            k = K / 8 * 8; /* (this row's values up to there are in) */
        } else if (i / 4 * 4 + 4 <= ld) {
            if (i % 4 == 0) transpose4(x, m, K, (int)dt, xm, ld);
            k = K / 4 * 4;
        }
        x_row_rest(x, m, K, K2, (int)dt, xm, ld, k);
    }
}

#endif
