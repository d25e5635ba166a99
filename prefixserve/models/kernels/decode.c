/* A decode step of a Llama-family model in one call: every layer, then the final norm and the
 * logits, for n decoded tokens (one per session), on a team of threads (models/native_decode.py
 * `decode_rows`, docs/architecture.md "Decode"); and, with the same per-row arithmetic but
 * attention.c's attention, a layer of a step's prompt rows per call (`prefill_layer`, at the end).
 *
 * Built with attention.c, qmatmul.c and gemm.c by models/native.py and called through ctypes. Decoded
 * tokens' KV is never cached (the engine re-derives it by prefill), so their arithmetic need not
 * match prefill's, only be row-local: each row's bits depend on its own token, position and keys,
 * never on the other rows of the call or on the number of threads. Every step below is one fixed
 * loop per row (fp32 throughout; K and V rounded to bf16 as the cache holds them):
 *   RMSNorm     ss = hsum of 16-lane chains of x*x; r = 1 / sqrtf(ss / d + eps); x * r * w
 *   matmuls     qmatmul.c (4-bit layers, 8- or 4-bit logits); prompt rows' layers gemm.c (one
 *               chain over K per output, lanes over outputs); threads split the outputs
 *   q/k         + bias, per-head RMSNorm (where the model has them), RoPE (fp32 cos/sin)
 *   attention   scores s_j = hsum(q . k_j) (chains of 16 lanes over head_dim, scaled q), m = max,
 *               e_j = exp(s_j - m) (simd.h v_exp, 16 keys at a time), den = hsum of a 16-lane
 *               chain, out = (sum_j e_j v_j, chains in key order) / den
 *   MLP         silu(g) * u with silu(g) = g * sigmoid(g) from exp(-|g|)
 * Threads claim the outputs of a matmul in chunks as they go (`grab`); attention's work is split by
 * (row, kv head) for q/k/v and the K/V write, by 64-key chunks for scores, by (row, head) for softmax
 * weights, by 16 dims for P.V: who computes a value never changes how.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#include "simd.h"

void qmatmul(const float *x, int64_t n, int64_t ldx, int64_t K, int kind, const uint8_t *q, int64_t o0, int64_t o1,
             float *out, int64_t ldo);
int qgemm(const float *x, int64_t n, int64_t ldx, int64_t K, int kind, const uint8_t *q, int64_t o0, int64_t o1,
          float *out, int64_t ldo);
void quantize_q8x(const float *x, int64_t n, int64_t ldx, int64_t K, int8_t *q, float *d, float *sq);
void qmatmul_x(const int8_t *xq, const float *xd, const float *xs, int64_t n, int64_t K, int kind,
               const uint8_t *q, int64_t o0, int64_t o1, float *out, int64_t ldo);
void xgemm_q8(const int8_t *xq, const float *xd, const float *xs, int64_t n, int64_t K, const uint8_t *q, int64_t o0,
              int64_t o1, float *out, int64_t ldo);
int amx_matmul(const void *x, int x_f32, int64_t M, int64_t ldx, int64_t K, const uint16_t *w, const float *bias,
               int64_t o0, int64_t o1, void *out, int out_f32, int64_t ldo);

/* ---- a team of threads: the caller is member 0, MAXT - 1 workers at most ---- */
enum { MAXT = 16, SPINS = 4000 };  /* pauses (~30-140 cycles each) before yielding or sleeping */
typedef void (*task_fn)(void *arg, int t, int T);
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t th[MAXT];
    int started;
    atomic_int gen, done, sleeping;
    task_fn fn;
    void *arg;
    int T;
} team = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static inline void relax(long *spins) {
    if (++*spins < SPINS) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    } else {
        sched_yield();  /* the other member is not running: give the core away */
    }
}

static void *worker(void *p) {
    int t = (int)(intptr_t)p, seen = 0;
    for (;;) {
        long spins = 0;
        while (atomic_load(&team.gen) == seen && spins < SPINS) relax(&spins);
        if (atomic_load(&team.gen) == seen) {
            pthread_mutex_lock(&team.mu);
            atomic_fetch_add(&team.sleeping, 1);
            while (atomic_load(&team.gen) == seen) pthread_cond_wait(&team.cv, &team.mu);
            atomic_fetch_sub(&team.sleeping, 1);
            pthread_mutex_unlock(&team.mu);
        }
        seen = atomic_load(&team.gen);
        if (t < team.T) team.fn(team.arg, t, team.T);
        atomic_fetch_add(&team.done, 1);
    }
    return NULL;
}

static void after_fork(void) { team.started = 0; }  /* a forked child has no workers */

static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;  /* one team call at a time */

static int run_team_locked(task_fn fn, void *arg, int T);

static int run_team(task_fn fn, void *arg, int T) {
    if (T > MAXT) T = MAXT;
    if (T <= 1) {
        fn(arg, 0, 1);
        return 1;
    }
    pthread_mutex_lock(&run_mu);
    int got = run_team_locked(fn, arg, T);
    pthread_mutex_unlock(&run_mu);
    return got;
}

