/* W_Q4, W_Q8G and W_Q8 linears of up to 9 rows on AVX-512 (level 2): the AVX2 tiles of those kinds
 * (linear_avx2.c) with two panels in each 16-lane vector, lanes 0-7 the first panel's 8 columns and
 * 8-15 the next one's.
 *
 * Why only these: a quantized weight costs instructions to become a float (a 4-bit code widened, made
 * a float, scaled, for bf16 calls rounded; an int8 one widened twice) besides its FMA, so on 2 cores
 * the AVX2 tiles of a 1-row call run below the read bandwidth, where float weights run at it (the
 * 32-register AVX-512 float tiles were no faster: docs/results.md). 16 lanes do that work for twice
 * the weights an instruction, and a 16-entry codebook is one permute (vpermps) rather than two and a
 * blend.
 *
 * Each output is the same chain as at the other levels: the AVX2 tiles' FMA over k of the same
 * values, lane for lane, so level 2's linears give level 0's bits. A panel left without a partner
 * (an odd count in a thread's range), and calls of more rows, go to level 1's code.
 *
 * W_Q4K's tiles (below) take every row count: its codes lie along k, and a group's 16 values are a
 * table one vpermps looks 16 codes up in, so a weight costs a shift, a permute and its FMAs whatever
 * its form and the call's dtype. */
#include "simd.h"

#if HAVE_AVX512BF16_KERNELS

#define AVX512_INLINE AVX512 static inline __attribute__((always_inline))
#define PACK_AHEAD_Q4 2048 /* (as linear_avx2.c's) */
#define PACK_AHEAD_Q8 4096

/* 8 floats at a, then 8 at b, as one vector */
AVX512_INLINE __m512 two8(const float* a, const float* b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(a))),
                                               _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
/* the 8 bytes at p (for lanes 0-7) and the 8 at p + next (lanes 8-15): two panels' bytes at one k
 * (W_Q8) or pair of k (W_Q4), prefetched `ahead` bytes on in both panels when `prefetch` */
AVX512_INLINE __m128i two_panels(const void* p, int64_t next, int prefetch, int ahead) {
    const char* a = (const char*)p;
    if (prefetch) {
        _mm_prefetch(a + ahead, _MM_HINT_T1);
        _mm_prefetch(a + next + ahead, _MM_HINT_T1);
    }
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)a), _mm_loadl_epi64((const __m128i*)(a + next)));
}
/* rnd8_number and rnd8 (simd.h) in 16 lanes */
AVX512_INLINE __m512 rnd16_number(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
}
AVX512_INLINE __m512 rnd16(__m512 v) {
    __m512i nan = _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0xFFFF0000u)),
                                  _mm512_set1_epi32(0x00400000));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rnd16_number(v), _mm512_castsi512_ps(nan));
}
#define RND16_F16(V) _mm512_cvtph_ps(_mm512_cvtps_ph(V, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))

/* as Q4_CONSTANTS (linear_avx2.c); the codebook is one vector, which vpermps indexes by a lane's low 4 bits */
#define Q4_CONSTANTS16(M)                                                                               \
    const __m512i low = _mm512_set1_epi32(15), magic = _mm512_set1_epi32(0x4B000000);                   \
    const __m512 base = _mm512_set1_ps(8388608.0f + (M)->offset), lut = _mm512_loadu_ps((M)->lut);     \
    (void)low, (void)magic, (void)base, (void)lut
/* F0, F1: the floats of the codes at k and k + 1 in B (two_panels' bytes widened), as Q4_AFFINE and Q4_LUT_CODES */
#define Q4_AFFINE16(B, F0, F1)                                                                          \
    __m512 F0 = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(B, low), magic)), base); \
    __m512 F1 = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(B, 4), magic)), base)
#define Q4_LUT16(B, F0, F1)                                                                             \
    __m512 F0 = _mm512_permutexvar_ps(B, lut), F1 = _mm512_permutexvar_ps(_mm512_srli_epi32(B, 4), lut)
/* the floats F0, F1 of the codes at k and k + 1 of pair of panels J of a tile whose first panel is at
 * W (K values long): 4-bit codes (a pair of k in 8 bytes of each panel) read by CODES, or W_Q8G's 8-bit
 * codes (8 bytes of each panel a k) as Q4_AFFINE16's floats; prefetched every 64 bytes of a panel */
