/* Row-invariant CPU kernels for decode, verify and tree steps (engine.cpu_kernels drives them).
 *
 * Both kernels give every output one fixed order of arithmetic that depends only on the
 * operand sizes (K for a linear output, the visible keys for an attention query), never on
 * how many rows share the call, where a row sits in it or which thread computes it. So a
 * token's logits in a k+1-token verify step are bitwise those of a 1-token step.
 *
 * linear_range: out[m, n] = dot(x[m], w[n]) (+ bias[n]) for n in [n_lo, n_hi), every m.
 *   The dot product runs in 8 fp32 lanes (lane l sums k = l, l+8, l+16, ... with one FMA
 *   each, in order), then the lanes are added in one fixed tree (hsum8). Tiles of up to 4
 *   rows x 3 outputs share each weight load between rows; a tile's shape changes which
 *   outputs are computed together, never an output's arithmetic. Each weight row is read
 *   from memory once per call, for all rows: a step of 5 tokens streams the weights as a
 *   step of 1 does. bf16 weights and inputs are widened in registers (a bf16 is the high half
 *   of an fp32) and the fp32 result is rounded once (to nearest even), after the bias.
 *
 * attend_range: one query head over its visible keys, read in place from the paged cache
 *   ([slots, H_kv, D], flat), in position order: scores (8-lane dot, fixed hsum), optional
 *   tanh soft-capping, softmax with one max and one sum in fixed order, then the weighted sum
 *   of values, each output element accumulated key by key.
 *
 * Threads: a small pool of its own (below) hands out output columns or query heads, 48 columns
 * or one head at a time, to `threads` threads, the caller being one of them. Workers spin briefly
 * between calls (a step makes hundreds of calls microseconds apart), then sleep.
 *
 * An x86-64 CPU with AVX2 and FMA runs the vector code; any other CPU runs a plain C version
 * with the same lane structure (the check is made once, at load).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------ bf16 helpers (portable) */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load1(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void store1(void* p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t*)p)[i] = f32_to_bf16(v);
    else ((float*)p)[i] = v;
}

/* ------------------------------------------------------------------ portable version */

/* dot of n values in 8 lanes, lanes summed as hsum8 does */
static float dot8_c(const void* a, int a_bf16, const void* b, int b_bf16, int64_t n) {
    float acc[8] = {0};
    for (int64_t k = 0; k < n; k++) acc[k & 7] = fmaf(load1(a, k, a_bf16), load1(b, k, b_bf16), acc[k & 7]);
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

static void linear_c(const void* x, int64_t M, const void* w, int64_t K, const void* bias, int64_t n_lo,
                     int64_t n_hi, void* out, int64_t N, int bf16) {
    for (int64_t n = n_lo; n < n_hi; n++)
        for (int64_t m = 0; m < M; m++) {
            const float* xr = (const float*)x + m * K;
            const char* wr = (const char*)w + n * K * (bf16 ? 2 : 4);
            float s = dot8_c(wr, bf16, xr, 0, K);
            if (bias) s += load1(bias, n, bf16);
            store1(out, m * N + n, s, bf16);
        }
}

/* ------------------------------------------------------------------ AVX2 + FMA version */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))
#ifndef PF_TILES
#define PF_TILES 3 /* how many 3-row tiles ahead the first row tile prefetches weights (into L2) */
#endif
#define HAVE_AVX2_PATH 1

AVX2 static inline float hsum8(__m256 v) { /* ((0+4)+(2+6)) + ((1+5)+(3+7)) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[u] = hsum8(v[u]) for u < 8, bitwise (the same tree: lane i + lane i+4, then (0+2) + (1+3)),
 * eight sums at once by transposing as they are added */
AVX2 static inline void hsum8x8(const __m256* v, float* out) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; i++) /* [v_2i: p0..p3 | v_2i+1: p0..p3], p_l = lane l + lane l+4 */
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* [p0+p2, p1+p3] of four vectors */
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    __m256 d = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
    /* d = sums of v0 v2 v4 v6 | v1 v3 v5 v7 */
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