static int run_team_locked(task_fn fn, void *arg, int T) {
    if (team.started < T - 1) {
        if (team.started == 0) pthread_atfork(NULL, NULL, after_fork);
        while (team.started < T - 1) {
            if (pthread_create(&team.th[team.started + 1], NULL, worker, (void *)(intptr_t)(team.started + 1)) != 0)
                break;
            pthread_detach(team.th[team.started + 1]);
            team.started++;
        }
        if (team.started < T - 1) T = team.started + 1;
        if (T <= 1) {
            fn(arg, 0, 1);
            return 1;
        }
    }
    team.fn = fn;
    team.arg = arg;
    team.T = T;
    atomic_store(&team.done, 0);
    pthread_mutex_lock(&team.mu);
    atomic_fetch_add(&team.gen, 1);
    if (atomic_load(&team.sleeping)) pthread_cond_broadcast(&team.cv);
    pthread_mutex_unlock(&team.mu);
    fn(arg, 0, T);
    long spins = 0;
    while (atomic_load(&team.done) < team.started) relax(&spins);  /* every worker, busy or not */
    return T;
}

/* `work`: the next unclaimed output of the matmul between two barriers (`grab`); the last member to
 * arrive sets it back to 0 while the others wait, so no member can still be claiming from it */
typedef struct {
    atomic_int count, sense;
    atomic_llong work;
} barrier_t;

static void barrier(barrier_t *b, int *local, int T) {
    if (T <= 1) {
        atomic_store(&b->work, 0);
        return;
    }
    *local = !*local;
    if (atomic_fetch_add(&b->count, 1) == T - 1) {
        atomic_store(&b->count, 0);
        atomic_store(&b->work, 0);
        atomic_store(&b->sense, *local);
    } else {
        long spins = 0;
        while (atomic_load(&b->sense) != *local) relax(&spins);
    }
}

/* ---- the team's share of a matmul: blocks of 16 outputs (N a multiple of 16) split evenly ---- */
static void share(int64_t N, int t, int T, int64_t *o0, int64_t *o1) {
    int64_t blocks = N / 16;
    *o0 = blocks * t / T * 16;
    *o1 = blocks * (t + 1) / T * 16;
}

/* The next chunk [o0, o1) of a matmul's N outputs (N a multiple of 16) that no member has claimed,
 * from the counter the barriers reset; 0 when none is left. Chunks shrink as the outputs run out
 * (1 / (2T) of what is left, whole blocks of 16, at least GRAB_MIN): a member that a busy machine
 * slowed (a VM's other tenants, another process) takes fewer of them instead of keeping the others
 * at the next barrier. Who computes an output never changes how, so the bits are the same. */
enum { GRAB_MIN = 32 };
static int grab(barrier_t *b, int64_t N, int T, int64_t *o0, int64_t *o1) {
    long long cur = atomic_load(&b->work);
    for (;;) {
        if (cur >= N) return 0;
        int64_t size = T <= 1 ? N : ((N - cur) / (2 * T) + 15) / 16 * 16;
        size = size < GRAB_MIN ? GRAB_MIN : size;
        long long next = cur + size < N ? cur + size : N;
        if (atomic_compare_exchange_weak(&b->work, &cur, next)) {
            *o0 = cur, *o1 = next;
            return 1;
        }
    }
}

typedef struct {
    const float *x;
    int64_t n, ldx, K, N, ldo;
    int kind;
    const uint8_t *q;
    float *out;
} mm_args;

static void mm_task(void *p, int t, int T) {
    mm_args *a = p;
    int64_t o0, o1;
    share(a->N, t, T, &o0, &o1);
    qmatmul(a->x, a->n, a->ldx, a->K, a->kind, a->q, o0, o1, a->out, a->ldo);
}

/* qmatmul of all N outputs on `ways` threads; returns the count used */
int qmatmul_team(const float *x, int64_t n, int64_t ldx, int64_t K, int kind, const uint8_t *q, int64_t N,
                 float *out, int64_t ldo, int ways) {
    mm_args a = {x, n, ldx, K, N, ldo, kind, q, out};
    return run_team(mm_task, &a, ways);
}

typedef struct {
    const uint16_t *x, *w;
    const float *bias;
    int64_t M, ldx, K, N, ldo;
    uint16_t *out;
    atomic_int failed;
} amx_args;

static void amx_task(void *p, int t, int T) {
    amx_args *a = p;
    int64_t o0, o1;
    share(a->N, t, T, &o0, &o1);
    if (amx_matmul(a->x, 0, a->M, a->ldx, a->K, a->w, a->bias, o0, o1, a->out, 0, a->ldo) != 0)
        atomic_store(&a->failed, 1);
}

/* amx.c's bf16 matmul (bf16 rows in, bf16 out) of all N outputs on `ways` threads; the count used, or
 * -1 when it failed */
int amx_linear_team(const uint16_t *x, int64_t M, int64_t ldx, int64_t K, const uint16_t *w, const float *bias,
                    int64_t N, uint16_t *out, int64_t ldo, int ways) {
    amx_args a = {x, w, bias, M, ldx, K, N, ldo, out, 0};
    int used = run_team(amx_task, &a, ways);
    return atomic_load(&a.failed) ? -1 : used;
}

/* ---- row-local pieces ---- */
static float sumsq(const float *x, int64_t d) {
    vec acc = V_ZERO();
    for (int64_t i = 0; i < d; i += 16) {
        vec v = V_LOAD(x + i);
        acc = V_FMA(v, v, acc);
    }
    return hsum(acc);
}

static void rmsnorm(const float *x, const float *w, int64_t d, float eps, float *y) {
    vec r = V_SET1(1.0f / sqrtf(sumsq(x, d) / (float)d + eps));
    for (int64_t i = 0; i < d; i += 16) V_STORE(y + i, V_MUL(V_MUL(V_LOAD(x + i), r), V_LOAD(w + i)));
}

