/* Linears: out [M, N] = x @ w^T (+ bias) over packed weights, every output one FMA chain over k in
 * order (cpu_kernels.h says the packing and the arithmetic). Each weight is read from memory once per
 * call, for all rows: a step of 5 tokens streams the weights as a step of 1 does. bf16 and fp16
 * weights and inputs are widened exactly (a bf16 is the high half of an fp32; every fp16 is an fp32).
 *
 * This file holds the portable loop (level 0) and the call's work split over the threads; the tiles
 * that compute the same bits with vectors are in arch/x86/linear_avx2.c. */
#include "cpu_kernels.h"

#include <stdlib.h>

/* x [M, K] (fp32, or bf16 or fp16 widened) into xt, transposed in blocks of rows (x_block), K2 values
 * a row (zeros past K) */
void pack_x_c(const void* x, int64_t M, int64_t K, int64_t K2, int64_t dt, float* xt) {
    int64_t B = x_block(M, dt);
    for (int64_t m = 0; m < M; m++) {
        int64_t ld, at = x_at(M, B, K2, m, &ld);
        x_row_rest(x, m, K, K2, (int)dt, xt + at, ld, 0);
    }
}

/* the weight of output column n at value k of a packed linear of N columns (of W_Q8: the integer,
 * widened; of W_Q4 and W_Q8G: the dequantized value) */
static inline float packed_w(const void* wp, int64_t wkind, int64_t K2, int64_t N, int64_t n, int64_t k, int dt) {
    if (wkind == W_Q8) return (float)((const int8_t*)wp)[((n / 8) * K2 + k) * 8 + n % 8];
    if (wkind == W_Q4 || wkind == W_Q8G || wkind == W_Q4K) {
        int64_t P = (N + 7) / 8, kb = q4_kbytes(wkind);
        const q4_meta* m = (const q4_meta*)((const char*)wp + q4_meta_at(P, K2, kb));
        const float* sz = q4_scales(wp, P, K2, kb, n / 8, k / m->group);
        int q, high;
        if (wkind == W_Q8G) q = ((const uint8_t*)wp)[((n / 8) * K2 + k) * 8 + n % 8];
        else if (wkind == W_Q4K) {
            uint8_t byte = ((const uint8_t*)wp)[q4k_byte(K2, n, k, &high)];
            q = high ? byte >> 4 : byte & 15;
        } else {
            uint8_t byte = ((const uint8_t*)wp)[((n / 8) * (K2 / 2) + k / 2) * 8 + n % 8];
            q = k & 1 ? byte >> 4 : byte & 15;
        }
        return q4_value(q, sz[n % 8], sz[8 + n % 8], m, dt);
    }
    return float_w(wp, K2, n, k, dt);
}

/* a W_Q8 weight's chain s of output n, scaled (cpu_kernels.h): rnd(rnd(s) * scale[n]) */
static inline float q8_scaled(const void* wp, int64_t K2, int64_t N, int64_t n, float s, int dt) {
    const float* scale = (const float*)((const char*)wp + q8_scales_at((N + 7) / 8, K2));
    return rnd(rnd(s, dt) * scale[n], dt);
}

/* linear_range_c for a W_Q4K weight (cpu_kernels.h): x's rows as they are (fp32), each output 16
 * chains over k, then their sum */
static void linear_range_q4k_c(const float* x, int64_t M, const void* wp, int64_t K, const void* bias, int64_t p_lo,
                               int64_t p_hi, void* out, int64_t N, int dt) {
    for (int64_t n = p_lo * 8; n < p_hi * 8 && n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc[16] = {0}, t[8];
            for (int64_t k = 0; k < K; k++)
                acc[k % 16] = fmaf(packed_w(wp, W_Q4K, K, N, n, k, dt), x[m * K + k], acc[k % 16]);
            for (int i = 0; i < 8; i++) t[i] = acc[i] + acc[i + 8];
            float s = sum8(t);
            if (bias) s += load1(bias, n, dt);
            store1(out, m * N + n, s, dt);
        }
}

/* out [M, N] = x @ w^T (+ bias) for the columns of panels [p_lo, p_hi) (8 columns a panel), every row:
 * xt is x transposed in blocks of rows (x_block), fp32 (for W_Q4K: x's rows as they are, fp32); w is
 * packed, of kind wkind, K2 its values a column (K, or K rounded up to even for bf16); bias and out
 * are of the call's dtype dt, and so is a W_FLOAT w. One output at a time. */
