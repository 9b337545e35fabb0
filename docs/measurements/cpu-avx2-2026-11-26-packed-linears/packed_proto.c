#define _GNU_SOURCE
#include <sys/mman.h>
#include CPU_KERNELS_C
/* A prototype, not the project's code: SmolLM2-135M's linears with packed weights (docs/results.md,
   "Packed linears"). N-vectorized: weights packed [N/8][K][8] bf16 (or fp32), x transposed [K][M] fp32,
   out[m][n] = sequential-over-k FMA chain per output (lanes = 8 output columns). */
#ifndef PFD_F
#define PFD_F 0
#endif
#define NVT(NAME, MB, NP, BF)                                                                      \
AVX2 static void NAME(const float* xt, int64_t M, const void* wp, int64_t K, float* out, int64_t ldo, int64_t sk, int64_t sj) { \
    __m256 acc[MB][NP];                                                                           \
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++) acc[i][j] = _mm256_setzero_ps();     \
    for (int64_t k = 0; k < K; k++) {                                                             \
        __m256 wv[NP];                                                                            \
        if (PFD_F && !((k * 8 * (BF ? 2 : 4)) & 63)) { _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++) _mm_prefetch((const char*)wp + (k * sk + j * sj) * (BF ? 2 : 4) + PFD_F, _MM_HINT_T1); } \
        _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++) wv[j] = BF ? widen8(_mm_loadu_si128((const __m128i*)((const uint16_t*)wp + k * sk + j * sj))) \
                                                : _mm256_loadu_ps((const float*)wp + k * sk + j * sj); \
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) {                                                            \
            __m256 xb = _mm256_broadcast_ss(xt + k * M + i);                                      \
            _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xb, acc[i][j]);        \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++) _mm256_storeu_ps(out + i * ldo + j * 8, acc[i][j]); \
}
NVT(nb_1x4,1,4,1) NVT(nb_2x4,2,4,1) NVT(nb_3x4,3,4,1) NVT(nb_4x3,4,3,1) NVT(nb_5x2,5,2,1) NVT(nb_6x2,6,2,1)
NVT(nb_7x1,7,1,1) NVT(nb_8x1,8,1,1) NVT(nb_9x1,9,1,1) NVT(nb_4x2,4,2,1) NVT(nb_3x2,3,2,1)
NVT(nf_1x4,1,4,0) NVT(nf_2x4,2,4,0) NVT(nf_3x4,3,4,0) NVT(nf_4x3,4,3,0) NVT(nf_5x2,5,2,0) NVT(nf_6x2,6,2,0)
NVT(nf_7x1,7,1,0) NVT(nf_8x1,8,1,0) NVT(nf_9x1,9,1,0) NVT(nf_4x2,4,2,0) NVT(nf_3x2,3,2,0)

