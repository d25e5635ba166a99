/* Causal attention whose every output row is computed in one fixed order (docs/exactness.md).
 *
 * Built on the machine that runs it by models/native.py (cc -O3 -march=native -ffp-contract=off)
 * and called through ctypes by models/layers.py `attention`.
 *
 * Query row i of a call sits at absolute position p = start + i and attends keys 0..p. For each
 * (row, head) the kernel computes, always the same way:
 *   scores  s_j = sum_d (q_d * scale) k_jd         d = 0, 1, ..., head_dim - 1, one fused chain
 *   max     m = max_j s_j                          exact, whatever the order
 *   weights e_j = exp(s_j - m)                      v_exp below, 16 keys at a time
 *   den     16 lanes, lane l adds e_j for j = l, l + 16, ... in order; then a fixed tree
 *   out_d   two chains, over even and over odd j, in order; added; divided by den
 * Nothing in it depends on how many rows the call has, which rows share it, where the call
 * starts, the KV capacity or anything past key p -- so a row prefilled in one chunk, in another,
 * alone, in a batch, or as a decoded token gets the same bits.
 *
 * Only the loop order is chosen for speed: a pass takes up to GP pairs of one kv head and walks the
 * keys in stretches of SB, scoring every pair of the pass against a stretch while its staged K is in
 * cache, then (after each pair's max and exp) adding every pair's P.V over a stretch while its V is
 * in cache. Over 8,000 keys the staged K and V (2 MiB each) stream from memory once a pass instead
 * of once per 8 pairs: 64 rows over 8,000 keys, one layer, one thread (Ice Lake) 50-70 -> 21 ms.
 *
 * K and V: [kv_heads][capacity][head_dim], bf16 or fp32 (a session's cache, as the runner keeps
 * it); head_dim a multiple of 16 (models/layers.py falls back to its torch formulation otherwise).
 */
#include "simd.h"


enum { PB = 8 };    /* (row, head) pairs scored together: independent chains sharing each key load */
enum { PV_MAX = 3 };  /* pairs with the same keys (one row's query heads) sharing each value load */
enum { GP = 96 };   /* pairs of one kv head in a pass (their scores held together) */
enum { SB = 512 };  /* keys a pass takes at a time: their fp32 K (then V) stays in cache, 128 KiB at hd 64 */

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

/* Keys of one kv head transposed per 16-key block, fp32: kt[b][d][lane] = k[16b + lane][d]
 * (zero past `keys`); bf16 values converted to fp32 [keys][head_dim] (fp32 values are used where
 * they are). Conversions from bf16 are exact. */
