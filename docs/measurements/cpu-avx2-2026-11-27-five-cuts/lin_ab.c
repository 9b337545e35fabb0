/* A/B of linear() from two builds of cpu_kernels.c in one process (run_ab.sh builds and runs it):
 * SmolLM2-135M's 30 layers of 7 linears (q, k, v, o, gate, up, down; random weights, packed as the
 * engine packs them: only their bytes matter here), M rows of x, TH threads. Sweeps over all 210
 * calls alternate between the builds, R rounds after 2 warm-up rounds; the 30 layers' weights (106 M
 * values) stream from memory as in a step.
 * usage: lin_ab A.so B.so M bf16 TH [R] */
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef int64_t (*lin_fn)(const void*, int64_t, const void*, int64_t, const void*, int64_t, void*, int64_t, int64_t);
static int64_t now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
static int cmp(const void* a, const void* b) { double x = *(const double*)a, y = *(const double*)b; return x < y ? -1 : x > y; }
int main(int argc, char** argv) {
    if (argc < 6) { fprintf(stderr, "usage: lin_ab A.so B.so M bf16 TH [R]\n"); return 2; }
    int64_t M = atoi(argv[3]), bf = atoi(argv[4]), TH = atoi(argv[5]), R = argc > 6 ? atoi(argv[6]) : 15;
    int64_t esz = bf ? 2 : 4, NL = 30;
    const int64_t shapes[7][2] = {{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}}; /* N, K */
    Py_Initialize();
    lin_fn f[2];
    for (int l = 0; l < 2; l++) {
        void* h = dlopen(argv[1 + l], RTLD_NOW | RTLD_LOCAL);
        if (!h) { printf("%s\n", dlerror()); return 1; }
        ((PyObject * (*)(void)) dlsym(h, "PyInit__cpu_kernels"))(); /* sets the build's SIMD level */
        f[l] = (lin_fn)dlsym(h, "linear");
    }
    void* w[30][7];
    uint32_t x = 1;
    for (int l = 0; l < NL; l++)
        for (int i = 0; i < 7; i++) {
            int64_t n = shapes[i][0] * shapes[i][1];
            char* p = aligned_alloc(4096, (size_t)(n * esz));
            for (int64_t e = 0; e < n; e++) { /* values in [-0.05, 0.05) */
                x = x * 1664525u + 1013904223u;
                float v = ((float)(x >> 8) / 16777216.0f - 0.5f) * 0.1f;
                if (bf) { uint32_t u; memcpy(&u, &v, 4); uint16_t hh = (uint16_t)(u >> 16); memcpy(p + e * 2, &hh, 2); }
                else memcpy(p + e * 4, &v, 4);
            }
            w[l][i] = p;
        }
    float* xf = malloc((size_t)(M * 1536) * 4);
    uint16_t* xb = malloc((size_t)(M * 1536) * 2);
    for (int64_t i = 0; i < M * 1536; i++) {
        xf[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
        uint32_t u; memcpy(&u, &xf[i], 4); xb[i] = (uint16_t)(u >> 16);
    }
    void* out = malloc((size_t)(M * 1536) * 4);
    double* t[2] = {malloc((size_t)R * sizeof(double)), malloc((size_t)R * sizeof(double))};
    for (int64_t r = -2; r < R; r++)
        for (int v = 0; v < 2; v++) {
            int64_t t0 = now();
            for (int l = 0; l < NL; l++)
                for (int i = 0; i < 7; i++)
                    f[v](bf ? (void*)xb : (void*)xf, M, w[l][i], shapes[i][1], NULL, shapes[i][0], out, bf, TH);
            if (r >= 0) t[v][r] = (double)(now() - t0) / 1e6;
        }
    double mn[2], md[2];
    for (int v = 0; v < 2; v++) { qsort(t[v], (size_t)R, sizeof(double), cmp); mn[v] = t[v][0]; md[v] = t[v][R / 2]; }
    printf("%s M=%ld TH=%ld, ms per 30 layers' linears: A median %.2f min %.2f | B median %.2f min %.2f | A/B median %.3f min %.3f\n",
           bf ? "bf16" : "fp32", (long)M, (long)TH, md[0], mn[0], md[1], mn[1], md[0] / md[1], mn[0] / mn[1]);
    return 0;
}