#define READ4_16(CODES, W, J, K, k, F0, F1)                                                             \
    __m512i b_ = _mm512_cvtepu8_epi32(two_panels(W + (2 * J * K + k) * 4, K * 4, !(k & 15), PACK_AHEAD_Q4)); \
    CODES(b_, F0, F1)
#define READ_AFFINE16(W, J, K, k, F0, F1) READ4_16(Q4_AFFINE16, W, J, K, k, F0, F1)
#define READ_LUT16(W, J, K, k, F0, F1) READ4_16(Q4_LUT16, W, J, K, k, F0, F1)
#define READ_Q8G16(W, J, K, k, F0, F1)                                                                  \
    __m512i b0_ = _mm512_cvtepu8_epi32(two_panels(W + (2 * J * K + k) * 8, K * 8, !(k & 7), PACK_AHEAD_Q4)); \
    __m512i b1_ = _mm512_cvtepu8_epi32(two_panels(W + (2 * J * K + k + 1) * 8, K * 8, 0, PACK_AHEAD_Q4));   \
    __m512 F0 = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(b0_, magic)), base);                  \
    __m512 F1 = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(b1_, magic)), base)
/* each form's dequantization, as the DEQ_ macros of linear_avx2.c */
#define DEQ16_FMA(F, S, Z) _mm512_fmadd_ps(F, S, Z)
#define DEQ16_MUL_SUB(F, S, Z) _mm512_sub_ps(_mm512_mul_ps(F, S), Z)
#define DEQ16_MUL_SUB_BF16(F, S, Z) rnd16(_mm512_sub_ps(rnd16(_mm512_mul_ps(F, S)), Z))
#define DEQ16_MUL_SUB_F16(F, S, Z) RND16_F16(_mm512_sub_ps(RND16_F16(_mm512_mul_ps(F, S)), Z))
#define DEQ16_LUT(F, S, Z) ((void)(Z), _mm512_mul_ps(F, S))
#define DEQ16_LUT_BF16(F, S, Z) ((void)(Z), rnd16_number(_mm512_mul_ps(F, S)))
#define DEQ16_LUT_F16(F, S, Z) ((void)(Z), RND16_F16(_mm512_mul_ps(F, S)))
#define DEQ16_SUB_MUL_F16(F, S, Z) RND16_F16(_mm512_mul_ps(_mm512_sub_ps(F, Z), S))
#define DEQ16_SUB_MUL_F16_BF16(F, S, Z) rnd16_number(DEQ16_SUB_MUL_F16(F, S, Z))
#define DEQ16_SUB_MUL(F, S, Z) _mm512_mul_ps(_mm512_sub_ps(F, Z), S)
#define DEQ16_SUB_MUL_BF16(F, S, Z) rnd16_number(DEQ16_SUB_MUL(F, S, Z))

/* a tile of MB rows over NP pairs of panels, the first at wp: as PTILE_Q4 (linear_avx2.c), its sums
 * stored as that tile's of 2 NP panels; READ says the codes */
