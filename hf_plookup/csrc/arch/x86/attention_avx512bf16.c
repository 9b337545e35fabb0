/* bf16 attention scores by AVX-512 BF16 dot products (level 2). VDPBF16PS multiplies bf16 pairs and
 * adds both products to an fp32 lane, with the instruction's fixed DAZ / FTZ rounding: lane l adds the
 * exact products of values d + 2l + 1, then d + 2l, of each 16 from d; then hsum8. A query is bf16
 * already (the projection's output), so neither it nor the key is widened, and a score takes half the
 * instructions of 8-lane FMAs. The order is fixed per score whatever the key blocks, heads or threads:
 * invariant as the other levels, with bits of its own. Everything else at level 2 is level 1's code. */
#include "simd.h"

#if HAVE_AVX512BF16_KERNELS

#define AVX512BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bf16")))

AVX512BF16 static inline __m256i ld_pairs(const void* p, int64_t i) { return _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i)); }
AVX512BF16 static inline __m256i ld_pairs_part(const void* p, int64_t i, int rem) { /* rem < 16 values, zeros after */
    uint16_t tmp[16] = {0};
    memcpy(tmp, (const uint16_t*)p + i, (size_t)rem * 2);
    return _mm256_loadu_si256((const __m256i*)tmp);
}
#define DP_LD(P, OFF, REM) ((REM) ? ld_pairs_part(P, OFF, REM) : ld_pairs(P, OFF))

/* scores_bf16_fn (cpu_kernels.h) for NH heads, keys KB at a time, as the AVX2 head groups go */
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
const scores_bf16_fn scores_dpbf16[MAX_NH + 1] = {0, scores_dp1, scores_dp2, scores_dp3};

#endif
