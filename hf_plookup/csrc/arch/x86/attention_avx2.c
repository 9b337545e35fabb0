/* Attention on AVX2 + FMA (level 1 and up): scores, softmax and weighted sums of attention.c's passes,
 * the same arithmetic as its portable loops (a score: 8 lanes over D, then sum8's tree; an output
 * element: one FMA per key, in order), eight lanes or several heads and keys at a time. */
#include "simd.h"

#if HAVE_X86_KERNELS

/* exp(x) for x <= 0 (softmax after the max is taken): 2^n * p(r), r in [-ln2/2, ln2/2], a degree-6
 * polynomial (relative error about 2e-7); exp(-88) and below flush to 0 */
AVX2 static inline __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.3981999507e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* in place; s[j] <- exp(s[j] * scale - max) / sum (scale 1 after soft-capping); the vector loops round
 * as the scalar ones they replace (a product, a max, then per lane in order) */
AVX2 void softmax_avx2(float* s, int64_t L, float scale) {
    int64_t j = 0;
    __m256 vm = _mm256_set1_ps(-INFINITY), vs = _mm256_set1_ps(scale);
    for (; j + 8 <= L; j += 8) { /* scaled (one product each; scale 1 leaves s as it is) and the lanes' max */
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + j), vs);
        _mm256_storeu_ps(s + j, v);
        vm = _mm256_max_ps(v, vm); /* (a > b) ? a : b */
    }
    float lanes[8], mx = -INFINITY;
    _mm256_storeu_ps(lanes, vm);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    for (; j < L; j++) { /* the last L % 8 the same way, one at a time */
        s[j] *= scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    __m256 vmx = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
    j = 0;
    for (; j + 8 <= L; j += 8) {
        __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < L) {
        float tmp[8];
        for (int i = 0; i < 8; i++) tmp[i] = j + i < L ? s[j + i] - mx : -INFINITY;
        __m256 e = exp_neg(_mm256_loadu_ps(tmp));
        _mm256_storeu_ps(tmp, e);
        for (int i = 0; j + i < L; i++) s[j + i] = tmp[i];
        sum = _mm256_add_ps(sum, e);
    }
    float inv = 1.0f / hsum8(sum);
    __m256 vinv = _mm256_set1_ps(inv);
    for (j = 0; j + 8 <= L; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), vinv));
    for (; j < L; j++) s[j] *= inv;
}

/* ---- Head groups: NH query vectors (heads of one token that share a KV head) over keys or values at
 * element offsets rows[j], each row read once for all NH vectors. */

/* scores_fn (cpu_kernels.h) for NH heads: keys KB at a time (independent sums, each with the same
 * arithmetic whatever NH and KB) */