#define PTILE_Q4_16(NAME, READ, DEQ, MB, NP)                                                            \
    AVX512 static void NAME##_##MB##x##NP(const float* xt, int64_t ldx, const uint8_t* wp, int64_t K, const float* sz, \
                                          int64_t szld, const q4_meta* m, float* o) {                   \
        Q4_CONSTANTS16(m);                                                                              \
        const int64_t G = m->group;                                                                     \
        __m512 acc[MB][NP];                                                                             \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm512_setzero_ps(); \
        for (int64_t g0 = 0; g0 < K; g0 += G) {                                                         \
            __m512 sc[NP], sh[NP];                                                                      \
            UNROLL for (int j = 0; j < NP; j++) {                                                       \
                const float* s0 = sz + 2 * j * szld + g0 / G * 16;                                      \
                sc[j] = two8(s0, s0 + szld);                                                            \
                sh[j] = two8(s0 + 8, s0 + szld + 8);                                                    \
            }                                                                                           \
            for (int64_t k = g0; k < g0 + G; k += 2) {                                                  \
                __m512 w0[NP], w1[NP];                                                                  \
                UNROLL for (int j = 0; j < NP; j++) {                                                   \
                    READ(wp, j, K, k, f0, f1);                                                          \
                    w0[j] = DEQ(f0, sc[j], sh[j]);                                                      \
                    w1[j] = DEQ(f1, sc[j], sh[j]);                                                      \
                }                                                                                       \
                UNROLL for (int i = 0; i < MB; i++) {                                                   \
                    __m512 xb = _mm512_set1_ps(xt[k * ldx + i]);                                        \
                    UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm512_fmadd_ps(w0[j], xb, acc[i][j]); \
                }                                                                                       \
                UNROLL for (int i = 0; i < MB; i++) {                                                   \
                    __m512 xb = _mm512_set1_ps(xt[(k + 1) * ldx + i]);                                  \
                    UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm512_fmadd_ps(w1[j], xb, acc[i][j]); \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) _mm512_storeu_ps(o + (i * NP + j) * 16, acc[i][j]); \
    }
typedef void (*q4tile16_fn)(const float* xt, int64_t ldx, const uint8_t* wp, int64_t K, const float* sz, int64_t szld,
                            const q4_meta* m, float* o);
/* by rows (1-9): the tile of one pass (tile_pairs[M] pairs of panels) and the tile of one pair; the
 * shapes keep sums, weights, scales and shifts within AVX-512's 32 registers. One row goes over 2
 * pairs, not 4: 4 streams of codes a thread, as level 1's 1-row tile reads, ran faster than 8
 * (docs/measurements/cpu-xeon-2026-11-30-q4-avx512/NOTES.md) */
static const int tile_pairs[] = {0, 2, 4, 3, 3, 2, 2, 2, 2, 1};
#define Q4_TILES16(NAME, READ, DEQ)                                                                     \
    PTILE_Q4_16(NAME, READ, DEQ, 1, 1) PTILE_Q4_16(NAME, READ, DEQ, 2, 1) PTILE_Q4_16(NAME, READ, DEQ, 3, 1) \
    PTILE_Q4_16(NAME, READ, DEQ, 4, 1) PTILE_Q4_16(NAME, READ, DEQ, 5, 1) PTILE_Q4_16(NAME, READ, DEQ, 6, 1) \
    PTILE_Q4_16(NAME, READ, DEQ, 7, 1) PTILE_Q4_16(NAME, READ, DEQ, 8, 1) PTILE_Q4_16(NAME, READ, DEQ, 9, 1) \
    PTILE_Q4_16(NAME, READ, DEQ, 1, 2) PTILE_Q4_16(NAME, READ, DEQ, 2, 4) PTILE_Q4_16(NAME, READ, DEQ, 3, 3) \
    PTILE_Q4_16(NAME, READ, DEQ, 4, 3) PTILE_Q4_16(NAME, READ, DEQ, 5, 2) PTILE_Q4_16(NAME, READ, DEQ, 6, 2) \
    PTILE_Q4_16(NAME, READ, DEQ, 7, 2) PTILE_Q4_16(NAME, READ, DEQ, 8, 2)                              \
    static const q4tile16_fn NAME##_wide[] = {0, NAME##_1x2, NAME##_2x4, NAME##_3x3, NAME##_4x3, NAME##_5x2, \
                                              NAME##_6x2, NAME##_7x2, NAME##_8x2, NAME##_9x1};           \
    static const q4tile16_fn NAME##_one[] = {0, NAME##_1x1, NAME##_2x1, NAME##_3x1, NAME##_4x1, NAME##_5x1, \
                                             NAME##_6x1, NAME##_7x1, NAME##_8x1, NAME##_9x1};
Q4_TILES16(zq4fma, READ_AFFINE16, DEQ16_FMA)
Q4_TILES16(zq4ms, READ_AFFINE16, DEQ16_MUL_SUB)
Q4_TILES16(zq4msb, READ_AFFINE16, DEQ16_MUL_SUB_BF16)
Q4_TILES16(zq4msh, READ_AFFINE16, DEQ16_MUL_SUB_F16)
Q4_TILES16(zq4lut, READ_LUT16, DEQ16_LUT)
Q4_TILES16(zq4lutb, READ_LUT16, DEQ16_LUT_BF16)
Q4_TILES16(zq4luth, READ_LUT16, DEQ16_LUT_F16)
Q4_TILES16(zq4smh, READ_AFFINE16, DEQ16_SUB_MUL_F16)
Q4_TILES16(zq4smhb, READ_AFFINE16, DEQ16_SUB_MUL_F16_BF16)
Q4_TILES16(zq4sm, READ_AFFINE16, DEQ16_SUB_MUL)
Q4_TILES16(zq4smb, READ_AFFINE16, DEQ16_SUB_MUL_BF16)
Q4_TILES16(zq8gsm, READ_Q8G16, DEQ16_SUB_MUL)
Q4_TILES16(zq8gsmb, READ_Q8G16, DEQ16_SUB_MUL_BF16)
Q4_TILES16(zq8gsmh, READ_Q8G16, DEQ16_SUB_MUL_F16)
/* by form and dtype, as q4_wide and q4_one (linear_avx2.c) */
static const q4tile16_fn* const q4_wide16[5][3] = {{zq4ms_wide, zq4msb_wide, zq4msh_wide},
                                                   {zq4fma_wide, zq4fma_wide, zq4fma_wide},
                                                   {zq4lut_wide, zq4lutb_wide, zq4luth_wide},
                                                   {zq4smh_wide, zq4smhb_wide, zq4smh_wide},
                                                   {zq4sm_wide, zq4smb_wide, zq4smh_wide}};
static const q4tile16_fn* const q4_one16[5][3] = {{zq4ms_one, zq4msb_one, zq4msh_one},
                                                  {zq4fma_one, zq4fma_one, zq4fma_one},
                                                  {zq4lut_one, zq4lutb_one, zq4luth_one},
                                                  {zq4smh_one, zq4smhb_one, zq4smh_one},
                                                  {zq4sm_one, zq4smb_one, zq4smh_one}};
/* W_Q8G's (its one form, Q4_SUB_MUL) by dtype */
static const q4tile16_fn* const q8g_wide16[3] = {zq8gsm_wide, zq8gsmb_wide, zq8gsmh_wide};
static const q4tile16_fn* const q8g_one16[3] = {zq8gsm_one, zq8gsmb_one, zq8gsmh_one};

/* W_Q8: a tile of MB rows over NP pairs of panels (K2 values long, the first at wp), as the W_Q8 tiles
 * of linear_avx2.c: each k the 8 bytes of each panel widened to floats (exact), one FMA a row */
#define PTILE_Q8_16(MB, NP)                                                                             \
    AVX512 static void zq8_##MB##x##NP(const float* xt, int64_t ldx, const int8_t* wp, int64_t K, float* o) { \
        __m512 acc[MB][NP];                                                                             \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm512_setzero_ps(); \
        for (int64_t k = 0; k < K; k++) {                                                               \
            __m512 wv[NP];                                                                              \
            UNROLL for (int j = 0; j < NP; j++) {                                                       \
                __m128i b = two_panels(wp + (2 * j * K + k) * 8, K * 8, !(k & 7), PACK_AHEAD_Q8);       \
                wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));                                    \
            }                                                                                           \
            UNROLL for (int i = 0; i < MB; i++) {                                                       \
                __m512 xb = _mm512_set1_ps(xt[k * ldx + i]);                                            \
                UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm512_fmadd_ps(wv[j], xb, acc[i][j]);  \
            }                                                                                           \
        }                                                                                               \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) _mm512_storeu_ps(o + (i * NP + j) * 16, acc[i][j]); \
    }
