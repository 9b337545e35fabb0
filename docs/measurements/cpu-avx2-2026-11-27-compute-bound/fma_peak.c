/* The cores' FMA peak: each thread runs 10 independent chains of 8-lane FMAs (more than a core's
 * 2 pipes x 4 cycles of latency keep busy), nothing else. The ceiling against which eval/lib/timing.py's
 * gemm_rate (MKL's fp32 GEMM) and the C kernels' rates in `step_bench.py --kernels` are read.
 * build and run: gcc -O3 -mavx2 -mfma fma_peak.c -o fma_peak -lpthread && ./fma_peak */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>
#define N 200000000L /* FMAs per thread */
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void* run(void* out) {
    __m256 acc[10], x = _mm256_set1_ps(1e-9f);
    for (int i = 0; i < 10; i++) acc[i] = _mm256_set1_ps((float)i);
    for (long n = 0; n < N / 10; n++)
        _Pragma("GCC unroll 10") for (int i = 0; i < 10; i++) acc[i] = _mm256_fmadd_ps(x, x, acc[i]); /* (unrolled: in registers) */
    float s = 0, lane[8];
    for (int i = 0; i < 10; i++) { _mm256_storeu_ps(lane, acc[i]); s += lane[0]; }
    *(float*)out = s; /* used, so that nothing is optimised away */
    return 0;
}
int main(void) {
    float sink[2];
    for (int th = 1; th <= 2; th++) {
        pthread_t p[2];
        double t0 = now();
        for (int i = 0; i < th; i++) pthread_create(&p[i], 0, run, &sink[i]);
        for (int i = 0; i < th; i++) pthread_join(p[i], 0);
        double t = now() - t0;
        printf("%d thread(s): %.2f G 8-lane FMAs a second (%.2f per thread) = %.1f GMAC/s\n", th, th * N / t / 1e9, N / t / 1e9, 8 * th * N / t / 1e9);
    }
    return 0;
}
