/* W_Q8B linears: bitsandbytes' LLM.int8 with each row's outliers its own (cpu_kernels.h says the
 * arithmetic). bitsandbytes takes a column out of the int8 product for every row of a call when any
 * row holds an outlier there, so its result for a row depends on the call's other rows; here each row
 * is quantized and summed as bitsandbytes' call of that row alone does it, whatever else the step holds.
 *
 * A call quantizes x's rows once (portable, O(M K)), then the outputs go in blocks over the threads:
 * each block's exact integer sums (ops.i8_dots: the level's own way, since sums of integers do not
 * depend on their order), then bitsandbytes' scaling, the bias and each row's outlier columns. The
 * codes are read where bitsandbytes keeps them: nothing is packed, so they are held once. */
#include "cpu_kernels.h"

#include <stdlib.h>

#define Q8B_BLOCK 32 /* outputs per unit of work */

/* ops.q8b_row (cpu_kernels.h), portable */
int64_t q8b_row_c(const void* x, int64_t m, int64_t K, int64_t Kp, int64_t dt, float threshold, int8_t* q, float* r,
                  int32_t* cols) {
    float most = 0.0f;
    int nan = 0;
    int64_t count = 0;
    for (int64_t k = 0; k < K; k++) { /* the outliers (their codes 0), and the largest of the rest */
        float a = fabsf(q8b_half(load1(x, m * K + k, (int)dt)));
        if (q8b_outlier(a, threshold)) {
            cols[count++] = (int32_t)k;
            continue;
        }
        nan |= a != a;
        most = a > most ? a : most;
    }
    *r = nan ? NAN : most;
    float scale = (1.0f / *r) * 127.0f; /* (torch's 127.0 / r: a reciprocal, then the product) */
    for (int64_t k = 0; k < K; k++) q[k] = q8b_code(q8b_half(load1(x, m * K + k, (int)dt)), scale, threshold);
    for (int64_t k = K; k < Kp; k++) q[k] = 0;
    return count;
}

#define Q8B_ROWS 8 /* rows quantized per unit of work */

typedef struct {
    const void* x;
    int64_t M, K, Kp, dt;
    float threshold;
    int8_t* q;
    float* r;
    int32_t* cols;  /* [M][K]: row m's outlier columns from m * K (only those pages are touched) */
    int64_t* count; /* [M] how many */
} q8b_rows_job;

static void q8b_rows_part(void* ctx, int64_t part) {
    const q8b_rows_job* j = (const q8b_rows_job*)ctx;
    for (int64_t m = part * Q8B_ROWS; m < (part + 1) * Q8B_ROWS && m < j->M; m++)
        j->count[m] = ops.q8b_row(j->x, m, j->K, j->Kp, j->dt, j->threshold, j->q + m * j->Kp, j->r + m,
                                  j->cols + m * j->K);
}

typedef struct {
    const void* x;
    int64_t M, K, Kp, N, dt;
    const q8b_weight* w;
    const void* bias;
    void* out;
    const int8_t* q;      /* [M][Kp] the rows' codes */
    const float* r;       /* [M] their statistics */
    const int64_t* count; /* [M] each row's outlier columns, */
    const int32_t* cols;  /* from cols + m * K */
    int32_t* sums;        /* [M][N] */
} q8b_job;

/* y[i] += bias[i] (widened from dt), for i < n: one loop per dtype, so that each vectorizes */
static void add_bias(float* y, const void* bias, int64_t n, int dt) {
    if (dt == DT_F32)
        for (int64_t i = 0; i < n; i++) y[i] += ((const float*)bias)[i];
    else if (dt == DT_BF16)
        for (int64_t i = 0; i < n; i++) y[i] += bf16_to_f32(((const uint16_t*)bias)[i]);
    else
        for (int64_t i = 0; i < n; i++) y[i] += f16_to_f32(((const uint16_t*)bias)[i]);
}

/* out[i] = y[i] rounded to dt, for i < n */
static void store_row(void* out, const float* y, int64_t n, int dt) {
    if (dt == DT_F32) memcpy(out, y, (size_t)n * sizeof(float));
    else if (dt == DT_BF16)
        for (int64_t i = 0; i < n; i++) ((uint16_t*)out)[i] = f32_to_bf16(y[i]);
    else
        for (int64_t i = 0; i < n; i++) ((uint16_t*)out)[i] = f32_to_f16(y[i]);
}