AVX2 static inline __m256 ld_f32(const void* p, int64_t i) { return _mm256_loadu_ps((const float*)p + i); }
AVX2 static inline __m256 ld_bf16(const void* p, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* the first `rem` (< 8) values, zeros after: a zero lane adds 0 * 0 to its sum */
AVX2 static inline __m256 ld_part(const void* p, int64_t i, int rem, int bf16) {
    float tmp[8] = {0};
    for (int j = 0; j < rem; j++) tmp[j] = load1(p, i + j, bf16);
    return _mm256_loadu_ps(tmp);
}

/* A tile: MB rows of x (float32: bf16 inputs are widened once per call, in `linear`) times NB
 * weight rows. Prefetch: the weight rows PF_TILES column tiles ahead go into L2 one cache line at a
 * time, while this tile's weights stream from memory. A column tile is computed in `pf_every` row
 * passes (4 rows each); pass `pf_phase` requests every pf_every-th line, so requests go out
 * evenly over the tile's compute and memory stays busy during the later passes too (pf_every 0:
 * none). Into L1 instead, the prefetches evicted rows still being read and the stream ran at
 * about 70% of the speed. */
#define TILE(NAME, TGT, LD, ESZ, BF, MB, NB)                                                                 \
    TGT static void NAME(const void* x, const void* w, int64_t K, int64_t m0, int64_t n0, float* acc_out, \
                          int64_t pf_every, int64_t pf_phase) {                                         \
        __m256 acc[MB][NB];                                                                             \
        for (int i = 0; i < MB; i++)                                                                    \
            for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();                               \
        int64_t k = 0, line = 0;                                                                        \
        for (; k + 8 <= K; k += 8) {                                                                    \
            __m256 wv[NB];                                                                              \
            for (int j = 0; j < NB; j++) wv[j] = LD(w, (n0 + j) * K + k);                               \
            if (pf_every && !(k & (64 / ESZ - 1))) {                                                    \
                if (line == pf_phase)                                                                   \
                    for (int j = 0; j < NB; j++)                                                        \
                        _mm_prefetch((const char*)w + ((n0 + PF_TILES * NB + j) * K + k) * ESZ, _MM_HINT_T1); \
                if (++line == pf_every) line = 0;                                                       \
            }                                                                                           \
            for (int i = 0; i < MB; i++) {                                                              \
                __m256 xv = ld_f32(x, (m0 + i) * K + k);                                                \
                for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);         \
            }                                                                                           \
        }                                                                                               \
        if (k < K) {                                                                                    \
            int rem = (int)(K - k);                                                                     \
            __m256 wv[NB];                                                                              \
            for (int j = 0; j < NB; j++) wv[j] = ld_part(w, (n0 + j) * K + k, rem, BF);                 \
            for (int i = 0; i < MB; i++) {                                                              \
                __m256 xv = ld_part(x, (m0 + i) * K + k, rem, 0);                                       \
                for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);         \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < MB; i++)                                                                    \
            for (int j = 0; j < NB; j++) acc_out[i * NB + j] = hsum8(acc[i][j]);                        \
    }

/* A kernel: its tiles (1..4 rows with the 16 AVX2 registers, 1..9 rows with AVX-512's 32) and the
 * loop over output columns; M rows go in ceil(M / max rows) passes of about equal size. The
 * AVX-512 build runs the very same 8-lane arithmetic per output, so its results are bitwise the
 * AVX2 build's; it only keeps more rows in registers per weight load. */
