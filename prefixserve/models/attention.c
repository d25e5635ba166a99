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
 * K and V: [kv_heads][capacity][head_dim], bf16 or fp32 (a session's cache, as the runner keeps
 * it); head_dim a multiple of 16 (models/layers.py falls back to its torch formulation otherwise).
 */
#include "simd.h"


enum { PB = 8 };  /* (row, head) pairs scored together: independent chains sharing each key load */

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

/* One batch of up to PB pairs of the same kv head. qs[i]: the pair's scaled query (hd floats),
 * last[i]: its last key (its absolute position), out[i]: where its hd outputs go.
 * s: scratch, PB rows of `stride` floats. */
static void pairs(int np, const float *const *qs, const int64_t *last, float *const *out, const float *kt,
                  const float *vf, int hd, float *s, int64_t stride) {
    int64_t maxlast = 0;
    for (int i = 0; i < np; i++) maxlast = last[i] > maxlast ? last[i] : maxlast;
    int64_t nblk = maxlast / 16 + 1;
    /* scores: pair i's chain over d for each 16-key block; blocks past a pair's last key are
     * computed with the others and never read */
    for (int64_t b = 0; b < nblk; b++) {
        const float *kb = kt + b * hd * 16;
        vec acc[PB];
        for (int i = 0; i < PB; i++) acc[i] = V_ZERO();
        for (int d = 0; d < hd; d++) {
            vec kd = V_LOAD(kb + d * 16);
            for (int i = 0; i < PB; i++)
                if (i < np) acc[i] = V_FMA(V_SET1(qs[i][d]), kd, acc[i]);
        }
        for (int i = 0; i < np; i++) V_STORE(s + i * stride + b * 16, acc[i]);
    }
    for (int i = 0; i < np; i++) {
        float *si = s + i * stride;
        int64_t n = last[i] + 1, nb = last[i] / 16 + 1;
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
        vec dv = V_SET1(hsum(den));
        /* P.V: chains over even and odd keys (head_dim / 16 vectors each), then added */
        for (int d0 = 0; d0 < hd; d0 += 64) {
            int w = hd - d0 < 64 ? (hd - d0) / 16 : 4;
            vec a0[4], a1[4];
            for (int t = 0; t < 4; t++) a0[t] = a1[t] = V_ZERO();
            int64_t j = 0;
            for (; j + 1 < n; j += 2) {
                vec e0 = V_SET1(si[j]), e1 = V_SET1(si[j + 1]);
                const float *v0 = vf + j * hd + d0, *v1 = v0 + hd;
                for (int t = 0; t < 4; t++)
                    if (t < w) {
                        a0[t] = V_FMA(e0, V_LOAD(v0 + 16 * t), a0[t]);
                        a1[t] = V_FMA(e1, V_LOAD(v1 + 16 * t), a1[t]);
                    }
            }
            if (j < n) {
                vec e0 = V_SET1(si[j]);
                const float *v0 = vf + j * hd + d0;
                for (int t = 0; t < 4; t++)
                    if (t < w) a0[t] = V_FMA(e0, V_LOAD(v0 + 16 * t), a0[t]);
            }
            for (int t = 0; t < w; t++) V_STORE(out[i] + d0 + 16 * t, V_DIV(V_ADD(a0[t], a1[t]), dv));
        }
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
    float *s = aligned_alloc(64, (size_t)(PB * nblk * 16) * sizeof(float));
    if (!kt || !vf || !qs || !s) {
        free(kt), free(vf), free(qs), free(s);
        return -1;
    }
    for (int64_t i = 0; i < n * heads * hd; i++) qs[i] = q[i] * scale;
    for (int g = 0; g < kv_heads; g++) {
        const void *vg = (const char *)v + (size_t)g * kv_stride * esz;
        stage((const char *)k + (size_t)g * kv_stride * esz, vg, bf16, keys, hd, kt, vf);
        const float *vals = bf16 ? vf : (const float *)vg;
        const float *qp[PB];
        int64_t last[PB];
        float *op[PB];
        int np = 0;
        for (int64_t i = 0; i < n; i++)
            for (int r = 0; r < rep; r++) {
                int h = g * rep + r;
                qp[np] = qs + (i * heads + h) * hd;
                last[np] = start + i;
                op[np] = out + i * heads * hd + h * hd;
                if (++np == PB) {
                    pairs(np, qp, last, op, kt, vals, hd, s, nblk * 16);
                    np = 0;
                }
            }
        if (np) pairs(np, qp, last, op, kt, vals, hd, s, nblk * 16);
    }
    free(kt), free(vf), free(qs), free(s);
    return 0;
}