#define SCORES(NAME, NH, KB)                                                                            \
    AVX2 static void NAME(const float* q, const void* kb, const int64_t* rows, int64_t L, int64_t D,     \
                          int64_t qs, int bf16, float* s, int64_t ld, int64_t npf) {                    \
        int64_t j = 0, esz = bf16 ? 2 : 4;                                                              \
        for (; j + KB <= L; j += KB) {                                                                  \
            for (int u = 0; u < KB && j + KEY_AHEAD + u < npf; u++)                                     \
                prefetch_row((const char*)kb + rows[j + KEY_AHEAD + u] * esz, D * esz);                 \
            __m256 a[NH][KB];                                                                           \
            for (int h = 0; h < NH; h++)                                                                \
                for (int u = 0; u < KB; u++) a[h][u] = _mm256_setzero_ps();                             \
            int64_t d = 0;                                                                              \
            for (; d + 8 <= D; d += 8) {                                                                \
                __m256 kv[KB];                                                                          \
                for (int u = 0; u < KB; u++) kv[u] = LDX(kb, rows[j + u] + d, 0);                       \
                for (int h = 0; h < NH; h++) {                                                          \
                    __m256 qv = _mm256_loadu_ps(q + h * qs + d);                                         \
                    for (int u = 0; u < KB; u++) a[h][u] = _mm256_fmadd_ps(qv, kv[u], a[h][u]);         \
                }                                                                                       \
            }                                                                                           \
            if (d < D) { /* the last D % 8 values: zero lanes after them */                             \
                int rem = (int)(D - d);                                                                 \
                for (int u = 0; u < KB; u++) {                                                          \
                    __m256 kv = LDX(kb, rows[j + u] + d, rem);                                          \
                    for (int h = 0; h < NH; h++)                                                        \
                        a[h][u] = _mm256_fmadd_ps(ld_part(q + h * qs, d, rem, 0), kv, a[h][u]);          \
                }                                                                                       \
            }                                                                                           \
            store_scores(&a[0][0], NH, KB, s, ld, j);                                                   \
        }                                                                                               \
        for (; j < L; j++) {                                                                            \
            __m256 a[NH];                                                                               \
            for (int h = 0; h < NH; h++) a[h] = _mm256_setzero_ps();                                    \
            int64_t d = 0;                                                                              \
            for (; d + 8 <= D; d += 8) {                                                                \
                __m256 k0 = LDX(kb, rows[j] + d, 0);                                                    \
                for (int h = 0; h < NH; h++) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * qs + d), k0, a[h]); \
            }                                                                                           \
            if (d < D) {                                                                                \
                int rem = (int)(D - d);                                                                 \
                __m256 k0 = LDX(kb, rows[j] + d, rem);                                                  \
                for (int h = 0; h < NH; h++) a[h] = _mm256_fmadd_ps(ld_part(q + h * qs, d, rem, 0), k0, a[h]); \
            }                                                                                           \
            for (int h = 0; h < NH; h++) s[h * ld + j] = hsum8(a[h]);                                    \
        }                                                                                               \
    }

/* wsum_fn (cpu_kernels.h) for NH heads: the running sums in o (a query's keys may come in several
 * calls, in order), 32 values of D at a time, each value row read once for all NH heads */
#define WSUM(NAME, NH)                                                                                  \
    AVX2 static void NAME(const float* p, int64_t ld, const void* vb, const int64_t* rows, int64_t L,    \
                          int64_t D, int bf16, float* o, int64_t npf) {                                 \
        int64_t esz = bf16 ? 2 : 4;                                                                     \
        for (int64_t d0 = 0; d0 < D; d0 += 32) {                                                        \
            int64_t nd = D - d0 < 32 ? D - d0 : 32;                                                     \
            int nv = (int)((nd + 7) / 8), rem = (int)(nd % 8);                                          \
            __m256 acc[NH][4];                                                                          \
            for (int h = 0; h < NH; h++)                                                                \
                for (int c = 0; c < nv; c++)                                                           \
                    acc[h][c] = c == nv - 1 && rem ? ld_part(o + h * D + d0, c * 8, rem, 0)            \
                                                   : _mm256_loadu_ps(o + h * D + d0 + c * 8);         \
            if (nd == 32) /* whole vectors */                                                           \
                for (int64_t j = 0; j < L; j++) {                                                       \
                    if (j + KEY_AHEAD < npf) prefetch_row((const char*)vb + (rows[j + KEY_AHEAD] + d0) * esz, 32 * esz); \
                    __m256 pj[NH];                                                                      \
                    for (int h = 0; h < NH; h++) pj[h] = _mm256_set1_ps(p[h * ld + j]);                 \
                    for (int c = 0; c < 4; c++) {                                                       \
                        __m256 v = LDX(vb, rows[j] + d0 + c * 8, 0);                                    \
                        for (int h = 0; h < NH; h++) acc[h][c] = _mm256_fmadd_ps(pj[h], v, acc[h][c]);  \
                    }                                                                                   \
                }                                                                                       \
            else                                                                                        \
                for (int64_t j = 0; j < L; j++)                                                         \
                    for (int c = 0; c < nv; c++) {                                                      \
                        __m256 v = LDX(vb, rows[j] + d0 + c * 8, c == nv - 1 ? rem : 0);                \
                        for (int h = 0; h < NH; h++)                                                    \
                            acc[h][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[h * ld + j]), v, acc[h][c]);   \
                    }                                                                                   \
            for (int h = 0; h < NH; h++) {                                                              \
                float tmp[32];                                                                          \
                for (int c = 0; c < nv; c++)                                                            \
                    _mm256_storeu_ps(c == nv - 1 && rem ? tmp + c * 8 : o + h * D + d0 + c * 8, acc[h][c]); \
                for (int i = 0; i < rem; i++) o[h * D + d0 + (nv - 1) * 8 + i] = tmp[(nv - 1) * 8 + i];  \
            }                                                                                           \
        }                                                                                               \
    }

