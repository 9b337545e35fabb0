/* Paged attention (attend): one query head over its visible keys, read in place from the paged cache
 * ([slots, H_kv, D], flat), in position order: scores (8-lane dot, fixed hsum), optional tanh
 * soft-capping, softmax with one max and one sum in fixed order, then the weighted sum of values,
 * each output element accumulated key by key. The keys a sequence's tokens all see (a chain's or a
 * tree's cached prefix) are read once for all of them, block by block: in bf16 with TILE_QUERIES or
 * more queries to a KV head, a block widened once to fp32 rows against tiles of queries (ops.span_*);
 * otherwise by groups of a token's heads. Either way a query's arithmetic is the same.
 *
 * This file holds the passes, the split over the threads and the portable loops (level 0); the
 * vector code is in arch/x86/attention_*.c. */
#include "cpu_kernels.h"

#include <stdlib.h>

/* ------------------------------------------------------------------ portable loops (level 0) */

/* dot(q, key), fp32 query, fp32, bf16 or fp16 key, in the lanes of the vector scores */
static float qk_c(const float* q, const void* k, int64_t D, int bf16) {
    float acc[8] = {0};
    for (int64_t d = 0; d < D; d++) acc[d & 7] = fmaf(q[d], load1(k, d, bf16), acc[d & 7]);
    return sum8(acc);
}

static inline void scores_n_c(int64_t n, const float* q, const void* kb, const int64_t* rows, int64_t L, int64_t D,
                              int64_t qs, int bf16, float* s, int64_t ld) {
    for (int64_t h = 0; h < n; h++)
        for (int64_t j = 0; j < L; j++)
            s[h * ld + j] = qk_c(q + h * qs, (const char*)kb + rows[j] * (bf16 ? 2 : 4), D, bf16);
}

static inline void wsum_n_c(int64_t n, const float* p, int64_t ld, const void* vb, const int64_t* rows, int64_t L,
                            int64_t Dv, int bf16, float* o) {
    for (int64_t h = 0; h < n; h++)
        for (int64_t j = 0; j < L; j++)
            for (int64_t d = 0; d < Dv; d++) o[h * Dv + d] = fmaf(p[h * ld + j], load1(vb, rows[j] + d, bf16), o[h * Dv + d]);
}

/* the table's entries by head count (scores_fn, wsum_fn: cpu_kernels.h); no prefetching */
#define BY_HEADS(NH)                                                                                             \
    static void scores_c##NH(const float* q, const void* kb, const int64_t* rows, int64_t L, int64_t D, int64_t qs, \
                             int bf16, float* s, int64_t ld, int64_t npf) {                                      \
        (void)npf;                                                                                               \
        scores_n_c(NH, q, kb, rows, L, D, qs, bf16, s, ld);                                                      \
    }                                                                                                            \
    static void wsum_c##NH(const float* p, int64_t ld, const void* vb, const int64_t* rows, int64_t L, int64_t Dv,  \
                           int bf16, float* o, int64_t npf) {                                                    \
        (void)npf;                                                                                               \
        wsum_n_c(NH, p, ld, vb, rows, L, Dv, bf16, o);                                                           \
    }
BY_HEADS(1)
BY_HEADS(2)
BY_HEADS(3)
#undef BY_HEADS
const scores_fn scores_c[MAX_NH + 1] = {0, scores_c1, scores_c2, scores_c3};
const wsum_fn wsum_c[MAX_NH + 1] = {0, wsum_c1, wsum_c2, wsum_c3};