/* outputs [Q8B_BLOCK part, Q8B_BLOCK (part + 1)) of every row */
static void q8b_part(void* ctx, int64_t part) {
    const q8b_job* j = (const q8b_job*)ctx;
    const q8b_weight* w = j->w;
    int64_t n_lo = part * Q8B_BLOCK, n_hi = n_lo + Q8B_BLOCK < j->N ? n_lo + Q8B_BLOCK : j->N, nn = n_hi - n_lo;
    int dt = (int)j->dt, size = dt == DT_F32 ? 4 : 2;
    const float* scales = w->scales + n_lo;
    ops.i8_dots(j->q, j->M, j->Kp, w->codes, w->code_sums, j->K, n_lo, n_hi, j->sums, j->N);
    for (int64_t m = 0; m < j->M; m++) {
        float y[Q8B_BLOCK], r = j->r[m];
        const int32_t* s = j->sums + m * j->N + n_lo;
        for (int64_t i = 0; i < nn; i++) y[i] = (float)s[i] * (r * scales[i]) * 6.200124e-05f;
        if (j->bias) add_bias(y, (const char*)j->bias + n_lo * size, nn, dt);
        for (int64_t o = 0; o < j->count[m]; o++) { /* the row's outlier columns, in order, in dt */
            int64_t c = j->cols[m * j->K + o];
            float xc = load1(j->x, m * j->K + c, dt);
            for (int64_t i = 0; i < nn; i++) {
                float wc = rnd((float)w->codes[(n_lo + i) * j->K + c] * scales[i] * 7.874015718698502e-3f, dt);
                y[i] = rnd(rnd(y[i], dt) + rnd(xc * wc, dt), dt);
            }
        }
        store_row((char*)j->out + (m * j->N + n_lo) * size, y, nn, dt);
    }
}

/* `linears` where some weights are W_Q8B: each of those one at a time, over x's rows quantized once
 * for each threshold (rows in parallel); the others each as `linears` runs them. Returns 0, or -1
 * without scratch memory. */
int64_t linears_q8b(const void* x, int64_t M, int64_t K, int64_t n, const void* const* w, const int64_t* wkind,
                    const void* const* bias, void* const* out, const int64_t* N, int64_t dt, int64_t threads) {
    int64_t most = 0, failed = 0, Kp = (K + Q8B_KPAD - 1) / Q8B_KPAD * Q8B_KPAD;
    float quantized_at = NAN; /* the threshold x's rows were quantized with (none yet) */
    for (int64_t i = 0; i < n; i++) most = N[i] > most ? N[i] : most;
    int8_t* q = (int8_t*)malloc((size_t)(M * Kp));
    float* r = (float*)malloc((size_t)M * sizeof(float));
    int64_t* count = (int64_t*)malloc((size_t)M * sizeof(int64_t));
    int32_t* cols = (int32_t*)malloc((size_t)(M * K) * sizeof(int32_t));
    int32_t* sums = (int32_t*)malloc((size_t)(M * most) * sizeof(int32_t));
    for (int64_t i = 0; i < n && !failed; i++) {
        if (wkind[i] != W_Q8B) {
            failed = linears(x, M, K, 1, w + i, wkind + i, bias + i, out + i, N + i, dt, threads);
            continue;
        }
        const q8b_weight* wq = (const q8b_weight*)w[i];
        if (!q || !r || !count || !cols || !sums) {
            failed = -1;
            break;
        }
        if (!(wq->threshold == quantized_at)) {
            q8b_rows_job rj = {x, M, K, Kp, dt, wq->threshold, q, r, cols, count};
            run_parallel(q8b_rows_part, &rj, (M + Q8B_ROWS - 1) / Q8B_ROWS, threads);
            quantized_at = wq->threshold;
        }
        q8b_job j = {x, M, K, Kp, N[i], dt, wq, bias[i], out[i], q, r, count, cols, sums};
        run_parallel(q8b_part, &j, (N[i] + Q8B_BLOCK - 1) / Q8B_BLOCK, threads);
    }
    free(q), free(r), free(count), free(cols), free(sums);
    return failed;
}

/* the portable sums: one int32 chain per output and row */
void i8_dots_c(const int8_t* xq, int64_t M, int64_t Kp, const int8_t* w, const int32_t* code_sums, int64_t K,
               int64_t n_lo, int64_t n_hi, int32_t* sums, int64_t ld) {
    (void)code_sums;
    for (int64_t n = n_lo; n < n_hi; n++)
        for (int64_t m = 0; m < M; m++) {
            int32_t s = 0;
            for (int64_t k = 0; k < K; k++) s += (int32_t)xq[m * Kp + k] * (int32_t)w[n * K + k];
            sums[m * ld + n] = s;
        }
}