SCORES(scores1, 1, 8)
SCORES(scores2, 2, 4)
SCORES(scores3, 3, 3)
WSUM(wsum1, 1)
WSUM(wsum2, 2)
WSUM(wsum3, 3)
const scores_fn scores_avx2[MAX_NH + 1] = {0, scores1, scores2, scores3};
const wsum_fn wsum_avx2[MAX_NH + 1] = {0, wsum1, wsum2, wsum3};

/* ---- Tiles: the keys all of a pass's queries share (the span), bf16 pages: a block of them for one KV
 * head widened once to fp32 rows, against every query of the pass that reads that KV head, in
 * tiles. A score is the head groups' arithmetic (8 lanes over D, then hsum8) and an output element
 * theirs too (one FMA per key, in order, on what o holds), whatever tile or block it falls in: the
 * tiles only share loads between queries and keys. */

/* the NQ x NK sums of q[h] . k[u] over D (a multiple of 8: rows padded with zeros), 8 lanes each */
#define QK_SUMS(NQ, NK)                                                                                 \
    __m256 a[NQ * NK];                                                                                  \
    UNROLL for (int i = 0; i < NQ * NK; i++) a[i] = _mm256_setzero_ps();                                \
    for (int64_t d = 0; d < D; d += 8) {                                                                \
        __m256 kv[NK];                                                                                  \
        UNROLL for (int u = 0; u < NK; u++) {                                                           \
            kv[u] = _mm256_loadu_ps(k[u] + d);                                                          \
            __asm__("" : "+x"(kv[u])); /* one load each, not one per FMA (gcc would fold it in) */     \
        }                                                                                               \
        UNROLL for (int h = 0; h < NQ; h++) {                                                           \
            __m256 qv = _mm256_loadu_ps(q[h] + d);                                                      \
            UNROLL for (int u = 0; u < NK; u++) a[h * NK + u] = _mm256_fmadd_ps(qv, kv[u], a[h * NK + u]); \
        }                                                                                               \
    }
/* s[h][j + u] = q[h] . k[u]: 4 queries x 3 keys, 2 x 4, 1 x 8 (eight sums reduced at once), or N x 1 */
AVX2_INLINE void qk4x3(const float* const* q, const float* const* k, int64_t D, float* const* s, int64_t j) {
    QK_SUMS(4, 3)
    float r[12];
    _mm256_storeu_ps(r, hsum8x8_v(a));
    for (int i = 8; i < 12; i++) r[i] = hsum8(a[i]);
    for (int h = 0; h < 4; h++)
        for (int u = 0; u < 3; u++) s[h][j + u] = r[h * 3 + u];
}
AVX2_INLINE void qk2x4(const float* const* q, const float* const* k, int64_t D, float* const* s, int64_t j) {
    QK_SUMS(2, 4)
    __m256 r = hsum8x8_v(a); /* q0's four scores, then q1's */
    _mm_storeu_ps(s[0] + j, _mm256_castps256_ps128(r));
    _mm_storeu_ps(s[1] + j, _mm256_extractf128_ps(r, 1));
}
AVX2_INLINE void qk1x8(const float* const* q, const float* const* k, int64_t D, float* const* s, int64_t j) {
    QK_SUMS(1, 8)
    _mm256_storeu_ps(s[0] + j, hsum8x8_v(a));
}
#define QK_COLUMN(NAME, NQ)                                                                             \
    AVX2_INLINE void NAME(const float* const* q, const float* const* k, int64_t D, float* const* s, int64_t j) { \
        QK_SUMS(NQ, 1)                                                                                  \
        UNROLL for (int h = 0; h < NQ; h++) s[h][j] = hsum8(a[h]);                                      \
    }