typedef void (*q8tile16_fn)(const float* xt, int64_t ldx, const int8_t* wp, int64_t K, float* o);
PTILE_Q8_16(1, 1) PTILE_Q8_16(2, 1) PTILE_Q8_16(3, 1) PTILE_Q8_16(4, 1) PTILE_Q8_16(5, 1) PTILE_Q8_16(6, 1)
PTILE_Q8_16(7, 1) PTILE_Q8_16(8, 1) PTILE_Q8_16(9, 1) PTILE_Q8_16(1, 2) PTILE_Q8_16(2, 4) PTILE_Q8_16(3, 3)
PTILE_Q8_16(4, 3) PTILE_Q8_16(5, 2) PTILE_Q8_16(6, 2) PTILE_Q8_16(7, 2) PTILE_Q8_16(8, 2)
static const q8tile16_fn zq8_wide[] = {0, zq8_1x2, zq8_2x4, zq8_3x3, zq8_4x3, zq8_5x2, zq8_6x2, zq8_7x2, zq8_8x2, zq8_9x1};
static const q8tile16_fn zq8_one[] = {0, zq8_1x1, zq8_2x1, zq8_3x1, zq8_4x1, zq8_5x1, zq8_6x1, zq8_7x1, zq8_8x1, zq8_9x1};

