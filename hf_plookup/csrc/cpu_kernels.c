/* Row-invariant CPU kernels for decode, verify and tree steps (engine.cpu_kernels drives them).
 *
 * Both kernels give every output one fixed order of arithmetic that depends only on the
 * operand sizes (K for a linear output, the visible keys for an attention query), never on
 * how many rows share the call, where a row sits in it or which thread computes it. So a
 * token's logits in a k+1-token verify step are bitwise those of a 1-token step.
 *
 * linear_range: out[m, n] = dot(x[m], w[n]) (+ bias[n]) for the columns of some panels, every m.
 *   The weights come packed in panels of 8 output columns (engine.cpu_kernels.pack), and each
 *   output is one FMA chain over k = 0, 1, ..., K - 1 in order, from 0; the bias is added and, for
 *   bf16, the fp32 result rounded once (to nearest even). Tiles of up to 9 rows x 4 panels share
 *   each weight load between rows and each x value between 8 to 32 outputs; a tile's shape changes
 *   which outputs are computed together, never an output's arithmetic. Each weight is read from
 *   memory once per call, for all rows: a step of 5 tokens streams the weights as a step of 1
 *   does. bf16 weights and inputs are widened exactly (a bf16 is the high half of an fp32).
 *
 * attend_pass: one query head over its visible keys, read in place from the paged cache
 *   ([slots, H_kv, D], flat), in position order: scores (8-lane dot, fixed hsum), optional
 *   tanh soft-capping, softmax with one max and one sum in fixed order, then the weighted sum
 *   of values, each output element accumulated key by key. The keys a sequence's tokens all
 *   see (a chain's or a tree's cached prefix) are read once for all of them, block by block: in
 *   bf16 with TILE_QUERIES or more queries to a KV head, a block widened once to fp32 rows against
 *   tiles of 4 queries x 3 keys and of 3 queries x 32 values; otherwise by groups of a token's
 *   heads. Either way a query's arithmetic is the same.
 *
 * layer_attention, layer_mlp: a Llama-form decoder layer of a decode step in two calls, from the
 *   kernels above and torch's elementwise arithmetic written out (engine.cpu_layers).
 *
 * Threads: a small pool of its own (below) hands out BLOCK_P panels or one attention part (a
 * sequence, or a KV head of one) at a time to `threads` threads, the caller being one of them.
 * Workers spin briefly between calls (a step makes hundreds of calls microseconds apart), then sleep.
 *
 * An x86-64 CPU with AVX2 and FMA runs the vector code; any other CPU runs a plain C version
 * with the same arithmetic (the check is made once, at load).
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

/* Elementwise loops are written once for both dtypes (ELEMENTWISE functions taking B) and inlined with
 * B a constant (BOTH_DTYPES), so each dtype gets its own loop, which the compiler vectorizes: a
 * 9-token bf16 SmolLM2 step spent 2.3 ms in the decoder layers' norms, RoPE, residual adds and
 * products when one loop served both, testing the dtype per value. */
#define ELEMENTWISE static inline __attribute__((always_inline))
#define BOTH_DTYPES(CALL) \
    do {                   \
        if (b16) {         \
            const int B = 1; \
            CALL;          \
        } else {           \
            const int B = 0; \
            CALL;          \
        }                  \
    } while (0)

/* v rounded to bf16 (when bf16), as torch rounds each op's fp32 result of bf16 tensors */
static inline float rnd(float v, int b16) { return b16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* ------------------------------------------------------------------ AVX2 + FMA version */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))
#define HAVE_AVX2_PATH 1