QK_COLUMN(qk4x1, 4)
QK_COLUMN(qk2x1, 2)
QK_COLUMN(qk1x1, 1)

/* s[h][j0 + u] = q[h] . k[u], h < nq, u < nb: fours of queries x 3 keys, then a pair x 4, the last one x 8 */
AVX2 static void span_scores(int64_t nq, const float* const* q, const float* const* k, int64_t nb, int64_t D,
                             float* const* s, int64_t j0) {
    int64_t h = 0, u;
    for (; h + 4 <= nq; h += 4) {
        for (u = 0; u + 3 <= nb; u += 3) qk4x3(q + h, k + u, D, s + h, j0 + u);
        for (; u < nb; u++) qk4x1(q + h, k + u, D, s + h, j0 + u);
    }
    for (; h + 2 <= nq; h += 2) {
        for (u = 0; u + 4 <= nb; u += 4) qk2x4(q + h, k + u, D, s + h, j0 + u);
        for (; u < nb; u++) qk2x1(q + h, k + u, D, s + h, j0 + u);
    }
    if (h < nq) {
        for (u = 0; u + 8 <= nb; u += 8) qk1x8(q + h, k + u, D, s + h, j0 + u);
        for (; u < nb; u++) qk1x1(q + h, k + u, D, s + h, j0 + u);
    }
}

/* o[h][d0 .. d0 + 8C) += p[h][j0 + u] * v[u][...] for u = 0 .. nb-1 in order, NQ queries */
#define PV_TILE(NAME, NQ, C)                                                                            \
    AVX2_INLINE void NAME(const float* const* p, int64_t j0, const float* const* v, int64_t nb,         \
                          float* const* o, int64_t d0) {                                                \
        __m256 acc[NQ * C];                                                                             \
        UNROLL for (int h = 0; h < NQ; h++)                                                             \
            UNROLL for (int c = 0; c < C; c++) acc[h * C + c] = _mm256_loadu_ps(o[h] + d0 + 8 * c);     \
        for (int64_t u = 0; u < nb; u++) {                                                              \
            __m256 pb[NQ];                                                                              \
            UNROLL for (int h = 0; h < NQ; h++) pb[h] = _mm256_broadcast_ss(p[h] + j0 + u);             \
            UNROLL for (int c = 0; c < C; c++) {                                                        \
                __m256 vv = _mm256_loadu_ps(v[u] + d0 + 8 * c);                                         \
                UNROLL for (int h = 0; h < NQ; h++) acc[h * C + c] = _mm256_fmadd_ps(pb[h], vv, acc[h * C + c]); \
            }                                                                                           \
        }                                                                                               \
        UNROLL for (int h = 0; h < NQ; h++)                                                             \
            UNROLL for (int c = 0; c < C; c++) _mm256_storeu_ps(o[h] + d0 + 8 * c, acc[h * C + c]);     \
    }
PV_TILE(pv3x4, 3, 4)
PV_TILE(pv3x1, 3, 1)
PV_TILE(pv2x4, 2, 4)
PV_TILE(pv2x1, 2, 1)
PV_TILE(pv1x4, 1, 4)
PV_TILE(pv1x1, 1, 1)

/* o[h][d] += p[h][j0 + u] * v[u][d] for u = 0 .. nb-1 in order, h < nq, d < Dv: tiles of 3 queries x
 * 32 values (the last Dv % 8 one FMA at a time, the same rounding) */
