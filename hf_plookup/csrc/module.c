/* The module: the SIMD levels and their dispatch table, and the Python module (its only use is to be
 * imported, which runs PyInit__cpu_kernels; the kernels are called through ctypes, cpu.kernels). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>

#include "cpu_kernels.h"

/* Levels: 0 portable C; 1 AVX2 + FMA; 2 as 1, with bf16 attention scores by AVX-512 BF16 dot products
 * (their own order) and AVX-512 tiles for quantized (W_Q4, W_Q8G, W_Q8) linears of up to 9 rows (the same
 * bits), W_Q4K's at every row count (the same bits), and W_Q8B's integer sums by AVX-512 VNNI (every
 * AVX-512 BF16 CPU has it). An AVX-512 CPU without BF16 runs level 1: for float weights the packed linears' AVX2 tiles
 * beat the 32-register AVX-512 ones they replaced (docs/results.md, "Packed linears: weights packed
 * by output column"). */
enum { LEVEL_PORTABLE, LEVEL_AVX2, LEVEL_AVX512BF16 };

kernel_ops ops;
static int level_max = LEVEL_PORTABLE; /* what this CPU runs (PyInit__cpu_kernels) */

/* the table of `level`: each level the one below it with what it adds */
static void fill_ops(int level) {
    kernel_ops k = {
        .level = LEVEL_PORTABLE,
        .pack_x = pack_x_c,
        .linear_range = linear_range_c,
        .i8_dots = i8_dots_c,
        .q8b_row = q8b_row_c,
        .pack_range = pack_range_c,
        .softmax = softmax_c,
        .rms_rows = rms_rows_c,
        .add_into = add_into_c,
        .mul_to = mul_to_c,
        .rope = rope_c,
    };
    memcpy(k.scores, scores_c, sizeof k.scores);
    memcpy(k.wsum, wsum_c, sizeof k.wsum);
    (void)level; /* (a build without the x86 code has level 0 only) */
#if HAVE_X86_KERNELS
    if (level >= LEVEL_AVX2) {
        k.level = LEVEL_AVX2;
        k.pack_x = pack_x_avx2;
        k.linear_range = linear_range_avx2;
        k.i8_dots = i8_dots_avx2;
        k.q8b_row = q8b_row_avx2;
        k.pack_range = pack_range_avx2;
        memcpy(k.scores, scores_avx2, sizeof k.scores);
        memcpy(k.wsum, wsum_avx2, sizeof k.wsum);
        k.softmax = softmax_avx2;
        k.tile_scores = tile_scores_avx2;
        k.tile_values = tile_values_avx2;
        k.rms_rows = rms_rows_avx2;
        k.add_into = add_into_avx2;
        k.mul_to = mul_to_avx2;
        k.rope = rope_avx2;
    }
#endif
#if HAVE_AVX512BF16_KERNELS
    if (level >= LEVEL_AVX512BF16) {
        k.level = LEVEL_AVX512BF16;
        memcpy(k.scores_bf16, scores_dpbf16, sizeof k.scores_bf16);
        k.linear_range = linear_range_avx512;
        k.i8_dots = i8_dots_vnni;
        /* bf16 pages' scores come from the dot products, so the span goes by head groups (the tiles
         * are for bf16 pages only) */
        k.tile_scores = NULL;
        k.tile_values = NULL;
    }
#endif
    ops = k;
}

static int detect_level(void) {
#if HAVE_X86_KERNELS
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return LEVEL_PORTABLE;
#if HAVE_AVX512BF16_KERNELS
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni"))
        return LEVEL_AVX512BF16;
#endif
    return LEVEL_AVX2;
#else
    return LEVEL_PORTABLE;
#endif
}

int64_t uses_avx2(void) { return ops.level >= LEVEL_AVX2; }

/* the SIMD level the kernels run; set_simd_level picks a lower one (tests compare them), between
 * calls, and returns the one before */
int64_t simd_level(void) { return ops.level; }
int64_t set_simd_level(int64_t level) {
    int64_t was = ops.level;
    fill_ops(level < 0 ? LEVEL_PORTABLE : level > level_max ? level_max : (int)level);
    return was;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cpu_kernels",
    .m_doc = "Row-invariant CPU kernels, called through ctypes (cpu.kernels).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
    level_max = detect_level();
    fill_ops(level_max);
    pthread_atfork(NULL, NULL, pool_after_fork_child);
    return PyModule_Create(&module);
}