AVX2 static inline float hsum8(__m256 v) { /* ((0+4)+(2+6)) + ((1+5)+(3+7)) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[u] = hsum8(v[u]) for u < 8, bitwise (the same tree: lane i + lane i+4, then (0+2) + (1+3)),
 * eight sums at once by transposing as they are added */
AVX2 static inline __attribute__((always_inline)) __m256 hsum8x8_v(const __m256* v) {
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

AVX2 static inline __m256 ld_f32(const void* p, int64_t i) { return _mm256_loadu_ps((const float*)p + i); }
AVX2 static inline __m256 widen8(__m128i h) { /* 8 bf16 -> fp32, exact */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
AVX2 static inline __m256 ld_bf16(const void* p, int64_t i) { return widen8(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i))); }
/* the first `rem` (< 8) values, zeros after: a zero lane adds 0 * 0 to its sum */
AVX2 static inline __m256 ld_part(const void* p, int64_t i, int rem, int bf16) {
    float tmp[8] = {0};
    for (int j = 0; j < rem; j++) tmp[j] = load1(p, i + j, bf16);
    return _mm256_loadu_ps(tmp);
}

/* ------------------------------------------------------------------ linear: packed weights
 *
 * A linear's weights come packed (engine.cpu_kernels.pack) in panels of 8 output columns, the 8
 * columns' values for one k side by side: fp32 [P][K][8]; bf16 [P][K2/2][8][2], K2 being K rounded
 * up to even, so that lane c of a 32-bit pair holds column c's value k in its low half and k + 1 in
 * its high half; P = ceil(N / 8), zeros past N and K. x goes in transposed, [K][M] in fp32 (bf16
 * widened, exactly), so a tile broadcasts x[m][k] from one place.
 *
 * Every output n of row m is one FMA chain over k in order, from 0:
 *   s = fma(w[n][K-1], x[m][K-1], ... fma(w[n][1], x[m][1], fma(w[n][0], x[m][0], 0)) ...)
 * then s + bias[n], then (bf16) one rounding to nearest even. Nothing in it depends on the row count,
 * the row's place or the thread, and a padding zero adds 0 * 0. A tile of MB rows x NP panels keeps
 * MB x NP vectors of 8 sums and makes one FMA per 8 outputs: no horizontal sums, a bf16 pair widened by
 * one shift and one mask, and each panel read as one sequential stream, which the tile prefetches
 * PACK_AHEAD bytes ahead into L2. Against the row-along-K tiles this replaced, SmolLM2's linears took
 * 0.56-0.87x the time in bf16 and 0.79-0.94x in fp32 at 1 to 9 rows on a 2-core EPYC (docs/results.md,
 * eighteenth session). The shapes keep within AVX2's 16 registers (sums, weights, one broadcast). */
#define PACK_AHEAD_F32 4096
#define PACK_AHEAD_BF16 16384
#define UNROLL _Pragma("GCC unroll 16")
/* (gcc 12 at -O3 kept a tile's sums in memory, a store per FMA, unless every loop over them unrolls) */
/* a tile: sums over values [0, kn) of panels K values long (wp and xt at the first of them), into o
 * [MB][NP * 8], from 0 or (init) from o's sums: a chain cut at a block of K goes on bitwise */
typedef void (*ptile_fn)(const float* xt, int64_t ldx, const void* wp, int64_t K, int64_t kn, float* o, int init);
#define PTILE_F32(MB, NP)                                                                               \
    AVX2 static void pf32_##MB##x##NP(const float* xt, int64_t ldx, const void* wp, int64_t K, int64_t kn, float* o, int init) { \
        const float* w = (const float*)wp;                                                              \
        __m256 acc[MB][NP];                                                                             \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) acc[i][j] = init ? _mm256_loadu_ps(o + (i * NP + j) * 8) : _mm256_setzero_ps(); \
        for (int64_t k = 0; k < kn; k++) {                                                              \
            __m256 wv[NP];                                                                              \
            UNROLL for (int j = 0; j < NP; j++) {                                                       \
                const float* p = w + (j * K + k) * 8;                                                   \
                if (!(k & 1)) _mm_prefetch((const char*)p + PACK_AHEAD_F32, _MM_HINT_T1);               \
                wv[j] = _mm256_loadu_ps(p);                                                             \
            }                                                                                           \
            UNROLL for (int i = 0; i < MB; i++) {                                                       \
                __m256 xb = _mm256_broadcast_ss(xt + k * ldx + i);                                      \
                UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xb, acc[i][j]);  \
            }                                                                                           \
        }                                                                                               \
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NP; j++) _mm256_storeu_ps(o + (i * NP + j) * 8, acc[i][j]); \
    }
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
             * otherwise kept a sum in memory, a store and a load on its FMA chain (0.93-0.97x the    \
             * time of SmolLM2's 5-row linears); fewer: hiding it cost 1-row calls a few per cent */   \
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
/* out[m0 + i][n] = o[i][c] + bias[n] (rounded to bf16 when bf16) for the columns n = 8 p + c < N of a
 * tile's sums o [mb][np * 8]: 8 columns a vector where a panel lies within N, the same bits as one at a
 * time (store1); a 9-row bf16 step's linears spent a tenth of their time storing value by value */
AVX2 static inline __m128i bf16x8(__m256 v) { /* f32_to_bf16 of each lane */
    __m256i u = _mm256_castps_si256(v), top = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1))));
    r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_or_si256(top, _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* values below 2^16: packus keeps them; its lanes come as [0-3, 0-3 | 4-7, 4-7], quadwords 0 and 2 wanted */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
AVX2 static void packed_store_avx2(const float* o, int mb, int np, int64_t m0, int64_t p, const void* bias, void* out,
                                   int64_t N, int bf16) {
    for (int j = 0; j < np; j++) {
        int64_t n0 = (p + j) * 8;
        if (n0 + 8 > N) { /* the last panel's columns within N, one at a time */
            for (int i = 0; i < mb; i++)
                for (int64_t n = n0; n < N; n++) {
                    float s = o[(i * np + j) * 8 + n - n0];
                    if (bias) s += load1(bias, n, bf16);
                    store1(out, (m0 + i) * N + n, s, bf16);
                }
            continue;
        }
        __m256 b = bias ? (bf16 ? ld_bf16(bias, n0) : ld_f32(bias, n0)) : _mm256_setzero_ps();
        for (int i = 0; i < mb; i++) {
            __m256 s = _mm256_loadu_ps(o + (i * np + j) * 8);
            if (bias) s = _mm256_add_ps(s, b);
            if (bf16) _mm_storeu_si128((__m128i*)((uint16_t*)out + (m0 + i) * N + n0), bf16x8(s));
            else _mm256_storeu_ps((float*)out + (m0 + i) * N + n0, s);
        }
    }
}
/* x's rows m .. m + R - 1 (R = 8, 4 or 1), values [0, K - K % R) (bf16 widened), into a block of the
 * transposed x: value k of row m + i at dst[k * ld + i]; by R x R transposes, not one scalar store per
 * value, which kept a 9-row call's caller a few microseconds a layer while the other threads waited */
AVX2 static void transpose8(const void* x, int64_t m, int64_t K, int bf16, float* dst, int64_t ld) {
    for (int64_t k0 = 0; k0 + 8 <= K; k0 += 8) {
        __m256 r[8], t[8], s[8];
        for (int i = 0; i < 8; i++) r[i] = bf16 ? ld_bf16(x, (m + i) * K + k0) : ld_f32(x, (m + i) * K + k0);
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
            _mm256_storeu_ps(dst + (k0 + v) * ld, _mm256_permute2f128_ps(s[v], s[v + 4], 0x20));
            _mm256_storeu_ps(dst + (k0 + v + 4) * ld, _mm256_permute2f128_ps(s[v], s[v + 4], 0x31));
        }
    }
}
AVX2 static int64_t transpose1(const void* x, int64_t m, int64_t K, int bf16, float* dst) { /* one row: as it is */
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, bf16 ? ld_bf16(x, m * K + k) : ld_f32(x, m * K + k));
    return k;
}
AVX2 static void transpose4(const void* x, int64_t m, int64_t K, int bf16, float* dst, int64_t ld) {
    for (int64_t k0 = 0; k0 + 4 <= K; k0 += 4) {
        __m128 r[4];
        for (int i = 0; i < 4; i++)
            r[i] = bf16 ? _mm256_castps256_ps128(widen8(_mm_loadl_epi64((const __m128i*)((const uint16_t*)x + (m + i) * K + k0))))
                        : _mm_loadu_ps((const float*)x + (m + i) * K + k0);
        _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
        for (int v = 0; v < 4; v++) _mm_storeu_ps(dst + (k0 + v) * ld, r[v]);
    }
}
#define PTILES_X1(T) T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(5, 1) T(6, 1) T(7, 1) T(8, 1) T(9, 1)
PTILES_X1(PTILE_F32) PTILE_F32(1, 4) PTILE_F32(2, 4) PTILE_F32(3, 3) PTILE_F32(4, 3) PTILE_F32(5, 2) PTILE_F32(6, 2)
PTILES_X1(PTILE_BF16) PTILE_BF16(1, 4) PTILE_BF16(2, 3) PTILE_BF16(3, 3) PTILE_BF16(4, 2) PTILE_BF16(5, 2)
PTILE_F32(1, 3) PTILE_F32(2, 3)
/* by rows (1-9): the tile of one pass over the panels, and its panels; the 1-panel tile of as many rows */
static const ptile_fn pf32_wide[] = {0, pf32_1x4, pf32_2x4, pf32_3x3, pf32_4x3, pf32_5x2, pf32_6x2, pf32_7x1, pf32_8x1, pf32_9x1};
static const int pf32_np[] = {0, 4, 4, 3, 3, 2, 2, 1, 1, 1};
static const ptile_fn pf32_one[] = {0, pf32_1x1, pf32_2x1, pf32_3x1, pf32_4x1, pf32_5x1, pf32_6x1, pf32_7x1, pf32_8x1, pf32_9x1};
static const ptile_fn pbf16_wide[] = {0, pbf16_1x4, pbf16_2x3, pbf16_3x3, pbf16_4x2, pbf16_5x2, pbf16_6x1, pbf16_7x1, pbf16_8x1, pbf16_9x1};
static const int pbf16_np[] = {0, 4, 3, 3, 2, 2, 1, 1, 1, 1};
static const ptile_fn pbf16_one[] = {0, pbf16_1x1, pbf16_2x1, pbf16_3x1, pbf16_4x1, pbf16_5x1, pbf16_6x1, pbf16_7x1, pbf16_8x1, pbf16_9x1};
/* Calls of more than 9 rows (a batch's verify step, a prompt chunk) go in blocks of rows. fp32: blocks
 * of MANY_ROWS rows, each over MANY_PANELS panels at a time (the 4 x 3 tile has the fewest broadcasts
 * per FMA) and MANY_KBLOCK values at a time, so that the panels' block stays in L1 while every row
 * block passes over it (a chain cut there goes on from its stored sums, bitwise). bf16: blocks of up
 * to 9 rows (x_block) over one panel, which a bf16 pass widens again: 3 x 3 passes ran 1.3x slower than 9 x 1 ones at
 * 16 to 40 rows. With x in blocks of rows too (x_block), SmolLM2's fp32 linears took 43-45 and 95-101
 * ms at 16 and 40 rows on a 2-core EPYC, against 54-60 and 125-131 with x as one [K][M] block (with and
 * without blocks of K), and 54 and 98-107 with the row-along-K kernels before (eighteenth session). */
#define MANY_PANELS 3
#define MANY_ROWS 4
#define MANY_KBLOCK 128
#define MANY_BLOCK_ROWS 64 /* rows whose sums one pass over the panels keeps (a multiple of 4) */
static const ptile_fn pf32_many[] = {0, pf32_1x3, pf32_2x3, pf32_3x3, pf32_4x3};
/* AVX-512 BF16 (level 3): VDPBF16PS multiplies bf16 pairs and adds both products to an fp32 lane, with
 * the instruction's fixed DAZ / FTZ rounding; level 3 uses it for bf16 attention scores (SCORES_DP,
 * below), whose order is then its own. */
#if (defined(__clang__) && __clang_major__ >= 11) || (!defined(__clang__) && __GNUC__ >= 11)
#define HAVE_DPBF16 1
#define AVX512BF16 __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bf16")))
AVX512BF16 static inline __m256i ld_pairs(const void* p, int64_t i) { return _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i)); }
AVX512BF16 static inline __m256i ld_pairs_part(const void* p, int64_t i, int rem) { /* rem < 16 values, zeros after */
    uint16_t tmp[16] = {0};
    memcpy(tmp, (const uint16_t*)p + i, (size_t)rem * 2);
    return _mm256_loadu_si256((const __m256i*)tmp);
}
#else
#define HAVE_DPBF16 0
#endif

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

/* NH query vectors (heads of one token that share a KV head) over the same L keys at element offsets
 * rows[j]: s[h * ld + j] = dot(q[h], key j) in 8 lanes over D then hsum8; keys KB at a time, each key
 * read once for all NH vectors (independent sums, each with the same arithmetic whatever NH and KB). */
#define LDX(P, OFF, REM) ((REM) ? ld_part(P, OFF, REM, bf16) : (bf16 ? ld_bf16(P, OFF) : ld_f32(P, OFF)))
/* Keys and values are rows of D values scattered over the pages (the other KV heads' rows lie in
 * between), a pattern the hardware prefetchers miss: each loop asks for the row KEY_AHEAD keys ahead. */
