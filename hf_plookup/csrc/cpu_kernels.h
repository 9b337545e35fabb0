/* Row-invariant CPU kernels for decode, verify and tree steps (cpu.kernels and steps.c_layers drive them):
 * what every file of hf_plookup._cpu_kernels shares.
 *
 * Every kernel gives each output one fixed order of arithmetic that depends only on the operand
 * sizes (K for a linear output, the visible keys for an attention query), never on how many rows
 * share the call, where a row sits in it or which thread computes it. So a token's logits in a
 * k+1-token verify step are bitwise those of a 1-token step.
 *
 * The files, as ggml-cpu keeps them: the portable C of each concern here (linear.c, int8_rows.c for
 * bitsandbytes' LLM.int8, attention.c, layers.c for the norms and decoder layers, threads.c for the
 * pool, module.c for the entry points and the SIMD levels), and the vector code of each instruction
 * set apart under arch/ (arch/x86: AVX2 + FMA, and AVX-512 BF16 and VNNI for bf16 attention scores
 * and quantized linears), behind one
 * abstraction (arch/x86/simd.h).
 * The kernels reach the vector code only through `ops`, the dispatch table below, which module.c
 * fills for the SIMD level once at load and again whenever set_simd_level picks another level.
 *
 * Levels (simd_level): 0 portable C; 1 AVX2 + FMA; 2 as 1, with bf16 attention scores by AVX-512
 * BF16 dot products (an order of their own) and 16-lane tiles for quantized linears (the same bits
 * as level 1's). The linears, norms and the layers' elementwise
 * arithmetic give the same bits at every level; attention too, but for its softmax's exp (libm's at
 * level 0) and level 2's bf16 scores.
 */
#ifndef HF_PLOOKUP_CPU_KERNELS_H
#define HF_PLOOKUP_CPU_KERNELS_H

/* clock_gettime, pthreads under -std=c11 (every file includes this header first; module.c has Python.h
 * before it, which asks for as much) */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* the vector code of arch/x86 is compiled where the compiler can target it (per function, so one
 * build runs on any x86-64 CPU; module.c checks the CPU at load); -DHAVE_X86_KERNELS=0 builds the
 * portable code alone, as a CPU of another architecture gets it */
#ifndef HAVE_X86_KERNELS
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86_KERNELS 1
#else
#define HAVE_X86_KERNELS 0
#endif
#endif
/* VDPBF16PS intrinsics: gcc 11, clang 11 */
#if HAVE_X86_KERNELS && ((defined(__clang__) && __clang_major__ >= 11) || (!defined(__clang__) && __GNUC__ >= 11))
#define HAVE_AVX512BF16_KERNELS 1
#else
#define HAVE_AVX512BF16_KERNELS 0
#endif

/* the ctypes entry points (cpu.kernels, steps.c_layers declare them); everything else stays inside the
 * library, so calls between its files are direct, not through the PLT */
#define EXPORT __attribute__((visibility("default")))
#pragma GCC visibility push(hidden)

/* ------------------------------------------------------------------ 16-bit floats (portable)
 *
 * A call's dtype, `dt` (its parameter is named `bf16` or `b16` in the attention, norms and layers):
 * DT_F32, DT_BF16 or DT_F16 (cpu.kernels.DTYPES). 16-bit values
 * are widened exactly to fp32 for arithmetic and each result rounded back to nearest even, as torch
 * computes ops of bf16 and fp16 CPU tensors. */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

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

/* v rounded to fp16 (to nearest even) and widened back: fp16's quantum is 2^-24 below its least
 * normal 2^-14, else 2^-10 of the value's power of two; past 65504, infinity */
static inline float rnd_f16(float v) {
    if (fabsf(v) < 0x1p-14f) return rintf(v * 0x1p24f) * 0x1p-24f; /* (exact: rintf rounds to even) */
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
    float r;
    memcpy(&r, &u, 4);
    return fabsf(r) > 65504.0f ? copysignf(INFINITY, v) : r;
}

static inline float f16_to_f32(uint16_t h) { /* exact */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u, u;
    if (e == 0) return sign ? -(float)m * 0x1p-24f : (float)m * 0x1p-24f;
    u = sign | (e == 31 ? 0x7f800000u : (e + 112u) << 23) | m << 13;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_f16(float f) { /* rnd_f16's value, as bits; a NaN stays NaN, made quiet (as F16C) */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
    float r = fabsf(rnd_f16(f));
    if (r == INFINITY) return sign | 0x7c00u;
    if (r < 0x1p-14f) return (uint16_t)(sign | (uint16_t)(r * 0x1p24f)); /* (2^-14 itself: 1 << 10, exponent 1) */
    memcpy(&u, &r, 4);
    return (uint16_t)(sign | (((u >> 23) - 112u) << 10) | ((u >> 13) & 0x3ffu));
}

static inline float load1(const void* p, int64_t i, int dt) {
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t*)p)[i]);
    if (dt == DT_F16) return f16_to_f32(((const uint16_t*)p)[i]);
    return ((const float*)p)[i];
}