void linear_range_c(const float* xt, int64_t M, const void* wp, int64_t wkind, int64_t K2, const void* bias,
                    int64_t p_lo, int64_t p_hi, void* out, int64_t N, int64_t dt) {
    if (wkind == W_Q4K) {
        linear_range_q4k_c(xt, M, wp, K2, bias, p_lo, p_hi, out, N, (int)dt);
        return;
    }
    int64_t B = x_block(M, dt);
    for (int64_t n = p_lo * 8; n < p_hi * 8 && n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            int64_t ld;
            const float* xm = xt + x_at(M, B, K2, m, &ld);
            store1(out, m * N + n, linear_output_c(xm, ld, wp, wkind, K2, bias, N, n, (int)dt), (int)dt);
        }
}

float linear_output_c(const float* xm, int64_t ld, const void* wp, int64_t wkind, int64_t K2, const void* bias,
                      int64_t N, int64_t n, int dt) {
    float s = 0.0f;
    for (int64_t k = 0; k < K2; k++) s = fmaf(packed_w(wp, wkind, K2, N, n, k, dt), xm[k * ld], s);
    if (wkind == W_Q8) s = q8_scaled(wp, K2, N, n, s, dt);
    if (bias) s += load1(bias, n, dt);
    return rnd(s, dt);
}

/* panels (8 output columns each) per unit of work: a thread reads a unit's panels as one stream, and
 * units of 96 columns rather than 48 made SmolLM2's linears faster at 5 and 9 rows with the tiles
 * before the packed ones (docs/measurements/cpu-avx512-2026-11-25-layers/NOTES.md) */
#define BLOCK_P 12
#define MAX_LINEARS 3 /* linears of one input run as one job (a layer's q, k and v; its gate and up) */

typedef struct {
    const float* xt;
    int64_t M, K2, dt, n;
    const void *w[MAX_LINEARS], *bias[MAX_LINEARS];
    int64_t wkind[MAX_LINEARS];
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
    ops.linear_range(j->xt, j->M, j->w[i], j->wkind[i], j->K2, j->bias[i], p_lo, p_hi, j->out[i], j->N[i], j->dt);
}

static int64_t linears_q8t(const void* x, int64_t M, int64_t K, int64_t n, const void* const* w, const int64_t* wkind,
                           const void* const* bias, void* const* out, const int64_t* N, int64_t dt, int64_t threads);

/* out_i [M, N_i] = x [M, K] @ w_i^T (+ bias_i [N_i]) for the n (<= MAX_LINEARS) linears of one input, w_i
 * packed, of kind wkind_i (NULL: all W_FLOAT), in one parallel job; all of them of dtype dt (DT_F32,
 * DT_BF16, DT_F16); a bias may be NULL. Returns 0, or -1 when scratch memory could not be had. */
int64_t linears(const void* x, int64_t M, int64_t K, int64_t n, const void* const* w, const int64_t* wkind,
                const void* const* bias, void* const* out, const int64_t* N, int64_t dt, int64_t threads) {
    int64_t rows_kind = 0; /* how many are W_Q4K, whose tiles read x's rows as they are */
    for (int64_t i = 0; wkind && i < n; i++) {
        if (wkind[i] == W_Q8T) return linears_q8t(x, M, K, n, w, wkind, bias, out, N, dt, threads);
        if (wkind[i] == W_Q8B) return linears_q8b(x, M, K, n, w, wkind, bias, out, N, dt, threads);
        rows_kind += wkind[i] == W_Q4K;
    }
    if (rows_kind && rows_kind < n) { /* (not so in a model: one quantizer makes all of a layer's linears) */
        int64_t failed = 0;
        for (int64_t i = 0; i < n && !failed; i++) failed = linears(x, M, K, 1, w + i, wkind + i, bias + i, out + i, N + i, dt, threads);
        return failed;
    }
    int64_t K2 = dt == DT_BF16 ? K + (K & 1) : K;
    float* xt = NULL; /* x transposed in blocks (x_block), or for W_Q4K its rows, widened and padded once
                       * for every tile (fp32 1-row x, and fp32 x for W_Q4K, is its own) */
    if (rows_kind ? dt != DT_F32 : M > 1 || dt != DT_F32) {
        xt = (float*)malloc((size_t)(M * K2) * sizeof(float));
        if (!xt) return -1;
        if (rows_kind) /* (a row alone is its own block: pack_x of one row widens it as it is) */
            for (int64_t m = 0; m < M; m++) ops.pack_x((const char*)x + m * K * 2, 1, K, K2, dt, xt + m * K2);
        else
            ops.pack_x(x, M, K, K2, dt, xt);
    }
    linear_job j = {xt ? xt : (const float*)x, M, K2, dt, n};
    j.first[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        j.w[i] = w[i], j.wkind[i] = wkind ? wkind[i] : W_FLOAT, j.bias[i] = bias[i], j.out[i] = out[i], j.N[i] = N[i];
        j.first[i + 1] = j.first[i] + ((N[i] + 7) / 8 + BLOCK_P - 1) / BLOCK_P;
    }
    run_parallel(linear_part, &j, j.first[n], threads);
    free(xt);
    return 0;
}