#define KEY_AHEAD 32
AVX2 static inline void prefetch_row(const char* p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    _mm_prefetch(p + bytes - 1, _MM_HINT_T0); /* the last line, when the row does not start a line */
}
/* a key block's NH x KB sums a[h][u] (8 lanes each; NH * KB is 8 or 9) to scores s[h * ld + j + u] */
AVX2 static inline __attribute__((always_inline)) void store_scores(const __m256* a, int nh, int kb, float* s, int64_t ld, int64_t j) {
    float sums[8];
    hsum8x8(a, sums);
    for (int i = 0; i < nh * kb; i++) s[i / kb * ld + j + i % kb] = i < 8 ? sums[i] : hsum8(a[i]);
}
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

/* o[h][d] += sum_j p[h * ld + j] * v_j[d], key by key (one FMA chain per element, continuing from
 * what o holds: a query's keys may come in several calls, in order), 32 values of D at a time, each
 * value row read once for all NH heads */
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
#undef LDX

/* ---- The keys all of a pass's queries share (attend_pass), bf16 pages: a block of them for one KV
 * head widened once to fp32 rows, against every query of the pass that reads that KV head, in
 * tiles. A score is scores_avx2's arithmetic (8 lanes over D, then hsum8) and an output element
 * wsum_avx2's (one FMA per key, in order, on what o holds), whatever tile or block it falls in: the
 * tiles only share loads between queries and keys. */