static inline void store1(void* p, int64_t i, float v, int dt) {
    if (dt == DT_BF16) ((uint16_t*)p)[i] = f32_to_bf16(v);
    else if (dt == DT_F16) ((uint16_t*)p)[i] = f32_to_f16(v);
    else ((float*)p)[i] = v;
}

/* v rounded to the call's dtype, as torch rounds each op's fp32 result of bf16 or fp16 tensors */
static inline float rnd(float v, int dt) {
    return dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : dt == DT_F16 ? rnd_f16(v) : v;
}

/* the fixed tree of an 8-lane sum: ((0+4)+(2+6)) + ((1+5)+(3+7)), as the vector code's hsum8 */
static inline float sum8(const float* acc) {
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ------------------------------------------------------------------ linears (linear.c)
 *
 * A linear's weights come packed (cpu.kernels.pack) in panels of 8 output columns, the 8 columns'
 * values for one k side by side: fp32 [P][K][8]; bf16 [P][K2/2][8][2], K2 being K rounded up to even,
 * so that lane c of a 32-bit pair holds column c's value k in its low half and k + 1 in its high
 * half; fp16 [P][K][8], 8 values F16C widens in one instruction; P = ceil(N / 8), zeros past N and K.
 * x goes in transposed, in blocks of rows (x_block), fp32 (bf16 and fp16 widened, exactly), so that
 * a tile broadcasts x[m][k] from one place.
 *
 * Every output n of row m is one FMA chain over k in order, from 0:
 *   s = fma(w[n][K-1], x[m][K-1], ... fma(w[n][1], x[m][1], fma(w[n][0], x[m][0], 0)) ...)
 * then s + bias[n], then (bf16, fp16) one rounding to nearest even. Nothing in it depends on the row count,
 * the row's place or the thread, and a padding zero adds 0 * 0.
 *
 * Weight kinds (each linear of a call has its own, `wkind`): W_FLOAT, the call's dtype as above; W_Q8,
 * int8 weights with one scale per output column (torchao's int8 weight-only, optimum-quanto's qint8):
 * int8 panels [P][K2][8] (K2 as the call's dtype makes it; a byte of column c at k, widened exactly to
 * fp32), then, from byte q8_scales_at(P, K2), P * 8 fp32 scales (the model's scale rounded to the
 * call's dtype, then widened exactly; zeros past N). Its output n is the same FMA chain over k of the integer weights, then
 *   s = rnd(rnd(s) * scale[n])
 * (rnd: to the call's dtype, nothing for fp32), then + bias[n] and the rounding above: torchao's
 * order (the product of x and the integer weights, rounded to the dtype, times the scale, rounded,
 * plus the bias).
 *
 * W_Q4: 4-bit codes q (0..15) with a scale s and a shift z per output column and group of G values
 * of k (optimum-quanto's qint4, in its plain and its tinygemm form; bitsandbytes' nf4 and fp4, whose
 * scale is the block's absmax and whose code picks a value of a 16-entry codebook; GPTQ's and
 * compressed-tensors', whose shift is the group's zero point). K and G even, G
 * dividing K (K2 = K). Panels [P][K / 2][8] bytes: byte c of pair j holds column c's code at k = 2j
 * in its low nibble and at 2j + 1 in its high one. From byte q4_meta_at(P, K, 4) a 128-byte q4_meta,
 * then [P][K / G][2][8] fp32: the panel's 8 scales of group g, then its 8 shifts (zeros past N).
 * Each weight is dequantized to the value its quantizer defines (q4_value), and the output is the
 * W_FLOAT arithmetic over those values: a W_Q4 linear is bitwise a W_FLOAT linear of its
 * dequantized weight.
 *
 * W_Q8G: W_Q4 with 8-bit codes (0..255: compressed-tensors' int8, the signed value plus 128, whose
 * scale multiplies after its group's zero point is taken off: Q4_SUB_MUL, offset 128). Panels
 * [P][K][8] bytes, byte c of k column c's code; the rest (q4_meta, scales and shifts) and each
 * value's arithmetic as W_Q4's. Where W_Q8 scales a column's sum once, W_Q8G dequantizes every
 * weight first, as a library that makes the float weight and then calls F.linear does.
 *
 * W_Q4K: W_Q4's codes, forms, header, scales and shifts with the codes laid out along k and another
 * order of arithmetic, for K a multiple of 32 and G of 32 (cpu.kernels.q4_kind picks it there). A
 * panel's 8 columns go as two halves of 4 (columns 8p .. 8p + 3, then 8p + 4 .. 8p + 7), each half
 * [K / 32][4][16] bytes: for each block of 32 values of k, each column's 16 bytes, byte l holding its
 * code at k = 32b + l in the low nibble and at 32b + 16 + l in the high one. Output n of row m is a
 * dot product in 16 lanes: lane l is one FMA chain over k = l, l + 16, l + 32, ... in order, from 0,
 * of the dequantized values (q4_value) and x, then
 *   s = sum8(t), t[i] = acc[i] + acc[i + 8]
 * then + bias[n] and the rounding as above. A group's 16 values are then a table the vector code looks
 * a code up in (one permute for 16 weights) rather than arithmetic on every weight, which is what
 * bounds W_Q4 on a few cores; the result is the dequantized weight's product in another order, so a
 * W_Q4K linear is not bitwise a W_FLOAT one, but still the same for a row at every row count. Its x
 * goes to the tiles as rows, not transposed (linears). */
enum { W_FLOAT = 0, W_Q8 = 1, W_Q4 = 2, W_Q8G = 3, W_Q8T = 4, W_Q4K = 5, W_Q8B = 6 };
#define Q4K_BLOCK 32 /* W_Q4K: values of k a column's 16 bytes hold */

/* a W_FLOAT weight's value k of output column n, widened to fp32 (the packing above; K2 its values a
 * column) */
static inline float float_w(const void* wp, int64_t K2, int64_t n, int64_t k, int dt) {
    if (dt == DT_F32) return ((const float*)wp)[((n / 8) * K2 + k) * 8 + n % 8];
    if (dt == DT_F16) return f16_to_f32(((const uint16_t*)wp)[((n / 8) * K2 + k) * 8 + n % 8]);
    return bf16_to_f32(((const uint16_t*)wp)[((n / 8) * K2 + (k & ~(int64_t)1)) * 8 + (n % 8) * 2 + (k & 1)]);
}

/* where a W_Q8 weight's scales start, in bytes from its first panel (a cache line after the panels) */
static inline int64_t q8_scales_at(int64_t P, int64_t K2) { return (P * K2 * 8 + 63) / 64 * 64; }

/* W_Q8T: int8 weights whose inputs are quantized to int8 token by token first (torchao's
 * Int8DynamicActivationInt8WeightConfig): a W_Q8 weight laid out for fp32 calls (K2 = K) with unit
 * scales, then, from byte q8t_scales_at(P, K), P * 8 fp32 column scales (the library's, not rounded;
 * zeros past N) and two int32, the codes' range qmin and qmax. Any call dtype dt: each row of x is
 * quantized (quantize_rows_i8: codes c, the row's scale r), the W_Q8 linear of the codes in fp32 sums
 * the integers exactly (while the sums stay under 2^24), and output n of that row is torchao's
 *   rnd(rnd(s * r) * scale[n] + bias[n])
 * with each product and sum rounded to fp32 and rnd to dt, the bias widened. */
static inline int64_t q8t_scales_at(int64_t P, int64_t K) { return q8_scales_at(P, K) + P * 8 * 4; }

/* W_Q8B: bitsandbytes' LLM.int8 (`load_in_8bit`), each row as bitsandbytes computes a call of that
 * row alone (int8_rows.c). The weight is read where the library keeps it, not packed: `w` points to a
 * q8b_weight naming the library's int8 codes [N][K] (row-major, one output's K codes together), its
 * fp32 column scales [N] (bitsandbytes' SCB: each output's largest weight magnitude), each output's
 * sum of codes (int32, made once by cpu.kernels.pack_q8b, for level 2's unsigned products) and the
 * outlier threshold (rounded to fp16, as torch compares an fp16 tensor with it; <= 0: none).
 * Any call dtype dt. Row m of x is cast to fp16, a = f16(x[m][k]); its outliers are the k with
 * |a| >= threshold; the others give the row's statistic r = max |a| (NaN if any is NaN) and codes
 * c_k = rint(a * ((1 / r) * 127)) in fp32 (torch's 127.0 / r is a reciprocal and a product), NaN made
 * 0 (an outlier's code 0). Output n is then
 *   y = rnd((float)s * (r * scale[n]) * 6.200124e-05f + bias[n])
 * s being the exact int32 sum of c_k * w[n][k] (bitsandbytes' int8 matmul and its int8_mm_dequant,
 * in fp32), and then, for each outlier column j of the row in increasing order,
 *   y = rnd(y + rnd(x[m][j] * rnd((float)w[n][j] * scale[n] * 7.874015718698502e-3f)))
 * (the column's weight dequantized to dt, times the row's input as it came, added in dt). The sums
 * of integers are exact in any order, so each level may sum them its own way. */
typedef struct {
    const int8_t* codes;
    const float* scales;
    const int32_t* code_sums;
    float threshold;
    int32_t pad;
} q8b_weight;
#define Q8B_KPAD 64 /* a row of codes is padded with zeros to a multiple of this (one AVX-512 load) */

/* W_Q8B's quantizing, one value (ops.q8b_row: the portable loops and the vector code's tails): v cast
 * to fp16 and back (a NaN kept), whether that is an outlier, and its code given the row's scale
 * (1 / r) * 127: an outlier's 0, and a NaN's (a NaN input, or 0 * inf where the row is all zeros) */
static inline float q8b_half(float v) { return v != v ? v : rnd_f16(v); }
static inline int q8b_outlier(float a, float threshold) { return threshold > 0.0f && fabsf(a) >= threshold; }
static inline int8_t q8b_code(float a, float scale, float threshold) {
    float c = rintf(a * scale);
    return q8b_outlier(a, threshold) || c != c ? 0 : (int8_t)c;
}

/* A W_Q4 weight's dequantization, with f = q - offset (exact) and rnd the call's dtype (cpu_kernels.h, rnd):
 *   Q4_MUL_SUB: rnd(rnd(f * s) - z)  (quanto's plain form: scale * data, then minus the shift, each
 *               rounded to the dtype; offset 0)
 *   Q4_FMA:     fma(f, s, z)         (tinygemm's form: (q - 8) * scale + zero in fp32, rounded once,
 *               whatever the dtype; offset 8)
 *   Q4_LUT:     rnd(lut[q] * s)      (bitsandbytes' 4-bit: the codebook's value times the block's
 *               fp32 absmax, in fp32, rounded to the dtype; the shifts unused)
 *   Q4_SUB_MUL_F16: rnd(rnd_f16((f - z) * s))  (GPTQ as gptqmodel dequantizes it for fp32 calls:
 *               the code less the group's zero, times its fp16 scale, rounded to fp16, widened;
 *               offset 0)
 *   Q4_SUB_MUL: rnd((f - z) * s)     (compressed-tensors' int4: the signed code less the group's zero
 *               point, times the scale, rounded once to the dtype; offset 8) */
enum { Q4_MUL_SUB = 0, Q4_FMA = 1, Q4_LUT = 2, Q4_SUB_MUL_F16 = 3, Q4_SUB_MUL = 4 };
typedef struct {
    int32_t group; /* G */
    int32_t form;
    float offset;
    int32_t pad[13];
    float lut[16]; /* Q4_LUT's codebook, code q's value at q */
} q4_meta;

/* the bytes a W_Q4 (4) or W_Q8G (8) panel holds for each k: 8 columns' codes */
static inline int64_t q4_kbytes(int64_t wkind) { return wkind == W_Q8G ? 8 : 4; }

/* the byte of a W_Q4K weight (K values a column) holding column n's code at k, and the nibble (0 low) */
static inline int64_t q4k_byte(int64_t K, int64_t n, int64_t k, int* high) {
    *high = (k / 16) & 1;
    return ((n / 4) * (K / Q4K_BLOCK) + k / Q4K_BLOCK) * 64 + (n % 4) * 16 + k % 16;
}

/* where the q4_meta of a weight with panels of kb bytes a k starts (a cache line after the panels) */
static inline int64_t q4_meta_at(int64_t P, int64_t K, int64_t kb) { return (P * K * kb + 63) / 64 * 64; }

/* the fp32 scale (then, at + 8, shift) of panel p's 8 columns for group g */
static inline const float* q4_scales(const void* wp, int64_t P, int64_t K, int64_t kb, int64_t p, int64_t g) {
    const q4_meta* m = (const q4_meta*)((const char*)wp + q4_meta_at(P, K, kb));
    return (const float*)(m + 1) + (p * (K / m->group) + g) * 16;
}

static inline float q4_value(int q, float s, float z, const q4_meta* m, int dt) {
    if (m->form == Q4_LUT) return rnd(m->lut[q] * s, dt);
    float f = (float)q - m->offset;
    if (m->form == Q4_SUB_MUL_F16) return rnd(rnd_f16((f - z) * s), dt);
    if (m->form == Q4_SUB_MUL) return rnd((f - z) * s, dt);
    if (m->form == Q4_FMA) return fmaf(f, s, z);
    return rnd(rnd(f * s, dt) - z, dt);
}

/* Calls of more than 9 rows (a batch's verify step, a prompt chunk) go in blocks of rows: fp32 in
 * blocks of MANY_ROWS rows, each over MANY_PANELS panels and MANY_KBLOCK values at a time, so that
 * the panels' block stays in L1 while every row block passes over it (a chain cut there goes on
 * from its stored sums, bitwise); bf16 and fp16 in blocks of up to 9 rows over one panel, since each 16-bit
 * pass widens the panel again and passes of 3 x 3 over 3 panels were slower (docs/results.md, "CPU
 * verify steps: the bound, and the ideas tried"). x too goes in blocks of rows (x_block), which was
 * faster at 16 and 40 fp32 rows than one [K][M] block (docs/results.md, "Packed linears: weights
 * packed by output column"). */
#define MANY_PANELS 3
#define MANY_ROWS 4
#define MANY_KBLOCK 128
#define MANY_BLOCK_ROWS 64 /* rows whose sums one pass over the panels keeps (a multiple of 4) */

/* x goes to the tiles transposed in blocks of this many rows, [blocks][K2][B] (the last block fewer
 * rows), so that a pass over one block reads its x values as one stream: all M rows as one block
 * up to 9 rows, else the rows of a fp32 pass (MANY_ROWS) or of a 16-bit one (at most 9, the blocks as even
 * as they come: 10 rows as 5 + 5 rather than 9 + 1, whose 1-row pass is one FMA chain at a time) */
static inline int64_t x_block(int64_t M, int64_t dt) {
    if (M <= 9) return M;
    if (dt == DT_F32) return MANY_ROWS;
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

/* row m's values [k, K) into xm (ld apart), widened, then zeros up to K2 (the rest of pack_x's work) */
static inline void x_row_rest(const void* x, int64_t m, int64_t K, int64_t K2, int dt, float* xm, int64_t ld,
                              int64_t k) {
    for (; k < K; k++) xm[k * ld] = load1(x, m * K + k, dt);
    for (k = K; k < K2; k++) xm[k * ld] = 0.0f;
}

int64_t linears(const void* x, int64_t M, int64_t K, int64_t n, const void* const* w, const int64_t* wkind,
                const void* const* bias, void* const* out, const int64_t* N, int64_t dt, int64_t threads);
int64_t linears_q8b(const void* x, int64_t M, int64_t K, int64_t n, const void* const* w, const int64_t* wkind,
                    const void* const* bias, void* const* out, const int64_t* N, int64_t dt, int64_t threads);

/* ------------------------------------------------------------------ attention (attention.c) */

#define MAX_NH 3        /* query heads of a KV head whose scores and sums are computed together */
#define PASS_TOKENS 16  /* tokens of one sequence that share a pass over its keys */
#define KEY_BLOCK 24    /* keys of the shared span read by all of a pass's queries while in L1 (3 and 8 divide it) */
#define TILE_QUERIES 12 /* bf16 queries of a KV head from which the span goes by tiles (fewer: by head groups) */
/* Keys and values are rows of D values scattered over the pages (the other KV heads' rows lie in
 * between), a pattern the hardware prefetchers miss: each loop asks for the row KEY_AHEAD keys ahead. */
#define KEY_AHEAD 32

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

/* A pass (attention.c, attend_pass): tokens t_lo .. t_lo+nt-1 of one sequence, each with query heads
 * kvh * G + g_lo .. g_lo+ng-1 of the KV heads kvh = kv_lo .. kv_lo+nkv-1 (G = H / H_kv); nS keys all of
 * them see (the span), read once for all of them. */
typedef struct {
    const attend_job* J;
    int64_t t_lo, nt, kv_lo, nkv, g_lo, ng, HP, nS, D8;
    int64_t Ls[PASS_TOKENS], sbase[PASS_TOKENS], own_at[PASS_TOKENS + 1], pre[PASS_TOKENS];
    int64_t *krow, *kown, *vrow, *vown; /* element offsets of the span's and the own keys (all KV heads) */
    float *s, *qf, *o, *wide;           /* scores, fp32 queries, outputs, a block of fp32 rows */
    uint16_t* qb;                       /* bf16 scores by dot products (ops.scores_bf16): the queries' bf16 bits */
    const float** span_q;               /* per KV head nt * ng queries (token-major): vectors D8 long, */
    float **span_s, **span_o;           /* their score rows from the span's first key, output rows */
    int tiles;                          /* the span by tiles (ops.tile_scores, ops.tile_values) */
} pass_t;

/* ------------------------------------------------------------------ the dispatch table */

/* s[h * ld + j] = dot(q[h], key j) for NH (the table's index, 1 .. MAX_NH) fp32 query vectors qs apart
 * against L keys at element offsets rows[j] of kb (fp32, or bf16 when bf16): 8 lanes over D (lane l:
 * d = l, l + 8, ...), each an FMA chain, then sum8's tree; npf: how many of the keys to prefetch ahead */
typedef void (*scores_fn)(const float* q, const void* kb, const int64_t* rows, int64_t L, int64_t D, int64_t qs,
                          int bf16, float* s, int64_t ld, int64_t npf);
/* the same from bf16 queries (their bits, D apart) over bf16 keys, in the order of a dot-product
 * instruction */
typedef void (*scores_bf16_fn)(const uint16_t* q, const void* kb, const int64_t* rows, int64_t L, int64_t D,
                               float* s, int64_t ld, int64_t npf);
/* o[h * Dv + d] += p[h * ld + j] * value_j[d] for j = 0 .. L-1 in order, one FMA each, NH heads */
typedef void (*wsum_fn)(const float* p, int64_t ld, const void* vb, const int64_t* rows, int64_t L, int64_t Dv,
                        int bf16, float* o, int64_t npf);

/* The kernels of one SIMD level; the portable code calls them through `ops` and tests no level
 * itself. An entry a level lacks is NULL (said at each). */
typedef struct {
    int level;
    /* linears: x [M, K] into the tiles' transposed blocks (x_block), and the outputs of panels
     * [p_lo, p_hi) of a packed linear of weight kind wkind, every row (linear.c says what they compute;
     * for W_Q4K, xt is x's rows as they are, fp32) */
    void (*pack_x)(const void* x, int64_t M, int64_t K, int64_t K2, int64_t dt, float* xt);
    void (*linear_range)(const float* xt, int64_t M, const void* wp, int64_t wkind, int64_t K2, const void* bias,
                         int64_t p_lo, int64_t p_hi, void* out, int64_t N, int64_t dt);
    /* W_Q8B's integer sums: sums[m * ld + n] = sum over k < K of xq[m * Kp + k] * w[n * K + k], exactly
     * (int32), for rows m < M and outputs n in [n_lo, n_hi); xq's rows padded with zeros to Kp (a
     * multiple of Q8B_KPAD); code_sums[n] the sum of w's row n (level 2 multiplies unsigned codes) */
    void (*i8_dots)(const int8_t* xq, int64_t M, int64_t Kp, const int8_t* w, const int32_t* code_sums, int64_t K,
                    int64_t n_lo, int64_t n_hi, int32_t* sums, int64_t ld);
    /* W_Q8B's quantizing of row m of x [M, K] (dtype dt) as bitsandbytes does it alone: its codes into
     * q (Kp values, zeros past K), its statistic into *r, its outlier columns in increasing order into
     * cols (room for K); returns how many */
    int64_t (*q8b_row)(const void* x, int64_t m, int64_t K, int64_t Kp, int64_t dt, float threshold, int8_t* q,
                       float* r, int32_t* cols);
    /* a weight [N, K] into packed panels [p_lo, p_hi), or back when unpack (pack.c says the moves) */
    void (*pack_range)(const void* w, void* packed, int64_t N, int64_t K, int64_t dt, int64_t unpack, int64_t p_lo,
                       int64_t p_hi);
    /* attention: scores and weighted sums by the number of heads (index NH, 1 .. MAX_NH), and the
     * softmax of a row of scores after multiplying them by scale */
    scores_fn scores[MAX_NH + 1];
    wsum_fn wsum[MAX_NH + 1];
    void (*softmax)(float* s, int64_t L, float scale);
    /* bf16 scores by dot products, replacing scores[] for bf16 pages (NULL: scores[] reads them) */
    scores_bf16_fn scores_bf16[MAX_NH + 1];
    /* a pass's span by blocks of KEY_BLOCK keys widened to fp32 rows against tiles of queries, for
     * bf16 pages with TILE_QUERIES or more queries to a KV head; the same bits as scores[] and
     * wsum[] (NULL: the span by head groups) */
    void (*tile_scores)(const pass_t* P);
    void (*tile_values)(const pass_t* P);
    /* norms and the decoder layers' elementwise arithmetic (layers.c, elementwise.h) */
    void (*rms_rows)(const void* x, int64_t m_lo, int64_t m_hi, int64_t K, const void* w, float eps, int64_t form,
                     void* out, int b16);
    void (*add_into)(void* x, const void* y, int64_t n, int b16);
    void (*mul_to)(void* out, const void* a, const void* b, int64_t n, int b16);
    void (*rope)(void* x, int64_t T, int64_t nh, int64_t D, const void* cos, const void* sin, int b16);
} kernel_ops;

extern kernel_ops ops; /* module.c: the level's kernels, set between calls, never during one */

/* ------------------------------------------------------------------ each level's kernels */

/* portable C (level 0) */
void pack_x_c(const void* x, int64_t M, int64_t K, int64_t K2, int64_t dt, float* xt);
void linear_range_c(const float* xt, int64_t M, const void* wp, int64_t wkind, int64_t K2, const void* bias,
                    int64_t p_lo, int64_t p_hi, void* out, int64_t N, int64_t dt);
/* output n of one row of a packed linear of N columns (not W_Q4K, whose chains go along k), as every
 * level computes it: the chain over k of the packed weights and xm (the row widened, K2 values, ld
 * apart), W_Q8's scaling, the bias, the rounding to dt */
float linear_output_c(const float* xm, int64_t ld, const void* wp, int64_t wkind, int64_t K2, const void* bias,
                      int64_t N, int64_t n, int dt);
void pack_range_c(const void* w, void* packed, int64_t N, int64_t K, int64_t dt, int64_t unpack, int64_t p_lo,
                  int64_t p_hi);
void i8_dots_c(const int8_t* xq, int64_t M, int64_t Kp, const int8_t* w, const int32_t* code_sums, int64_t K,
               int64_t n_lo, int64_t n_hi, int32_t* sums, int64_t ld);
int64_t q8b_row_c(const void* x, int64_t m, int64_t K, int64_t Kp, int64_t dt, float threshold, int8_t* q, float* r,
                  int32_t* cols);
extern const scores_fn scores_c[MAX_NH + 1];
extern const wsum_fn wsum_c[MAX_NH + 1];
void softmax_c(float* s, int64_t L, float scale);
void rms_rows_c(const void* x, int64_t m_lo, int64_t m_hi, int64_t K, const void* w, float eps, int64_t form,
                void* out, int b16);
void add_into_c(void* x, const void* y, int64_t n, int b16);
void mul_to_c(void* out, const void* a, const void* b, int64_t n, int b16);
void rope_c(void* x, int64_t T, int64_t nh, int64_t D, const void* cos, const void* sin, int b16);

#if HAVE_X86_KERNELS
/* AVX2 + FMA (level 1 and up; arch/x86) */
void pack_x_avx2(const void* x, int64_t M, int64_t K, int64_t K2, int64_t dt, float* xt);
void linear_range_avx2(const float* xt, int64_t M, const void* wp, int64_t wkind, int64_t K2, const void* bias,
                       int64_t p_lo, int64_t p_hi, void* out, int64_t N, int64_t dt);
/* a tile's sums o [mb][np * 8] of panels p.. to out's rows m0.. (+ bias, rounded to dt) */
void packed_store_avx2(const float* o, int mb, int np, int64_t m0, int64_t p, const void* bias, void* out, int64_t N,
                       int dt);
/* a W_Q8 tile's sums o [mb][np * 8] of panels p.. scaled in place by the panels' column scales */
void q8_scale_avx2(float* o, int mb, int np, int64_t p, const float* scales, int dt);
void pack_range_avx2(const void* w, void* packed, int64_t N, int64_t K, int64_t dt, int64_t unpack, int64_t p_lo,
                     int64_t p_hi);
void i8_dots_avx2(const int8_t* xq, int64_t M, int64_t Kp, const int8_t* w, const int32_t* code_sums, int64_t K,
                  int64_t n_lo, int64_t n_hi, int32_t* sums, int64_t ld);
int64_t q8b_row_avx2(const void* x, int64_t m, int64_t K, int64_t Kp, int64_t dt, float threshold, int8_t* q,
                     float* r, int32_t* cols);
extern const scores_fn scores_avx2[MAX_NH + 1];
extern const wsum_fn wsum_avx2[MAX_NH + 1];
void softmax_avx2(float* s, int64_t L, float scale);
void tile_scores_avx2(const pass_t* P);
void tile_values_avx2(const pass_t* P);
void rms_rows_avx2(const void* x, int64_t m_lo, int64_t m_hi, int64_t K, const void* w, float eps, int64_t form,
                   void* out, int b16);
void add_into_avx2(void* x, const void* y, int64_t n, int b16);
void mul_to_avx2(void* out, const void* a, const void* b, int64_t n, int b16);
void rope_avx2(void* x, int64_t T, int64_t nh, int64_t D, const void* cos, const void* sin, int b16);
#endif
#if HAVE_AVX512BF16_KERNELS
/* AVX-512 BF16 (level 2's bf16 scores, arch/x86/attention_avx512bf16.c; its W_Q4, W_Q8G and W_Q8 tiles,
 * arch/x86/linear_avx512.c) */
extern const scores_bf16_fn scores_dpbf16[MAX_NH + 1];
void linear_range_avx512(const float* xt, int64_t M, const void* wp, int64_t wkind, int64_t K2, const void* bias,
                         int64_t p_lo, int64_t p_hi, void* out, int64_t N, int64_t dt);
/* W_Q8B's sums by AVX-512 VNNI's unsigned-by-signed byte products (arch/x86/int8_rows_avx.c) */
void i8_dots_vnni(const int8_t* xq, int64_t M, int64_t Kp, const int8_t* w, const int32_t* code_sums, int64_t K,
                  int64_t n_lo, int64_t n_hi, int32_t* sums, int64_t ld);
#endif

/* ------------------------------------------------------------------ threads (threads.c) */

typedef void (*task_fn)(void* ctx, int64_t part);

/* fn(ctx, p) for p = 0 .. parts-1 on up to `threads` threads, the caller one of them */
void run_parallel(task_fn fn, void* ctx, int64_t parts, int64_t threads);
void pool_after_fork_child(void);

#pragma GCC visibility pop

/* ------------------------------------------------------------------ entry points (ctypes) */

EXPORT int64_t linear(const void* x, int64_t M, const void* w, int64_t wkind, int64_t K, const void* bias, int64_t N,
                      void* out, int64_t dt, int64_t threads);
EXPORT void quantize_rows_i8(const void* x, int64_t M, int64_t K, int64_t dt, int64_t qmin, int64_t qmax, float* q,
                             float* scale);
EXPORT void pack_weight(const void* w, int64_t N, int64_t K, int64_t dt, void* packed, int64_t unpack,
                        int64_t threads);
EXPORT int64_t attend(const void* q, int64_t T, int64_t H, int64_t D, int64_t Dv, const void* k_cache,
                      const void* v_cache, int64_t H_kv, const int64_t* kv_slots, int64_t Lk, const int64_t* seq,
                      const int64_t* run_lo, const int64_t* run_hi, const int64_t* extra_off, const int64_t* extra,
                      float scale, float softcap, void* out, int64_t bf16, int64_t threads);
EXPORT int64_t rms_norm(const void* x, int64_t M, int64_t K, const void* w, float eps, int64_t form, void* out,
                        int64_t bf16, int64_t threads);
EXPORT int64_t layer_phases(int64_t on, int64_t* out);
/* head screen (head_screen.c): a greedy step's token without the whole LM head. The screen of a W_FLOAT
 * head w [N, K] (K2 its values a column) is a W_Q8 weight for fp32 calls: per output n the scale
 * s_n = max_k |w_nk| / 127 and the codes q_nk = rint(w_nk * (127 / max_k |w_nk|)) (0 where s_n is 0), and the coefficient
 *   D_n >= |e_n|_2 + g (|w_n|_2 + s_n |q_n|_2),  e_n = w_n - s_n q_n,  g = G / (1 - G),  G = (K2 + 2) 2^-24.
 * For a row x of the head's input, let T_n be the head's own output n before its rounding to dt: the
 * FMA chain over k plus the bias (linear.c), and a_n the screen's output (the W_Q8 chain over the codes
 * times s_n, in fp32). Then
 *   |T_n - (a_n + bias_n)| <= |x|_2 D_n + 4 2^-24 (|a_n| + |a_n + bias_n| + |x|_2 D_n) =: B_n
 * (screen_pick widens it by margins that also cover its own fp32 arithmetic): T_n - a_n - bias_n is the quantization
 * error's product sum_k e_nk x_k, at most |x|_2 |e_n|_2 (Cauchy-Schwarz), plus both chains' rounding
 * errors, each at most g times the sum of the products' magnitudes (Higham's bound for a recursive sum:
 * G bounds a chain of K2 roundings, two more than the scaling and the bias), and the scaling's and
 * the bias's roundings, a unit each of their results. The head's logit rnd(T_n) lies in
 * [rnd(lo_n), rnd(hi_n)], lo_n <= a_n + bias_n - B_n and hi_n >= a_n + bias_n + B_n, as rounding to dt is
 * monotone; so any output whose logit equals the largest has rnd(hi_n) >= max_j rnd(lo_j). Those outputs
 * (and a few more, the test being made in fp32 with a unit of dt's precision to spare) are the
 * candidates, and their exact chains decide the first largest. */
EXPORT int64_t screen_pack(const void* head, int64_t N, int64_t K, int64_t dt, int8_t* codes, float* D,
                           int64_t threads);
EXPORT void screen_pick(const void* x, int64_t M, int64_t K, const float* a, int64_t N, const float* D,
                        const void* bias, int64_t dt, int64_t cap, int64_t* cand, int64_t* count, int64_t threads);
EXPORT int64_t screen_exact(const void* x, int64_t M, int64_t K, const void* head, int64_t N, const void* bias,
                            int64_t dt, const int64_t* cand, const int64_t* count, int64_t cap, int64_t* tokens);
EXPORT int64_t uses_avx2(void);
EXPORT int64_t simd_level(void);
EXPORT int64_t set_simd_level(int64_t level);
/* layer_attention and layer_mlp: layers.c, with their structs */

#endif