/* `linears` where some weights are W_Q8T (cpu_kernels.h): each of those one at a time, on x's codes
 * (quantized once for each range of codes), its fp32 sums then scaled as torchao does; the others
 * each as `linears` runs them. */
static int64_t linears_q8t(const void* x, int64_t M, int64_t K, int64_t n, const void* const* w, const int64_t* wkind,
                           const void* const* bias, void* const* out, const int64_t* N, int64_t dt, int64_t threads) {
    int64_t most = 0, failed = 0, range[2] = {1, 0}; /* the range x's codes are of (none yet) */
    for (int64_t i = 0; i < n; i++) most = N[i] > most ? N[i] : most;
    float *q = (float*)malloc((size_t)(M * K) * sizeof(float)), *r = (float*)malloc((size_t)M * sizeof(float));
    float* sums = (float*)malloc((size_t)(M * most) * sizeof(float));
    for (int64_t i = 0; i < n && !failed; i++) {
        if (wkind[i] != W_Q8T) {
            failed = linears(x, M, K, 1, w + i, wkind + i, bias + i, out + i, N + i, dt, threads);
            continue;
        }
        if (!q || !r || !sums) {
            failed = -1;
            break;
        }
        int64_t P = (N[i] + 7) / 8, kind = W_Q8;
        const float* scale = (const float*)((const char*)w[i] + q8t_scales_at(P, K));
        const int32_t* codes = (const int32_t*)(scale + P * 8);
        if (codes[0] != range[0] || codes[1] != range[1]) {
            quantize_rows_i8(x, M, K, dt, codes[0], codes[1], q, r);
            range[0] = codes[0], range[1] = codes[1];
        }
        const void* b = NULL;
        void* o = sums;
        failed = linears(q, M, K, 1, w + i, &kind, &b, &o, N + i, DT_F32, threads);
        for (int64_t m = 0; m < M && !failed; m++)
            for (int64_t c = 0; c < N[i]; c++) {
                float y = rnd(sums[m * N[i] + c] * r[m], (int)dt) * scale[c];
                if (bias[i]) y += load1(bias[i], c, (int)dt);
                store1(out[i], m * N[i] + c, y, (int)dt);
            }
    }
    free(q), free(r), free(sums);
    return failed;
}

/* out [M, N] = x @ w^T (+ bias [N]), w packed, of kind wkind; x, bias, out and a W_FLOAT w of dtype dt;
 * bias may be NULL. Returns 0, or -1 when scratch memory could not be had. */
int64_t linear(const void* x, int64_t M, const void* w, int64_t wkind, int64_t K, const void* bias, int64_t N,
               void* out, int64_t dt, int64_t threads) {
    return linears(x, M, K, 1, &w, &wkind, &bias, &out, &N, dt, threads);
}

/* Per-row symmetric int8 quantization of x [M, K] (dtype dt), torchao's for a linear's activations
 * (choose_qparams_affine and quantize_affine, SYMMETRIC, one block a row): a row's scale is its
 * largest magnitude (taking 0 in) over half the range, (qmax - qmin) / 2, divided in fp32 and rounded to
 * dt, then at least 2^-23 (fp32's epsilon); its codes are x * (1 / scale) in fp32, rounded half to even
 * and clamped to [qmin, qmax]. q [M, K] gets the codes as fp32 integers (the input of a W_Q8 linear whose
 * sums of integers are then exact while they stay under 2^24), scale [M] the scales, widened to fp32.
 * A NaN in a row makes its scale NaN, as torch's min and max pass it on.
 *
 * Example: x = [[15.9375, -1.0625, 0.0625, 0.1875]] (fp32), qmin -128, qmax 127: scale 15.9375 / 127.5
 * = 0.125, so codes x * 8 rounded half to even: [127 (128 clamped), -8, 0, 2]. */
void quantize_rows_i8(const void* x, int64_t M, int64_t K, int64_t dt, int64_t qmin, int64_t qmax, float* q,
                      float* scale) {
    const float half = (float)(qmax - qmin) / 2.0f, eps = 0x1p-23f;
    for (int64_t m = 0; m < M; m++) {
        float lo = 0.0f, hi = 0.0f, r;
        int nan = 0;
        for (int64_t k = 0; k < K; k++) {
            float v = load1(x, m * K + k, (int)dt);
            nan |= v != v;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        float s = rnd((-lo > hi ? -lo : hi) / half, (int)dt);
        s = nan ? NAN : s < eps ? eps : s;
        scale[m] = s;
        r = 1.0f / s;
        for (int64_t k = 0; k < K; k++) {
            float c = rintf(load1(x, m * K + k, (int)dt) * r);
            q[m * K + k] = c < (float)qmin ? (float)qmin : c > (float)qmax ? (float)qmax : c;
        }
    }
}
