/* Causal attention whose every output row is computed in one fixed order (docs/exactness.md).
 *
 * Built on the machine that runs it by models/native.py (cc -O3 -march=native -ffp-contract=off)
 * and called through ctypes by models/layers.py `attention` and by decode.c's prefill.
 *
 * Query row i of a call sits at absolute position p = start + i and attends keys 0..p, which the
 * kernel takes in stretches of SB keys at fixed absolute positions: [0, SB), [SB, 2 SB), ..., the
 * last one ending at p. For each (row, head) it computes, always the same way:
 *   scores  s_j = sum_d (q_d * scale) k_jd         d = 0, 1, ..., head_dim - 1, one fused chain
 *   then stretch by stretch, in order:
 *   max     m = max(m, max_j s_j over the stretch)  exact, whatever the order (m starts at -inf)
 *   rescale where m grew (not on the first stretch): c = exp(m_before - m), den and both out
 *           chains multiplied by c
 *   weights e_j = exp(s_j - m)                      v_exp below, 16 keys at a time
 *   den     16 lanes, lane l adds e_j for j = l, l + 16, ... in order
 *   out_d   two chains, over even and over odd j, in order
 *   finally out_d = (even + odd) / (den's 16 lanes by a fixed tree)
 * Nothing in it depends on how many rows the call has, which rows share it, where the call
 * starts, the KV capacity or anything past key p -- so a row prefilled in one chunk, in another,
 * alone, in a batch, or as a decoded token gets the same bits.
 *
 * Only the loop order is chosen for speed: a pass takes up to GP pairs of one kv head and walks the
 * stretches once: it stages the stretch's K (transposed) and V as fp32 (256 KiB at hd 64, in L2),
 * scores every pair of the pass against it, weighs each pair's scores, then adds every pair's P.V
 * over it. Nothing of a pass outgrows the L2 however long the context: the earlier design, one
 * softmax over all of a row's keys, kept every pair's scores (3 MiB for 96 pairs over 8,000 keys)
 * and the staged K and V of the whole context (4 MiB), and went to memory for them.
 *
 * K and V: [kv_heads][capacity][head_dim], bf16 or fp32 (a session's cache, as the runner keeps
 * it); head_dim a multiple of 16 (models/layers.py falls back to its torch formulation otherwise).
 *
 * On a CPU with AMX (and the tiles granted, amx.c) bf16 K and V with head_dim a multiple of 32 take
 * `pass_amx`: the same passes, stretches and running max, the scores and P.V on the tiles with the
 * queries and weights rounded to bf16 (below). Which path runs is fixed for a build and a machine
 * (models/native.py names it in the kernel's fingerprint), never chosen per call.
 */
#include "simd.h"


enum { PB = 8 };    /* (row, head) pairs scored together: independent chains sharing each key load */
enum { PV_MAX = 3 };  /* pairs with the same keys (one row's query heads) sharing each value load */
enum { GP = 192 };  /* pairs of one kv head in a pass (their scores over a stretch held together, 384 KiB) */
enum { SB = 512 };  /* keys of a stretch: part of every row's arithmetic (where the max may be rescaled) */
enum { VB = 64 };   /* keys of a P.V slice */

#if defined(__AVX512F__)
/* r[i][j] -> r[j][i] for a 16 x 16 fp32 tile (pure data movement) */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
    }
}
#endif

/* Keys [lo, hi) of one kv head, staged for a stretch: kt[b][d][lane] = k[lo + 16b + lane][d] (zero
 * past hi, fp32), and (bf16 only) vf[j - lo][d] = v[j][d] as fp32. Conversions from bf16 are exact. */
