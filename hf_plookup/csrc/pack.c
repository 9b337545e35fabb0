/* Packing a linear's weight into the layout the linears read (cpu_kernels.h, "linears"), and back.
 *
 * A packed weight is the only copy of a wrapped CPU model's linear weight (cpu/packed_weight.py), so
 * packing at `wrap` and unpacking for a prompt's large GEMMs both stream whole weights: each panel's
 * 8 source rows are read side by side, one pass over the weight, the panels split over the threads.
 * Values are moved, never computed: pack then unpack gives the weight back bit for bit. This file holds
 * the portable loop (level 0) and the split over the threads; arch/x86/pack_avx2.c moves the same
 * values by 8 x 8 register transposes. */
#include "cpu_kernels.h"

#include <string.h>

#define PACK_PANELS 16 /* panels per unit of work */

typedef struct {
    const void* src;
    void* dst;
    int64_t N, K, dt, unpack;
} pack_job;

/* panel p of a weight of T values [K][8] (fp32, fp16): packed[p][k][c] = w[8p + c][k] */
#define MOVE_PANEL(T, ZERO)                                                                             \
    do {                                                                                                \
        T* pk = (T*)packed + p * K * 8;                                                                 \
        T* w = (T*)w_;                                                                                  \
        for (int c = 0; c < 8; c++) {                                                                   \
            int64_t n = p * 8 + c;                                                                      \
            if (n >= N) {                                                                               \
                if (!unpack)                                                                            \
                    for (int64_t k = 0; k < K; k++) pk[k * 8 + c] = ZERO;                               \
                continue;                                                                               \
            }                                                                                           \
            T* row = w + n * K;                                                                         \
            if (unpack)                                                                                 \
                for (int64_t k = 0; k < K; k++) row[k] = pk[k * 8 + c];                                 \
            else                                                                                        \
                for (int64_t k = 0; k < K; k++) pk[k * 8 + c] = row[k];                                 \
        }                                                                                               \
    } while (0)

/* panels [p_lo, p_hi) of a weight of dtype dt: fp32 and fp16 packed[p][k][c] = w[8p + c][k]; bf16
 * packed[p][j][c][h] = w[8p + c][2j + h] (K2 = K rounded up to even); zeros past N and K. Unpacking
 * reads the same places and writes only the values within N and K. One value at a time: the portable
 * code (level 0), and the vector code's last, partial panel and fp16 weights. */
void pack_range_c(const void* w_, void* packed, int64_t N, int64_t K, int64_t dt, int64_t unpack, int64_t p_lo,
                  int64_t p_hi) {
    for (int64_t p = p_lo; p < p_hi; p++) {
        if (dt == DT_F32) {
            MOVE_PANEL(float, 0.0f);
        } else if (dt == DT_F16) {
            MOVE_PANEL(uint16_t, 0);
        } else {
            int64_t K2 = K + (K & 1);
            uint16_t* pk = (uint16_t*)packed + p * K2 * 8;
            uint16_t* w = (uint16_t*)w_;
            for (int c = 0; c < 8; c++) {
                int64_t n = p * 8 + c;
                if (n >= N) {
                    if (!unpack)
                        for (int64_t k = 0; k < K2; k++) pk[(k >> 1) * 16 + c * 2 + (k & 1)] = 0;
                    continue;
                }
                uint16_t* row = w + n * K;
                if (unpack)
                    for (int64_t k = 0; k < K; k++) row[k] = pk[(k >> 1) * 16 + c * 2 + (k & 1)];
                else {
                    for (int64_t k = 0; k < K; k++) pk[(k >> 1) * 16 + c * 2 + (k & 1)] = row[k];
                    if (K & 1) pk[(K >> 1) * 16 + c * 2 + 1] = 0;
                }
            }
        }
    }
}

static void pack_part(void* ctx, int64_t u) {
    pack_job* j = (pack_job*)ctx;
    int64_t P = (j->N + 7) / 8, p1 = (u + 1) * PACK_PANELS < P ? (u + 1) * PACK_PANELS : P;
    void* w = (void*)(j->unpack ? j->dst : j->src);
    void* packed = (void*)(j->unpack ? j->src : j->dst);
    ops.pack_range(w, packed, j->N, j->K, j->dt, j->unpack, u * PACK_PANELS, p1);
}

/* w [N, K] (of dtype dt; contiguous) into packed (the layout above, ceil(N / 8) panels), or, when
 * unpack, packed back into w */
void pack_weight(const void* w, int64_t N, int64_t K, int64_t dt, void* packed, int64_t unpack, int64_t threads) {
    pack_job j = {unpack ? packed : w, unpack ? (void*)w : packed, N, K, dt, unpack};
    int64_t P = (N + 7) / 8;
    run_parallel(pack_part, &j, (P + PACK_PANELS - 1) / PACK_PANELS, threads);
}
