/* The decoder layers' elementwise loops (elementwise.h) compiled for AVX2 (level 1 and up): the
 * compiler vectorizes the same IEEE operations eight lanes at a time. */
#include "../../cpu_kernels.h"

/* fp16 values through _Float16 (gcc 12, clang 15), whose conversions the compiler vectorizes with
 * F16C (exact widening; narrowing to nearest even, as f32_to_f16); the portable loads elsewhere */
#if defined(__FLT16_MAX__) && HAVE_X86_KERNELS
#define EW_LOAD(P, I, B) ((B) == DT_F16 ? (float)((const _Float16*)(P))[I] : load1(P, I, B))
#define EW_STORE(P, I, V, B)                                  \
    do {                                                      \
        if ((B) == DT_F16) ((_Float16*)(P))[I] = (_Float16)(V); \
        else store1(P, I, V, B);                              \
    } while (0)
#define EW_RND(V, B) ((B) == DT_F16 ? (float)(_Float16)(V) : rnd(V, B))
#endif
#include "../../elementwise.h"
#include "simd.h"

#if HAVE_X86_KERNELS

AVX2 void rms_rows_avx2(const void* x, int64_t m_lo, int64_t m_hi, int64_t K, const void* w, float eps, int64_t form,
                        void* out, int b16) {
    EACH_DTYPE(rms_rows_n(x, m_lo, m_hi, K, w, eps, form, out, B));
}
AVX2 void add_into_avx2(void* x, const void* y, int64_t n, int b16) { EACH_DTYPE(binary_n(x, x, y, n, 0, B)); }
AVX2 void mul_to_avx2(void* out, const void* a, const void* b, int64_t n, int b16) {
    EACH_DTYPE(binary_n(out, a, b, n, 1, B));
}
AVX2 void rope_avx2(void* x, int64_t T, int64_t nh, int64_t D, const void* cos, const void* sin, int b16) {
    EACH_DTYPE(rope_n(x, T, nh, D, cos, sin, B));
}

#endif