static void stage(const void *k, const void *v, int bf16, int64_t lo, int64_t hi, int hd, float *kt, float *vf) {
    int64_t nblk = (hi - lo + 15) / 16;
    for (int64_t b = 0; b < nblk; b++) {
        float *dst = kt + b * hd * 16;
        int64_t j0 = lo + b * 16;
#if defined(__AVX512F__)
        if (j0 + 16 <= hi) {  /* a full block: 16 x 16 tiles through registers */
            for (int d = 0; d < hd; d += 16) {
                __m512 r[16];
                for (int lane = 0; lane < 16; lane++) {
                    int64_t j = j0 + lane;
                    r[lane] = bf16 ? v_load_bf16((const uint16_t *)k + j * hd + d) : V_LOAD((const float *)k + j * hd + d);
                }
                transpose16(r);
                for (int t = 0; t < 16; t++) V_STORE(dst + (d + t) * 16, r[t]);
            }
            continue;
        }
#endif
        for (int lane = 0; lane < 16; lane++) {
            int64_t j = j0 + lane;
            if (j >= hi) {
                for (int d = 0; d < hd; d++) dst[d * 16 + lane] = 0.0f;
            } else if (bf16) {
                const uint16_t *src = (const uint16_t *)k + j * hd;
                for (int d = 0; d < hd; d += 16) {
                    float tmp[16];
                    V_STORE(tmp, v_load_bf16(src + d));
                    for (int t = 0; t < 16; t++) dst[(d + t) * 16 + lane] = tmp[t];
                }
            } else {
                const float *src = (const float *)k + j * hd;
                for (int d = 0; d < hd; d++) dst[d * 16 + lane] = src[d];
            }
        }
    }
    if (bf16)
        for (int64_t i = 0; i < (hi - lo) * hd; i += 16) V_STORE(vf + i, v_load_bf16((const uint16_t *)v + lo * hd + i));
}

/* The pairs of one kv head in a pass: qs[i] its scaled query (hd floats), last[i] its last key (its
 * absolute position), out[i] where its hd outputs go. */
typedef struct {
    const float *qs[GP];
    int64_t last[GP];
    float *out[GP];
} Pass;

/* Scores of pairs [p0, p0 + np) (np <= PB) over the stretch's 16-key blocks [b, b + nb) (nb <= 3;
 * kt as `stage` left it): each pair's chain over d for each block, each query value loaded once for
 * all the blocks. s: a pair's scores at s + pair * SB. */
static inline __attribute__((always_inline)) void score_tile(int nb, const Pass *ps, int p0, int np, int64_t b,
                                                             const float *kt, int hd, float *s) {
    const float *q[PB];
    for (int i = 0; i < PB; i++) q[i] = ps->qs[p0 + (i < np ? i : 0)];
    const float *kb = kt + b * hd;
    vec a[3][PB];
    for (int t = 0; t < nb; t++)
        for (int i = 0; i < PB; i++) a[t][i] = V_ZERO();
    for (int d = 0; d < hd; d++) {
        vec kd[3];
        for (int t = 0; t < nb; t++) kd[t] = V_LOAD(kb + t * hd * 16 + d * 16);
        for (int i = 0; i < PB; i++) {
            vec qd = V_SET1(q[i][d]);
            for (int t = 0; t < nb; t++) a[t][i] = V_FMA(qd, kd[t], a[t][i]);
        }
    }
    for (int i = 0; i < np; i++)
        for (int t = 0; t < nb; t++) V_STORE(s + (int64_t)(p0 + i) * SB + b + 16 * t, a[t][i]);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2's score tile: 6 pairs x one 16-key block (12 accumulators of the 16 registers, each a named
 * variable so that none goes to the stack), each (pair, key) the chain of `score_tile` */
static void score_tile6(const Pass *ps, int p0, int np, int64_t b, const float *kt, int hd, float *s) {
    const float *q0 = ps->qs[p0], *q1 = ps->qs[p0 + (np > 1)], *q2 = ps->qs[p0 + (np > 2 ? 2 : np - 1)];
    const float *q3 = ps->qs[p0 + (np > 3 ? 3 : np - 1)], *q4 = ps->qs[p0 + (np > 4 ? 4 : np - 1)];
    const float *q5 = ps->qs[p0 + (np > 5 ? 5 : np - 1)];
    const float *kb = kt + b * hd;
    __m256 a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51;
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = _mm256_setzero_ps();
    for (int d = 0; d < hd; d++) {
        __m256 k0 = _mm256_load_ps(kb + d * 16), k1 = _mm256_load_ps(kb + d * 16 + 8), qd;
#define STEP(Q, A0, A1) qd = _mm256_broadcast_ss(Q + d), A0 = _mm256_fmadd_ps(qd, k0, A0), A1 = _mm256_fmadd_ps(qd, k1, A1);
        STEP(q0, a00, a01) STEP(q1, a10, a11) STEP(q2, a20, a21) STEP(q3, a30, a31) STEP(q4, a40, a41)
        STEP(q5, a50, a51)
#undef STEP
    }
    float *o = s + (int64_t)p0 * SB + b;
#define ST(r, A0, A1) if (np > r) _mm256_storeu_ps(o + r * SB, A0), _mm256_storeu_ps(o + r * SB + 8, A1);
    ST(0, a00, a01) ST(1, a10, a11) ST(2, a20, a21) ST(3, a30, a31) ST(4, a40, a41) ST(5, a50, a51)
#undef ST
}