#define UNROLL _Pragma("GCC unroll 16")
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
AVX2 static inline __attribute__((always_inline)) void qk4x3(const float* const* q, const float* const* k, int64_t D,
                                                             float* const* s, int64_t j) {
    QK_SUMS(4, 3)
    float r[12];
    _mm256_storeu_ps(r, hsum8x8_v(a));
    for (int i = 8; i < 12; i++) r[i] = hsum8(a[i]);
    for (int h = 0; h < 4; h++)
        for (int u = 0; u < 3; u++) s[h][j + u] = r[h * 3 + u];
}
AVX2 static inline __attribute__((always_inline)) void qk2x4(const float* const* q, const float* const* k, int64_t D,
                                                             float* const* s, int64_t j) {
    QK_SUMS(2, 4)
    __m256 r = hsum8x8_v(a); /* q0's four scores, then q1's */
    _mm_storeu_ps(s[0] + j, _mm256_castps256_ps128(r));
    _mm_storeu_ps(s[1] + j, _mm256_extractf128_ps(r, 1));
}
AVX2 static inline __attribute__((always_inline)) void qk1x8(const float* const* q, const float* const* k, int64_t D,
                                                             float* const* s, int64_t j) {
    QK_SUMS(1, 8)
    _mm256_storeu_ps(s[0] + j, hsum8x8_v(a));
}
#define QK_COLUMN(NAME, NQ)                                                                             \
    AVX2 static inline __attribute__((always_inline)) void NAME(const float* const* q, const float* const* k, \
                                                                int64_t D, float* const* s, int64_t j) { \
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
    AVX2 static inline __attribute__((always_inline)) void NAME(const float* const* p, int64_t j0,      \
                                                                const float* const* v, int64_t nb,      \
                                                                float* const* o, int64_t d0) {          \
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
#undef UNROLL

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

#if HAVE_DPBF16
/* Level 3, bf16 pages: q.k as VDPBF16PS dot products of bf16 pairs (lane l adds the exact products of
 * values d + 2l + 1, then d + 2l, of each 16 from d, with the instruction's DAZ / FTZ; then hsum8). A
 * query is bf16 already (the projection's output), so neither it nor the key is widened, and a score
 * takes half the instructions of 8-lane FMAs. The order is fixed per score whatever the key blocks,
 * heads or threads: invariant as the other levels, with bits of its own. */
#define DP_LD(P, OFF, REM) ((REM) ? ld_pairs_part(P, OFF, REM) : ld_pairs(P, OFF))
#define SCORES_DP(NAME, NH, KB)                                                                         \
    AVX512BF16 static void NAME(const uint16_t* q, const void* kb, const int64_t* rows, int64_t L,       \
                                int64_t D, float* s, int64_t ld, int64_t npf) {                         \
        int64_t j = 0;                                                                                  \
        for (; j + KB <= L; j += KB) {                                                                  \
            for (int u = 0; u < KB && j + KEY_AHEAD + u < npf; u++)                                     \
                prefetch_row((const char*)kb + rows[j + KEY_AHEAD + u] * 2, D * 2);                     \
            __m256 a[NH][KB];                                                                           \
            for (int h = 0; h < NH; h++)                                                                \
                for (int u = 0; u < KB; u++) a[h][u] = _mm256_setzero_ps();                             \
            for (int64_t d = 0; d < D; d += 16) {                                                       \
                int rem = D - d < 16 ? (int)(D - d) : 0; /* the last D % 16 values: zeros after them */ \
                __m256i kv[KB];                                                                         \
                for (int u = 0; u < KB; u++) kv[u] = DP_LD(kb, rows[j + u] + d, rem);                   \
                for (int h = 0; h < NH; h++) {                                                          \
                    __m256bh qv = (__m256bh)DP_LD(q, h * D + d, rem);                                   \
                    for (int u = 0; u < KB; u++) a[h][u] = _mm256_dpbf16_ps(a[h][u], (__m256bh)kv[u], qv); \
                }                                                                                       \
            }                                                                                           \
            store_scores(&a[0][0], NH, KB, s, ld, j);                                                   \
        }                                                                                               \
        for (; j < L; j++) {                                                                            \
            __m256 a[NH];                                                                               \
            for (int h = 0; h < NH; h++) a[h] = _mm256_setzero_ps();                                    \
            for (int64_t d = 0; d < D; d += 16) {                                                       \
                int rem = D - d < 16 ? (int)(D - d) : 0;                                                \
                __m256bh kv = (__m256bh)DP_LD(kb, rows[j] + d, rem);                                    \
                for (int h = 0; h < NH; h++) a[h] = _mm256_dpbf16_ps(a[h], kv, (__m256bh)DP_LD(q, h * D + d, rem)); \
            }                                                                                           \
            for (int h = 0; h < NH; h++) s[h * ld + j] = hsum8(a[h]);                                    \
        }                                                                                               \
    }
SCORES_DP(scores_dp1, 1, 8)
SCORES_DP(scores_dp2, 2, 4)
SCORES_DP(scores_dp3, 3, 3)
#undef DP_LD
typedef void (*scores_dp_fn)(const uint16_t*, const void*, const int64_t*, int64_t, int64_t, float*, int64_t, int64_t);
static const scores_dp_fn scores_dp[4] = {0, scores_dp1, scores_dp2, scores_dp3};
#endif

typedef void (*scores_fn)(const float*, const void*, const int64_t*, int64_t, int64_t, int64_t, int, float*, int64_t, int64_t);
typedef void (*wsum_fn)(const float*, int64_t, const void*, const int64_t*, int64_t, int64_t, int, float*, int64_t);
static const scores_fn scores_avx2[4] = {0, scores1, scores2, scores3};
static const wsum_fn wsum_avx2[4] = {0, wsum1, wsum2, wsum3};
#else
#define HAVE_AVX2_PATH 0
#define HAVE_DPBF16 0
#endif

#define MAX_NH 3 /* query heads of a KV head whose scores and sums are computed together */
/* 0: portable C, 1: AVX2 + FMA, 2: an AVX-512 CPU (which runs level 1's code: the packed linears' AVX2
 * tiles beat the 32-register AVX-512 ones they replaced, docs/results.md, eighteenth session), 3: and
 * AVX-512 BF16 dot products for bf16 attention scores (their own order; everything else as level 1) */
static int simd = 0, simd_max = 0;

/* NAME(PARAMS): BODY compiled twice, for AVX2 (run where the kernels run AVX2) and for the baseline.
 * For the elementwise loops: the same IEEE operations either way (the build keeps products and sums
 * apart, -ffp-contract=off), eight or more lanes at a time instead of four. */
#if HAVE_AVX2_PATH
#define VECTORIZED(NAME, PARAMS, ARGS, BODY)                 \
    static void NAME##_base PARAMS { BODY; }                 \
    AVX2 static void NAME##_avx2 PARAMS { BODY; }            \
    static void NAME PARAMS {                                \
        if (simd) NAME##_avx2 ARGS;                          \
        else NAME##_base ARGS;                               \
    }
#else
#define VECTORIZED(NAME, PARAMS, ARGS, BODY) \
    static void NAME PARAMS { BODY; }
#endif

/* ------------------------------------------------------------------ entry points */

/* x goes to the tiles transposed in blocks of this many rows, [blocks][K2][B] (the last block fewer
 * rows), so that a pass over one block reads its x values as one stream: all M rows as one block
 * up to 9 rows, else the rows of a fp32 pass (MANY_ROWS) or of a bf16 one (at most 9, the blocks as even
 * as they come: 10 rows as 5 + 5 rather than 9 + 1, whose 1-row pass is one FMA chain at a time) */
static inline int64_t x_block(int64_t M, int64_t bf16) {
    if (M <= 9) return M;
    if (!bf16) return MANY_ROWS;
    int64_t blocks = (M + 8) / 9;
    return (M + blocks - 1) / blocks;
}

/* where row m's value 0 lies in the transposed x (blocks of B rows, K2 values), *ld the step between its
 * values (the rows of m's block) */
static inline int64_t x_at(int64_t M, int64_t B, int64_t K2, int64_t m, int64_t* ld) {
    int64_t m0 = m / B * B;
    *ld = M - m0 < B ? M - m0 : B;
    return m0 * K2 + (m - m0);
}

/* the weight of output column n at value k of a packed linear (the portable path's read) */
static inline float packed_w(const void* wp, int64_t K2, int64_t n, int64_t k, int bf16) {
    if (!bf16) return ((const float*)wp)[((n / 8) * K2 + k) * 8 + n % 8];
    return bf16_to_f32(((const uint16_t*)wp)[((n / 8) * K2 + (k & ~(int64_t)1)) * 8 + (n % 8) * 2 + (k & 1)]);
}

/* out [M, N] = x @ w^T (+ bias) for the columns of panels [p_lo, p_hi) (8 columns a panel), every row:
 * xt is x transposed in blocks of rows (x_block), fp32; w is packed (above), K2 its values a column (K,
 * or K rounded up to even for bf16); w, bias and out are bf16 when bf16, else fp32. Up to 9 rows go in one pass over the
 * panels; more rows in blocks (MANY_ROWS, below the tiles). */
static void linear_range(const float* xt, int64_t M, const void* wp, int64_t K2, const void* bias, int64_t p_lo,
                         int64_t p_hi, void* out, int64_t N, int64_t bf16) {
#if HAVE_AVX2_PATH
    if (simd) {
        const ptile_fn *wide = bf16 ? pbf16_wide : pf32_wide, *one = bf16 ? pbf16_one : pf32_one;
        int64_t panel = K2 * 8 * (bf16 ? 2 : 4); /* bytes */
        float o[9 * 32];
        if (M <= 9) {
            int np = (bf16 ? pbf16_np : pf32_np)[M];
            for (int64_t p = p_lo; p < p_hi;) {
                int n = p + np <= p_hi ? np : 1;
                (n == np ? wide : one)[M](xt, M, (const char*)wp + p * panel, K2, K2, o, 0);
                packed_store_avx2(o, (int)M, n, 0, p, bias, out, N, (int)bf16);
                p += n;
            }
        } else { /* blocks of rows (MANY_ROWS above) */
            int64_t B = x_block(M, bf16), blocks = (M + B - 1) / B;
            float acc[MANY_BLOCK_ROWS * MANY_PANELS * 8];
            for (int64_t p = p_lo; p < p_hi;) {
                int n = !bf16 && p + MANY_PANELS <= p_hi ? MANY_PANELS : 1;
                int64_t kb = n == MANY_PANELS ? MANY_KBLOCK : K2;
                for (int64_t b0 = 0; b0 < blocks; b0 += MANY_BLOCK_ROWS / B) {
                    int64_t b1 = b0 + MANY_BLOCK_ROWS / B < blocks ? b0 + MANY_BLOCK_ROWS / B : blocks;
                    for (int64_t k0 = 0; k0 < K2; k0 += kb)
                        for (int64_t b = b0; b < b1; b++) {
                            int64_t mb, at = x_at(M, B, K2, b * B, &mb), m0 = b * B;
                            (n == MANY_PANELS ? pf32_many : one)[mb](xt + at + k0 * mb, mb,
                                (const char*)wp + p * panel + k0 * 8 * (bf16 ? 2 : 4), K2,
                                K2 - k0 < kb ? K2 - k0 : kb, acc + (m0 - b0 * B) * n * 8, k0 > 0);
                        }
                    int64_t r1 = b1 * B < M ? b1 * B : M;
                    packed_store_avx2(acc, (int)(r1 - b0 * B), n, b0 * B, p, bias, out, N, (int)bf16);
                }
                p += n;
            }
        }
        return;
    }
#endif
    int64_t B = x_block(M, bf16);
    for (int64_t n = p_lo * 8; n < p_hi * 8 && n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            int64_t ld;
            const float* xm = xt + x_at(M, B, K2, m, &ld);
            float s = 0.0f;
            for (int64_t k = 0; k < K2; k++) s = fmaf(packed_w(wp, K2, n, k, (int)bf16), xm[k * ld], s);
            if (bias) s += load1(bias, n, (int)bf16);
            store1(out, m * N + n, s, (int)bf16);
        }
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

/* n (<= MAX_NH) query vectors qs apart against L keys at element offsets rows[j] of kb:
 * s[h * ld + j] = dot(q[h], key j); qb: the same vectors' bf16 bits (D apart) where level 3 runs bf16 pages */
static void scores_n(int64_t n, const float* q, const uint16_t* qb, const void* kb, const int64_t* rows, int64_t L,
                     int64_t D, int64_t qs, int bf16, float* s, int64_t ld, int64_t npf) {
    if (L <= 0) return;
#if HAVE_DPBF16
    if (qb) { /* level 3, bf16: q's bf16 bits, and the dot products' own order */
        scores_dp[n](qb, kb, rows, L, D, s, ld, npf);
        return;
    }
#else
    (void)qb;
#endif
#if HAVE_AVX2_PATH
    if (simd) {
        scores_avx2[n](q, kb, rows, L, D, qs, bf16, s, ld, npf);
        return;
    }
#endif
    for (int64_t h = 0; h < n; h++)
        for (int64_t j = 0; j < L; j++)
            s[h * ld + j] = qk_c(q + h * qs, (const char*)kb + rows[j] * (bf16 ? 2 : 4), D, bf16);
}

/* o[h][d] += p[h * ld + j] * v_j[d] for j = 0 .. L-1 in order, one FMA each, for n heads Dv apart */
static void wsum_n(int64_t n, const float* p, int64_t ld, const void* vb, const int64_t* rows, int64_t L,
                   int64_t Dv, int bf16, float* o, int64_t npf) {
    if (L <= 0) return;
#if HAVE_AVX2_PATH
    if (simd) {
        wsum_avx2[n](p, ld, vb, rows, L, Dv, bf16, o, npf);
        return;
    }
#endif
    for (int64_t h = 0; h < n; h++)
        for (int64_t j = 0; j < L; j++)
            for (int64_t d = 0; d < Dv; d++) o[h * Dv + d] = fmaf(p[h * ld + j], load1(vb, rows[j] + d, bf16), o[h * Dv + d]);
}

/* in place over one query's L scores: scale, optional tanh soft-capping, softmax */
static void normalize_scores(float* sh, int64_t L, float scale, float softcap) {
#if HAVE_AVX2_PATH
    if (simd && !(softcap > 0.0f)) { /* the scaling inside, vectorized */
        softmax_avx2(sh, L, scale);
        return;
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

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *kv_slots, *seq, *run_lo, *run_hi, *extra_off, *extra;
    void* out;
    int64_t T, H, D, Dv, H_kv, Lk, bf16;
    float scale, softcap;
    const int64_t* starts; /* [R+1] first token of each run of tokens of one sequence */
    int64_t chunks;        /* token pieces per (run, KV piece, head piece) */
    int64_t kvsplit;       /* pieces the KV heads are cut into */
    int64_t hsplit;        /* pieces the query heads of a KV head are cut into */
    atomic_long failed;
} attend_job;

#define PASS_TOKENS 16  /* tokens of one sequence that share a pass over its keys */
#define KEY_BLOCK 24    /* keys of the shared span read by all of a pass's queries while in L1 (3 and 8 divide it) */
#define TILE_QUERIES 12  /* bf16 queries of a KV head from which the span goes by tiles (fewer: by head groups) */

/* A pass: tokens t_lo .. t_lo+nt-1 of one sequence, each with query heads kvh * G + g_lo .. g_lo+ng-1
 * of the KV heads kvh = kv_lo .. kv_lo+nkv-1 (G = H / H_kv). A token t sees cache positions run_lo[t] ..
 * run_hi[t]-1, then extra[extra_off[t] .. extra_off[t+1]-1]: its key j, in that order, is its j-th
 * score and the j-th term of each output element's sum.
 *
 * The positions all the tokens see, [max run_lo, min run_hi) (the cached prefix of a chain or a tree),
 * are the span: read once for all the pass's queries of a KV head, KEY_BLOCK keys at a time (bf16
 * with TILE_QUERIES or more of them: widened once to fp32 rows, against tiles of queries; otherwise
 * by groups of a token's heads). Each query's own keys before and after the span are read for its token alone. Which
 * queries share a block changes only what is in cache, never a query's arithmetic: its scores are
 * independent dot products, and each output element is summed key by key in the query's key order,
 * the running sums kept in o. */
typedef struct {
    const attend_job* J;
    int64_t t_lo, nt, kv_lo, nkv, g_lo, ng, HP, nS, D8;
    int64_t Ls[PASS_TOKENS], sbase[PASS_TOKENS], own_at[PASS_TOKENS + 1], pre[PASS_TOKENS];
    int64_t *krow, *kown, *vrow, *vown; /* element offsets of the span's and the own keys (all KV heads) */
    float *s, *qf, *o, *wide;           /* scores, fp32 queries, outputs, a block of fp32 rows */
    uint16_t* qb;                       /* level 3, bf16: the queries' bf16 bits (scores_dp) */
    const float** span_q;               /* per KV head nt * ng queries (token-major): vectors D8 long, */
    float **span_s, **span_o;           /* their score rows from the span's first key, output rows */
    int tiles;                          /* the span by tiles */
} pass_t;

/* the pass's index arrays, queries and scratch */
static int64_t pass_begin(pass_t* P, const attend_job* J, int64_t t_lo, int64_t t_hi, int64_t kv_lo, int64_t kv_hi,
                          int64_t g_lo, int64_t g_hi) {
    int64_t nt = t_hi - t_lo, ng = g_hi - g_lo, HP = (kv_hi - kv_lo) * ng, D = J->D, Dv = J->Dv, H = J->H;
    int64_t G = H / J->H_kv, total = 0;
    int b16 = (int)J->bf16;
    *P = (pass_t){.J = J, .t_lo = t_lo, .nt = nt, .kv_lo = kv_lo, .nkv = kv_hi - kv_lo, .g_lo = g_lo, .ng = ng, .HP = HP};
    int64_t a = J->run_lo[t_lo], b = J->run_hi[t_lo];
    for (int64_t i = 0; i < nt; i++) {
        int64_t t = t_lo + i;
        a = J->run_lo[t] > a ? J->run_lo[t] : a;
        b = J->run_hi[t] < b ? J->run_hi[t] : b;
    }
    int64_t nS = P->nS = b > a ? b - a : 0;
    P->own_at[0] = 0;
    for (int64_t i = 0; i < nt; i++) {
        int64_t t = t_lo + i;
        P->Ls[i] = J->run_hi[t] - J->run_lo[t] + J->extra_off[t + 1] - J->extra_off[t];
        P->sbase[i] = total;
        total += HP * P->Ls[i];
        P->pre[i] = nS ? a - J->run_lo[t] : 0; /* own keys before the span */
        P->own_at[i + 1] = P->own_at[i] + P->Ls[i] - nS;
    }
    int64_t nown = P->own_at[nt], vsep = Dv != D; /* values narrower than keys (MLA): their own offsets */
    int64_t nrows = (nS + nown) * (1 + vsep), nq = nt * HP, D8 = P->D8 = (D + 7) / 8 * 8;
    int64_t wmax = D8 > Dv ? D8 : Dv; /* the widest row of a block */
    int dp = HAVE_DPBF16 && simd >= 3 && b16;
    P->tiles = simd && !dp && b16 && nt * ng >= TILE_QUERIES; /* fp32 gained nothing (docs/results.md) */
    int64_t* mem = (int64_t*)malloc((size_t)nrows * sizeof(int64_t) + (size_t)nq * 3 * sizeof(float*) +
                                    (size_t)(total + nq * (D8 + Dv) + KEY_BLOCK * wmax) * sizeof(float) +
                                    (size_t)(dp ? nq * D : 0) * sizeof(uint16_t));
    if (!mem) return -1;
    P->krow = mem, P->kown = mem + nS, P->vrow = vsep ? P->kown + nown : mem, P->vown = P->vrow + nS;
    P->span_q = (const float**)(mem + nrows), P->span_s = (float**)(P->span_q + nq), P->span_o = P->span_s + nq;
    P->s = (float*)(P->span_o + nq), P->qf = P->s + total, P->o = P->qf + nq * D8, P->wide = P->o + nq * Dv;
    P->qb = dp ? (uint16_t*)(P->wide + KEY_BLOCK * wmax) : NULL;
    const int64_t* slots = J->kv_slots + J->seq[t_lo] * J->Lk;
    for (int64_t j = 0; j < nS; j++) P->krow[j] = slots[a + j] * J->H_kv * D, P->vrow[j] = slots[a + j] * J->H_kv * Dv;
    for (int64_t i = 0; i < nt; i++) {
        int64_t t = t_lo + i, n_run = J->run_hi[t] - J->run_lo[t], m = P->own_at[i];
        for (int64_t j = 0; j < P->Ls[i]; j++) {
            if (j == P->pre[i]) j += nS; /* the span's keys are in krow (a skip, not a test per key) */
            if (j >= P->Ls[i]) break;
            int64_t c = j < n_run ? J->run_lo[t] + j : J->extra[J->extra_off[t] + j - n_run];
            P->kown[m] = slots[c] * J->H_kv * D, P->vown[m++] = slots[c] * J->H_kv * Dv;
        }
        for (int64_t hh = 0; hh < HP; hh++) {
            int64_t h = (kv_lo + hh / ng) * G + g_lo + hh % ng, k = hh / ng * nt * ng + i * ng + hh % ng;
            float* qv = P->qf + (i * HP + hh) * D8;
            for (int64_t d = 0; d < D8; d++) qv[d] = d < D ? load1(J->q, (t * H + h) * D + d, b16) : 0.0f;
            if (P->qb) memcpy(P->qb + (i * HP + hh) * D, (const uint16_t*)J->q + (t * H + h) * D, (size_t)D * sizeof(uint16_t));
            P->span_q[k] = qv;
            P->span_s[k] = P->s + P->sbase[i] + hh * P->Ls[i] + P->pre[i];
            P->span_o[k] = P->o + (i * HP + hh) * Dv;
        }
    }
    memset(P->o, 0, (size_t)(nq * Dv) * sizeof(float));
    return 0;
}

/* for every query group (token i, KV head kv of the pass, heads g0 .. g0+n-1 of it; hh the first's
 * index in the pass): BODY, with sq its score rows (Ls[i] apart), q its fp32 vectors (D8 apart), qb
 * their bf16 bits (level 3), kb and vb its KV head's keys and values */
#define EACH_GROUP(BODY)                                                                                \
    for (int64_t i = 0; i < P->nt; i++)                                                                \
        for (int64_t kv = 0; kv < P->nkv; kv++)                                                        \
            for (int64_t g0 = 0; g0 < P->ng; g0 += MAX_NH) {                                           \
                int64_t n = P->ng - g0 < MAX_NH ? P->ng - g0 : MAX_NH, hh = kv * P->ng + g0;          \
                float* sq = P->s + P->sbase[i] + hh * P->Ls[i];                                         \
                const float* q = P->qf + (i * P->HP + hh) * P->D8;                                      \
                const uint16_t* qb = P->qb ? P->qb + (i * P->HP + hh) * D : NULL;                       \
                const char* kb = (const char*)J->k_cache + (P->kv_lo + kv) * D * esz;                   \
                const char* vb = (const char*)J->v_cache + (P->kv_lo + kv) * Dv * esz;                  \
                (void)q, (void)qb, (void)kb, (void)vb;                                                  \
                BODY                                                                                    \
            }
#define PASS_LOCALS                                                                                     \
    const attend_job* J = P->J;                                                                         \
    int b16 = (int)J->bf16;                                                                             \
    int64_t D = J->D, Dv = J->Dv, esz = b16 ? 2 : 4, per_kv = P->nt * P->ng, nS = P->nS;               \
    (void)Dv, (void)per_kv, (void)nS;

#if HAVE_AVX2_PATH
/* the span block after the one at j0, every KV head of the pass: rows offs[j] of width values, esz bytes each */
static void prefetch_next_block(const pass_t* P, const char* cache, const int64_t* offs, int64_t width, int64_t esz,
                                int64_t j0) {
    for (int64_t j = j0 + KEY_BLOCK; j < P->nS && j < j0 + 2 * KEY_BLOCK; j++)
        prefetch_row(cache + (offs[j] + P->kv_lo * width) * esz, P->nkv * width * esz);
}
#endif

/* every score of the pass */
static void pass_scores(const pass_t* P) {
    PASS_LOCALS
#if HAVE_AVX2_PATH
    if (P->tiles) { /* a block of span keys, KV head by KV head, against all its queries */
        const float* rows[KEY_BLOCK];
        for (int64_t j0 = 0; j0 < nS; j0 += KEY_BLOCK) {
            int64_t nb = nS - j0 < KEY_BLOCK ? nS - j0 : KEY_BLOCK;
            prefetch_next_block(P, (const char*)J->k_cache, P->krow, D, esz, j0);
            for (int64_t kv = 0; kv < P->nkv; kv++) {
                widen_rows((const char*)J->k_cache + (P->kv_lo + kv) * D * esz, P->krow + j0, nb, D, P->D8, P->wide, rows);
                span_scores(per_kv, P->span_q + kv * per_kv, rows, nb, P->D8, P->span_s + kv * per_kv, j0);
            }
        }
    } else
#endif
    /* One token of several KV heads, fp32 (a decode step of many sequences): each key's rows for
     * every KV head in turn, so the pages are read in address order, which the hardware prefetchers
     * stream (fp32: 8 sequences x 700 keys x 30 layers 16.7 -> 13.8 ms on a 2-core EPYC; bf16's
     * half-size rows gained nothing, and several tokens are better served by the blocks, whose tiles
     * share each key between tokens) */
    if (simd && !b16 && P->nt == 1 && P->nkv > 1) {
        for (int64_t j0 = 0; j0 < nS; j0++)
            EACH_GROUP(scores_n(n, q, qb, kb, P->krow + j0, 1, D, P->D8, b16, sq + P->pre[i] + j0, P->Ls[i], 0);)
    } else {
        for (int64_t j0 = 0; j0 < nS; j0 += KEY_BLOCK) {
            int64_t nb = nS - j0 < KEY_BLOCK ? nS - j0 : KEY_BLOCK;
            EACH_GROUP(scores_n(n, q, qb, kb, P->krow + j0, nb, D, P->D8, b16, sq + P->pre[i] + j0, P->Ls[i],
                                i || g0 ? 0 : nS - j0);)
        }
    }
    EACH_GROUP(const int64_t* ko = P->kown + P->own_at[i];
               int64_t post = P->Ls[i] - nS - P->pre[i];
               scores_n(n, q, qb, kb, ko, P->pre[i], D, P->D8, b16, sq, P->Ls[i], g0 ? 0 : P->pre[i]);
               scores_n(n, q, qb, kb, ko + P->pre[i], post, D, P->D8, b16, sq + P->pre[i] + nS, P->Ls[i], g0 ? 0 : post);)
}

/* scale, soft-capping and softmax of every query row */
static void pass_softmax(const pass_t* P) {
    for (int64_t i = 0; i < P->nt; i++)
        for (int64_t hh = 0; hh < P->HP; hh++)
            normalize_scores(P->s + P->sbase[i] + hh * P->Ls[i], P->Ls[i], P->J->scale, P->J->softcap);
}

/* every output: each query's own keys before the span, the span, its own keys after it, one FMA per
 * key in that order, the running sums in o */
static void pass_values(const pass_t* P) {
    PASS_LOCALS
#define OUT(i, hh) (P->o + ((i) * P->HP + (hh)) * Dv)
    EACH_GROUP(wsum_n(n, sq, P->Ls[i], vb, P->vown + P->own_at[i], P->pre[i], Dv, b16, OUT(i, hh), g0 ? 0 : P->pre[i]);)
#if HAVE_AVX2_PATH
    if (P->tiles) {
        const float* rows[KEY_BLOCK];
        for (int64_t j0 = 0; j0 < nS; j0 += KEY_BLOCK) {
            int64_t nb = nS - j0 < KEY_BLOCK ? nS - j0 : KEY_BLOCK;
            prefetch_next_block(P, (const char*)J->v_cache, P->vrow, Dv, esz, j0);
            for (int64_t kv = 0; kv < P->nkv; kv++) {
                widen_rows((const char*)J->v_cache + (P->kv_lo + kv) * Dv * esz, P->vrow + j0, nb, Dv, Dv, P->wide, rows);
                span_wsum(per_kv, (const float* const*)P->span_s + kv * per_kv, j0, rows, nb, Dv, P->span_o + kv * per_kv);
            }
        }
    } else
#endif
        for (int64_t j0 = 0; j0 < nS; j0 += KEY_BLOCK) {
            int64_t nb = nS - j0 < KEY_BLOCK ? nS - j0 : KEY_BLOCK;
            EACH_GROUP(wsum_n(n, sq + P->pre[i] + j0, P->Ls[i], vb, P->vrow + j0, nb, Dv, b16, OUT(i, hh),
                              i || g0 ? 0 : nS - j0);)
        }
    EACH_GROUP(int64_t post = P->Ls[i] - nS - P->pre[i];
               wsum_n(n, sq + P->pre[i] + nS, P->Ls[i], vb, P->vown + P->own_at[i] + P->pre[i], post, Dv, b16,
                      OUT(i, hh), g0 ? 0 : post);)
#undef OUT
}
#undef PASS_LOCALS
#undef EACH_GROUP

/* the outputs in the cache's dtype; frees the pass */
static void pass_end(pass_t* P) {
    const attend_job* J = P->J;
    int64_t G = J->H / J->H_kv;
    for (int64_t i = 0; i < P->nt; i++)
        for (int64_t hh = 0; hh < P->HP; hh++) {
            int64_t h = (P->kv_lo + hh / P->ng) * G + P->g_lo + hh % P->ng;
            for (int64_t d = 0; d < J->Dv; d++)
                store1(J->out, ((P->t_lo + i) * J->H + h) * J->Dv + d, P->o[(i * P->HP + hh) * J->Dv + d], (int)J->bf16);
        }
    free(P->krow);
}

/* a pass; returns 0, or -1 when scratch memory could not be had */
static int64_t attend_pass(const attend_job* J, int64_t t_lo, int64_t t_hi, int64_t kv_lo, int64_t kv_hi,
                           int64_t g_lo, int64_t g_hi) {
    pass_t P;
    if (pass_begin(&P, J, t_lo, t_hi, kv_lo, kv_hi, g_lo, g_hi)) return -1;
    pass_scores(&P);
    pass_softmax(&P);
    pass_values(&P);
    pass_end(&P);
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

/* panels (8 output columns each) per unit of work: a thread reads a unit's panels as one stream; 96
 * columns rather than 48 made SmolLM2's linears 5-10% faster at 5 and 9 rows with the earlier tiles */
#define BLOCK_P 12
#define MAX_LINEARS 3 /* linears of one input run as one job (a layer's q, k and v; its gate and up) */

typedef struct {
    const float* xt;
    int64_t M, K2, bf16, n;
    const void *w[MAX_LINEARS], *bias[MAX_LINEARS];
    void* out[MAX_LINEARS];
    int64_t N[MAX_LINEARS], first[MAX_LINEARS + 1]; /* each linear's first part */
} linear_job;

/* panels [BLOCK_P p, BLOCK_P (p + 1)) of linear i, p counted from that linear's first part */
static void linear_part(void* ctx, int64_t part) {
    linear_job* j = (linear_job*)ctx;
    int64_t i = 0;
    while (part >= j->first[i + 1]) i++;
    int64_t panels = (j->N[i] + 7) / 8, p_lo = (part - j->first[i]) * BLOCK_P;
    int64_t p_hi = p_lo + BLOCK_P < panels ? p_lo + BLOCK_P : panels;
    linear_range(j->xt, j->M, j->w[i], j->K2, j->bias[i], p_lo, p_hi, j->out[i], j->N[i], j->bf16);
}

/* out_i [M, N_i] = x [M, K] @ w_i^T (+ bias_i [N_i]) for the n (<= MAX_LINEARS) linears of one input, w_i
 * packed (above), in one parallel job; fp32, or bf16 (all of them) when bf16; a bias may be NULL.
 * Returns 0, or -1 when scratch memory could not be had. */
static int64_t linears(const void* x, int64_t M, int64_t K, int64_t n, const void* const* w,
                       const void* const* bias, void* const* out, const int64_t* N, int64_t bf16, int64_t threads) {
    int64_t K2 = bf16 ? K + (K & 1) : K;
    float* xt = NULL; /* x transposed in blocks (x_block), widened and padded once for every tile (fp32 1-row x is its own) */
    if (M > 1 || bf16) {
        xt = (float*)malloc((size_t)(M * K2) * sizeof(float));
        if (!xt) return -1;
        int64_t B = x_block(M, bf16);
        for (int64_t m = 0; m < M; m++) {
            int64_t ld, k = 0;
            float* xm = xt + x_at(M, B, K2, m, &ld);
#if HAVE_AVX2_PATH
            int64_t i = m % B; /* the row's place in its block: rows go by eights, then fours, then alone */
            if (simd && ld == 1) /* one row: its values in a line */
                k = transpose1(x, m, K, (int)bf16, xm);
            else if (simd && i / 8 * 8 + 8 <= ld) {
                if (i % 8 == 0) transpose8(x, m, K, (int)bf16, xm, ld);
                k = K / 8 * 8; /* (this row's values up to there are in) */
            } else if (simd && i / 4 * 4 + 4 <= ld) {
                if (i % 4 == 0) transpose4(x, m, K, (int)bf16, xm, ld);
                k = K / 4 * 4;
            }
#endif
            for (; k < K; k++) xm[k * ld] = load1(x, m * K + k, (int)bf16);
            for (k = K; k < K2; k++) xm[k * ld] = 0.0f;
        }
    }
    linear_job j = {xt ? xt : (const float*)x, M, K2, bf16, n};
    j.first[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        j.w[i] = w[i], j.bias[i] = bias[i], j.out[i] = out[i], j.N[i] = N[i];
        j.first[i + 1] = j.first[i] + ((N[i] + 7) / 8 + BLOCK_P - 1) / BLOCK_P;
    }
    run_parallel(linear_part, &j, j.first[n], threads);
    free(xt);
    return 0;
}

/* out [M, N] = x @ w^T (+ bias [N]), w packed (above); fp32, or bf16 (x, w, bias, out) when bf16; bias
 * may be NULL. Returns 0, or -1 when scratch memory could not be had. */
int64_t linear(const void* x, int64_t M, const void* w, int64_t K, const void* bias, int64_t N, void* out,
               int64_t bf16, int64_t threads) {
    return linears(x, M, K, 1, &w, &bias, &out, &N, bf16, threads);
}

/* Part p = (run r, KV piece, head piece, token piece): a piece of one sequence's tokens in this step,
 * each with a piece of the query heads of some KV heads, in passes of up to PASS_TOKENS tokens. */
static void attend_part(void* ctx, int64_t part) {
    attend_job* j = (attend_job*)ctx;
    int64_t G = j->H / j->H_kv, c = part % j->chunks, rest = part / j->chunks;
    int64_t hp = rest % j->hsplit, kp = rest / j->hsplit % j->kvsplit, r = rest / j->hsplit / j->kvsplit;
    int64_t kv_lo = j->H_kv * kp / j->kvsplit, kv_hi = j->H_kv * (kp + 1) / j->kvsplit;
    int64_t g_lo = G * hp / j->hsplit, g_hi = G * (hp + 1) / j->hsplit;
    int64_t n = j->starts[r + 1] - j->starts[r];
    int64_t lo = j->starts[r] + n * c / j->chunks, hi = j->starts[r] + n * (c + 1) / j->chunks;
    if (kv_lo >= kv_hi || g_lo >= g_hi) return;
    for (int64_t t = lo; t < hi; t += PASS_TOKENS)
        if (attend_pass(j, t, hi - t < PASS_TOKENS ? hi : t + PASS_TOKENS, kv_lo, kv_hi, g_lo, g_hi))
            atomic_store(&j->failed, 1);
}

/* attention of T tokens (see attend_pass; a sequence's tokens are consecutive); returns 0, or -1
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
    /* As few parts as keep the threads busy, since a part reads its keys once for all its queries.
     * With at least two sequences per thread a part is a whole sequence: its pages are then read front
     * to back, all KV heads at once. Otherwise a part is one KV head of a sequence (keys a row apart),
     * and where that gives too few parts the tokens, then the query heads of a KV head, are cut too. */
    int64_t want = threads > 1 ? threads : 1, group = H / H_kv, kvsplit = 1, hsplit = 1, chunks = 1;
    if (runs < 2 * want) {
        kvsplit = H_kv;
        int64_t groups = runs * H_kv;
        chunks = (want + groups - 1) / groups;
        /* parts a multiple of the threads where the tokens allow (3 KV heads on 2 threads: 6 parts,
         * each reading its KV head's keys for half the tokens; a 9-token step 7.2 -> 5.8 ms) */
        while (chunks < longest && (groups * chunks) % want) chunks++;
        if (chunks > longest) { /* too few tokens: cut the heads of a KV head too */
            chunks = longest;
            hsplit = (want + groups * chunks - 1) / (groups * chunks);
            hsplit = hsplit < group ? hsplit : group;
        }
    }
    attend_job j = {q, k_cache, v_cache, kv_slots, seq, run_lo, run_hi, extra_off, extra, out,
                    T, H, D, Dv, H_kv, Lk, bf16, scale, softcap, starts, chunks, kvsplit, hsplit, 0};
    run_parallel(attend_part, &j, runs * kvsplit * hsplit * chunks, threads);
    free(starts);
    return atomic_load(&j.failed) ? -1 : 0;
}

/* RMS normalization of M rows of K values, x and out fp32 (or bf16 when bf16), w [K] the same:
 *   r = 1 / sqrt(sum(x^2) / K + eps), the sum in 8 lanes over K (lane l: k = l, l + 8, ...)
 *   added in hsum8's fixed tree;
 *   form 0 (Llama's): out = w * round(x * r)  (round: to the dtype, a no-op in fp32)
 *   form 1 (Gemma's): out = round(x * r * (1 + w)).
 * Each row alone, in one fixed order whatever M; prompt chunks of many rows are cut into blocks of
 * NORM_ROWS rows over the threads (a row is a few hundred values: fewer rows stay on one thread). */
ELEMENTWISE void rms_rows_n(const void* x, int64_t m_lo, int64_t m_hi, int64_t K, const void* w, float eps,
                            int64_t form, void* out, const int B) {
    for (int64_t m = m_lo; m < m_hi; m++) {
        float acc[8] = {0};
        int64_t k = 0;
        for (; k + 8 <= K; k += 8)
            for (int j = 0; j < 8; j++) {
                float v = load1(x, m * K + k + j, B);
                acc[j] += v * v;
            }
        for (; k < K; k++) {
            float v = load1(x, m * K + k, B);
            acc[k & 7] += v * v;
        }
        float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        float r = 1.0f / sqrtf(sum / (float)K + eps);
        if (form == 0)
            for (k = 0; k < K; k++) store1(out, m * K + k, load1(w, k, B) * rnd(load1(x, m * K + k, B) * r, B), B);
        else
            for (k = 0; k < K; k++) store1(out, m * K + k, load1(x, m * K + k, B) * r * (1.0f + load1(w, k, B)), B);
    }
}
VECTORIZED(rms_rows, (const void* x, int64_t m_lo, int64_t m_hi, int64_t K, const void* w, float eps, int64_t form,
                      void* out, int b16), (x, m_lo, m_hi, K, w, eps, form, out, b16),
           BOTH_DTYPES(rms_rows_n(x, m_lo, m_hi, K, w, eps, form, out, B)))

#define NORM_ROWS 64
typedef struct {
    const void *x, *w;
    void* out;
    int64_t M, K, form, bf16;
    float eps;
} norm_job;

static void norm_part(void* ctx, int64_t part) {
    norm_job* j = (norm_job*)ctx;
    int64_t lo = part * NORM_ROWS, hi = lo + NORM_ROWS < j->M ? lo + NORM_ROWS : j->M;
    rms_rows(j->x, lo, hi, j->K, j->w, j->eps, j->form, j->out, (int)j->bf16);
}

int64_t rms_norm(const void* x, int64_t M, int64_t K, const void* w, float eps, int64_t form, void* out,
                 int64_t bf16, int64_t threads) {
    norm_job j = {x, w, out, M, K, form, bf16, eps};
    run_parallel(norm_part, &j, (M + NORM_ROWS - 1) / NORM_ROWS, M >= 2 * NORM_ROWS ? threads : 1);
    return 0;
}

/* ------------------------------------------------------------------ decoder layers (engine.cpu_layers) */

/* A decode step of a Llama-form model runs its layers here, two calls per layer, instead of HF's
 * modules (about 300 Python-level calls a layer). Every operation is the one invariant mode runs
 * through the modules, with the same rounding: the norms and linears above, attend, and torch's own
 * elementwise arithmetic written out (a product or a sum rounded to fp32, then to bf16 for bf16
 * tensors). Only the activation stays with the model's module, between the two calls: its exp is torch's. */

typedef struct { /* sizes, the same for every layer */
    int64_t hidden, H, H_kv, D, inter, bf16;
} dec_shape;

typedef struct { /* one layer's tensors (NULL: absent) */
    const void *ln1, *ln2, *q_norm, *k_norm;      /* RMSNorm weights (q_norm, k_norm: per head, D) */
    const void *wq, *wk, *wv, *wo, *wg, *wu, *wd; /* linear weights [N, K] */
    const void *bq, *bk, *bv, *bo, *bg, *bu, *bd; /* biases */
    void *k_cache, *v_cache;                      /* the layer's pages, [slots, H_kv, D] */
    float eps1, eps2, eps_qk, scale, softcap;
    int64_t form1, form2, form_qk; /* rms_norm forms */
} dec_layer;

typedef struct { /* one step of T tokens */
    int64_t T, threads;
    const int64_t* slots;                /* [T] each token's flat cache slot */
    const void *cos, *sin;               /* [T, D] the rotary tables at the tokens' positions */
    void *h, *x, *q, *k, *v, *a, *g, *u; /* [T, hidden] the residual stream (in place); scratch */
} dec_step;

typedef struct { /* the keys each token reads in a layer: attend's arguments (they depend on the window) */
    const int64_t *kv_slots, *seq, *run_lo, *run_hi, *extra_off, *extra;
    int64_t Lk;
} dec_keys;


/* Where the layers' time goes (eval/step_bench.py --breakdown): nanoseconds per phase, summed while
 * on. Phases: 0 norms, RoPE, KV writes and the elementwise products and sums; 1 q/k/v; 2 attention;
 * 3 o_proj; 4 gate/up; 5 down. */
#define PHASES 6
static int64_t phase_on, phase_ns[PHASES];
#define PHASE(i)                                                    \
    do {                                                            \
        if (phase_on) {                                             \
            int64_t t_ = now_ns();                                  \
            phase_ns[i] += t_ - phase_t;                            \
            phase_t = t_;                                           \
        }                                                           \
    } while (0)

/* copies the sums into out [PHASES] (when not NULL) and zeroes them; on: keep timing */
int64_t layer_phases(int64_t on, int64_t* out) {
    for (int i = 0; i < PHASES; i++) {
        if (out) out[i] = phase_ns[i];
        phase_ns[i] = 0;
    }
    phase_on = on;
    return PHASES;
}

/* out[i] = a[i] op b[i] (op: + or *) for n values: torch's add or mul (bf16: the fp32 result rounded) */
ELEMENTWISE void binary_n(void* out, const void* a, const void* b, int64_t n, int mul, const int B) {
    for (int64_t i = 0; i < n; i++) {
        float va = load1(a, i, B), vb = load1(b, i, B);
        store1(out, i, mul ? va * vb : va + vb, B);
    }
}
VECTORIZED(add_into, (void* x, const void* y, int64_t n, int b16), (x, y, n, b16), BOTH_DTYPES(binary_n(x, x, y, n, 0, B)))
VECTORIZED(mul_to, (void* out, const void* a, const void* b, int64_t n, int b16), (out, a, b, n, b16),
           BOTH_DTYPES(binary_n(out, a, b, n, 1, B)))

/* RoPE in place on T tokens of nh heads of D values, HF's rotate-half form
 * x * cos + rotate_half(x) * sin, each product rounded, then the sum (no fused multiply-add) */
ELEMENTWISE void rope_n(void* x, int64_t T, int64_t nh, int64_t D, const void* cos, const void* sin, const int B) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nh; h++) {
            int64_t o = (t * nh + h) * D;
            for (int64_t d = 0; d < half; d++) {
                float x1 = load1(x, o + d, B), x2 = load1(x, o + d + half, B);
                float a1 = rnd(x1 * load1(cos, t * D + d, B), B);
                float b1 = rnd(-x2 * load1(sin, t * D + d, B), B);
                float a2 = rnd(x2 * load1(cos, t * D + d + half, B), B);
                float b2 = rnd(x1 * load1(sin, t * D + d + half, B), B);
                store1(x, o + d, a1 + b1, B);
                store1(x, o + d + half, a2 + b2, B);
            }
        }
}
VECTORIZED(rope, (void* x, int64_t T, int64_t nh, int64_t D, const void* cos, const void* sin, int b16),
           (x, T, nh, D, cos, sin, b16), BOTH_DTYPES(rope_n(x, T, nh, D, cos, sin, B)))

/* First half of a layer: x = norm1(h); q, k, v = its projections (q and k normed per head where the
 * layer has those norms); RoPE; k and v stored at the tokens' slots; a = attention; h += o_proj(a);
 * x = norm2(h); g, u = gate and up projections of x. The caller then computes y = act(g). */
int64_t layer_attention(const dec_shape* S, const dec_layer* L, const dec_step* P, const dec_keys* K) {
    int64_t T = P->T, hid = S->hidden, D = S->D, qn = S->H * D, kn = S->H_kv * D, b16 = S->bf16;
    int64_t esz = b16 ? 2 : 4, phase_t = phase_on ? now_ns() : 0;
    rms_norm(P->h, T, hid, L->ln1, L->eps1, L->form1, P->x, b16, P->threads);
    PHASE(0);
    const void* w[3] = {L->wq, L->wk, L->wv};
    const void* b[3] = {L->bq, L->bk, L->bv};
    void* o[3] = {P->q, P->k, P->v};
    int64_t N[3] = {qn, kn, kn};
    if (linears(P->x, T, hid, 3, w, b, o, N, b16, P->threads)) return -1;
    PHASE(1);
    if (L->q_norm) rms_norm(P->q, T * S->H, D, L->q_norm, L->eps_qk, L->form_qk, P->q, b16, 1);
    if (L->k_norm) rms_norm(P->k, T * S->H_kv, D, L->k_norm, L->eps_qk, L->form_qk, P->k, b16, 1);
    rope(P->q, T, S->H, D, P->cos, P->sin, (int)b16);
    rope(P->k, T, S->H_kv, D, P->cos, P->sin, (int)b16);
    for (int64_t t = 0; t < T; t++) {
        memcpy((char*)L->k_cache + P->slots[t] * kn * esz, (const char*)P->k + t * kn * esz, (size_t)(kn * esz));
        memcpy((char*)L->v_cache + P->slots[t] * kn * esz, (const char*)P->v + t * kn * esz, (size_t)(kn * esz));
    }
    PHASE(0);
    if (attend(P->q, T, S->H, D, D, L->k_cache, L->v_cache, S->H_kv, K->kv_slots, K->Lk, K->seq, K->run_lo,
               K->run_hi, K->extra_off, K->extra, L->scale, L->softcap, P->a, b16, P->threads))
        return -1;
    PHASE(2);
    if (linear(P->a, T, L->wo, qn, L->bo, hid, P->x, b16, P->threads)) return -1;
    PHASE(3);
    add_into(P->h, P->x, T * hid, (int)b16);
    rms_norm(P->h, T, hid, L->ln2, L->eps2, L->form2, P->x, b16, P->threads);
    PHASE(0);
    const void* w2[2] = {L->wg, L->wu};
    const void* b2[2] = {L->bg, L->bu};
    void* o2[2] = {P->g, P->u};
    int64_t N2[2] = {S->inter, S->inter};
    int64_t failed = linears(P->x, T, hid, 2, w2, b2, o2, N2, b16, P->threads);
    PHASE(4);
    return failed;
}

/* Second half, y [T, inter] being act(g): g = y * u (rounded as torch's product); h += down_proj(g). */
int64_t layer_mlp(const dec_shape* S, const dec_layer* L, const dec_step* P, const void* y) {
    int64_t T = P->T, n = T * S->inter;
    int b16 = (int)S->bf16;
    int64_t phase_t = phase_on ? now_ns() : 0;
    mul_to(P->g, y, P->u, n, b16);
    PHASE(0);
    if (linear(P->g, T, L->wd, S->inter, L->bd, S->hidden, P->x, S->bf16, P->threads)) return -1;
    PHASE(5);
    add_into(P->h, P->x, T * S->hidden, b16);
    PHASE(0);
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
#if HAVE_DPBF16
    if (simd_max == 2 && __builtin_cpu_supports("avx512bf16")) simd_max = 3;
#endif
    simd = simd_max;
#endif
    pthread_atfork(NULL, NULL, after_fork_child);
    return PyModule_Create(&module);
}