/* rotate-half RoPE of one head in place: x * cos + rot(x) * sin (products rounded, then added) */
static void rope(float *x, const float *cs, const float *sn, int hd) {
    float tmp[512];
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        tmp[i] = x[i] * cs[i] + (-x[i + half]) * sn[i];
        tmp[i + half] = x[i + half] * cs[i + half] + x[i] * sn[i + half];
    }
    memcpy(x, tmp, (size_t)hd * sizeof(float));
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline vec silu(vec g) {
    /* g * sigmoid(g), sigmoid from e = exp(-|g|): 1 / (1 + e) for g >= 0, e / (1 + e) below */
    vec e = v_exp(V_SUB(V_ZERO(), V_ABS(g)));
    vec one = V_SET1(1.0f), den = V_ADD(one, e);
    return V_MUL(g, V_DIV(v_if_negative(g, one, e), den));
}

enum { KEY_CHUNK = 64, MAXREP = 8, KV_DESC = 5, KV_AHEAD = 24 /* rows prefetched ahead */ };  /* keys per scoring task; query heads per kv head scored together */

/* scores of the rep query heads q[rep][hd] (scaled) against keys [j0, j1) (j0, j1 multiples of 16)
 * of one kv head, k: [cap][hd] bf16 (keys at or past cap read as zero); s_h = s + h * stride */
static void score(const float *q, int rep, int hd, const uint16_t *k, int64_t cap, int64_t j0, int64_t j1, float *s,
                  int64_t stride) {
    int nv = hd / 16;
    for (int h0 = 0; h0 < rep; h0 += MAXREP) {
        int nh = rep - h0 < MAXREP ? rep - h0 : MAXREP;
        for (int64_t b = j0; b < j1; b += 16) {
            vec t[MAXREP][16];
            for (int jj = 0; jj < 16; jj++) {
                vec kj[32];
                for (int c = 0; c < nv; c += 2) __builtin_prefetch(k + (b + jj + KV_AHEAD) * hd + 16 * c);
                for (int c = 0; c < nv; c++)
                    kj[c] = b + jj < cap ? v_load_bf16(k + (b + jj) * hd + 16 * c) : V_ZERO();
                for (int h = 0; h < nh; h++) {
                    const float *qh = q + (h0 + h) * hd;
                    vec a = V_MUL(V_LOAD(qh), kj[0]);
                    for (int c = 1; c < nv; c++) a = V_FMA(V_LOAD(qh + 16 * c), kj[c], a);
                    t[h][jj] = a;
                }
            }
            for (int h = 0; h < nh; h++) V_STORE(s + (h0 + h) * stride + b, hsum16(t[h]));
        }
    }
}

/* keys 0..last of one head's scores: e_j = exp(s_j - max) in place (past last: 0); returns the
 * denominator (16 lanes over the blocks in order, then hsum) */
static float softmax_weights(float *sh, int64_t last) {
    int64_t n = last + 1, nb = (n + 15) / 16;
    for (int64_t j = n; j < nb * 16; j++) sh[j] = -INFINITY;
    vec mv = V_SET1(-INFINITY);
    for (int64_t b = 0; b < nb; b++) mv = V_MAX(mv, V_LOAD(sh + b * 16));
    vec m = V_SET1(v_hmax(mv)), den = V_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        vec e = v_exp(V_SUB(V_LOAD(sh + b * 16), m));
        V_STORE(sh + b * 16, e);
        den = V_ADD(den, e);
    }
    return hsum(den);
}

/* one (row, kv head)'s P.V over keys [j0, j1) of V [>= j1][hd] bf16, for its rep query heads' weights
 * e_h = e + h * stride: part_h = part + h * pstride gets sum_j e_j v_j (each output one chain over j
 * in order). A task reads whole rows of V (a thread reading only some dims of each row pulled its
 * neighbour's cache lines too), NH heads by NC 16-dim slices at a time in registers. */