/* Scores of pairs [first, np) over the stretch [lo, lo + cnt): one key block at a time against every
 * group of 6 pairs that reaches it (the other ISAs' form below, cut to AVX2's 16 registers) */
static void score_stretch(const Pass *ps, int first, int np, int64_t lo, int64_t cnt, const float *kt, int hd,
                          float *s) {
    int64_t blocks = (cnt + 15) / 16;
    for (int64_t b = 0; b < blocks; b++)
        for (int p0 = first; p0 < np; p0 += 6) {
            int g = np - p0 < 6 ? np - p0 : 6;
            if ((ps->last[p0 + g - 1] - lo) / 16 >= b) score_tile6(ps, p0, g, b * 16, kt, hd, s);
        }
}
#else
/* Scores of pairs [first, np) over the stretch [lo, lo + cnt): three key blocks (12 KiB of K at hd 64,
 * kept in L1) against every group of PB pairs in turn; a group stops at its last key's block, blocks
 * past a pair's own last key are computed with the others and never read. */
static void score_stretch(const Pass *ps, int first, int np, int64_t lo, int64_t cnt, const float *kt, int hd,
                          float *s) {
    int64_t blocks = (cnt + 15) / 16;
    for (int64_t b = 0; b < blocks; b += 3)
        for (int p0 = first; p0 < np; p0 += PB) {
            int g = np - p0 < PB ? np - p0 : PB;
            int64_t top = (ps->last[p0 + g - 1] - lo) / 16 + 1;  /* blocks this group needs (last grows with i) */
            int64_t nb = (top < blocks ? top : blocks) - b;
            if (nb <= 0) continue;
            if (nb >= 3) score_tile(3, ps, p0, g, b * 16, kt, hd, s);
            else if (nb == 2) score_tile(2, ps, p0, g, b * 16, kt, hd, s);
            else score_tile(1, ps, p0, g, b * 16, kt, hd, s);
        }
}
#endif

/* A pair's scores si over a stretch's first `cnt` keys: the rest of the last 16-key block masked,
 * the running max m taken on, and where it grew, den and the `n` sums at acc rescaled. Returns the
 * stretch's 16-key blocks. */
static int64_t stretch_max(float *si, int64_t cnt, float *m, vec *den, float *acc, int n) {
    int64_t nb = (cnt + 15) / 16;
    for (int64_t j = cnt; j < nb * 16; j++) si[j] = -INFINITY;
    vec mv = V_SET1(-INFINITY);
    for (int64_t b = 0; b < nb; b++) mv = V_MAX(mv, V_LOAD(si + b * 16));
    float mx = v_hmax(mv);
    if (mx > *m) {
        if (*m != -INFINITY) {  /* c = 1 where the max held: nothing to do; and nothing to scale yet */
            vec c = v_exp(V_SET1(*m - mx));
            *den = V_MUL(*den, c);
            for (int d = 0; d < n; d += 16) V_STORE(acc + d, V_MUL(V_LOAD(acc + d), c));
        }
        *m = mx;
    }
    return nb;
}

/* A pair's weights over a stretch's first `cnt` keys in place of its scores si, with its running
 * max m, den and out chains acc (2 x hd) carried on. */
static void weigh(float *si, int64_t cnt, float *m, vec *den, float *acc, int hd) {
    int64_t nb = stretch_max(si, cnt, m, den, acc, 2 * hd);
    vec mm = V_SET1(*m), dn = *den;
    for (int64_t b = 0; b < nb; b++) {
        vec e = v_exp(V_SUB(V_LOAD(si + b * 16), mm));
        V_STORE(si + b * 16, e);
        dn = V_ADD(dn, e);
    }
    *den = dn;
}

/* P.V of R pairs that share their last key (the query heads of one row) over a stretch's keys
 * [j0, j1) (j0 even; si: their weights, vf: the stretch's values), sharing each value load: every
 * pair's two chains, over even and over odd keys (a stretch starts at an even key), go on from its
 * `acc` (2 x hd floats) in key order -- so splitting the keys at even points, or grouping the pairs
 * differently, changes nothing. */