static void stage(const void *k, const void *v, int bf16, int64_t keys, int hd, float *kt, float *vf) {
    int64_t nblk = (keys + 15) / 16;
    for (int64_t b = 0; b < nblk; b++) {
        float *dst = kt + b * hd * 16;
#if defined(__AVX512F__)
        if (b * 16 + 16 <= keys) {  /* a full block: 16 x 16 tiles through registers */
            for (int d = 0; d < hd; d += 16) {
                __m512 r[16];
                for (int lane = 0; lane < 16; lane++) {
                    int64_t j = b * 16 + lane;
                    r[lane] = bf16 ? v_load_bf16((const uint16_t *)k + j * hd + d) : V_LOAD((const float *)k + j * hd + d);
                }
                transpose16(r);
                for (int t = 0; t < 16; t++) V_STORE(dst + (d + t) * 16, r[t]);
            }
            continue;
        }
#endif
        for (int lane = 0; lane < 16; lane++) {
            int64_t j = b * 16 + lane;
            if (j >= keys) {
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
        for (int64_t i = 0; i < keys * hd; i += 16) V_STORE(vf + i, v_load_bf16((const uint16_t *)v + i));
}

/* The pairs of one kv head in a pass: qs[i] its scaled query (hd floats), last[i] its last key (its
 * absolute position), out[i] where its hd outputs go. */
typedef struct {
    const float *qs[GP];
    int64_t last[GP];
    float *out[GP];
} Pass;

/* Scores of pairs [p0, p0 + np) (np <= PB) over keys [lo, hi) (16-aligned): each pair's chain over d
 * for each 16-key block; blocks past a pair's last key are computed with the others and never read. */
static void score_blocks(const Pass *ps, int p0, int np, int64_t lo, int64_t hi, const float *kt, int hd,
                         float *s, int64_t stride) {
    int64_t top = 0;
    for (int i = 0; i < np; i++) top = ps->last[p0 + i] > top ? ps->last[p0 + i] : top;
    top = (top / 16 + 1) * 16;
    if (hi > top) hi = top;
    const float *q[PB];
    for (int i = 0; i < PB; i++) q[i] = ps->qs[p0 + (i < np ? i : 0)];
    int64_t b = lo;
    for (; b + 48 <= hi; b += 48) {  /* three key blocks at a time: each query value loaded once for all */
        const float *kb = kt + b * hd;
        vec a0[PB], a1[PB], a2[PB];
        for (int i = 0; i < PB; i++) a0[i] = a1[i] = a2[i] = V_ZERO();
        for (int d = 0; d < hd; d++) {
            vec k0 = V_LOAD(kb + d * 16), k1 = V_LOAD(kb + hd * 16 + d * 16), k2 = V_LOAD(kb + 2 * hd * 16 + d * 16);
            for (int i = 0; i < PB; i++) {
                vec qd = V_SET1(q[i][d]);
                a0[i] = V_FMA(qd, k0, a0[i]);
                a1[i] = V_FMA(qd, k1, a1[i]);
                a2[i] = V_FMA(qd, k2, a2[i]);
            }
        }
        for (int i = 0; i < np; i++) {
            float *si = s + (int64_t)(p0 + i) * stride + b;
            V_STORE(si, a0[i]);
            V_STORE(si + 16, a1[i]);
            V_STORE(si + 32, a2[i]);
        }
    }
    for (; b + 16 <= hi; b += 16) {
        const float *kb = kt + b * hd;
        vec acc[PB];
        for (int i = 0; i < PB; i++) acc[i] = V_ZERO();
        for (int d = 0; d < hd; d++) {
            vec kd = V_LOAD(kb + d * 16);
            for (int i = 0; i < PB; i++) acc[i] = V_FMA(V_SET1(q[i][d]), kd, acc[i]);
        }
        for (int i = 0; i < np; i++) V_STORE(s + (int64_t)(p0 + i) * stride + b, acc[i]);
    }
}

/* A pair's weights in place of its scores (exact max, exp); returns their sum (16 lanes, then hsum). */
static float softmax_row(float *si, int64_t last) {
    int64_t n = last + 1, nb = last / 16 + 1;
    for (int64_t j = n; j < nb * 16; j++) si[j] = -INFINITY;
    vec mv = V_SET1(-INFINITY);
    for (int64_t b = 0; b < nb; b++) mv = V_MAX(mv, V_LOAD(si + b * 16));
    vec m = V_SET1(v_hmax(mv));
    vec den = V_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        vec e = v_exp(V_SUB(V_LOAD(si + b * 16), m));
        V_STORE(si + b * 16, e);
        den = V_ADD(den, e);
    }
    return hsum(den);
}

/* P.V of R pairs that share their last key (the query heads of one row) over keys [lo, min(hi, n))
 * (lo even), sharing each value load: every pair's two chains, over even and over odd keys, go on
 * from its `acc` (2 x hd floats) in key order -- so splitting the keys at even points, or grouping
 * the pairs differently, changes nothing. */
static inline __attribute__((always_inline)) void pv_keys(int R, const float *const *si, int64_t n, int64_t lo,
                                                          int64_t hi, const float *vf, int hd, float *const *acc) {
    if (hi > n) hi = n;
    for (int d0 = 0; d0 < hd; d0 += 64) {
        int w = hd - d0 < 64 ? (hd - d0) / 16 : 4;
        vec a0[PV_MAX][4], a1[PV_MAX][4];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < 4; t++) {
                a0[r][t] = t < w ? V_LOAD(acc[r] + d0 + 16 * t) : V_ZERO();
                a1[r][t] = t < w ? V_LOAD(acc[r] + hd + d0 + 16 * t) : V_ZERO();
            }
        int64_t j = lo;
        for (; j + 1 < hi; j += 2) {
            const float *v0 = vf + j * hd + d0, *v1 = v0 + hd;
            for (int t = 0; t < 4; t++)
                if (t < w) {
                    vec x0 = V_LOAD(v0 + 16 * t), x1 = V_LOAD(v1 + 16 * t);
                    for (int r = 0; r < R; r++) {
                        a0[r][t] = V_FMA(V_SET1(si[r][j]), x0, a0[r][t]);
                        a1[r][t] = V_FMA(V_SET1(si[r][j + 1]), x1, a1[r][t]);
                    }
                }
        }
        if (j < hi) {  /* the last key of an odd count: only where hi == n */
            const float *v0 = vf + j * hd + d0;
            for (int t = 0; t < 4; t++)
                if (t < w) {
                    vec x0 = V_LOAD(v0 + 16 * t);
                    for (int r = 0; r < R; r++) a0[r][t] = V_FMA(V_SET1(si[r][j]), x0, a0[r][t]);
                }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < w; t++) {
                V_STORE(acc[r] + d0 + 16 * t, a0[r][t]);
                V_STORE(acc[r] + hd + d0 + 16 * t, a1[r][t]);
            }
    }
}

static void pv_group(int R, const float *const *si, int64_t n, int64_t lo, int64_t hi, const float *vf, int hd,
                     float *const *acc) {
    switch (R) {  /* each count its own unrolled copy; the arithmetic per pair is the same */
    case 1: pv_keys(1, si, n, lo, hi, vf, hd, acc); break;
    case 2: pv_keys(2, si, n, lo, hi, vf, hd, acc); break;
    default: pv_keys(3, si, n, lo, hi, vf, hd, acc); break;
    }
}

/* One pass: up to GP pairs of the same kv head. The keys go by in stretches of SB, each stretch's K
 * (then V) used by every pair of the pass while it is in cache; each pair's arithmetic is the fixed
 * order of the header whatever the stretch boundaries (multiples of 16, so of 2).
 * s: GP rows of `stride` floats; acc: GP x 2 x hd floats. */
static void pass(const Pass *ps, int np, const float *kt, const float *vf, int hd, float *s, int64_t stride,
                 float *acc) {
    int64_t top = 0;
    for (int i = 0; i < np; i++) top = ps->last[i] > top ? ps->last[i] : top;
    for (int64_t lo = 0; lo <= top; lo += SB)
        for (int p0 = 0; p0 < np; p0 += PB)
            score_blocks(ps, p0, np - p0 < PB ? np - p0 : PB, lo, lo + SB, kt, hd, s, stride);
    float den[GP];
    for (int i = 0; i < np; i++) den[i] = softmax_row(s + (int64_t)i * stride, ps->last[i]);
    for (int64_t i = 0; i < (int64_t)np * 2 * hd; i++) acc[i] = 0.0f;
    for (int64_t lo = 0; lo <= top; lo += SB)
        for (int i = 0; i < np;) {
            int R = 1;
            while (R < PV_MAX && i + R < np && ps->last[i + R] == ps->last[i]) R++;
            if (ps->last[i] >= lo) {
                const float *si[PV_MAX];
                float *ai[PV_MAX];
                for (int r = 0; r < R; r++) {
                    si[r] = s + (int64_t)(i + r) * stride;
                    ai[r] = acc + (int64_t)(i + r) * 2 * hd;
                }
                pv_group(R, si, ps->last[i] + 1, lo, lo + SB, vf, hd, ai);
            }
            i += R;
        }
    for (int i = 0; i < np; i++) {
        vec dv = V_SET1(den[i]);
        const float *a = acc + (int64_t)i * 2 * hd;
        for (int d = 0; d < hd; d += 16) V_STORE(ps->out[i] + d, V_DIV(V_ADD(V_LOAD(a + d), V_LOAD(a + hd + d)), dv));
    }
}

/* q: [n][heads][hd] fp32 (unscaled); k, v: [kv_heads] blocks `kv_stride` elements apart, each
 * [>= start + n][hd]; out: [n][heads * hd] fp32. Returns 0, or -1 when out of memory. */
int attention(const float *q, int64_t n, int64_t start, int heads, int kv_heads, int hd, const void *k,
              const void *v, int64_t kv_stride, int bf16, float scale, float *out) {
    int64_t keys = start + n, nblk = (keys + 15) / 16;
    int rep = heads / kv_heads;
    size_t esz = bf16 ? 2 : 4;
    float *kt = aligned_alloc(64, (size_t)(nblk * 16 * hd) * sizeof(float));
    float *vf = aligned_alloc(64, (size_t)(nblk * 16 * hd) * sizeof(float));
    float *qs = aligned_alloc(64, (size_t)(n * heads * hd) * sizeof(float) + 64);
    float *s = aligned_alloc(64, (size_t)(GP * nblk * 16) * sizeof(float));
    float *acc = aligned_alloc(64, (size_t)(GP * 2 * hd) * sizeof(float));
    Pass *ps = malloc(sizeof(Pass));
    if (!kt || !vf || !qs || !s || !acc || !ps) {
        free(kt), free(vf), free(qs), free(s), free(acc), free(ps);
        return -1;
    }
    for (int64_t i = 0; i < n * heads * hd; i++) qs[i] = q[i] * scale;
    for (int g = 0; g < kv_heads; g++) {
        const void *vg = (const char *)v + (size_t)g * kv_stride * esz;
        stage((const char *)k + (size_t)g * kv_stride * esz, vg, bf16, keys, hd, kt, vf);
        const float *vals = bf16 ? vf : (const float *)vg;
        int np = 0;
        for (int64_t i = 0; i < n; i++)
            for (int r = 0; r < rep; r++) {
                int h = g * rep + r;
                ps->qs[np] = qs + (i * heads + h) * hd;
                ps->last[np] = start + i;
                ps->out[np] = out + i * heads * hd + h * hd;
                if (++np == GP) {
                    pass(ps, np, kt, vals, hd, s, nblk * 16, acc);
                    np = 0;
                }
            }
        if (np) pass(ps, np, kt, vals, hd, s, nblk * 16, acc);
    }
    free(kt), free(vf), free(qs), free(s), free(acc), free(ps);
    return 0;
}
