/* A/B of attend() from two builds in one process (run_attend_ab.sh builds and runs it): SmolLM2's
 * attention shape (9 heads, 3 KV heads, D 64), B sequences of 700 cached keys each
 * feeding T chain tokens, 30 layers of pages (NL in the environment), TH threads; sweeps of the
 * 30 layers alternate between the builds, R rounds after 2 warm-up rounds. Before each layer's call
 * the harness reads EVICT MB (environment; default 9, a SmolLM2 layer's bf16 weights) of another
 * buffer, as a step's linears stream their weights between two layers' attention; only the calls are timed
 * (TOTAL=1: the reading too). PREKV=1 (2): while A's reading passes, ask for the layer's pages with
 * prefetcht0 (prefetcht1), spread evenly over it, as a linear kernel could for the next layer.
 * usage: attend_ab A.so B.so T bf16 B TH [R] */
#include <Python.h>
#include <immintrin.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
typedef int64_t (*attend_fn)(const void*, int64_t, int64_t, int64_t, int64_t, const void*, const void*, int64_t, const int64_t*, int64_t,
                             const int64_t*, const int64_t*, const int64_t*, const int64_t*, const int64_t*, float, float, void*, int64_t, int64_t);
static int64_t now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
static int cmp(const void* a, const void* b) { double x = *(const double*)a, y = *(const double*)b; return x < y ? -1 : x > y; }
int main(int argc, char** argv) {
    int64_t T = atoi(argv[3]), bf = atoi(argv[4]), B = atoi(argv[5]), TH = atoi(argv[6]), R = argc > 7 ? atoi(argv[7]) : 21;
    int64_t H = 9, HKV = 3, D = 64, CTX = 700, NL = getenv("NL") ? atoi(getenv("NL")) : 30, esz = bf ? 2 : 4;
    Py_Initialize();
    attend_fn f[2];
    for (int l = 0; l < 2; l++) {
        void* h = dlopen(argv[1 + l], RTLD_NOW | RTLD_LOCAL);
        if (!h) { printf("%s\n", dlerror()); return 1; }
        PyObject* (*init)(void) = (PyObject * (*)(void)) dlsym(h, "PyInit__cpu_kernels");
        init();
        f[l] = (attend_fn)dlsym(h, "attend");
    }
    int64_t per = CTX + 32, NS = B * per;
    char* kc = malloc(NL * NS * HKV * D * esz); char* vc = malloc(NL * NS * HKV * D * esz);
    uint32_t x = 1;
    for (int64_t i = 0; i < NL * NS * HKV * D; i++) {
        for (int z = 0; z < 2; z++) {
            x = x * 1664525u + 1013904223u;
            float v = (float)(x >> 8) / 16777216.0f * 2.0f - 1.0f;
            char* dst = z ? vc : kc;
            if (bf) { uint32_t u; memcpy(&u, &v, 4); uint16_t hh = (uint16_t)(u >> 16); memcpy(dst + i * 2, &hh, 2); }
            else memcpy(dst + i * 4, &v, 4);
        }
    }
    char* q = malloc(B * T * H * D * esz); char* out = malloc(B * T * H * D * esz);
    memset(q, 0, B * T * H * D * esz);
    for (int64_t i = 0; i < B * T * H * D; i++) {
        x = x * 1664525u + 1013904223u; float v = (float)(x >> 8) / 16777216.0f - 0.5f;
        if (bf) { uint32_t u; memcpy(&u, &v, 4); uint16_t hh = (uint16_t)(u >> 16); memcpy(q + i * 2, &hh, 2); } else memcpy(q + i * 4, &v, 4);
    }
    int64_t* slots = malloc(B * per * 8); int64_t *seq = malloc(B * T * 8), *lo = calloc(B * T, 8), *hi = malloc(B * T * 8), *xo = calloc(B * T + 1, 8), ex[1] = {0};
    for (int64_t i = 0; i < B * per; i++) slots[i] = i;
    for (int64_t b = 0; b < B; b++) for (int64_t t = 0; t < T; t++) seq[b * T + t] = b, hi[b * T + t] = CTX + 1 + t;
    int64_t ev = (int64_t)(getenv("EVICT") ? atof(getenv("EVICT")) : 9.0) * 1048576;
    volatile char* evict = malloc(ev > 0 ? ev : 1);
    for (int64_t i = 0; i < ev; i++) evict[i] = (char)i;
    int64_t sink = 0, pre = getenv("PREKV") ? atoi(getenv("PREKV")) : 0;
    double* ts[2] = {malloc(R * sizeof(double)), malloc(R * sizeof(double))};
    for (int r = -2; r < R; r++)
        for (int l = 0; l < 2; l++) {
            int64_t spent = 0, tall = now(); /* the calls' time, not the reading between them */
            for (int64_t L = 0; L < NL; L++) {
                if (pre && l == 0) { /* A: the layer's pages asked for while the reading passes */
                    const char* kk = kc + L * NS * HKV * D * esz; const char* vv = vc + L * NS * HKV * D * esz;
                    int64_t kvb = NS * HKV * D * esz, step = ev / (2 * kvb / 64 + 1), o = 0;
                    for (int64_t i = 0; i < ev; i += 64) {
                        sink += evict[i];
                        if (i % step < 64 && o < 2 * kvb) {
                            const char* a = o < kvb ? kk + o : vv + (o - kvb);
                            if (pre == 1) _mm_prefetch(a, _MM_HINT_T0); else _mm_prefetch(a, _MM_HINT_T1);
                            o += 64;
                        }
                    }
                } else
                    for (int64_t i = 0; i < ev; i += 64) sink += evict[i];
                int64_t t0 = now();
                f[l](q, B * T, H, D, D, kc + L * NS * HKV * D * esz, vc + L * NS * HKV * D * esz, HKV, slots, per, seq, lo, hi, xo, ex, 0.125f, 0.0f, out, bf, TH);
                spent += now() - t0;
            }
            if (getenv("TOTAL") && atoi(getenv("TOTAL"))) spent = now() - tall;
            if (r >= 0) ts[l][r] = spent / 1e6;
        }
    qsort(ts[0], R, sizeof(double), cmp); qsort(ts[1], R, sizeof(double), cmp);
    if (sink == 42) printf(" ");
    printf("%s B=%ld T=%ld TH=%ld, ms per 30 layers: A median %.2f min %.2f | B median %.2f min %.2f | A/B median %.2f min %.2f\n",
           bf ? "bf16" : "fp32", B, T, TH, ts[0][R / 2], ts[0][0], ts[1][R / 2], ts[1][0], ts[0][R / 2] / ts[1][R / 2], ts[0][0] / ts[1][0]);
    return 0;
}