static inline __attribute__((always_inline)) void pv_keys(int R, int W, const float *const *si, int64_t j0,
                                                          int64_t j1, const float *vf, int hd, int d0,
                                                          float *const *acc) {
    vec a0[PV_MAX][4], a1[PV_MAX][4];  /* W (a constant in each copy) x 16 of the outputs from d0 */
    for (int r = 0; r < R; r++)
        for (int t = 0; t < W; t++) {
            a0[r][t] = V_LOAD(acc[r] + d0 + 16 * t);
            a1[r][t] = V_LOAD(acc[r] + hd + d0 + 16 * t);
        }
    int64_t j = j0;
    for (; j + 1 < j1; j += 2) {
        const float *v0 = vf + j * hd + d0, *v1 = v0 + hd;
        for (int t = 0; t < W; t++) {
            vec x0 = V_LOAD(v0 + 16 * t), x1 = V_LOAD(v1 + 16 * t);
            for (int r = 0; r < R; r++) {
                a0[r][t] = V_FMA(V_SET1(si[r][j]), x0, a0[r][t]);
                a1[r][t] = V_FMA(V_SET1(si[r][j + 1]), x1, a1[r][t]);
            }
        }
    }
    if (j < j1) {  /* the last key of an odd count: only at a pair's last key */
        const float *v0 = vf + j * hd + d0;
        for (int t = 0; t < W; t++) {
            vec x0 = V_LOAD(v0 + 16 * t);
            for (int r = 0; r < R; r++) a0[r][t] = V_FMA(V_SET1(si[r][j]), x0, a0[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < W; t++) {
            V_STORE(acc[r] + d0 + 16 * t, a0[r][t]);
            V_STORE(acc[r] + hd + d0 + 16 * t, a1[r][t]);
        }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2's P.V: R <= 3 pairs x 16 outputs, the even and the odd chain of each (12 accumulators, named
 * variables), each output's chains those of `pv_keys` */
static inline __attribute__((always_inline)) void pv_keys16(int R, const float *const *si, int64_t j0, int64_t j1,
                                                            const float *vf, int hd, int d0, float *const *acc) {
    const float *s0 = si[0], *s1 = si[R > 1], *s2 = si[R > 2 ? 2 : R - 1];
    __m256 e00, e01, e10, e11, e20, e21, o00, o01, o10, o11, o20, o21, vl, vh, b;
    e00 = e01 = e10 = e11 = e20 = e21 = o00 = o01 = o10 = o11 = o20 = o21 = _mm256_setzero_ps();
#define LD(r, E0, E1, O0, O1) if (R > r) E0 = _mm256_loadu_ps(acc[r] + d0), E1 = _mm256_loadu_ps(acc[r] + d0 + 8), \
        O0 = _mm256_loadu_ps(acc[r] + hd + d0), O1 = _mm256_loadu_ps(acc[r] + hd + d0 + 8);
    LD(0, e00, e01, o00, o01) LD(1, e10, e11, o10, o11) LD(2, e20, e21, o20, o21)
#undef LD
#define KEY(J, A00, A01, A10, A11, A20, A21)                                                              \
    vl = _mm256_loadu_ps(vf + (J) * hd + d0), vh = _mm256_loadu_ps(vf + (J) * hd + d0 + 8);              \
    b = _mm256_broadcast_ss(s0 + (J)), A00 = _mm256_fmadd_ps(b, vl, A00), A01 = _mm256_fmadd_ps(b, vh, A01); \
    if (R > 1) b = _mm256_broadcast_ss(s1 + (J)), A10 = _mm256_fmadd_ps(b, vl, A10), A11 = _mm256_fmadd_ps(b, vh, A11); \
    if (R > 2) b = _mm256_broadcast_ss(s2 + (J)), A20 = _mm256_fmadd_ps(b, vl, A20), A21 = _mm256_fmadd_ps(b, vh, A21);
    int64_t j = j0;
    for (; j + 1 < j1; j += 2) {
        KEY(j, e00, e01, e10, e11, e20, e21)
        KEY(j + 1, o00, o01, o10, o11, o20, o21)
    }
    if (j < j1) {  /* the last key of an odd count: only at a pair's last key */
        KEY(j, e00, e01, e10, e11, e20, e21)
    }
#undef KEY
#define ST(r, E0, E1, O0, O1) if (R > r) _mm256_storeu_ps(acc[r] + d0, E0), _mm256_storeu_ps(acc[r] + d0 + 8, E1), \
        _mm256_storeu_ps(acc[r] + hd + d0, O0), _mm256_storeu_ps(acc[r] + hd + d0 + 8, O1);
    ST(0, e00, e01, o00, o01) ST(1, e10, e11, o10, o11) ST(2, e20, e21, o20, o21)
#undef ST
}

static void pv_group(int R, const float *const *si, int64_t j0, int64_t j1, const float *vf, int hd,
                     float *const *acc) {
    for (int d0 = 0; d0 < hd; d0 += 16) {
        if (R == 1) pv_keys16(1, si, j0, j1, vf, hd, d0, acc);
        else if (R == 2) pv_keys16(2, si, j0, j1, vf, hd, d0, acc);
        else pv_keys16(3, si, j0, j1, vf, hd, d0, acc);
    }
}
#else
/* every output of R pairs, 64 at a time (each count and width its own unrolled copy; the arithmetic
 * per output is the same) */
static void pv_group(int R, const float *const *si, int64_t j0, int64_t j1, const float *vf, int hd,
                     float *const *acc) {
#define PV_W(RR)                                                                                \
    for (int d0 = 0; d0 < hd; d0 += 64) {                                                      \
        int w = hd - d0 < 64 ? (hd - d0) / 16 : 4;                                             \
        if (w == 4) pv_keys(RR, 4, si, j0, j1, vf, hd, d0, acc);                                \
        else if (w == 3) pv_keys(RR, 3, si, j0, j1, vf, hd, d0, acc);                           \
        else if (w == 2) pv_keys(RR, 2, si, j0, j1, vf, hd, d0, acc);                           \
        else pv_keys(RR, 1, si, j0, j1, vf, hd, d0, acc);                                       \
    }
    switch (R) {
    case 1: PV_W(1) break;
    case 2: PV_W(2) break;
    default: PV_W(3) break;
    }
#undef PV_W
}
#endif

/* Scratch of one call: a stretch's staged K and V, and a pass's scores and running state. */
typedef struct {
    float *kt, *vf, *s, *acc, *m;
    vec *den;
    void *pb, *qb; /* the tiles' path: a pass's weights and queries in bf16 */
} Scratch;

/* keys of the stretch [lo, hi) that a pair whose last key is `last` (>= lo) attends */
static inline int64_t keys_in(int64_t last, int64_t lo, int64_t hi) { return (last + 1 < hi ? last + 1 : hi) - lo; }

/* One pass: up to GP pairs of the same kv head, stretch by stretch (k, v: this kv head's keys). */
static void pass(const Pass *ps, int np, const void *k, const void *v, int bf16, int hd, Scratch *w) {
    int64_t top = 0;
    for (int i = 0; i < np; i++) {
        top = ps->last[i] > top ? ps->last[i] : top;
        w->m[i] = -INFINITY;
        w->den[i] = V_ZERO();
    }
    for (int64_t i = 0; i < (int64_t)np * 2 * hd; i++) w->acc[i] = 0.0f;
    for (int64_t lo = 0; lo <= top; lo += SB) {
        int64_t hi = lo + SB < top + 1 ? lo + SB : top + 1;
        stage(k, v, bf16, lo, hi, hd, w->kt, w->vf);
        const float *vals = bf16 ? w->vf : (const float *)v + lo * hd;
        int first = 0;  /* pairs go by position: those that ended before this stretch lead */
        while (first < np && ps->last[first] < lo) first++;
        score_stretch(ps, first, np, lo, hi - lo, w->kt, hd, w->s);
        for (int i = first; i < np; i++)
            weigh(w->s + (int64_t)i * SB, keys_in(ps->last[i], lo, hi), &w->m[i], &w->den[i],
                  w->acc + (int64_t)i * 2 * hd, hd);
        /* P.V in slices of VB keys (16 KiB of V at hd 64, kept in L1) against every group of pairs */
        for (int64_t j0 = 0; j0 < hi - lo; j0 += VB)
            for (int i = first; i < np;) {
                int R = 1;
                while (R < PV_MAX && i + R < np && ps->last[i + R] == ps->last[i]) R++;
                int64_t cnt = keys_in(ps->last[i], lo, hi);
                if (cnt > j0) {
                    const float *si[PV_MAX];
                    float *ai[PV_MAX];
                    for (int r = 0; r < R; r++) {
                        si[r] = w->s + (int64_t)(i + r) * SB;
                        ai[r] = w->acc + (int64_t)(i + r) * 2 * hd;
                    }
                    pv_group(R, si, j0, j0 + VB < cnt ? j0 + VB : cnt, vals, hd, ai);
                }
                i += R;
            }
    }
    for (int i = 0; i < np; i++) {
        vec dv = V_SET1(hsum(w->den[i]));
        const float *a = w->acc + (int64_t)i * 2 * hd;
        for (int d = 0; d < hd; d += 16) V_STORE(ps->out[i] + d, V_DIV(V_ADD(V_LOAD(a + d), V_LOAD(a + hd + d)), dv));
    }
}

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ATT_AMX 1
/* ---- bf16 K and V on AMX tiles (Intel Xeon with AMX-BF16; amx.c grants the tiles) ----
 * The same passes, stretches and running max as above, with the two products on the tiles:
 *   scores  s_j = TDPBF16PS over d in 32-dim steps, in order, of bf16(q_d * scale) k_jd (fp32 sums)
 *   weights e_j = bf16(exp(s_j - m)) (the max and rescale as above); den sums these rounded e_j
 *   out_d   per stretch, TDPBF16PS over its keys in 32-key steps, in order, of e_j v_jd from zero;
 *           then added to the pair's carried sum (rescaled where the max grew)
 *   finally out_d / (den's 16 lanes by the fixed tree)
 * A C-tile element belongs to one (row, head) pair and one key or output, and keys past a pair's
 * last weigh exactly 0, so nothing depends on the other pairs of the tile, the call or the KV past p. */
extern int amx_granted;

void amx_tiles_on(void); /* amx.c: every tile 16 rows of 64 bytes */

/* C tiles 4 .. 3 + n (n <= 4) += A tile 0 times the n B tiles at b, b + stride, ... (32-bit words) */
static inline __attribute__((always_inline)) void products(int n, const uint32_t *b, int64_t stride) {
    _tile_loadd(1, b, 64);
    _tile_dpbf16ps(4, 0, 1);
    if (n > 1) { _tile_loadd(2, b + stride, 64); _tile_dpbf16ps(5, 0, 2); }
    if (n > 2) { _tile_loadd(3, b + 2 * stride, 64); _tile_dpbf16ps(6, 0, 3); }
    if (n > 3) { _tile_loadd(1, b + 3 * stride, 64); _tile_dpbf16ps(7, 0, 1); }
}

static inline __attribute__((always_inline)) void zero_sums(void) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
}

/* Keys [lo, hi) of one kv head (bf16) in the tiles' layouts, zero past hi:
 * kb: block b of 16 keys, dim step t of 32: a 16 x 16 tile of dim pairs, kb[((b * steps + t) * 16 + i) * 16 + n]
 *     = the pair (k[lo + 16b + n][32t + 2i], ... + 1) (32 bits each);
 * vb: key step t of 32, output block e of 16: vb[((t * blocks + e) * 16 + i) * 16 + n] = the pair
 *     (v[lo + 32t + 2i][16e + n], v[lo + 32t + 2i + 1][16e + n]). */
static void stage_tiles(const uint16_t *k, const uint16_t *v, int64_t lo, int64_t hi, int hd, uint32_t *kb,
                        uint32_t *vb) {
    int steps = hd / 32, blocks = hd / 16;
    int64_t cnt = hi - lo, nk = (cnt + 31) / 32 * 32;
    for (int64_t b = 0; b < nk / 16; b++)
        for (int t = 0; t < steps; t++) {
            __m512 r[16];
            for (int n = 0; n < 16; n++) {
                int64_t j = 16 * b + n;
                r[n] = j < cnt ? _mm512_loadu_ps((const float *)(k + (lo + j) * hd + 32 * t)) : _mm512_setzero_ps();
            }
            transpose16(r);  /* 32-bit words: dim pair i of each key n */
            for (int i = 0; i < 16; i++) _mm512_store_ps((float *)kb + ((b * steps + t) * 16 + i) * 16, r[i]);
        }
    for (int64_t t = 0; t < nk / 32; t++)
        for (int i = 0; i < 16; i++) {
            int64_t j = 32 * t + 2 * i;
            for (int e = 0; e < blocks; e++) {
                __m512i ev = j < cnt ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + (lo + j) * hd + 16 * e)))
                                     : _mm512_setzero_si512();
                __m512i od = j + 1 < cnt ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + (lo + j + 1) * hd + 16 * e)))
                                         : _mm512_setzero_si512();
                _mm512_store_si512(vb + ((t * blocks + e) * 16 + i) * 16, _mm512_or_si512(ev, _mm512_slli_epi32(od, 16)));
            }
        }
}