#ifndef PFD
#define PFD 1024
#endif
#define NVP(NAME, MB, NP)                                                                           \
AVX2 static void NAME(const float* xt, int64_t M, const void* wp, int64_t K, float* out, int64_t ldo, int64_t sk, int64_t sj) { \
    __m256 acc[MB][NP];                                                                           \
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++) acc[i][j] = _mm256_setzero_ps(); \
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);                                        \
    for (int64_t k = 0; k < K; k += 2) {                                                          \
        __m256 w0[NP], w1[NP];                                                                    \
        _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++) {                                   \
            const uint16_t* p = (const uint16_t*)wp + j * (K * 8) + k * 8;                       \
            if (PFD && !((k * 16) & 63)) _mm_prefetch((const char*)p + PFD, _MM_HINT_T1);         \
            __m256i v = _mm256_loadu_si256((const __m256i*)p);                                     \
            w0[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                                \
            w1[j] = _mm256_castsi256_ps(_mm256_and_si256(v, hi));                                 \
        }                                                                                         \
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) {                                   \
            __m256 xb = _mm256_broadcast_ss(xt + k * M + i);                                      \
            _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++) acc[i][j] = _mm256_fmadd_ps(w0[j], xb, acc[i][j]); \
        }                                                                                         \
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) {                                   \
            __m256 xb = _mm256_broadcast_ss(xt + (k + 1) * M + i);                                \
            _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++) acc[i][j] = _mm256_fmadd_ps(w1[j], xb, acc[i][j]); \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++) _mm256_storeu_ps(out + i * ldo + j * 8, acc[i][j]); \
}
NVP(np_1x4,1,4) NVP(np_2x4,2,4) NVP(np_3x4,3,4) NVP(np_4x3,4,3) NVP(np_5x2,5,2) NVP(np_6x2,6,2) NVP(np_7x1,7,1) NVP(np_8x1,8,1) NVP(np_9x1,9,1) NVP(np_4x2,4,2) NVP(np_3x2,3,2)
typedef void (*nv_fn)(const float*, int64_t, const void*, int64_t, float*, int64_t, int64_t, int64_t);
static int layout_t = 0; /* 1: weights [K][N] */
static int variant = 0; /* 0: one pass (9x1 for 7-9); 1: two passes (5x2 + 4x2 etc) */
typedef struct { const float* xt; int64_t M, K, bf16, n; const void* w[3]; float* out[3]; int64_t N[3], first[4]; } nv_job;
#define PANELS_PER_PART 12
static void nv_part(void* ctx, int64_t part) {
    nv_job* J = ctx; int64_t i = 0;
    while (part >= J->first[i + 1]) i++;
    int64_t p0 = (part - J->first[i]) * PANELS_PER_PART, np_all = J->N[i] / 8;
    int64_t p1 = p0 + PANELS_PER_PART < np_all ? p0 + PANELS_PER_PART : np_all;
    int64_t M = J->M, K = J->K, esz = J->bf16 ? 2 : 4, N = J->N[i];
    const char* w = J->w[i]; float* out = J->out[i];
    int bf = (int)J->bf16;
    /* choose tile */
    nv_fn f; int np; 
    if (bf && layout_t == 2) { if (M == 1) { f = np_1x4; np = 4; } else if (M == 2) { f = np_2x4; np = 4; } else if (M == 3) { f = np_3x4; np = 4; }
        else if (M == 4) { f = np_4x3; np = 3; } else if (M <= 6) { f = M == 5 ? np_5x2 : np_6x2; np = 2; } else { f = M == 7 ? np_7x1 : M == 8 ? np_8x1 : np_9x1; np = 1; } }
    else if (M == 1) { f = bf ? nb_1x4 : nf_1x4; np = 4; }
    else if (M == 2) { f = bf ? nb_2x4 : nf_2x4; np = 4; }
    else if (M == 3) { f = bf ? nb_3x4 : nf_3x4; np = 4; }
    else if (M == 4) { f = bf ? nb_4x3 : nf_4x3; np = 3; }
    else if (M == 5) { f = bf ? nb_5x2 : nf_5x2; np = 2; }
    else if (M == 6) { f = bf ? nb_6x2 : nf_6x2; np = 2; }
    else if (variant == 0) { f = M == 7 ? (bf ? nb_7x1 : nf_7x1) : M == 8 ? (bf ? nb_8x1 : nf_8x1) : (bf ? nb_9x1 : nf_9x1); np = 1; }
    else { f = NULL; np = 2; }
    for (int64_t p = p0; p < p1; p += np) {
        int n = (int)(p + np <= p1 ? np : p1 - p);
        const char* wp = w + (layout_t == 1 ? p * 8 : p * K * 8) * esz; int64_t sk = layout_t == 1 ? N : 8, sj = layout_t == 1 ? 8 : K * 8;
        if (f && n == np) f(J->xt, M, wp, K, out + p * 8, N, sk, sj);
        /* (every N here is a multiple of 96 columns, 12 panels: a part has no remainder) */
        else { /* variant 1: rows in two passes, 2 panels */
            int64_t ma = (M + 1) / 2;
            const float* xt = J->xt;
            if (n == 2) {
                /* pass A rows [0, ma), pass B rows [ma, M); xt is [K][M] so pass B's rows at offset ma */
                nv_fn fa = ma == 5 ? (bf ? nb_5x2 : nf_5x2) : ma == 4 ? (bf ? nb_4x2 : nf_4x2) : (bf ? nb_3x2 : nf_3x2);
                int64_t mb = M - ma;
                nv_fn fb = mb == 5 ? (bf ? nb_5x2 : nf_5x2) : mb == 4 ? (bf ? nb_4x2 : nf_4x2) : (bf ? nb_3x2 : nf_3x2);
                fa(xt, M, wp, K, out + p * 8, N, sk, sj);
                fb(xt + ma, M, wp, K, out + ma * N + p * 8, N, sk, sj);
            }
        }
    }
}
static int64_t nv_linears(const float* xt, int64_t M, int64_t K, int64_t n, const void* const* w, float* const* out, const int64_t* N, int64_t bf16, int64_t threads) {
    nv_job j = {xt, M, K, bf16, n}; j.first[0] = 0;
    for (int64_t i = 0; i < n; i++) { j.w[i] = w[i]; j.out[i] = out[i]; j.N[i] = N[i]; j.first[i+1] = j.first[i] + (N[i]/8 + PANELS_PER_PART - 1) / PANELS_PER_PART; }
    run_parallel(nv_part, &j, j.first[n], threads);
    return 0;
}
/* ---- the step's linears ---- */
#define L 30
#define HID 576
#define INTER 1536
#define KVD 192
#define VOCAB 49152
static void* W[L][7]; static void* WP[L][7]; static void* WT[L][7]; static void* WH; static void* WHP; static void* WHT;
static const int64_t SN[7] = {HID, KVD, KVD, HID, INTER, INTER, HID}, SK[7] = {HID, HID, HID, HID, HID, HID, INTER};
static int cur_bf = -1;
static uint32_t rng = 12345;
static float frand(void) { rng = rng * 1664525u + 1013904223u; return ((rng >> 9) * (1.0f / 8388608.0f) - 0.5f) * 0.1f; }
static char* arena[3]; static size_t used[3];
static void* take(int a, size_t n) {
    if (!arena[a]) { arena[a] = mmap(NULL, (size_t)1200 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
                     madvise(arena[a], (size_t)1200 << 20, MADV_HUGEPAGE); }
    void* p = arena[a] + used[a]; used[a] += (n + 63) / 64 * 64; return p; }
static void* mk(int64_t N, int64_t K, int bf) { /* rows [N][K] */
    size_t es = bf ? 2 : 4; void* p = take(0, N * K * es);
    for (int64_t i = 0; i < N * K; i++) { float v = frand(); if (bf) ((uint16_t*)p)[i] = f32_to_bf16(v); else ((float*)p)[i] = v; }
    return p;
}
static void* pack(const void* w, int64_t N, int64_t K, int bf) { /* [N/8][K][8] */
    size_t es = bf ? 2 : 4; char* p = take(1, N * K * es);
    for (int64_t n = 0; n < N; n++) for (int64_t k = 0; k < K; k++)
        memcpy(p + (((n / 8) * K + k) * 8 + n % 8) * es, (const char*)w + (n * K + k) * es, es);
    return p;
}
static void* packpair(const void* w, int64_t N, int64_t K, int bf) { /* [N/8][K/2][8][2] */
    size_t es = bf ? 2 : 4; char* p = take(2, N * K * es);
    for (int64_t n = 0; n < N; n++) for (int64_t k = 0; k < K; k++)
        memcpy(p + ((((n / 8) * (K / 2) + k / 2) * 8 + n % 8) * 2 + k % 2) * es, (const char*)w + (n * K + k) * es, es);
    return p;
}
static void* transp(const void* w, int64_t N, int64_t K, int bf) {
    size_t es = bf ? 2 : 4; char* p = take(2, N * K * es);
    for (int64_t n = 0; n < N; n++) for (int64_t k = 0; k < K; k++) memcpy(p + (k * N + n) * es, (const char*)w + (n * K + k) * es, es);
    return p;
}
int64_t proto_setup(int64_t bf) {
    if (cur_bf == bf) return 0;
    used[0] = used[1] = used[2] = 0;
    for (int l = 0; l < L; l++) for (int i = 0; i < 7; i++) {
        W[l][i] = mk(SN[i], SK[i], bf); WP[l][i] = pack(W[l][i], SN[i], SK[i], bf); WT[l][i] = bf ? packpair(W[l][i], SN[i], SK[i], bf) : WP[l][i]; }
    WH = mk(VOCAB, HID, bf); WHP = pack(WH, VOCAB, HID, bf); WHT = bf ? packpair(WH, VOCAB, HID, bf) : WHP;
    cur_bf = bf; return 0;
}
static float XT[9 * INTER], OUTF[3][9 * VOCAB]; static uint16_t XB[9 * INTER]; static char OUTB[3][9 * VOCAB * 4];
/* which: 0 = current kernels (linears), 1 = N-vectorized. returns ns */
int64_t proto_level(int64_t l) { simd = l < simd_max ? (int)l : simd_max; return simd; }
int64_t proto_step(int64_t which, int64_t M, int64_t threads, int64_t var) {
    variant = (int)(var & 1); layout_t = (int)(var >> 1) ? 2 : 0;
    int bf = cur_bf;
    for (int i = 0; i < 9 * INTER; i++) { XT[i] = frand(); XB[i] = f32_to_bf16(XT[i]); if (!bf) XT[i] = bf16_to_f32(XB[i]); }
    int64_t t0 = now_ns();
    const void* xin = bf ? (const void*)XB : (const void*)XT;
    for (int l = 0; l < L; l++) {
        int groups[4][3] = {{0,1,2},{3,-1,-1},{4,5,-1},{6,-1,-1}}; int gn[4] = {3,1,2,1};
        for (int g = 0; g < 4; g++) {
            const void* w[3]; const void* b[3] = {0,0,0}; void* o[3]; float* of[3]; int64_t N[3]; int64_t K = SK[groups[g][0]];
            for (int q = 0; q < gn[g]; q++) { int i = groups[g][q]; w[q] = which ? (layout_t ? WT[l][i] : WP[l][i]) : W[l][i]; o[q] = OUTB[q]; of[q] = OUTF[q]; N[q] = SN[i]; }
            if (which) nv_linears(XT, M, K, gn[g], w, of, N, bf, threads);
            else linears(xin, M, K, gn[g], w, b, o, N, bf, threads);
        }
    }
    { const void* w = which ? (layout_t ? WHT : WHP) : WH; const void* b = 0; void* o = OUTB[0]; float* of = OUTF[0]; int64_t N = VOCAB;
      if (which) nv_linears(XT, M, HID, 1, &w, &of, &N, bf, threads); else linears(xin, M, HID, 1, &w, &b, &o, &N, bf, threads); }
    return now_ns() - t0;
}
/* correctness: one linear, compare to double reference; returns max rel err*1e9 */
double proto_check(int64_t M, int64_t var) {
    variant = (int)(var & 1); layout_t = (int)(var >> 1) ? 2 : 0; int bf = cur_bf;
    for (int i = 0; i < 9 * INTER; i++) XT[i] = frand();
    /* xt is [K][M] */
    const void* w = layout_t ? WT[0][4] : WP[0][4]; float* of = OUTF[0]; int64_t N = INTER, K = HID;
    nv_linears(XT, M, K, 1, &w, &of, &N, bf, 2);
    double worst = 0;
    for (int64_t m = 0; m < M; m++) for (int64_t n = 0; n < N; n++) {
        double s = 0, a = 0; for (int64_t k = 0; k < K; k++) { double wv = load1(W[0][4], n * K + k, bf); s += wv * XT[k * M + m]; a += fabs(wv * XT[k * M + m]); }
        double e = fabs(of[m * N + n] - s) / a; if (e > worst) worst = e; }
    return worst;
}
int64_t proto_init(int64_t level) { __builtin_cpu_init();
    simd_max = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") ? 2 : 1;
#if HAVE_DPBF16
    if (simd_max == 2 && __builtin_cpu_supports("avx512bf16")) simd_max = 3;
#endif
    simd = level < simd_max ? (int)level : simd_max; pthread_atfork(NULL, NULL, after_fork_child); return simd; }
/* single-thread tile rate: tile t over `panels` panels of K (weights resident after first rep); returns FMAs per ns */
double proto_tile(int64_t t, int64_t K, int64_t panels, int64_t reps) {
    static nv_fn tiles[] = {nb_9x1, nb_6x2, nb_4x3, nb_1x4, nf_9x1, nf_6x2, nf_4x3, nf_1x4, np_9x1, np_5x2, np_4x2, np_1x4, np_6x2};
    static int mb[] = {9, 6, 4, 1, 9, 6, 4, 1, 9, 5, 4, 1, 6}, np[] = {1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 2, 4, 2};
    int bf = t < 4 || t >= 8; size_t es = bf ? 2 : 4;
    char* w = aligned_alloc(64, panels * K * 8 * es + 64); memset(w, 0, panels * K * 8 * es);
    float* xt = aligned_alloc(64, K * 9 * 4 + 64); for (int i = 0; i < K * 9; i++) xt[i] = 0.5f;
    float out[9 * 64 * 8];
    int64_t best = INT64_MAX;
    for (int64_t r = 0; r < reps; r++) {
        int64_t t0 = now_ns();
        for (int64_t p = 0; p + np[t] <= panels; p += np[t]) tiles[t](xt, mb[t], w + p * K * 8 * es, K, out, 64 * 8, 8, K * 8);
        int64_t d = now_ns() - t0; if (d < best) best = d;
    }
    free(w); free(xt);
    return (double)(panels / np[t] * np[t]) * K * mb[t] / best;
}