#define TILES4(T, TGT, LD, ESZ, BF)                                                                     \
    TILE(T##_1x3, TGT, LD, ESZ, BF, 1, 3) TILE(T##_2x3, TGT, LD, ESZ, BF, 2, 3)                         \
    TILE(T##_3x3, TGT, LD, ESZ, BF, 3, 3) TILE(T##_4x3, TGT, LD, ESZ, BF, 4, 3)                         \
    TILE(T##_1x1, TGT, LD, ESZ, BF, 1, 1) TILE(T##_2x1, TGT, LD, ESZ, BF, 2, 1)                         \
    TILE(T##_3x1, TGT, LD, ESZ, BF, 3, 1) TILE(T##_4x1, TGT, LD, ESZ, BF, 4, 1)
#define TILES8(T, TGT, LD, ESZ, BF)                                                                     \
    TILES4(T, TGT, LD, ESZ, BF)                                                                         \
    TILE(T##_5x3, TGT, LD, ESZ, BF, 5, 3) TILE(T##_6x3, TGT, LD, ESZ, BF, 6, 3)                         \
    TILE(T##_7x3, TGT, LD, ESZ, BF, 7, 3) TILE(T##_8x3, TGT, LD, ESZ, BF, 8, 3)                         \
    TILE(T##_5x1, TGT, LD, ESZ, BF, 5, 1) TILE(T##_6x1, TGT, LD, ESZ, BF, 6, 1)                         \
    TILE(T##_7x1, TGT, LD, ESZ, BF, 7, 1) TILE(T##_8x1, TGT, LD, ESZ, BF, 8, 1)                         \
    TILE(T##_9x3, TGT, LD, ESZ, BF, 9, 3) TILE(T##_9x1, TGT, LD, ESZ, BF, 9, 1)
typedef void (*tile_fn)(const void*, const void*, int64_t, int64_t, int64_t, float*, int64_t, int64_t);
#define LINEAR(T, TGT, MAXMB, BF)                                                                       \
    TGT static void T##_linear(const tile_fn* cols3, const tile_fn* cols1, const void* x, int64_t M,     \
                               const void* w, int64_t K, const void* bias, int64_t n_lo, int64_t n_hi,  \
                               void* out, int64_t N) {                                                  \
        float acc[3 * MAXMB];                                                                           \
        int64_t n = n_lo, passes = (M + MAXMB - 1) / MAXMB;                                             \
        while (n < n_hi) {                                                                              \
            int nb = n + 3 <= n_hi ? 3 : 1;                                                             \
            int64_t pf = nb == 3 && n + 3 * PF_TILES + 3 <= N ? passes : 0; /* rows to prefetch exist */ \
            for (int64_t p = 0; p < passes; p++) {                                                      \
                int64_t m = M * p / passes;                                                             \
                int mb = (int)(M * (p + 1) / passes - m);                                               \
                (nb == 3 ? cols3 : cols1)[mb](x, w, K, m, n, acc, pf, p);                               \
                for (int i = 0; i < mb; i++)                                                            \
                    for (int j = 0; j < nb; j++) {                                                      \
                        float s = acc[i * nb + j];                                                      \
                        if (bias) s += load1(bias, n + j, BF);                                          \
                        store1(out, (m + i) * N + n + j, s, BF);                                        \
                    }                                                                                   \
            }                                                                                           \
            n += nb;                                                                                    \
        }                                                                                               \
    }
#define AVX512 __attribute__((target("avx2,fma,avx512f,avx512vl")))
TILES4(f32, AVX2, ld_f32, 4, 0)
TILES4(bf16, AVX2, ld_bf16, 2, 1)
TILES8(f32w, AVX512, ld_f32, 4, 0)
TILES8(bf16w, AVX512, ld_bf16, 2, 1)
LINEAR(f32, AVX2, 4, 0)
LINEAR(bf16, AVX2, 4, 1)
LINEAR(f32w, AVX512, 9, 0)
LINEAR(bf16w, AVX512, 9, 1)
static const tile_fn f32_cols3[] = {0, f32_1x3, f32_2x3, f32_3x3, f32_4x3};
static const tile_fn f32_cols1[] = {0, f32_1x1, f32_2x1, f32_3x1, f32_4x1};
static const tile_fn bf16_cols3[] = {0, bf16_1x3, bf16_2x3, bf16_3x3, bf16_4x3};
static const tile_fn bf16_cols1[] = {0, bf16_1x1, bf16_2x1, bf16_3x1, bf16_4x1};
static const tile_fn f32w_cols3[] = {0, f32w_1x3, f32w_2x3, f32w_3x3, f32w_4x3, f32w_5x3, f32w_6x3, f32w_7x3, f32w_8x3, f32w_9x3};
static const tile_fn f32w_cols1[] = {0, f32w_1x1, f32w_2x1, f32w_3x1, f32w_4x1, f32w_5x1, f32w_6x1, f32w_7x1, f32w_8x1, f32w_9x1};
static const tile_fn bf16w_cols3[] = {0, bf16w_1x3, bf16w_2x3, bf16w_3x3, bf16w_4x3, bf16w_5x3, bf16w_6x3, bf16w_7x3, bf16w_8x3, bf16w_9x3};
static const tile_fn bf16w_cols1[] = {0, bf16w_1x1, bf16w_2x1, bf16w_3x1, bf16w_4x1, bf16w_5x1, bf16w_6x1, bf16w_7x1, bf16w_8x1, bf16w_9x1};

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

/* in place; s[j] <- exp(s[j] * scale - max) / sum (scale: the caller's, 1 after soft-capping); the
 * vector loops round as the scalar ones they replace (a product, a max, then per lane in order) */
AVX2 static void softmax_avx2(float* s, int64_t L, float scale) {
    int64_t j = 0;
    if (scale != 1.0f) {
        __m256 vs = _mm256_set1_ps(scale);
        for (; j + 8 <= L; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), vs));
        for (; j < L; j++) s[j] *= scale;
    }
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (j = 0; j + 8 <= L; j += 8) vm = _mm256_max_ps(_mm256_loadu_ps(s + j), vm); /* (a > b) ? a : b */
    float lanes[8], mx = -INFINITY;
    _mm256_storeu_ps(lanes, vm);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    for (; j < L; j++) mx = s[j] > mx ? s[j] : mx;
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

/* NH query heads of one token (they share a KV head) over the same L keys at element offsets rows[j]:
 * s[h][j] = dot(q[h], key j) in 8 lanes over D then hsum8; keys KB at a time, each key read once for
 * all NH heads (independent sums, each with the same arithmetic whatever NH and KB). */
#define LDX(P, OFF, REM) ((REM) ? ld_part(P, OFF, REM, bf16) : (bf16 ? ld_bf16(P, OFF) : ld_f32(P, OFF)))
/* Keys and values are rows of D values scattered over the pages (the other KV heads' rows lie in
 * between), a pattern the hardware prefetchers miss: each loop asks for the row KEY_AHEAD keys ahead. */
#define KEY_AHEAD 32
AVX2 static inline void prefetch_row(const char* p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    _mm_prefetch(p + bytes - 1, _MM_HINT_T0); /* the last line, when the row does not start a line */
}
#define SCORES(NAME, NH, KB)                                                                            \
    AVX2 static void NAME(const float* q, const void* kb, const int64_t* rows, int64_t L, int64_t D,     \
                          int bf16, float* s) {                                                         \
        int64_t j = 0, esz = bf16 ? 2 : 4;                                                              \
        for (; j + KB <= L; j += KB) {                                                                  \
            for (int u = 0; u < KB && j + KEY_AHEAD + u < L; u++)                                       \
                prefetch_row((const char*)kb + rows[j + KEY_AHEAD + u] * esz, D * esz);                 \
            __m256 a[NH][KB];                                                                           \
            for (int h = 0; h < NH; h++)                                                                \
                for (int u = 0; u < KB; u++) a[h][u] = _mm256_setzero_ps();                             \
            int64_t d = 0;                                                                              \
            for (; d + 8 <= D; d += 8) {                                                                \
                __m256 kv[KB];                                                                          \
                for (int u = 0; u < KB; u++) kv[u] = LDX(kb, rows[j + u] + d, 0);                       \
                for (int h = 0; h < NH; h++) {                                                          \
                    __m256 qv = _mm256_loadu_ps(q + h * D + d);                                         \
                    for (int u = 0; u < KB; u++) a[h][u] = _mm256_fmadd_ps(qv, kv[u], a[h][u]);         \
                }                                                                                       \
            }                                                                                           \
            if (d < D) { /* the last D % 8 values: zero lanes after them */                             \
                int rem = (int)(D - d);                                                                 \
                for (int u = 0; u < KB; u++) {                                                          \
                    __m256 kv = LDX(kb, rows[j + u] + d, rem);                                          \
                    for (int h = 0; h < NH; h++)                                                        \
                        a[h][u] = _mm256_fmadd_ps(ld_part(q + h * D, d, rem, 0), kv, a[h][u]);          \
                }                                                                                       \
            }                                                                                           \
            float sums[8];                                                                              \
            hsum8x8(&a[0][0], sums); /* NH * KB is 8 or 9 */                                            \
            for (int i = 0; i < NH * KB; i++)                                                           \
                s[i / KB * L + j + i % KB] = i < 8 ? sums[i] : hsum8(a[i / KB][i % KB]);                \
        }                                                                                               \
        for (; j < L; j++) {                                                                            \
            __m256 a[NH];                                                                               \
            for (int h = 0; h < NH; h++) a[h] = _mm256_setzero_ps();                                    \
            int64_t d = 0;                                                                              \
            for (; d + 8 <= D; d += 8) {                                                                \
                __m256 k0 = LDX(kb, rows[j] + d, 0);                                                    \
                for (int h = 0; h < NH; h++) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), k0, a[h]); \
            }                                                                                           \
            if (d < D) {                                                                                \
                int rem = (int)(D - d);                                                                 \
                __m256 k0 = LDX(kb, rows[j] + d, rem);                                                  \
                for (int h = 0; h < NH; h++) a[h] = _mm256_fmadd_ps(ld_part(q + h * D, d, rem, 0), k0, a[h]); \
            }                                                                                           \
            for (int h = 0; h < NH; h++) s[h * L + j] = hsum8(a[h]);                                    \
        }                                                                                               \
    }

/* o[h][d] = sum_j p[h][j] * v_j[d], key by key (one FMA chain per element), 32 values of D at a
 * time, each value row read once for all NH heads */
#define WSUM(NAME, NH)                                                                                  \
    AVX2 static void NAME(const float* p, const void* vb, const int64_t* rows, int64_t L, int64_t D,     \
                          int bf16, float* o) {                                                         \
        int64_t esz = bf16 ? 2 : 4;                                                                     \
        for (int64_t d0 = 0; d0 < D; d0 += 32) {                                                        \
            int64_t nd = D - d0 < 32 ? D - d0 : 32;                                                     \
            int nv = (int)((nd + 7) / 8), rem = (int)(nd % 8);                                          \
            __m256 acc[NH][4];                                                                          \
            for (int h = 0; h < NH; h++)                                                                \
                for (int c = 0; c < 4; c++) acc[h][c] = _mm256_setzero_ps();                            \
            if (nd == 32) /* whole vectors */                                                           \
                for (int64_t j = 0; j < L; j++) {                                                       \
                    if (j + KEY_AHEAD < L) prefetch_row((const char*)vb + (rows[j + KEY_AHEAD] + d0) * esz, 32 * esz); \
                    __m256 pj[NH];                                                                      \
                    for (int h = 0; h < NH; h++) pj[h] = _mm256_set1_ps(p[h * L + j]);                  \
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
                            acc[h][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[h * L + j]), v, acc[h][c]);    \
                    }                                                                                   \
            for (int h = 0; h < NH; h++) {                                                              \
                float tmp[32];                                                                          \
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(tmp + c * 8, acc[h][c]);                   \
                memcpy(o + h * D + d0, tmp, (size_t)nd * sizeof(float));                               \
            }                                                                                           \
        }                                                                                               \
    }

SCORES(scores1, 1, 8)
SCORES(scores2, 2, 4)
SCORES(scores3, 3, 3)
WSUM(wsum1, 1)
WSUM(wsum2, 2)
WSUM(wsum3, 3)
#undef LDX

typedef void (*scores_fn)(const float*, const void*, const int64_t*, int64_t, int64_t, int, float*);
typedef void (*wsum_fn)(const float*, const void*, const int64_t*, int64_t, int64_t, int, float*);
static const scores_fn scores_avx2[4] = {0, scores1, scores2, scores3};
static const wsum_fn wsum_avx2[4] = {0, wsum1, wsum2, wsum3};
#define MAX_NH 3 /* query heads computed together (one pass over a KV head's keys) */
#else
#define HAVE_AVX2_PATH 0
#endif

static int simd = 0, simd_max = 0; /* 0: portable C, 1: AVX2 + FMA, 2: and AVX-512's registers (tiles of up to 9 rows) */

/* ------------------------------------------------------------------ entry points */

/* x: float32 [M, K] (linear widens bf16 inputs first); w, bias and out: bf16 when bf16, else float32 */
static void linear_range(const void* x, int64_t M, const void* w, int64_t K, const void* bias, int64_t n_lo,
                         int64_t n_hi, void* out, int64_t N, int64_t bf16) {
#if HAVE_AVX2_PATH
    if (simd) {
        if (simd == 2 && bf16) bf16w_linear(bf16w_cols3, bf16w_cols1, x, M, w, K, bias, n_lo, n_hi, out, N);
        else if (simd == 2) f32w_linear(f32w_cols3, f32w_cols1, x, M, w, K, bias, n_lo, n_hi, out, N);
        else if (bf16) bf16_linear(bf16_cols3, bf16_cols1, x, M, w, K, bias, n_lo, n_hi, out, N);
        else f32_linear(f32_cols3, f32_cols1, x, M, w, K, bias, n_lo, n_hi, out, N);
        return;
    }
#endif
    linear_c(x, M, w, K, bias, n_lo, n_hi, out, N, (int)bf16);
}

static void softmax_c(float* s, int64_t L) {
    float mx = -INFINITY, acc[8] = {0};
    for (int64_t j = 0; j < L; j++) mx = s[j] > mx ? s[j] : mx;
    for (int64_t j = 0; j < L; j++) {
        s[j] = expf(s[j] - mx);
        acc[j & 7] += s[j];
    }
    float inv = 1.0f / (((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])));
    for (int64_t j = 0; j < L; j++) s[j] *= inv;
}

/* dot(q, key), fp32 query, fp32 or bf16 key, in the lanes of scores_avx2 */
static float qk_c(const float* q, const void* k, int64_t D, int bf16) {
    float acc[8] = {0};
    for (int64_t d = 0; d < D; d++) acc[d & 7] = fmaf(q[d], load1(k, d, bf16), acc[d & 7]);
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

static void weighted_sum_c(const float* p, const void* vbase, const int64_t* rows, int64_t L, int64_t D, int bf16,
                           float* out) {
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t j = 0; j < L; j++)
        for (int64_t d = 0; d < D; d++) out[d] = fmaf(p[j], load1(vbase, rows[j] + d, bf16), out[d]);
}

/* Tokens t0 + i for i in [i_lo, i_hi), each with query heads h_lo .. h_hi - 1 (all of one KV head:
 * heads kvh * G .. kvh * G + G - 1, G = H / H_kv), nh of them at a time (one pass over the keys
 * serves them all).
 *   q [T, H, D] and out [T, H, Dv]: fp32, or bf16 when bf16;
 *   k_cache / v_cache: one layer's pages, flat [slots, H_kv, D] / [slots, H_kv, Dv] (fp32, or bf16
 *   when bf16; Dv = D but for multi-head latent attention);
 *   token t reads cache positions run_lo[t] .. run_hi[t]-1, then extra[extra_off[t] .. extra_off[t+1]-1],
 *   cache position c of its sequence being flat slot kv_slots[seq[t] * Lk + c];
 *   softcap 0: none. Returns 0, or -1 when scratch memory could not be had. */
static int64_t attend_range(const void* q, int64_t H, int64_t D, int64_t Dv, const void* k_cache, const void* v_cache,
                            int64_t H_kv, const int64_t* kv_slots, int64_t Lk, const int64_t* seq,
                            const int64_t* run_lo, const int64_t* run_hi, const int64_t* extra_off,
                            const int64_t* extra, float scale, float softcap, void* out, int64_t t0, int64_t h_lo,
                            int64_t h_hi, int64_t i_lo, int64_t i_hi, int64_t nh, int64_t bf16) {
    int64_t kvh = h_lo / (H / H_kv);
    int b16 = (int)bf16;
    int64_t esz = b16 ? 2 : 4;
    for (int64_t i = i_lo; i < i_hi; i++) {
        int64_t t = t0 + i;
        int64_t n_run = run_hi[t] - run_lo[t], n_extra = extra_off[t + 1] - extra_off[t], L = n_run + n_extra;
        int64_t nrows = Dv == D ? L : 2 * L; /* values narrower than keys (MLA): their own offsets */
        int64_t* rows = (int64_t*)malloc((size_t)nrows * sizeof(int64_t) + (size_t)MAX_NH * (L + D + Dv) * sizeof(float));
        if (!rows) return -1;
        int64_t* vrows = rows + nrows - L;
        float *s = (float*)(rows + nrows), *qf = s + MAX_NH * L, *o = qf + MAX_NH * D;
        const int64_t* slots = kv_slots + seq[t] * Lk;
        for (int64_t j = 0; j < L; j++) { /* element offset of each key's D values (and value's Dv) */
            int64_t c = j < n_run ? run_lo[t] + j : extra[extra_off[t] + j - n_run];
            rows[j] = (slots[c] * H_kv + kvh) * D;
            vrows[j] = (slots[c] * H_kv + kvh) * Dv;
        }
        for (int64_t h0 = h_lo; h0 < h_hi; h0 += nh) {
            int64_t n = h_hi - h0 < nh ? h_hi - h0 : nh;
            for (int64_t h = 0; h < n; h++)
                for (int64_t d = 0; d < D; d++) qf[h * D + d] = load1(q, (t * H + h0 + h) * D + d, b16);
#if HAVE_AVX2_PATH
            if (simd) scores_avx2[n](qf, k_cache, rows, L, D, b16, s);
            else
#endif
                for (int64_t h = 0; h < n; h++)
                    for (int64_t j = 0; j < L; j++) s[h * L + j] = qk_c(qf + h * D, (const char*)k_cache + rows[j] * esz, D, b16);
            for (int64_t h = 0; h < n; h++) {
                float* sh = s + h * L;
#if HAVE_AVX2_PATH
                if (simd && !(softcap > 0.0f)) { /* the scaling inside, vectorized */
                    softmax_avx2(sh, L, scale);
                    continue;
                }
#endif
                for (int64_t j = 0; j < L; j++) {
                    float sc = sh[j] * scale;
                    sh[j] = softcap > 0.0f ? softcap * tanhf(sc / softcap) : sc;
                }
#if HAVE_AVX2_PATH
                if (simd) softmax_avx2(sh, L, 1.0f);
                else
#endif
                    softmax_c(sh, L);
            }
#if HAVE_AVX2_PATH
            if (simd) wsum_avx2[n](s, v_cache, vrows, L, Dv, b16, o);
            else
#endif
                for (int64_t h = 0; h < n; h++) weighted_sum_c(s + h * L, v_cache, vrows, L, Dv, b16, o + h * Dv);
            for (int64_t h = 0; h < n; h++)
                for (int64_t d = 0; d < Dv; d++) store1(out, (t * H + h0 + h) * Dv + d, o[h * Dv + d], b16);
        }
        free(rows);
    }
    return 0;
}

/* ------------------------------------------------------------------ thread pool */

typedef void (*task_fn)(void* ctx, int64_t part);

typedef struct {
    task_fn fn;
    void* ctx;
    int64_t parts;
    atomic_long next; /* the next part to claim */
    atomic_long done; /* parts finished */
} job_t;

#define MAX_WORKERS 255
#define SPIN_NS 200000 /* how long a worker polls for the next job before it sleeps */

/* Parts are claimed one at a time by whoever is free, the caller included: a worker the OS has
 * not scheduled yet (a busy machine) leaves its share to the others instead of stalling the call. */
static struct {
    pthread_mutex_t job_mu; /* one job at a time (callers from several Python threads queue here) */
    pthread_mutex_t mu;
    pthread_cond_t wake;
    atomic_long gen;  /* bumped once per job */
    atomic_int sleepers;
    atomic_int busy;  /* workers between taking the job pointer and letting it go */
    _Atomic(job_t*) job;
    int workers;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, NULL, 0};

static inline void relax(int64_t spins) {
    if ((spins & 63) == 63) sched_yield(); /* let a descheduled worker run on a busy machine */
#if defined(__x86_64__) || defined(__i386__)
    else __builtin_ia32_pause();
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void work_on(job_t* j) {
    int64_t p;
    while ((p = atomic_fetch_add(&j->next, 1)) < j->parts) {
        j->fn(j->ctx, p);
        atomic_fetch_add_explicit(&j->done, 1, memory_order_release);
    }
}

static void* worker_main(void* arg) {
    long seen = (long)(intptr_t)arg; /* the last job before this worker was made */
    for (;;) {
        long g;
        int64_t since = now_ns(), spins = 0;
        while ((g = atomic_load_explicit(&pool.gen, memory_order_acquire)) == seen) {
            relax(++spins);
            if ((spins & 255) || now_ns() - since < SPIN_NS) continue;
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.wake, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = g;
        atomic_fetch_add(&pool.busy, 1);
        job_t* j = atomic_load(&pool.job);
        if (j) work_on(j);
        atomic_fetch_sub(&pool.busy, 1);
    }
    return NULL;
}

static void after_fork_child(void) { /* the workers did not come along */
    pool.workers = 0;
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.job, NULL);
    pthread_mutex_init(&pool.job_mu, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
}

/* fn(ctx, p) for p = 0 .. parts-1 on up to `threads` threads, the caller one of them */
static void run_parallel(task_fn fn, void* ctx, int64_t parts, int64_t threads) {
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads <= 1 || parts <= 1) {
        for (int64_t p = 0; p < parts; p++) fn(ctx, p);
        return;
    }
    pthread_mutex_lock(&pool.job_mu);
    while (pool.workers < threads - 1) {
        pthread_t th;
        if (pthread_create(&th, NULL, worker_main, (void*)(intptr_t)atomic_load(&pool.gen)) != 0) break;
        pthread_detach(th);
        pool.workers++;
    }
    job_t j = {fn, ctx, parts, 0, 0};
    atomic_store(&pool.job, &j);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add_explicit(&pool.gen, 1, memory_order_release);
    if (atomic_load(&pool.sleepers)) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    work_on(&j);
    for (int64_t spins = 0; atomic_load_explicit(&j.done, memory_order_acquire) < parts;) relax(++spins);
    atomic_store(&pool.job, NULL); /* then wait for workers still holding it: j lives on this stack */
    for (int64_t spins = 0; atomic_load(&pool.busy) > 0;) relax(++spins);
    pthread_mutex_unlock(&pool.job_mu);
}

/* ------------------------------------------------------------------ entry points (ctypes) */

#define BLOCK_N 48 /* output columns per unit of work: a multiple of the 3-column tiles */

typedef struct {
    const void *x, *w, *bias;
    void* out;
    int64_t M, K, N, bf16;
} linear_job;

static void linear_part(void* ctx, int64_t part) { /* output columns [48 part, 48 part + 48) */
    linear_job* j = (linear_job*)ctx;
    int64_t n_lo = part * BLOCK_N, n_hi = n_lo + BLOCK_N < j->N ? n_lo + BLOCK_N : j->N;
    linear_range(j->x, j->M, j->w, j->K, j->bias, n_lo, n_hi, j->out, j->N, j->bf16);
}

/* out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]); fp32, or bf16 (all four) when bf16; bias may be NULL.
 * Returns 0, or -1 when scratch memory could not be had. */
int64_t linear(const void* x, int64_t M, const void* w, int64_t K, const void* bias, int64_t N, void* out,
               int64_t bf16, int64_t threads) {
    float* xf = NULL; /* bf16 x widened to float32 once (exact), not once per tile */
    if (bf16) {
        xf = (float*)malloc((size_t)(M * K) * sizeof(float));
        if (!xf) return -1;
        for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(((const uint16_t*)x)[i]);
    }
    linear_job j = {xf ? xf : x, w, bias, out, M, K, N, bf16};
    run_parallel(linear_part, &j, (N + BLOCK_N - 1) / BLOCK_N, threads);
    free(xf);
    return 0;
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *kv_slots, *seq, *run_lo, *run_hi, *extra_off, *extra;
    void* out;
    int64_t T, H, D, Dv, H_kv, Lk, bf16;
    float scale, softcap;
    const int64_t* starts; /* [R+1] first token of each run of tokens of one sequence */
    int64_t chunks;        /* token pieces per (run, head piece) */
    int64_t hsplit;        /* pieces the query heads of a KV head are cut into */
    int64_t nh;            /* query heads per pass over the keys */
    atomic_long failed;
} attend_job;

/* Part p = (run r, head piece, token piece c): a piece of one sequence's tokens in this step, each with
 * a piece of the query heads of one KV head. That KV head's keys then stay in cache for all the part's
 * queries (which queries run together never changes a query's arithmetic). */
static void attend_part(void* ctx, int64_t part) {
    attend_job* j = (attend_job*)ctx;
    int64_t group = j->H / j->H_kv;
    int64_t c = part % j->chunks, hp = part / j->chunks % (j->H_kv * j->hsplit), r = part / j->chunks / (j->H_kv * j->hsplit);
    int64_t kvh = hp / j->hsplit, piece = hp % j->hsplit;
    int64_t h_lo = kvh * group + group * piece / j->hsplit, h_hi = kvh * group + group * (piece + 1) / j->hsplit;
    int64_t n = j->starts[r + 1] - j->starts[r];
    int64_t lo = n * c / j->chunks, hi = n * (c + 1) / j->chunks;
    if (lo < hi && h_lo < h_hi &&
        attend_range(j->q, j->H, j->D, j->Dv, j->k_cache, j->v_cache, j->H_kv, j->kv_slots, j->Lk, j->seq, j->run_lo,
                     j->run_hi, j->extra_off, j->extra, j->scale, j->softcap, j->out, j->starts[r], h_lo, h_hi, lo,
                     hi, j->nh, j->bf16))
        atomic_store(&j->failed, 1);
}

/* attention of T tokens (see attend_range; a sequence's tokens are consecutive); returns 0, or -1
 * when scratch memory could not be had */
int64_t attend(const void* q, int64_t T, int64_t H, int64_t D, int64_t Dv, const void* k_cache, const void* v_cache, int64_t H_kv,
               const int64_t* kv_slots, int64_t Lk, const int64_t* seq, const int64_t* run_lo, const int64_t* run_hi,
               const int64_t* extra_off, const int64_t* extra, float scale, float softcap, void* out, int64_t bf16,
               int64_t threads) {
    if (T <= 0) return 0;
    int64_t* starts = (int64_t*)malloc((size_t)(T + 1) * sizeof(int64_t));
    if (!starts) return -1;
    int64_t runs = 0, longest = 0;  /* sequences, and the most tokens one feeds */
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || seq[t] != seq[t - 1]) starts[runs++] = t;
    starts[runs] = T;
    for (int64_t r = 0; r < runs; r++) longest = starts[r + 1] - starts[r] > longest ? starts[r + 1] - starts[r] : longest;
    /* about one part per thread, each as large as that allows: one pass over a KV head's keys serves
     * all the query heads of a part, so finer parts read the same keys again (a 1-token step of 3 KV
     * heads: 3 parts of 3 heads took 60% of the time of 9 parts of 1 head on 2 threads). Where
     * the tokens are too few for that, the heads of a KV head are cut too. */
    int64_t groups = runs * H_kv, want = threads > 1 ? threads : 1, group = H / H_kv, hsplit = 1;
    int64_t chunks = (want + groups - 1) / groups;
    if (chunks > longest) { /* too few tokens: cut the heads of a KV head too */
        chunks = longest;
        hsplit = (want + groups * chunks - 1) / (groups * chunks);
        hsplit = hsplit < group ? hsplit : group;
    }
    int64_t nh = (group + hsplit - 1) / hsplit;
    nh = nh < MAX_NH ? nh : MAX_NH;
    attend_job j = {q, k_cache, v_cache, kv_slots, seq, run_lo, run_hi, extra_off, extra, out,
                    T, H, D, Dv, H_kv, Lk, bf16, scale, softcap, starts, chunks, hsplit, nh, 0};
    run_parallel(attend_part, &j, groups * hsplit * chunks, threads);
    free(starts);
    return atomic_load(&j.failed) ? -1 : 0;
}

/* RMS normalization of M rows of K values, x and out fp32 (or bf16 when bf16), w [K] the same:
 *   r = 1 / sqrt(sum(x^2) / K + eps), the sum in 8 lanes over K added in the fixed tree of dot8_c;
 *   form 0 (Llama's): out = w * round(x * r)  (round: to the dtype, a no-op in fp32)
 *   form 1 (Gemma's): out = round(x * r * (1 + w)).
 * Each row alone, in one fixed order whatever M: no threads (a row is a few hundred values). */
int64_t rms_norm(const void* x, int64_t M, int64_t K, const void* w, float eps, int64_t form, void* out,
                 int64_t bf16) {
    int b16 = (int)bf16;
    for (int64_t m = 0; m < M; m++) {
        float acc[8] = {0};
        for (int64_t k = 0; k < K; k++) {
            float v = load1(x, m * K + k, b16);
            acc[k & 7] += v * v;
        }
        float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        float r = 1.0f / sqrtf(sum / (float)K + eps);
        for (int64_t k = 0; k < K; k++) {
            float y = load1(x, m * K + k, b16) * r;
            if (form == 0) {
                if (b16) y = bf16_to_f32(f32_to_bf16(y));
                y = load1(w, k, b16) * y;
            } else {
                y = y * (1.0f + load1(w, k, b16));
            }
            store1(out, m * K + k, y, b16);
        }
    }
    return 0;
}

int64_t uses_avx2(void) { return simd >= 1; }

/* the SIMD level the kernels run (see `simd`); set_simd_level picks a lower one (tests compare them) */
int64_t simd_level(void) { return simd; }
int64_t set_simd_level(int64_t level) {
    int64_t was = simd;
    simd = level < 0 ? 0 : level > simd_max ? simd_max : (int)level;
    return was;
}

/* ------------------------------------------------------------------ module */

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cpu_kernels",
    .m_doc = "Row-invariant CPU kernels, called through ctypes (engine.cpu_kernels).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
#if HAVE_AVX2_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        simd_max = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") ? 2 : 1;
    simd = simd_max;
#endif
    pthread_atfork(NULL, NULL, after_fork_child);
    return PyModule_Create(&module);
}