enum { PV_SEG = 256 /* keys of a P.V task; fixed, so the sums' order never depends on the threads */ };
static inline int64_t pv_segs(int64_t keys) { return (keys + PV_SEG - 1) / PV_SEG; }
/* out[0, hd) = (the segs sums at p, p + hd, ..., added in order) / den; p may be out (segs 1) */
static void pv_finish(float *out, const float *p, int64_t segs, int64_t hd, float den) {
    for (int64_t d = 0; d < hd; d += 16) {
        vec sum = V_LOAD(p + d);
        for (int64_t q = 1; q < segs; q++) sum = V_ADD(sum, V_LOAD(p + q * hd + d));
        V_STORE(out + d, V_DIV(sum, V_SET1(den)));
    }
}
static inline __attribute__((always_inline)) void weigh_group(const float *e, int64_t stride, int hd,
                                                               const uint16_t *v, int64_t j0, int64_t j1, int h0,
                                                               const int nh, int c0, const int nc, float *part,
                                                               int64_t pstride) {
    vec acc[6][4];
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < nc; i++) acc[h][i] = V_ZERO();
    for (int64_t j = j0; j < j1; j++) {
        vec vj[4];
        for (int i = 0; i < nc; i += 4) __builtin_prefetch(v + (j + KV_AHEAD) * hd + 16 * (c0 + i));
        for (int i = 0; i < nc; i++) vj[i] = v_load_bf16(v + j * hd + 16 * (c0 + i));
        for (int h = 0; h < nh; h++) {
            vec eh = V_SET1(e[(h0 + h) * stride + j]);
            for (int i = 0; i < nc; i++) acc[h][i] = V_FMA(eh, vj[i], acc[h][i]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < nc; i++) V_STORE(part + (h0 + h) * pstride + 16 * (c0 + i), acc[h][i]);
}
static void weigh_values(const float *e, int64_t stride, int rep, int hd, const uint16_t *v, int64_t j0, int64_t j1,
                         float *part, int64_t pstride) {
    int nv = hd / 16;
    for (int c0 = 0; c0 < nv; c0 += 4) {
        int nc = nv - c0 < 4 ? nv - c0 : 4;
        for (int h0 = 0; h0 < rep; h0 += 6) {
            int nh = rep - h0 < 6 ? rep - h0 : 6;
            switch (nc == 4 ? nh : 0) {  /* registers for constant shapes; any other runs a slice at a time */
            case 1: weigh_group(e, stride, hd, v, j0, j1, h0, 1, c0, 4, part, pstride); break;
            case 2: weigh_group(e, stride, hd, v, j0, j1, h0, 2, c0, 4, part, pstride); break;
            case 3: weigh_group(e, stride, hd, v, j0, j1, h0, 3, c0, 4, part, pstride); break;
            case 4: weigh_group(e, stride, hd, v, j0, j1, h0, 4, c0, 4, part, pstride); break;
            case 5: weigh_group(e, stride, hd, v, j0, j1, h0, 5, c0, 4, part, pstride); break;
            case 6: weigh_group(e, stride, hd, v, j0, j1, h0, 6, c0, 4, part, pstride); break;
            default:
                for (int h = h0; h < h0 + nh; h++)
                    for (int c = c0; c < c0 + nc; c++) weigh_group(e, stride, hd, v, j0, j1, h, 1, c, 1, part, pstride);
            }
        }
    }
}

/* ---- the step ---- */
/* a layer's weights: fp32 vectors and packs; W_KINDS: bit i set when pack i (qkv, o, gate_up, down)
 * is a qmatmul.c Q8 pack rather than Q4, bit 4 + i when it is an amx.c bf16 pack (prompt rows on a
 * CPU with AMX: models/native_decode.py), bit 8 + i when it is a gemm.c P4 pack (prompt rows' copy of
 * a Q4 pack in panel order), bit 12 + i when it is a gemm.c X4 pack (prompt rows' copy of a Q4 pack,
 * multiplied by the rows rounded to int8) */
enum { W_ATTN_NORM, W_MLP_NORM, W_Q_NORM, W_K_NORM, W_QKV_BIAS, W_QKV, W_O, W_GATE_UP, W_DOWN, W_KINDS, W_PER_LAYER };

/* out[:, o0:o1] = x W^T for pack i of layer weights w: qmatmul.c's arithmetic (gemm.c's for prompt rows),
 * or amx.c's on the rows rounded to bf16 (row-local either way); 0, or -1 when out of memory */
static int matmul(const int64_t *w, int i, const float *x, int64_t n, int64_t ldx, int64_t K, int64_t o0,
                  int64_t o1, float *out, int64_t ldo, int prompt) {
    const uint8_t *pack = (const uint8_t *)w[W_QKV + i];
    if (w[W_KINDS] >> (4 + i) & 1)
        return amx_matmul(x, 1, n, ldx, K, (const uint16_t *)pack, NULL, o0, o1, out, 1, ldo) == 0 ? 0 : -1;
    if (prompt)  /* X4 packs never reach here: `mm` quantizes their rows once a matmul */
        return qgemm(x, n, ldx, K, w[W_KINDS] >> (8 + i) & 1 ? 2 : (int)(w[W_KINDS] >> i & 1), pack, o0, o1, out, ldo);
    qmatmul(x, n, ldx, K, (int)(w[W_KINDS] >> i & 1), pack, o0, o1, out, ldo);
    return 0;
}

typedef struct {
    int64_t n, hidden, heads, kv_heads, hd, inter, layers, vocab_pad, head_kind;
    float eps, scale;
    const int64_t *w;        /* [layers][W_PER_LAYER] addresses (0: absent) */
    const float *final_norm; /* [hidden] */
    const uint8_t *head;     /* the logits' weight (qmatmul layout) */
    float *h;                /* [n][hidden] in: embeddings; out: the last layer's output */
    const int64_t *pos;      /* [n] */
    const float *cs, *sn;    /* [n][hd] */
    const int64_t *kv;       /* [n][KV_DESC]: K address of layer 0 head 0, layer stride, V - K offset, head stride
                              * (elements), capacity (keys) */
    float *y;                /* [n][vocab_pad] logits */
    /* scratch */
    float *qkv, *attn, *gu, *act, *tmp, *xs; /* xs: [T][n][max(hidden, inter)] */
    float *q;                                /* [n][heads][hd]: rotated, scaled queries */
    float *scores, *den;                     /* [n][heads][stride], [n][heads] */
    float *parts;                            /* [n][heads][stride / PV_SEG rounded up][hd]: P.V stretches' sums */
    int64_t stride;
    int q8x;      /* decode rows' matmuls on int8 activations (qmatmul.c `qmatmul_x`) */
    int prompt;   /* prompt rows (`prefill_layer`): the layers' 4-bit matmuls are gemm.c's */
    int8_t *xq;   /* [T][n][max(hidden, inter)]: each member's quantized rows */
    float *xqd;   /* [T][2][n][max(hidden, inter) / 32]: their scales, then their sums */
    barrier_t bar;
    atomic_int failed; /* amx.c could not have its staging buffer */
} step_t;

/* out[:, o0:o1] = x W^T for pack i of layer weights w (w NULL: the logits' weight): `matmul`, or, in a
 * decode step with q8x (or prompt rows on a gemm.c X4 pack), the int8 kernel on x quantized into member
 * t's own buffers -- where `fresh` says x is new to this member: its first chunk of a matmul (`grab`) */
static int mm(step_t *s, int t, const int64_t *w, int i, const float *x, int64_t ldx, int64_t K, int64_t o0,
              int64_t o1, float *out, int64_t ldo, int fresh) {
    int64_t n = s->n;
    int x4 = s->prompt && w && (w[W_KINDS] >> (12 + i) & 1);
    if (!x4 && (!s->q8x || (w && w[W_KINDS] >> (4 + i) & 1))) {
        if (w) return matmul(w, i, x, n, ldx, K, o0, o1, out, ldo, s->prompt);
        qmatmul(x, n, ldx, K, (int)s->head_kind, s->head, o0, o1, out, ldo);
        return 0;
    }
    int64_t wide = s->hidden > s->inter ? s->hidden : s->inter;
    int8_t *xq = s->xq + (int64_t)t * n * wide;
    float *d = s->xqd + (int64_t)t * 2 * n * (wide / 32), *sq = d + n * (wide / 32);
    if (fresh) quantize_q8x(x, n, ldx, K, xq, d, sq);
    if (x4)
        xgemm_q8(xq, d, sq, n, K, (const uint8_t *)w[W_QKV + i], o0, o1, out, ldo);
    else
        qmatmul_x(xq, d, sq, n, K, w ? (int)(w[W_KINDS] >> i & 1) : (int)s->head_kind,
                  w ? (const uint8_t *)w[W_QKV + i] : s->head, o0, o1, out, ldo);
    return 0;
}

/* h += tmp over the outputs [o0, o1) this member computed */
static void residual(step_t *s, int64_t o0, int64_t o1) {
    for (int64_t r = 0; r < s->n; r++)
        for (int64_t i = o0; i < o1; i++) s->h[r * s->hidden + i] = s->h[r * s->hidden + i] + s->tmp[r * s->hidden + i];
}

/* the attention of layer l's rows (K/V of their positions written): scores by chunks of keys, then
 * softmax weights by head, then outputs by 16 dims, a barrier after each */
static void decode_attention(step_t *s, int64_t l, int t, int T, int *local) {
    int64_t n = s->n, hd = s->hd, kvh = s->kv_heads, rep = s->heads / kvh, idx = 0;
    for (int64_t r = 0; r < n; r++)
        for (int64_t g = 0; g < kvh; g++) {
            const int64_t *kv = s->kv + r * KV_DESC;
            const uint16_t *kc = (const uint16_t *)kv[0] + l * kv[1] + g * kv[3];
            int64_t keys = (s->pos[r] + 16) / 16 * 16;
            for (int64_t j0 = 0; j0 < keys; j0 += KEY_CHUNK, idx++) {
                if (idx % T != t) continue;
                int64_t j1 = j0 + KEY_CHUNK < keys ? j0 + KEY_CHUNK : keys;
                score(s->q + (r * s->heads + g * rep) * hd, (int)rep, (int)hd, kc, kv[4], j0, j1,
                      s->scores + (r * s->heads + g * rep) * s->stride, s->stride);
            }
        }
    barrier(&s->bar, local, T);
    for (int64_t i = t; i < n * s->heads; i += T) s->den[i] = softmax_weights(s->scores + i * s->stride, s->pos[i / s->heads]);
    barrier(&s->bar, local, T);
    /* P.V by (row, kv head, PV_SEG keys): a row with one such stretch writes its outputs, a longer
     * one its stretches' sums (parts), added in order after a barrier */
    int64_t pstride = pv_segs(s->stride) * hd;
    int any_parts = 0;
    idx = 0;
    for (int64_t r = 0; r < n; r++) {
        int64_t keys = s->pos[r] + 1, segs = pv_segs(keys);
        any_parts |= segs > 1;
        for (int64_t g = 0; g < kvh; g++) {
            const int64_t *kv = s->kv + r * KV_DESC;
            const uint16_t *vc = (const uint16_t *)kv[0] + l * kv[1] + g * kv[3] + kv[2];
            int64_t first = r * s->heads + g * rep;
            for (int64_t q = 0; q < segs; q++, idx++) {
                if (idx % T != t) continue;
                int64_t j0 = q * PV_SEG, j1 = j0 + PV_SEG < keys ? j0 + PV_SEG : keys;
                const float *e = s->scores + first * s->stride;
                if (segs == 1) {
                    weigh_values(e, s->stride, (int)rep, (int)hd, vc, j0, j1, s->attn + first * hd, hd);
                    for (int64_t h = first; h < first + rep; h++)
                        pv_finish(s->attn + h * hd, s->attn + h * hd, 1, hd, s->den[h]);
                } else {
                    weigh_values(e, s->stride, (int)rep, (int)hd, vc, j0, j1, s->parts + first * pstride + q * hd,
                                 pstride);
                }
            }
        }
    }
    if (any_parts) {
        barrier(&s->bar, local, T);
        for (int64_t i = t; i < n * s->heads; i += T) {
            int64_t segs = pv_segs(s->pos[i / s->heads] + 1);
            if (segs > 1) pv_finish(s->attn + i * hd, s->parts + i * pstride, segs, hd, s->den[i]);
        }
    }
    barrier(&s->bar, local, T);
}

/* layer l's first half for every row: norm, q/k/v, bias, q/k norms, RoPE; queries scaled into s->q,
 * K and V written at the rows' positions; ends at a barrier */
static void front(step_t *s, int64_t l, int t, int T, int *local) {
    int64_t n = s->n, d = s->hidden, hd = s->hd, kvh = s->kv_heads, rep = s->heads / kvh;
    int64_t qs = s->heads * hd, ks = kvh * hd, nqkv = qs + 2 * ks, inter = s->inter;
    float *x = s->xs + (int64_t)t * n * (d > inter ? d : inter);
    int64_t o0, o1;
    const int64_t *w = s->w + l * W_PER_LAYER;
    const float *qn = (const float *)w[W_Q_NORM], *kn = (const float *)w[W_K_NORM], *bias = (const float *)w[W_QKV_BIAS];
    for (int64_t r = 0; r < n; r++) rmsnorm(s->h + r * d, (const float *)w[W_ATTN_NORM], d, s->eps, x + r * d);
    for (int fresh = 1; grab(&s->bar, nqkv, T, &o0, &o1); fresh = 0)
        if (mm(s, t, w, 0, x, d, d, o0, o1, s->qkv, nqkv, fresh)) atomic_store(&s->failed, 1);
    barrier(&s->bar, local, T);
    for (int64_t task = t; task < n * kvh; task += T) {
        int64_t r = task / kvh, g = task % kvh;
        float *row = s->qkv + r * nqkv, *kr = row + qs + g * hd, *vr = row + qs + ks + g * hd;
        const float *cs = s->cs + r * hd, *sn = s->sn + r * hd;
        for (int64_t h = 0; h < rep; h++) {
            float *qr = row + (g * rep + h) * hd, *dst = s->q + (r * s->heads + g * rep + h) * hd;
            if (bias)
                for (int64_t i = 0; i < hd; i++) qr[i] = qr[i] + bias[(g * rep + h) * hd + i];
            if (qn) rmsnorm(qr, qn, hd, s->eps, qr);
            rope(qr, cs, sn, (int)hd);
            for (int64_t i = 0; i < hd; i++) dst[i] = qr[i] * s->scale;
        }
        if (bias)
            for (int64_t i = 0; i < hd; i++) {
                kr[i] = kr[i] + bias[qs + g * hd + i];
                vr[i] = vr[i] + bias[qs + ks + g * hd + i];
            }
        if (kn) rmsnorm(kr, kn, hd, s->eps, kr);
        rope(kr, cs, sn, (int)hd);
        const int64_t *kv = s->kv + r * KV_DESC;
        uint16_t *kc = (uint16_t *)kv[0] + l * kv[1] + g * kv[3], *vc = kc + kv[2];
        int64_t at = s->pos[r];
        for (int64_t i = 0; i < hd; i++) {
            kc[at * hd + i] = to_bf16(kr[i]);
            vc[at * hd + i] = to_bf16(vr[i]);
        }
    }
    barrier(&s->bar, local, T);
}

/* layer l's second half (s->attn holds the attention's outputs): o_proj and the residual, norm,
 * gate/up, SiLU, down and the residual; ends at a barrier */
static void back(step_t *s, int64_t l, int t, int T, int *local) {
    int64_t n = s->n, d = s->hidden, qs = s->heads * s->hd, inter = s->inter;
    float *x = s->xs + (int64_t)t * n * (d > inter ? d : inter);
    int64_t o0, o1;
    const int64_t *w = s->w + l * W_PER_LAYER;
    for (int fresh = 1; grab(&s->bar, d, T, &o0, &o1); fresh = 0) {
        if (mm(s, t, w, 1, s->attn, qs, qs, o0, o1, s->tmp, d, fresh)) atomic_store(&s->failed, 1);
        residual(s, o0, o1);
    }
    barrier(&s->bar, local, T);
    for (int64_t r = 0; r < n; r++) rmsnorm(s->h + r * d, (const float *)w[W_MLP_NORM], d, s->eps, x + r * d);
    for (int fresh = 1; grab(&s->bar, inter, T, &o0, &o1); fresh = 0) {
        if (mm(s, t, w, 2, x, d, d, o0, o1, s->gu, 2 * inter, fresh) ||
            mm(s, t, w, 2, x, d, d, inter + o0, inter + o1, s->gu, 2 * inter, 0))
            atomic_store(&s->failed, 1);
        for (int64_t r = 0; r < n; r++)
            for (int64_t i = o0; i < o1; i += 16) {
                const float *g = s->gu + r * 2 * inter + i;
                V_STORE(s->act + r * inter + i, V_MUL(silu(V_LOAD(g)), V_LOAD(g + inter)));
            }
    }
    barrier(&s->bar, local, T);
    for (int fresh = 1; grab(&s->bar, d, T, &o0, &o1); fresh = 0) {
        if (mm(s, t, w, 3, s->act, inter, inter, o0, o1, s->tmp, d, fresh)) atomic_store(&s->failed, 1);
        residual(s, o0, o1);
    }
    barrier(&s->bar, local, T);
}

/* the final norm and the logits of every row */
static void logits(step_t *s, int t, int T) {
    int64_t n = s->n, d = s->hidden, inter = s->inter, o0, o1;
    float *x = s->xs + (int64_t)t * n * (d > inter ? d : inter);
    for (int64_t r = 0; r < n; r++) rmsnorm(s->h + r * d, s->final_norm, d, s->eps, x + r * d);
    for (int fresh = 1; grab(&s->bar, s->vocab_pad, T, &o0, &o1); fresh = 0)
        mm(s, t, NULL, 0, x, d, d, o0, o1, s->y, s->vocab_pad, fresh);
}

static void step_task(void *p, int t, int T) {
    step_t *s = p;
    int local = 0;
    for (int64_t l = 0; l < s->layers; l++) {
        front(s, l, t, T, &local);
        decode_attention(s, l, t, T, &local);
        back(s, l, t, T, &local);
    }
    logits(s, t, T);
}

/* dims: n, hidden, heads, kv_heads, head_dim, intermediate, layers, vocab_pad, head_kind, q8x (1: the
 * matmuls on int8 activations, qmatmul.c `qmatmul_x`);
 * returns the threads used, or -1 when out of memory. Shapes are the caller's to check: hidden,
 * intermediate, heads * head_dim multiples of 32, head_dim of 16, head_dim <= 512, heads / kv_heads <= 32,
 * every matmul's outputs (and vocab_pad) a multiple of 16. */
int decode_step(const int64_t *dims, float eps, float scale, const int64_t *w, const float *final_norm,
                const uint8_t *head, float *h, const int64_t *pos, const float *cs, const float *sn,
                const int64_t *kv, float *y, int ways) {
    step_t s;
    memset(&s, 0, sizeof s);
    s.n = dims[0], s.hidden = dims[1], s.heads = dims[2], s.kv_heads = dims[3], s.hd = dims[4];
    s.inter = dims[5], s.layers = dims[6], s.vocab_pad = dims[7], s.head_kind = dims[8], s.q8x = (int)dims[9];
    s.eps = eps, s.scale = scale, s.w = w, s.final_norm = final_norm, s.head = head;
    s.h = h, s.pos = pos, s.cs = cs, s.sn = sn, s.kv = kv, s.y = y;
    int T = ways < 1 ? 1 : (ways > MAXT ? MAXT : ways);
    int64_t n = s.n, qs = s.heads * s.hd, nqkv = qs + 2 * s.kv_heads * s.hd, wide = s.hidden > s.inter ? s.hidden : s.inter;
    int64_t maxpos = 0;
    for (int64_t r = 0; r < n; r++) maxpos = pos[r] > maxpos ? pos[r] : maxpos;
    s.stride = (maxpos + 16) / 16 * 16 + 16;
    float *buf = aligned_alloc(64, (size_t)(n * (nqkv + 2 * qs + 3 * s.inter + s.hidden + s.heads * (s.stride + 1) +
                                                 s.heads * pv_segs(s.stride) * s.hd) +
                                            T * n * wide + (s.q8x ? T * n * wide / 4 + 2 * T * n * (wide / 32) : 0)) *
                                           sizeof(float) + 64);
    if (!buf) return -1;
    float *p = buf;
    s.qkv = p, p += n * nqkv;
    s.attn = p, p += n * qs;
    s.q = p, p += n * qs;
    s.gu = p, p += 2 * n * s.inter;
    s.act = p, p += n * s.inter;
    s.tmp = p, p += n * s.hidden;
    s.scores = p, p += n * s.heads * s.stride;
    s.den = p, p += n * s.heads;
    s.parts = p, p += n * s.heads * pv_segs(s.stride) * s.hd;
    s.xs = p, p += T * n * wide;
    if (s.q8x) {
        s.xqd = p, p += 2 * T * n * (wide / 32);
        s.xq = (int8_t *)p;  /* T n wide bytes: T n wide / 4 floats (wide a multiple of 32) */
    }
    /* run_team settles the member count before any member starts (fewer where a worker could not be
     * created), so every barrier waits for the members that run */
    T = run_team(step_task, &s, T);
    free(buf);
    return atomic_load(&s.failed) ? -1 : T;
}

/* ---- prefill rows, a layer per call (models/native_decode.py `prefill_layer`) ----
 * The same front and back halves as a decode step, for a step's prompt rows: each row's bits are its
 * own (its token, position and keys), whatever the batch, the chunking or the thread count. The
 * attention is attention.c's kernel, one call per segment (its rows at consecutive positions of one
 * session) or per part of one: a long segment's rows are cut into parts of about equal work (a
 * row's keys grow with its position) shared by the team. */
int attention(const float *q, int64_t n, int64_t start, int heads, int kv_heads, int hd, const void *k,
              const void *v, int64_t kv_stride, int bf16, float scale, float *out);

/* rows x keys below which a segment's attention is one call: a 23-row suffix after 630 cached keys
 * (~15,000) is shared, which took its step on two AVX2 threads from 69 to 57 ms (16,384 before) */
enum { SPLIT_WORK = 2048 };

typedef struct {
    step_t s;
    int64_t layer, nseg;
    const int64_t *segs;  /* [nseg][2]: first row, rows (the rows' positions follow pos[first]) */
    atomic_int failed;
} prefill_t;

/* keys attended by a segment's first r rows from position `start` */
static double work(int64_t r, int64_t start) { return (double)r * (double)start + (double)r * (double)(r + 1) / 2; }

/* the first row of part k of T of a segment's n rows from `start`, parts of about equal work */
static int64_t part_start(int64_t n, int64_t start, int k, int T) {
    if (k >= T) return n;
    double goal = work(n, start) * k / T;
    int64_t r = 0;
    while (r < n && work(r, start) < goal) r++;
    return r;
}

static void prefill_task(void *p, int t, int T) {
    prefill_t *pf = p;
    step_t *s = &pf->s;
    int local = 0;
    int64_t l = pf->layer, qs = s->heads * s->hd;
    front(s, l, t, T, &local);
    for (int64_t i = 0; i < pf->nseg; i++) {
        int64_t first = pf->segs[2 * i], rows = pf->segs[2 * i + 1], a = 0, b = rows;
        if (rows <= 0) continue;
        int64_t start = s->pos[first];
        if (rows * (start + rows) >= SPLIT_WORK)
            a = part_start(rows, start, t, T), b = part_start(rows, start, t + 1, T);
        else if (i % T != t)
            continue;
        if (b <= a) continue;
        const int64_t *kv = s->kv + first * KV_DESC;
        const uint16_t *k = (const uint16_t *)kv[0] + l * kv[1];
        if (attention(s->q + (first + a) * qs, b - a, start + a, (int)s->heads, (int)s->kv_heads, (int)s->hd, k,
                      k + kv[2], kv[3], 1, 1.0f, s->attn + (first + a) * qs) != 0)
            atomic_store(&pf->failed, 1);
    }
    barrier(&s->bar, &local, T);
    back(s, l, t, T, &local);
}

static void logits_task(void *p, int t, int T) { logits(p, t, T); }

/* floats of scratch `prefill_layer` needs for n rows on `ways` threads (dims as decode_step's): with
 * each member's normed rows, their int8 copies and scales (`mm` on X4 packs) */
int64_t prefill_scratch(const int64_t *dims, int ways) {
    int64_t n = dims[0], d = dims[1], qs = dims[2] * dims[4], nqkv = qs + 2 * dims[3] * dims[4], inter = dims[5];
    int64_t wide = d > inter ? d : inter;
    int T = ways < 1 ? 1 : (ways > MAXT ? MAXT : ways);
    return n * (nqkv + 2 * qs + 3 * inter + d) + T * n * wide + T * n * wide / 4 + 2 * T * n * (wide / 32);
}

/* layer `layer` for n prompt rows: h [n][hidden] fp32 in and out (the residual stream), K/V written
 * at pos (kv as decode_step's), segs as prefill_t's; scratch: prefill_scratch(dims, ways) floats.
 * Returns the threads used, or -1 when out of memory. */
int prefill_layer(const int64_t *dims, float eps, float scale, const int64_t *w, int64_t layer, float *h,
                  const int64_t *pos, const float *cs, const float *sn, const int64_t *kv, const int64_t *segs,
                  int64_t nseg, float *scratch, int ways) {
    prefill_t pf;
    memset(&pf, 0, sizeof pf);
    step_t *s = &pf.s;
    s->n = dims[0], s->hidden = dims[1], s->heads = dims[2], s->kv_heads = dims[3], s->hd = dims[4];
    s->inter = dims[5], s->layers = dims[6], s->prompt = 1;
    s->eps = eps, s->scale = scale, s->w = w, s->h = h, s->pos = pos, s->cs = cs, s->sn = sn, s->kv = kv;
    int T = ways < 1 ? 1 : (ways > MAXT ? MAXT : ways);
    int64_t n = s->n, qs = s->heads * s->hd, nqkv = qs + 2 * s->kv_heads * s->hd;
    float *p = scratch;
    s->qkv = p, p += n * nqkv;
    s->attn = p, p += n * qs;
    s->q = p, p += n * qs;
    s->gu = p, p += 2 * n * s->inter;
    s->act = p, p += n * s->inter;
    s->tmp = p, p += n * s->hidden;
    int64_t wide = s->hidden > s->inter ? s->hidden : s->inter;
    s->xs = p, p += T * n * wide;
    s->xqd = p, p += 2 * T * n * (wide / 32);
    s->xq = (int8_t *)p;  /* T n wide bytes: T n wide / 4 floats (wide a multiple of 32) */
    pf.layer = layer, pf.segs = segs, pf.nseg = nseg;
    T = run_team(prefill_task, &pf, T);
    return atomic_load(&pf.failed) || atomic_load(&s->failed) ? -1 : T;
}

/* the final norm and logits of n rows h [n][hidden] into y [n][vocab_pad] (dims as decode_step's) */
int rows_logits(const int64_t *dims, float eps, const float *final_norm, const uint8_t *head, const float *h,
                float *y, int ways) {
    step_t s;
    memset(&s, 0, sizeof s);
    s.n = dims[0], s.hidden = dims[1], s.inter = dims[5], s.vocab_pad = dims[7], s.head_kind = dims[8];
    s.eps = eps, s.final_norm = final_norm, s.head = head, s.h = (float *)h, s.y = y;
    int T = ways < 1 ? 1 : (ways > MAXT ? MAXT : ways);
    int64_t wide = s.hidden > s.inter ? s.hidden : s.inter;
    float *buf = aligned_alloc(64, (size_t)(T * s.n * wide) * sizeof(float) + 64);
    if (!buf) return -1;
    s.xs = buf;
    T = run_team(logits_task, &s, T);
    free(buf);
    return T;
}
