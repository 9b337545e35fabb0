/* RMS norms and the decoder layers of a decode step (steps.c_layers drives them), with the elementwise
 * loops' portable entries (elementwise.h; level 0). */
#include "cpu_kernels.h"
#include "elementwise.h"

/* ------------------------------------------------------------------ elementwise, portable */

void rms_rows_c(const void* x, int64_t m_lo, int64_t m_hi, int64_t K, const void* w, float eps, int64_t form,
                void* out, int b16) {
    EACH_DTYPE(rms_rows_n(x, m_lo, m_hi, K, w, eps, form, out, B));
}
void add_into_c(void* x, const void* y, int64_t n, int b16) { EACH_DTYPE(binary_n(x, x, y, n, 0, B)); }
void mul_to_c(void* out, const void* a, const void* b, int64_t n, int b16) { EACH_DTYPE(binary_n(out, a, b, n, 1, B)); }
void rope_c(void* x, int64_t T, int64_t nh, int64_t D, const void* cos, const void* sin, int b16) {
    EACH_DTYPE(rope_n(x, T, nh, D, cos, sin, B));
}

/* ------------------------------------------------------------------ RMS norms */

/* RMS normalization of M rows of K values, x, out and w [K] of the dtype code `bf16` (fp32, bf16, fp16):
 *   r = 1 / sqrt(sum(x^2) / K + eps), the sum in 8 lanes over K (lane l: k = l, l + 8, ...)
 *   added in sum8's fixed tree;
 *   form 0 (Llama's): out = w * round(x * r)  (round: to the dtype, a no-op in fp32)
 *   form 1 (Gemma's): out = round(x * r * (1 + w)).
 * Each row alone, in one fixed order whatever M; prompt chunks of many rows are cut into blocks of
 * NORM_ROWS rows over the threads (a row is a few hundred values: fewer rows stay on one thread). */
#define NORM_ROWS 64
typedef struct {
    const void *x, *w;
    void* out;
    int64_t M, K, form, bf16;
    float eps;
} norm_job;

static void norm_part(void* ctx, int64_t part) {
    norm_job* j = (norm_job*)ctx;
    int64_t lo = part * NORM_ROWS, hi = lo + NORM_ROWS < j->M ? lo + NORM_ROWS : j->M;
    ops.rms_rows(j->x, lo, hi, j->K, j->w, j->eps, j->form, j->out, (int)j->bf16);
}

int64_t rms_norm(const void* x, int64_t M, int64_t K, const void* w, float eps, int64_t form, void* out, int64_t bf16,
                 int64_t threads) {
    norm_job j = {x, w, out, M, K, form, bf16, eps};
    run_parallel(norm_part, &j, (M + NORM_ROWS - 1) / NORM_ROWS, M >= 2 * NORM_ROWS ? threads : 1);
    return 0;
}

/* ------------------------------------------------------------------ decoder layers */

/* A decode step of a Llama-form model runs its layers here, two calls per layer, instead of HF's
 * modules (about 300 Python-level calls a layer). Every operation is the one invariant mode runs
 * through the modules, with the same rounding: the norms and linears, attend, and torch's own
 * elementwise arithmetic written out (a product or a sum rounded to fp32, then to bf16 or fp16 for
 * such tensors). Only the activation stays with the model's module, between the two calls: its exp is
 * torch's. The structs are steps.c_layers' _Shape, _Layer, _Step and _Keys. */

typedef struct { /* sizes, the same for every layer */
    int64_t hidden, H, H_kv, D, inter, dt; /* dt: the dtype code (cpu_kernels.h) */
} dec_shape;

typedef struct { /* one layer's tensors (NULL: absent) */
    const void *ln1, *ln2, *q_norm, *k_norm;      /* RMSNorm weights (q_norm, k_norm: per head, D) */
    const void *wq, *wk, *wv, *wo, *wg, *wu, *wd; /* linear weights [N, K] */
    const void *bq, *bk, *bv, *bo, *bg, *bu, *bd; /* biases */
    void *k_cache, *v_cache;                      /* the layer's pages, [slots, H_kv, D] */
    float eps1, eps2, eps_qk, scale, softcap;
    int64_t form1, form2, form_qk; /* rms_norm forms */
    /* Gemma 2/3's sandwich norms (NULL in a Llama layer): on the attention's and the MLP's outputs,
     * before each is added to the residual stream; ln2 is then the MLP's input norm */
    const void *ln_attn_out, *ln_mlp_out;
    float eps_attn_out, eps_mlp_out;
    int64_t form_attn_out, form_mlp_out;
    int64_t wkind[7]; /* the weight kind (cpu_kernels.h) of wq, wk, wv, wo, wg, wu, wd */
} dec_layer;

typedef struct { /* one step of T tokens */
    int64_t T, threads;
    const int64_t* slots;                /* [T] each token's flat cache slot */
    const void *cos, *sin;               /* [T, D] the rotary tables at the tokens' positions */
    void *h, *x, *q, *k, *v, *a, *g, *u; /* [T, hidden] the residual stream (in place); scratch */
} dec_step;

typedef struct { /* the keys each token reads in a layer: attend's arguments (they depend on the window) */
    const int64_t *kv_slots, *seq, *run_lo, *run_hi, *extra_off, *extra;
    int64_t Lk;
} dec_keys;