/* weigh's arithmetic with each weight rounded to bf16 (into pb, zero from cnt to the stretch's next
 * 32-key step) and den summing the rounded weights */
static void weigh_bf16(float *si, int64_t cnt, int64_t upto, float *m, vec *den, float *acc, int hd, uint16_t *pb) {
    int64_t nb = stretch_max(si, cnt, m, den, acc, hd);
    vec mm = V_SET1(*m), dn = *den;
    for (int64_t b = 0; b < nb; b++) {
        __m256bh e = _mm512_cvtneps_pbh(v_exp(V_SUB(V_LOAD(si + b * 16), mm)));
        _mm256_storeu_si256((__m256i *)(pb + 16 * b), (__m256i)e);
        dn = V_ADD(dn, _mm512_cvtpbh_ps(e));
    }
    *den = dn;
    if (upto > nb * 16) memset(pb + nb * 16, 0, (size_t)(upto - nb * 16) * 2);
}

/* One pass on the tiles (bf16 K and V). */
static void pass_amx(const Pass *ps, int np, const uint16_t *k, const uint16_t *v, int hd, Scratch *w) {
    int steps = hd / 32, blocks = hd / 16;
    uint16_t *qb = w->qb;  /* the pass's scaled queries in bf16, one rounding each; zero to a whole tile */
    for (int p = 0; p < np; p++)
        for (int d = 0; d < hd; d += 16)
            _mm256_store_si256((__m256i *)(qb + (int64_t)p * hd + d), (__m256i)_mm512_cvtneps_pbh(V_LOAD(ps->qs[p] + d)));
    memset(qb + (int64_t)np * hd, 0, (size_t)((np + 15) / 16 * 16 - np) * hd * 2);
    int64_t top = 0;
    for (int i = 0; i < np; i++) {
        top = ps->last[i] > top ? ps->last[i] : top;
        w->m[i] = -INFINITY;
        w->den[i] = V_ZERO();
    }
    memset(w->acc, 0, (size_t)np * hd * sizeof(float));
    float sums[16 * 16] __attribute__((aligned(64)));
    for (int64_t lo = 0; lo <= top; lo += SB) {
        int64_t hi = lo + SB < top + 1 ? lo + SB : top + 1;
        stage_tiles(k, v, lo, hi, hd, (uint32_t *)w->kt, (uint32_t *)w->vf);
        int first = 0;
        while (first < np && ps->last[first] < lo) first++;
        for (int p0 = first / 16 * 16; p0 < np; p0 += 16) {
            int g = np - p0 < 16 ? np - p0 : 16;
            int64_t need = (keys_in(ps->last[p0 + g - 1], lo, hi) + 15) / 16;  /* key blocks the group reads */
            for (int64_t b = 0; b < need; b += 4) {  /* scores: up to four 16-key blocks per A tile load */
                int nb = need - b < 4 ? (int)(need - b) : 4;
                zero_sums();
                for (int t = 0; t < steps; t++) {
                    _tile_loadd(0, qb + (int64_t)p0 * hd + 32 * t, hd * 2);
                    products(nb, (const uint32_t *)w->kt + (b * steps + t) * 256, steps * 256);
                }
                float *sd = w->s + (int64_t)p0 * SB + 16 * b;
                _tile_stored(4, sd, SB * 4);
                if (nb > 1) _tile_stored(5, sd + 16, SB * 4);
                if (nb > 2) _tile_stored(6, sd + 32, SB * 4);
                if (nb > 3) _tile_stored(7, sd + 48, SB * 4);
            }
        }
        uint16_t *pb = (uint16_t *)w->pb;
        for (int i = first; i < np; i++) {
            int64_t cnt = keys_in(ps->last[i], lo, hi), p0 = i / 16 * 16;
            int g = np - p0 < 16 ? np - (int)p0 : 16;
            int64_t upto = (keys_in(ps->last[p0 + g - 1], lo, hi) + 31) / 32 * 32;  /* the group's key steps */
            weigh_bf16(w->s + (int64_t)i * SB, cnt, upto, &w->m[i], &w->den[i], w->acc + (int64_t)i * hd, hd,
                       pb + (int64_t)i * SB);
        }
        for (int p0 = first / 16 * 16; p0 < np; p0 += 16) {  /* P.V: this stretch's sums from zero */
            int g = np - p0 < 16 ? np - p0 : 16;
            int64_t ksteps = (keys_in(ps->last[p0 + g - 1], lo, hi) + 31) / 32;
            for (int e0 = 0; e0 < blocks; e0 += 4) {
                int ne = blocks - e0 < 4 ? blocks - e0 : 4;
                zero_sums();
                for (int64_t t = 0; t < ksteps; t++) {
                    _tile_loadd(0, pb + (int64_t)p0 * SB + 32 * t, SB * 2);
                    products(ne, (const uint32_t *)w->vf + (t * blocks + e0) * 256, 256);
                }
                for (int e = 0; e < ne; e++) {
                    if (e == 0) _tile_stored(4, sums, 64);
                    else if (e == 1) _tile_stored(5, sums, 64);
                    else if (e == 2) _tile_stored(6, sums, 64);
                    else _tile_stored(7, sums, 64);
                    for (int r = 0; r < g; r++) {
                        if (p0 + r < first) continue;
                        float *a = w->acc + (int64_t)(p0 + r) * hd + 16 * (e0 + e);
                        V_STORE(a, V_ADD(V_LOAD(a), _mm512_load_ps(sums + 16 * r)));
                    }
                }
            }
        }
    }
    for (int i = 0; i < np; i++) {
        vec dv = V_SET1(hsum(w->den[i]));
        const float *a = w->acc + (int64_t)i * hd;
        for (int d = 0; d < hd; d += 16) V_STORE(ps->out[i] + d, V_DIV(V_LOAD(a + d), dv));
    }
}
#endif