AVX2 static void span_wsum(int64_t nq, const float* const* p, int64_t j0, const float* const* v, int64_t nb,
                           int64_t Dv, float* const* o) {
    int64_t full = Dv / 8 * 8;
    for (int64_t h = 0; h < nq; h += 3) {
        int64_t n = nq - h < 3 ? nq - h : 3, d0 = 0;
        for (; d0 + 32 <= full; d0 += 32)
            n == 3 ? pv3x4(p + h, j0, v, nb, o + h, d0)
                   : n == 2 ? pv2x4(p + h, j0, v, nb, o + h, d0) : pv1x4(p + h, j0, v, nb, o + h, d0);
        for (; d0 < full; d0 += 8)
            n == 3 ? pv3x1(p + h, j0, v, nb, o + h, d0)
                   : n == 2 ? pv2x1(p + h, j0, v, nb, o + h, d0) : pv1x1(p + h, j0, v, nb, o + h, d0);
        for (int64_t x = h; x < h + n; x++)
            for (int64_t d = full; d < Dv; d++)
                for (int64_t u = 0; u < nb; u++) o[x][d] = fmaf(p[x][j0 + u], v[u][d], o[x][d]);
    }
}

/* bf16 rows rows[u] (element offsets into base, u < nb) of D values widened into w, ld apart, zeros
 * after D; out[u]: row u there */
AVX2 static void widen_rows(const void* base, const int64_t* rows, int64_t nb, int64_t D, int64_t ld, float* w,
                            const float** out) {
    for (int64_t u = 0; u < nb; u++) {
        float* f = w + u * ld;
        const uint16_t* src = (const uint16_t*)base + rows[u]; /* once: the stores below may alias rows */
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(f + d, ld_bf16(src, d));
        for (; d < D; d++) f[d] = bf16_to_f32(src[d]);
        for (; d < ld; d++) f[d] = 0.0f;
        out[u] = f;
    }
}

/* the span block after the one at j0, every KV head of the pass: rows offs[j] of width values, esz bytes each */
AVX2 static void prefetch_next_block(const pass_t* P, const char* cache, const int64_t* offs, int64_t width,
                                     int64_t esz, int64_t j0) {
    for (int64_t j = j0 + KEY_BLOCK; j < P->nS && j < j0 + 2 * KEY_BLOCK; j++)
        prefetch_row(cache + (offs[j] + P->kv_lo * width) * esz, P->nkv * width * esz);
}

/* the span's scores of every query of the pass: a block of span keys, KV head by KV head, against
 * all its queries (bf16 pages) */
void tile_scores_avx2(const pass_t* P) {
    const attend_job* J = P->J;
    int64_t D = J->D, per_kv = P->nt * P->ng;
    const float* rows[KEY_BLOCK];
    for (int64_t j0 = 0; j0 < P->nS; j0 += KEY_BLOCK) {
        int64_t nb = P->nS - j0 < KEY_BLOCK ? P->nS - j0 : KEY_BLOCK;
        prefetch_next_block(P, (const char*)J->k_cache, P->krow, D, 2, j0);
        for (int64_t kv = 0; kv < P->nkv; kv++) {
            widen_rows((const char*)J->k_cache + (P->kv_lo + kv) * D * 2, P->krow + j0, nb, D, P->D8, P->wide, rows);
            span_scores(per_kv, P->span_q + kv * per_kv, rows, nb, P->D8, P->span_s + kv * per_kv, j0);
        }
    }
}

/* the span's terms of every output of the pass, in key order (after the keys before the span) */
void tile_values_avx2(const pass_t* P) {
    const attend_job* J = P->J;
    int64_t Dv = J->Dv, per_kv = P->nt * P->ng;
    const float* rows[KEY_BLOCK];
    for (int64_t j0 = 0; j0 < P->nS; j0 += KEY_BLOCK) {
        int64_t nb = P->nS - j0 < KEY_BLOCK ? P->nS - j0 : KEY_BLOCK;
        prefetch_next_block(P, (const char*)J->v_cache, P->vrow, Dv, 2, j0);
        for (int64_t kv = 0; kv < P->nkv; kv++) {
            widen_rows((const char*)J->v_cache + (P->kv_lo + kv) * Dv * 2, P->vrow + j0, nb, Dv, Dv, P->wide, rows);
            span_wsum(per_kv, (const float* const*)P->span_s + kv * per_kv, j0, rows, nb, Dv, P->span_o + kv * per_kv);
        }
    }
}

#endif