/* W_Q4K (cpu_kernels.h): a tile of MB rows (1-6, x's rows ldx apart) over one half of a panel (4
 * columns, its codes at wq, its scales and shifts of group 0 at sz): for each block of 32 values of k,
 * a column's 16 bytes widened to 16 lanes, their low nibbles (k = 32b + l) and then their high ones
 * (32b + 16 + l) looked up in the column's table of its group's 16 values (vpermps reads a lane's low
 * 4 bits: one instruction for 16 weights), one FMA a row each. The tables are made at each group's
 * first block: DEQ over FB, the 16 codes as floats (q - offset, or the codebook). The sums o[i * 4 + c]
 * (hsum16: the 16 lanes' tree of cpu_kernels.h). */
AVX512_INLINE float hsum16(__m512 a) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
}
#define PTILE_Q4K16(NAME, DEQ, MB)                                                                      \
    AVX512 static void NAME##_##MB(const float* x, int64_t ldx, const uint8_t* wq, int64_t K, const float* sz, \
                                   int64_t G, __m512 fb, float* o) {                                    \
        __m512 acc[MB][4], lut[4];                                                                      \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps(); \
        UNROLL for (int c = 0; c < 4; c++) lut[c] = _mm512_setzero_ps(); /* (made at k = 0) */        \
        for (int64_t k = 0; k < K; k += Q4K_BLOCK) {                                                    \
            const uint8_t* b = wq + k * 2; /* (64 bytes a block) */                                     \
            if (k % G == 0) {                                                                           \
                const float* s = sz + k / G * 16;                                                       \
                UNROLL for (int c = 0; c < 4; c++) lut[c] = DEQ(fb, _mm512_set1_ps(s[c]), _mm512_set1_ps(s[8 + c])); \
            }                                                                                           \
            _mm_prefetch((const char*)b + PACK_AHEAD_Q4, _MM_HINT_T0);                                  \
            UNROLL for (int c = 0; c < 4; c++) {                                                        \
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + c * 16)));        \
                __m512 w0 = _mm512_permutexvar_ps(v, lut[c]);                                           \
                __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut[c]);                     \
                UNROLL for (int i = 0; i < MB; i++) {                                                   \
                    acc[i][c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * ldx + k), acc[i][c]);       \
                    acc[i][c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i * ldx + k + 16), acc[i][c]);  \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int c = 0; c < 4; c++) o[i * 4 + c] = hsum16(acc[i][c]); \
    }
typedef void (*q4ktile16_fn)(const float* x, int64_t ldx, const uint8_t* wq, int64_t K, const float* sz, int64_t G,
                             __m512 fb, float* o);
#define Q4K_TILES16(NAME, DEQ)                                                                          \
    PTILE_Q4K16(NAME, DEQ, 1) PTILE_Q4K16(NAME, DEQ, 2) PTILE_Q4K16(NAME, DEQ, 3) PTILE_Q4K16(NAME, DEQ, 4) \
    PTILE_Q4K16(NAME, DEQ, 5) PTILE_Q4K16(NAME, DEQ, 6)                                                 \
    static const q4ktile16_fn NAME[] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6};
Q4K_TILES16(kq4fma, DEQ16_FMA)
Q4K_TILES16(kq4ms, DEQ16_MUL_SUB)
Q4K_TILES16(kq4msb, DEQ16_MUL_SUB_BF16)
Q4K_TILES16(kq4msh, DEQ16_MUL_SUB_F16)
Q4K_TILES16(kq4lut, DEQ16_LUT)
Q4K_TILES16(kq4lutb, DEQ16_LUT_BF16)
Q4K_TILES16(kq4luth, DEQ16_LUT_F16)
Q4K_TILES16(kq4smh, DEQ16_SUB_MUL_F16)
Q4K_TILES16(kq4smhb, DEQ16_SUB_MUL_F16_BF16)
Q4K_TILES16(kq4sm, DEQ16_SUB_MUL)
Q4K_TILES16(kq4smb, DEQ16_SUB_MUL_BF16)
/* by form and dtype, as q4_wide16 */
static const q4ktile16_fn* const q4k16[5][3] = {{kq4ms, kq4msb, kq4msh},
                                                {kq4fma, kq4fma, kq4fma},
                                                {kq4lut, kq4lutb, kq4luth},
                                                {kq4smh, kq4smhb, kq4smh},
                                                {kq4sm, kq4smb, kq4smh}};