/* a pass on the tiles where `tiles` (decided once per call), else on the FMAs */
static void run_pass(const Pass *ps, int np, const void *k, const void *v, int bf16, int hd, Scratch *w, int tiles) {
#ifdef ATT_AMX
    if (tiles) {
        pass_amx(ps, np, k, v, hd, w);
        return;
    }
#endif
    (void)tiles;
    pass(ps, np, k, v, bf16, hd, w);
}

/* q: [n][heads][hd] fp32 (unscaled); k, v: [kv_heads] blocks `kv_stride` elements apart, each
 * [>= start + n][hd]; out: [n][heads * hd] fp32. Returns 0, or -1 when out of memory. */
int attention(const float *q, int64_t n, int64_t start, int heads, int kv_heads, int hd, const void *k,
              const void *v, int64_t kv_stride, int bf16, float scale, float *out) {
    int rep = heads / kv_heads;
    size_t esz = bf16 ? 2 : 4;
#ifdef ATT_AMX
    int tiles = bf16 && amx_granted && hd % 32 == 0;
#else
    int tiles = 0;
#endif
    Scratch w;
    memset(&w, 0, sizeof w);
    w.kt = aligned_alloc(64, (size_t)(SB * hd) * sizeof(float));
    w.vf = aligned_alloc(64, (size_t)(SB * hd) * sizeof(float));
    w.s = aligned_alloc(64, (size_t)((GP + 16) * SB) * sizeof(float));
    w.acc = aligned_alloc(64, (size_t)(GP * 2 * hd) * sizeof(float));
    w.m = aligned_alloc(64, GP * sizeof(float));
    w.den = aligned_alloc(64, GP * sizeof(vec));
    w.pb = tiles ? aligned_alloc(64, (size_t)((GP + 16) * SB) * 2) : NULL;
    w.qb = tiles ? aligned_alloc(64, (size_t)((GP + 16) * hd) * 2) : NULL;
    float *qs = aligned_alloc(64, (size_t)(n * heads * hd) * sizeof(float) + 64);
    Pass *ps = malloc(sizeof(Pass));
    if (!w.kt || !w.vf || !w.s || !w.acc || !w.m || !w.den || !qs || !ps || (tiles && (!w.pb || !w.qb))) {
        free(w.kt), free(w.vf), free(w.s), free(w.acc), free(w.m), free(w.den), free(w.pb), free(w.qb), free(qs), free(ps);
        return -1;
    }
    for (int64_t i = 0; i < n * heads * hd; i++) qs[i] = q[i] * scale;
#ifdef ATT_AMX
    if (tiles) amx_tiles_on();
#endif
    for (int g = 0; g < kv_heads; g++) {
        const void *kg = (const char *)k + (size_t)g * kv_stride * esz, *vg = (const char *)v + (size_t)g * kv_stride * esz;
        int np = 0;
        for (int64_t i = 0; i < n; i++)
            for (int r = 0; r < rep; r++) {
                int h = g * rep + r;
                ps->qs[np] = qs + (i * heads + h) * hd;
                ps->last[np] = start + i;
                ps->out[np] = out + i * heads * hd + h * hd;
                if (++np == GP) {
                    run_pass(ps, np, kg, vg, bf16, hd, &w, tiles);
                    np = 0;
                }
            }
        if (np) run_pass(ps, np, kg, vg, bf16, hd, &w, tiles);
    }
#ifdef ATT_AMX
    if (tiles) _tile_release();
#endif
    free(w.kt), free(w.vf), free(w.s), free(w.acc), free(w.m), free(w.den), free(w.pb), free(w.qb), free(qs), free(ps);
    return 0;
}