/* in place; s[j] <- exp(s[j] * scale - max) / sum, the sum in 8 lanes and sum8's tree (libm's exp) */
void softmax_c(float* s, int64_t L, float scale) {
    float mx = -INFINITY, acc[8] = {0};
    for (int64_t j = 0; j < L; j++) {
        s[j] *= scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    for (int64_t j = 0; j < L; j++) {
        s[j] = expf(s[j] - mx);
        acc[j & 7] += s[j];
    }
    float inv = 1.0f / sum8(acc);
    for (int64_t j = 0; j < L; j++) s[j] *= inv;
}

/* ------------------------------------------------------------------ through the level's table */

/* n (<= MAX_NH) query vectors qs apart against L keys at element offsets rows[j] of kb:
 * s[h * ld + j] = dot(q[h], key j); qb: the same vectors' bf16 bits (D apart) where the level has
 * bf16 scores of its own (ops.scores_bf16; NULL otherwise) */
static inline void scores_n(int64_t n, const float* q, const uint16_t* qb, const void* kb, const int64_t* rows,
                            int64_t L, int64_t D, int64_t qs, int bf16, float* s, int64_t ld, int64_t npf) {
    if (L <= 0) return;
    if (qb) ops.scores_bf16[n](qb, kb, rows, L, D, s, ld, npf);
    else ops.scores[n](q, kb, rows, L, D, qs, bf16, s, ld, npf);
}

/* o[h][d] += p[h * ld + j] * v_j[d] for j = 0 .. L-1 in order, one FMA each, for n heads Dv apart */
static inline void wsum_n(int64_t n, const float* p, int64_t ld, const void* vb, const int64_t* rows, int64_t L,
                          int64_t Dv, int bf16, float* o, int64_t npf) {
    if (L > 0) ops.wsum[n](p, ld, vb, rows, L, Dv, bf16, o, npf);
}

/* in place over one query's L scores: scale, optional tanh soft-capping, softmax */
static void normalize_scores(float* sh, int64_t L, float scale, float softcap) {
    if (softcap > 0.0f) {
        for (int64_t j = 0; j < L; j++) sh[j] = softcap * tanhf(sh[j] * scale / softcap);
        scale = 1.0f; /* (a product by 1 changes no score) */
    }
    ops.softmax(sh, L, scale);
}

/* ------------------------------------------------------------------ a pass */

/* A pass (pass_t, cpu_kernels.h): a token t sees cache positions run_lo[t] .. run_hi[t]-1, then
 * extra[extra_off[t] .. extra_off[t+1]-1]: its key j, in that order, is its j-th score and the j-th
 * term of each output element's sum.
 *
 * The positions all the tokens see, [max run_lo, min run_hi) (the cached prefix of a chain or a tree),
 * are the span: read once for all the pass's queries of a KV head, KEY_BLOCK keys at a time (bf16
 * with TILE_QUERIES or more of them: widened once to fp32 rows, against tiles of queries; otherwise
 * by groups of a token's heads). Each query's own keys before and after the span are read for its
 * token alone. Which queries share a block changes only what is in cache, never a query's
 * arithmetic: its scores are independent dot products, and each output element is summed key by key
 * in the query's key order, the running sums kept in o. */

/* the pass's index arrays, queries and scratch */
static int64_t pass_begin(pass_t* P, const attend_job* J, int64_t t_lo, int64_t t_hi, int64_t kv_lo, int64_t kv_hi,
                          int64_t g_lo, int64_t g_hi) {
    int64_t nt = t_hi - t_lo, ng = g_hi - g_lo, HP = (kv_hi - kv_lo) * ng, D = J->D, Dv = J->Dv, H = J->H;
    int64_t G = H / J->H_kv, total = 0;
    int b16 = (int)J->bf16;
    *P = (pass_t){.J = J, .t_lo = t_lo, .nt = nt, .kv_lo = kv_lo, .nkv = kv_hi - kv_lo, .g_lo = g_lo, .ng = ng, .HP = HP};
    int64_t a = J->run_lo[t_lo], b = J->run_hi[t_lo];
    for (int64_t i = 0; i < nt; i++) {
        int64_t t = t_lo + i;
        a = J->run_lo[t] > a ? J->run_lo[t] : a;
        b = J->run_hi[t] < b ? J->run_hi[t] : b;
    }
    int64_t nS = P->nS = b > a ? b - a : 0;
    P->own_at[0] = 0;
    for (int64_t i = 0; i < nt; i++) {
        int64_t t = t_lo + i;
        P->Ls[i] = J->run_hi[t] - J->run_lo[t] + J->extra_off[t + 1] - J->extra_off[t];
        P->sbase[i] = total;
        total += HP * P->Ls[i];
        P->pre[i] = nS ? a - J->run_lo[t] : 0; /* own keys before the span */
        P->own_at[i + 1] = P->own_at[i] + P->Ls[i] - nS;
    }
    int64_t nown = P->own_at[nt], vsep = Dv != D; /* values narrower than keys (MLA): their own offsets */
    int64_t nrows = (nS + nown) * (1 + vsep), nq = nt * HP, D8 = P->D8 = (D + 7) / 8 * 8;
    int64_t wmax = D8 > Dv ? D8 : Dv; /* the widest row of a block */
    int dp = b16 == DT_BF16 && ops.scores_bf16[1];
    /* tiles: bf16 only (fp32 gained nothing: docs/results.md, "Attention tiles: the bf16 attention by
     * tiles"; fp16 pages go by head groups); a level with bf16 scores of its own has none */
    P->tiles = ops.tile_scores && b16 == DT_BF16 && nt * ng >= TILE_QUERIES;
    int64_t* mem = (int64_t*)malloc((size_t)nrows * sizeof(int64_t) + (size_t)nq * 3 * sizeof(float*) +
                                    (size_t)(total + nq * (D8 + Dv) + KEY_BLOCK * wmax) * sizeof(float) +
                                    (size_t)(dp ? nq * D : 0) * sizeof(uint16_t));
    if (!mem) return -1;
    P->krow = mem, P->kown = mem + nS, P->vrow = vsep ? P->kown + nown : mem, P->vown = P->vrow + nS;
    P->span_q = (const float**)(mem + nrows), P->span_s = (float**)(P->span_q + nq), P->span_o = P->span_s + nq;
    P->s = (float*)(P->span_o + nq), P->qf = P->s + total, P->o = P->qf + nq * D8, P->wide = P->o + nq * Dv;
    P->qb = dp ? (uint16_t*)(P->wide + KEY_BLOCK * wmax) : NULL;
    const int64_t* slots = J->kv_slots + J->seq[t_lo] * J->Lk;
    for (int64_t j = 0; j < nS; j++) P->krow[j] = slots[a + j] * J->H_kv * D, P->vrow[j] = slots[a + j] * J->H_kv * Dv;
    for (int64_t i = 0; i < nt; i++) {
        int64_t t = t_lo + i, n_run = J->run_hi[t] - J->run_lo[t], m = P->own_at[i];
        for (int64_t j = 0; j < P->Ls[i]; j++) {
            if (j == P->pre[i]) j += nS; /* the span's keys are in krow (a skip, not a test per key) */
            if (j >= P->Ls[i]) break;
            int64_t c = j < n_run ? J->run_lo[t] + j : J->extra[J->extra_off[t] + j - n_run];
            P->kown[m] = slots[c] * J->H_kv * D, P->vown[m++] = slots[c] * J->H_kv * Dv;
        }
        for (int64_t hh = 0; hh < HP; hh++) {
            int64_t h = (kv_lo + hh / ng) * G + g_lo + hh % ng, k = hh / ng * nt * ng + i * ng + hh % ng;
            float* qv = P->qf + (i * HP + hh) * D8;
            for (int64_t d = 0; d < D8; d++) qv[d] = d < D ? load1(J->q, (t * H + h) * D + d, b16) : 0.0f;
            if (P->qb) memcpy(P->qb + (i * HP + hh) * D, (const uint16_t*)J->q + (t * H + h) * D, (size_t)D * sizeof(uint16_t));
            P->span_q[k] = qv;
            P->span_s[k] = P->s + P->sbase[i] + hh * P->Ls[i] + P->pre[i];
            P->span_o[k] = P->o + (i * HP + hh) * Dv;
        }
    }
    memset(P->o, 0, (size_t)(nq * Dv) * sizeof(float));
    return 0;
}

/* A query group of a pass: heads g0 .. g0+n-1 (n <= MAX_NH) of KV head kv of the pass for token i,
 * hh the first's index among the pass's heads; their score rows sq (Ls[i] apart), fp32 vectors q (D8
 * apart), bf16 bits qb (ops.scores_bf16; else NULL), output rows o (Dv apart), and their KV head's keys
 * kb and values vb in the pages. */
typedef struct {
    int64_t i, kv, g0, n, hh;
    float *sq, *o;
    const float* q;
    const uint16_t* qb;
    const char *kb, *vb;
} group_t;

static inline void group_at(const pass_t* P, group_t* g) {
    const attend_job* J = P->J;
    int64_t esz = J->bf16 ? 2 : 4;
    g->n = P->ng - g->g0 < MAX_NH ? P->ng - g->g0 : MAX_NH, g->hh = g->kv * P->ng + g->g0;
    g->sq = P->s + P->sbase[g->i] + g->hh * P->Ls[g->i];
    g->o = P->o + (g->i * P->HP + g->hh) * J->Dv;
    g->q = P->qf + (g->i * P->HP + g->hh) * P->D8;
    g->qb = P->qb ? P->qb + (g->i * P->HP + g->hh) * J->D : NULL;
    g->kb = (const char*)J->k_cache + (P->kv_lo + g->kv) * J->D * esz;
    g->vb = (const char*)J->v_cache + (P->kv_lo + g->kv) * J->Dv * esz;
}
static inline group_t group_first(const pass_t* P) {
    group_t g = {0};
    if (P->nt > 0) group_at(P, &g);
    return g;
}
static inline void group_next(const pass_t* P, group_t* g) { /* heads, then KV heads, then tokens */
    if ((g->g0 += MAX_NH) >= P->ng) {
        g->g0 = 0;
        if (++g->kv >= P->nkv) g->kv = 0, g->i++;
    }
    if (g->i < P->nt) group_at(P, g);
}
/* every query group of pass P, token by token, as g */
#define EACH_GROUP(P, g) for (group_t g = group_first(P); g.i < (P)->nt; group_next(P, &g))

/* every score of the pass */
static void pass_scores(const pass_t* P) {
    const attend_job* J = P->J;
    int b16 = (int)J->bf16;
    int64_t D = J->D, nS = P->nS;
    if (P->tiles) {
        ops.tile_scores(P);
    } else if (!b16 && P->nt == 1 && P->nkv > 1) {
        /* One token of several KV heads, fp32 (a decode step of many sequences): each key's rows for
         * every KV head in turn, so the pages are read in address order, which the hardware
         * prefetchers stream (a batch's decode attention took less time so; docs/results.md does not
         * summarize it: docs/measurements/cpu-avx512-2026-11-25-kernels/NOTES.md); bf16's half-size
         * rows gained nothing, and several tokens are better served by the blocks, whose groups share
         * each key between tokens. The same scores at every level. */
        for (int64_t j0 = 0; j0 < nS; j0++)
            EACH_GROUP(P, g)
                scores_n(g.n, g.q, g.qb, g.kb, P->krow + j0, 1, D, P->D8, b16, g.sq + P->pre[g.i] + j0, P->Ls[g.i], 0);
    } else {
        for (int64_t j0 = 0; j0 < nS; j0 += KEY_BLOCK) {
            int64_t nb = nS - j0 < KEY_BLOCK ? nS - j0 : KEY_BLOCK;
            EACH_GROUP(P, g) /* the first group of the pass prefetches the span for all */
                scores_n(g.n, g.q, g.qb, g.kb, P->krow + j0, nb, D, P->D8, b16, g.sq + P->pre[g.i] + j0, P->Ls[g.i],
                         g.i || g.g0 ? 0 : nS - j0);
        }
    }
    EACH_GROUP(P, g) { /* each token's own keys, before the span and after it */
        const int64_t* ko = P->kown + P->own_at[g.i];
        int64_t pre = P->pre[g.i], post = P->Ls[g.i] - nS - pre;
        scores_n(g.n, g.q, g.qb, g.kb, ko, pre, D, P->D8, b16, g.sq, P->Ls[g.i], g.g0 ? 0 : pre);
        scores_n(g.n, g.q, g.qb, g.kb, ko + pre, post, D, P->D8, b16, g.sq + pre + nS, P->Ls[g.i], g.g0 ? 0 : post);
    }
}

/* scale, soft-capping and softmax of every query row */
static void pass_softmax(const pass_t* P) {
    for (int64_t i = 0; i < P->nt; i++)
        for (int64_t hh = 0; hh < P->HP; hh++)
            normalize_scores(P->s + P->sbase[i] + hh * P->Ls[i], P->Ls[i], P->J->scale, P->J->softcap);
}

/* every output: each query's own keys before the span, the span, its own keys after it, one FMA per
 * key in that order, the running sums in o */
static void pass_values(const pass_t* P) {
    int b16 = (int)P->J->bf16;
    int64_t Dv = P->J->Dv, nS = P->nS;
    EACH_GROUP(P, g) {
        int64_t pre = P->pre[g.i];
        wsum_n(g.n, g.sq, P->Ls[g.i], g.vb, P->vown + P->own_at[g.i], pre, Dv, b16, g.o, g.g0 ? 0 : pre);
    }
    if (P->tiles) ops.tile_values(P);
    else
        for (int64_t j0 = 0; j0 < nS; j0 += KEY_BLOCK) {
            int64_t nb = nS - j0 < KEY_BLOCK ? nS - j0 : KEY_BLOCK;
            EACH_GROUP(P, g)
                wsum_n(g.n, g.sq + P->pre[g.i] + j0, P->Ls[g.i], g.vb, P->vrow + j0, nb, Dv, b16, g.o,
                       g.i || g.g0 ? 0 : nS - j0);
        }
    EACH_GROUP(P, g) {
        int64_t pre = P->pre[g.i], post = P->Ls[g.i] - nS - pre;
        wsum_n(g.n, g.sq + pre + nS, P->Ls[g.i], g.vb, P->vown + P->own_at[g.i] + pre, post, Dv, b16, g.o,
               g.g0 ? 0 : post);
    }
}
#undef EACH_GROUP

/* the outputs in the cache's dtype; frees the pass */
static void pass_end(pass_t* P) {
    const attend_job* J = P->J;
    int64_t G = J->H / J->H_kv;
    for (int64_t i = 0; i < P->nt; i++)
        for (int64_t hh = 0; hh < P->HP; hh++) {
            int64_t h = (P->kv_lo + hh / P->ng) * G + P->g_lo + hh % P->ng;
            for (int64_t d = 0; d < J->Dv; d++)
                store1(J->out, ((P->t_lo + i) * J->H + h) * J->Dv + d, P->o[(i * P->HP + hh) * J->Dv + d], (int)J->bf16);
        }
    free(P->krow);
}

/* a pass; returns 0, or -1 when scratch memory could not be had */
static int64_t attend_pass(const attend_job* J, int64_t t_lo, int64_t t_hi, int64_t kv_lo, int64_t kv_hi,
                           int64_t g_lo, int64_t g_hi) {
    pass_t P;
    if (pass_begin(&P, J, t_lo, t_hi, kv_lo, kv_hi, g_lo, g_hi)) return -1;
    pass_scores(&P);
    pass_softmax(&P);
    pass_values(&P);
    pass_end(&P);
    return 0;
}

/* ------------------------------------------------------------------ the call over the threads */

/* Part p = (run r, KV piece, head piece, token piece): a piece of one sequence's tokens in this step,
 * each with a piece of the query heads of some KV heads, in passes of up to PASS_TOKENS tokens. */
static void attend_part(void* ctx, int64_t part) {
    attend_job* j = (attend_job*)ctx;
    int64_t G = j->H / j->H_kv, c = part % j->chunks, rest = part / j->chunks;
    int64_t hp = rest % j->hsplit, kp = rest / j->hsplit % j->kvsplit, r = rest / j->hsplit / j->kvsplit;
    int64_t kv_lo = j->H_kv * kp / j->kvsplit, kv_hi = j->H_kv * (kp + 1) / j->kvsplit;
    int64_t g_lo = G * hp / j->hsplit, g_hi = G * (hp + 1) / j->hsplit;
    int64_t n = j->starts[r + 1] - j->starts[r];
    int64_t lo = j->starts[r] + n * c / j->chunks, hi = j->starts[r] + n * (c + 1) / j->chunks;
    if (kv_lo >= kv_hi || g_lo >= g_hi) return;
    for (int64_t t = lo; t < hi; t += PASS_TOKENS)
        if (attend_pass(j, t, hi - t < PASS_TOKENS ? hi : t + PASS_TOKENS, kv_lo, kv_hi, g_lo, g_hi))
            atomic_store(&j->failed, 1);
}

/* attention of T tokens (see attend_pass; a sequence's tokens are consecutive); returns 0, or -1
 * when scratch memory could not be had */
int64_t attend(const void* q, int64_t T, int64_t H, int64_t D, int64_t Dv, const void* k_cache, const void* v_cache,
               int64_t H_kv, const int64_t* kv_slots, int64_t Lk, const int64_t* seq, const int64_t* run_lo,
               const int64_t* run_hi, const int64_t* extra_off, const int64_t* extra, float scale, float softcap,
               void* out, int64_t bf16, int64_t threads) {
    if (T <= 0) return 0;
    int64_t* starts = (int64_t*)malloc((size_t)(T + 1) * sizeof(int64_t));
    if (!starts) return -1;
    int64_t runs = 0, longest = 0; /* sequences, and the most tokens one feeds */
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || seq[t] != seq[t - 1]) starts[runs++] = t;
    starts[runs] = T;
    for (int64_t r = 0; r < runs; r++) longest = starts[r + 1] - starts[r] > longest ? starts[r + 1] - starts[r] : longest;
    /* As few parts as keep the threads busy, since a part reads its keys once for all its queries.
     * With at least two sequences per thread a part is a whole sequence: its pages are then read front
     * to back, all KV heads at once. Otherwise a part is one KV head of a sequence (keys a row apart),
     * and where that gives too few parts the tokens, then the query heads of a KV head, are cut too. */
    int64_t want = threads > 1 ? threads : 1, group = H / H_kv, kvsplit = 1, hsplit = 1, chunks = 1;
    if (runs < 2 * want) {
        kvsplit = H_kv;
        int64_t groups = runs * H_kv;
        chunks = (want + groups - 1) / groups;
        /* parts a multiple of the threads where the tokens allow (3 KV heads on 2 threads: 6 parts,
         * each reading its KV head's keys for half the tokens, rather than 3 parts of which one
         * thread takes two: a 9-token step's attention took less time so, the same notes) */
        while (chunks < longest && (groups * chunks) % want) chunks++;
        if (chunks > longest) { /* too few tokens: cut the heads of a KV head too */
            chunks = longest;
            hsplit = (want + groups * chunks - 1) / (groups * chunks);
            hsplit = hsplit < group ? hsplit : group;
        }
    }
    attend_job j = {q, k_cache, v_cache, kv_slots, seq, run_lo, run_hi, extra_off, extra, out,
                    T, H, D, Dv, H_kv, Lk, bf16, scale, softcap, starts, chunks, kvsplit, hsplit, 0};
    run_parallel(attend_part, &j, runs * kvsplit * hsplit * chunks, threads);
    free(starts);
    return atomic_load(&j.failed) ? -1 : 0;
}