/* Where the layers' time goes (eval/step_bench.py --breakdown): nanoseconds per phase, summed while
 * on. Phases: 0 norms, RoPE, KV writes and the elementwise products and sums; 1 q/k/v; 2 attention;
 * 3 o_proj; 4 gate/up; 5 down. */
#define PHASES 6
static int64_t phase_on, phase_ns[PHASES];
#define PHASE(i)                               \
    do {                                       \
        if (phase_on) {                        \
            int64_t t_ = now_ns();             \
            phase_ns[i] += t_ - phase_t;       \
            phase_t = t_;                      \
        }                                      \
    } while (0)

/* copies the sums into out [PHASES] (when not NULL) and zeroes them; on: keep timing */
int64_t layer_phases(int64_t on, int64_t* out) {
    for (int i = 0; i < PHASES; i++) {
        if (out) out[i] = phase_ns[i];
        phase_ns[i] = 0;
    }
    phase_on = on;
    return PHASES;
}

/* First half of a layer: x = norm1(h); q, k, v = its projections (q and k normed per head where the
 * layer has those norms); RoPE; k and v stored at the tokens' slots; a = attention; h += o_proj(a)
 * (normed first where the layer has ln_attn_out); x = norm2(h); g, u = gate and up projections of x.
 * The caller then computes y = act(g). */
EXPORT int64_t layer_attention(const dec_shape* S, const dec_layer* L, const dec_step* P, const dec_keys* K) {
    int64_t T = P->T, hid = S->hidden, D = S->D, qn = S->H * D, kn = S->H_kv * D, b16 = S->dt;
    int64_t esz = b16 ? 2 : 4, phase_t = phase_on ? now_ns() : 0;
    rms_norm(P->h, T, hid, L->ln1, L->eps1, L->form1, P->x, b16, P->threads);
    PHASE(0);
    const void* w[3] = {L->wq, L->wk, L->wv};
    const void* b[3] = {L->bq, L->bk, L->bv};
    void* o[3] = {P->q, P->k, P->v};
    int64_t N[3] = {qn, kn, kn};
    if (linears(P->x, T, hid, 3, w, L->wkind, b, o, N, b16, P->threads)) return -1;
    PHASE(1);
    if (L->q_norm) rms_norm(P->q, T * S->H, D, L->q_norm, L->eps_qk, L->form_qk, P->q, b16, 1);
    if (L->k_norm) rms_norm(P->k, T * S->H_kv, D, L->k_norm, L->eps_qk, L->form_qk, P->k, b16, 1);
    ops.rope(P->q, T, S->H, D, P->cos, P->sin, (int)b16);
    ops.rope(P->k, T, S->H_kv, D, P->cos, P->sin, (int)b16);
    for (int64_t t = 0; t < T; t++) {
        memcpy((char*)L->k_cache + P->slots[t] * kn * esz, (const char*)P->k + t * kn * esz, (size_t)(kn * esz));
        memcpy((char*)L->v_cache + P->slots[t] * kn * esz, (const char*)P->v + t * kn * esz, (size_t)(kn * esz));
    }
    PHASE(0);
    if (attend(P->q, T, S->H, D, D, L->k_cache, L->v_cache, S->H_kv, K->kv_slots, K->Lk, K->seq, K->run_lo,
               K->run_hi, K->extra_off, K->extra, L->scale, L->softcap, P->a, b16, P->threads))
        return -1;
    PHASE(2);
    if (linear(P->a, T, L->wo, L->wkind[3], qn, L->bo, hid, P->x, b16, P->threads)) return -1;
    PHASE(3);
    if (L->ln_attn_out) rms_norm(P->x, T, hid, L->ln_attn_out, L->eps_attn_out, L->form_attn_out, P->x, b16, P->threads);
    ops.add_into(P->h, P->x, T * hid, (int)b16);
    rms_norm(P->h, T, hid, L->ln2, L->eps2, L->form2, P->x, b16, P->threads);
    PHASE(0);
    const void* w2[2] = {L->wg, L->wu};
    const void* b2[2] = {L->bg, L->bu};
    void* o2[2] = {P->g, P->u};
    int64_t N2[2] = {S->inter, S->inter};
    int64_t failed = linears(P->x, T, hid, 2, w2, L->wkind + 4, b2, o2, N2, b16, P->threads);
    PHASE(4);
    return failed;
}

/* Second half, y [T, inter] being act(g): g = y * u (rounded as torch's product); h += down_proj(g)
 * (normed first where the layer has ln_mlp_out). */
EXPORT int64_t layer_mlp(const dec_shape* S, const dec_layer* L, const dec_step* P, const void* y) {
    int64_t T = P->T, n = T * S->inter;
    int b16 = (int)S->dt;
    int64_t phase_t = phase_on ? now_ns() : 0;
    ops.mul_to(P->g, y, P->u, n, b16);
    PHASE(0);
    if (linear(P->g, T, L->wd, L->wkind[6], S->inter, L->bd, S->hidden, P->x, S->dt, P->threads)) return -1;
    PHASE(5);
    if (L->ln_mlp_out)
        rms_norm(P->x, T, S->hidden, L->ln_mlp_out, L->eps_mlp_out, L->form_mlp_out, P->x, S->dt, P->threads);
    ops.add_into(P->h, P->x, T * S->hidden, b16);
    PHASE(0);
    return 0;
}