/* a W_Q4K linear's panels [p_lo, p_hi), every row (x's rows, fp32), by the tiles above: Q4K_ROWS16
 * rows at a time (a verify step of k = 4 in one pass), each pass over both halves of a panel */
#define Q4K_ROWS16 6
AVX512 static void linear_range_q4k16(const float* x, int64_t M, const void* wp, int64_t K, const void* bias,
                                      int64_t p_lo, int64_t p_hi, void* out, int64_t N, int64_t dt) {
    int64_t P = (N + 7) / 8;
    const q4_meta* m = (const q4_meta*)((const char*)wp + q4_meta_at(P, K, 4));
    const q4ktile16_fn* tile = q4k16[m->form][dt];
    __m512 fb = m->form == Q4_LUT ? _mm512_loadu_ps(m->lut)
                                  : _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                  _mm512_set1_ps(m->offset));
    float o[Q4K_ROWS16 * 8], oh[Q4K_ROWS16 * 4];
    for (int64_t p = p_lo; p < p_hi; p++)
        for (int64_t m0 = 0; m0 < M; m0 += Q4K_ROWS16) {
            int mb = M - m0 < Q4K_ROWS16 ? (int)(M - m0) : Q4K_ROWS16;
            for (int h = 0; h < 2; h++) {
                tile[mb](x + m0 * K, K, (const uint8_t*)wp + (2 * p + h) * K * 2, K, q4_scales(wp, P, K, 4, p, 0) + 4 * h,
                         m->group, fb, oh);
                for (int i = 0; i < mb; i++)
                    for (int c = 0; c < 4; c++) o[i * 8 + h * 4 + c] = oh[i * 4 + c];
            }
            packed_store_avx2(o, mb, 1, m0, p, bias, out, N, (int)dt);
        }
}

/* linear_range_avx2 with W_Q4, W_Q8G and W_Q8 weights of up to 9 rows on the tiles above, and W_Q4K ones */
void linear_range_avx512(const float* xt, int64_t M, const void* wp, int64_t wkind, int64_t K2, const void* bias,
                         int64_t p_lo, int64_t p_hi, void* out, int64_t N, int64_t dt) {
    if (wkind == W_Q4K) {
        linear_range_q4k16(xt, M, wp, K2, bias, p_lo, p_hi, out, N, dt);
        return;
    }
    int64_t p = p_lo, P = (N + 7) / 8;
    float o[9 * 64];
    int np = tile_pairs[M <= 9 ? M : 0]; /* (the W_Q8 tiles: as the W_Q4 ones) */
    if ((wkind == W_Q4 || wkind == W_Q8G) && M <= 9) {
        int64_t kb = q4_kbytes(wkind);
        const q4_meta* m = (const q4_meta*)((const char*)wp + q4_meta_at(P, K2, kb));
        const q4tile16_fn *wide = wkind == W_Q8G ? q8g_wide16[dt] : q4_wide16[m->form][dt];
        const q4tile16_fn *one = wkind == W_Q8G ? q8g_one16[dt] : q4_one16[m->form][dt];
        for (; p + 2 <= p_hi;) {
            int n = p + 2 * np <= p_hi ? np : 1;
            (n == np ? wide : one)[M](xt, M, (const uint8_t*)wp + p * K2 * kb, K2, q4_scales(wp, P, K2, kb, p, 0),
                                      K2 / m->group * 16, m, o);
            packed_store_avx2(o, (int)M, 2 * n, 0, p, bias, out, N, (int)dt);
            p += 2 * n;
        }
    } else if (wkind == W_Q8 && M <= 9) {
        const float* scales = (const float*)((const char*)wp + q8_scales_at(P, K2));
        for (; p + 2 <= p_hi;) {
            int n = p + 2 * np <= p_hi ? np : 1;
            (n == np ? zq8_wide : zq8_one)[M](xt, M, (const int8_t*)wp + p * K2 * 8, K2, o);
            q8_scale_avx2(o, (int)M, 2 * n, p, scales, (int)dt);
            packed_store_avx2(o, (int)M, 2 * n, 0, p, bias, out, N, (int)dt);
            p += 2 * n;
        }
    }
    if (p < p_hi) linear_range_avx2(xt, M, wp, wkind, K2, bias, p, p_hi, out, N, dt);
}

#endif
