/* Matmuls of GGUF 4- and 8-bit weights for decode rows and logits (models/quant.py), each output
 * computed in one fixed order.
 *
 * Built with attention.c by models/native.py and called through ctypes (and by decode.c).
 *
 * Weights, N output rows (N a multiple of 4) of K inputs (K a multiple of 32), in groups of 32,
 * stored by blocks of 4 outputs so that a block streams from one place: block b (outputs 4b..4b+3),
 * group g at byte (b * K/32 + g) * BYTES:
 *   Q4 (96 bytes): codes of output 4b + j at 16 j (byte i: code i in its low nibble, code i + 16 in
 *       its high one, GGUF's block layout), fp32 scale[4] at 64, fp32 bias[4] at 80;
 *       w = fma(scale, code, bias), one rounding
 *   Q8 (144 bytes): int8 codes of output 4b + j at 32 j, fp32 scale[4] at 128; w = scale * code
 *
 * For a row x and an output o the kernel computes, always the same way:
 *   Q4: acc = fma(w_j, x_j, acc) over j = l, l + 16, ... for lane l (16 lanes; per group the
 *       codes 0..15, then 16..31), groups in order; y = hsum(acc)
 *   Q8: t_g = fma(c_hi, x_hi, c_lo * x_lo) per group (16 lanes; c the codes), acc = fma(t_g,
 *       scale_g, acc) over the groups in order; y = hsum(acc)
 * hsum: a fixed tree over the 16 lanes (simd.h); a block of rows takes its 16 sums together by the
 * same tree (`hsum_block`: simd.h `hsum16`, ~10% of a 4-bit prefill matmul at K = 576). Nothing
 * depends on how many rows or which outputs a call has, or on the output range a thread was given:
 * a row's bits are its own, whatever the batch and however the outputs are split.
 */
#include "simd.h"

enum { OB = 4 };  /* outputs computed together (independent chains sharing each x load) */

enum { Q4_BYTES = 96, Q8_BYTES = 144, PREFETCH = 3072 /* bytes ahead in a block's stream */ };

/* The R x OB sums of a block at once (simd.h `hsum16`: the same bits as one hsum each) */
static inline __attribute__((always_inline)) void hsum_block(int R, vec acc[4][OB], float *out, int64_t ldo) {
    vec t[16];
    for (int k = 0; k < 16; k++) t[k] = k / OB < R ? acc[k / OB][k % OB] : V_ZERO();
    vec y = hsum16(t);  /* lane OB r + j: row r, output j */
#if defined(__AVX512F__)
    if (R > 0) _mm_storeu_ps(out, _mm512_extractf32x4_ps(y, 0));
    if (R > 1) _mm_storeu_ps(out + ldo, _mm512_extractf32x4_ps(y, 1));
    if (R > 2) _mm_storeu_ps(out + 2 * ldo, _mm512_extractf32x4_ps(y, 2));
    if (R > 3) _mm_storeu_ps(out + 3 * ldo, _mm512_extractf32x4_ps(y, 3));
#else
    float lanes[16];
    V_STORE(lanes, y);
    for (int r = 0; r < R; r++) memcpy(out + r * ldo, lanes + OB * r, OB * sizeof(float));
#endif
}

static inline __attribute__((always_inline)) void block(int R, int q8, const float *x, int64_t ldx, int64_t K,
                                                        const uint8_t *q, float *out, int64_t ldo) {
    vec acc[4][OB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < OB; j++) acc[r][j] = V_ZERO();
    int64_t groups = K / 32;
    for (int64_t g = 0; g < groups; g++) {
        vec lo[OB], hi[OB], s[OB];
        const uint8_t *p = q + g * (q8 ? Q8_BYTES : Q4_BYTES);
        const float *scale = (const float *)(p + (q8 ? 128 : 64)), *bias = scale + 4;
        /* the stream runs from DRAM: without asking ahead one thread read ~5 GB/s, with it ~9 */
        __builtin_prefetch(p + PREFETCH);
        __builtin_prefetch(p + PREFETCH + 64);
        if (q8) __builtin_prefetch(p + PREFETCH + 128);
        for (int j = 0; j < OB; j++) {
            if (q8) {
                lo[j] = v_q8((const int8_t *)p + 32 * j);
                hi[j] = v_q8((const int8_t *)p + 32 * j + 16);
                s[j] = V_SET1(scale[j]);
            } else {
                v_q4(p + 16 * j, scale[j], bias[j], &lo[j], &hi[j]);
            }
        }
        for (int r = 0; r < R; r++) {
            vec xl = V_LOAD(x + r * ldx + g * 32), xh = V_LOAD(x + r * ldx + g * 32 + 16);
            for (int j = 0; j < OB; j++) {
                if (q8) {
                    vec t = V_MUL(lo[j], xl);
                    t = V_FMA(hi[j], xh, t);
                    acc[r][j] = V_FMA(t, s[j], acc[r][j]);
                } else {
                    acc[r][j] = V_FMA(lo[j], xl, acc[r][j]);
                    acc[r][j] = V_FMA(hi[j], xh, acc[r][j]);
                }
            }
        }
    }
    if (R >= 2) {  /* one row: its four sums alone are cheaper */
        hsum_block(R, acc, out, ldo);
        return;
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < OB; j++) out[r * ldo + j] = hsum(acc[r][j]);
}

/* The same arithmetic as `block`, reading the weights of a block of OB outputs from `wb`, where
 * `widen` has stored them as fp32 (the very values `block` makes in registers): for calls of many
 * rows (prefill), which then decode each group once, not once per 4 rows. */
static inline __attribute__((always_inline)) void block_wide(int R, int q8, const float *x, int64_t ldx, int64_t K,
                                                             const float *wb, const float *sc, float *out,
                                                             int64_t ldo) {
    vec acc[4][OB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < OB; j++) acc[r][j] = V_ZERO();
    int64_t groups = K / 32;
    for (int64_t g = 0; g < groups; g++) {
        const float *w = wb + g * OB * 32;
        for (int r = 0; r < R; r++) {
            vec xl = V_LOAD(x + r * ldx + g * 32), xh = V_LOAD(x + r * ldx + g * 32 + 16);
            for (int j = 0; j < OB; j++) {
                vec lo = V_LOAD(w + 32 * j), hi = V_LOAD(w + 32 * j + 16);
                if (q8) {
                    vec t = V_MUL(lo, xl);
                    t = V_FMA(hi, xh, t);
                    acc[r][j] = V_FMA(t, V_SET1(sc[g * OB + j]), acc[r][j]);
                } else {
                    acc[r][j] = V_FMA(lo, xl, acc[r][j]);
                    acc[r][j] = V_FMA(hi, xh, acc[r][j]);
                }
            }
        }
    }
    hsum_block(R, acc, out, ldo);
}

/* one block of OB outputs as fp32 weights wb [groups][OB][32] (codes 0..15, then 16..31) and, for
 * Q8, scales sc [groups][OB] */
static void widen(int q8, int64_t K, const uint8_t *q, float *wb, float *sc) {
    for (int64_t g = 0; g < K / 32; g++) {
        const uint8_t *p = q + g * (q8 ? Q8_BYTES : Q4_BYTES);
        const float *scale = (const float *)(p + (q8 ? 128 : 64)), *bias = scale + 4;
        __builtin_prefetch(p + PREFETCH);
        __builtin_prefetch(p + PREFETCH + 64);
        if (q8) __builtin_prefetch(p + PREFETCH + 128);
        float *w = wb + g * OB * 32;
        for (int j = 0; j < OB; j++) {
            vec lo, hi;
            if (q8) {
                lo = v_q8((const int8_t *)p + 32 * j);
                hi = v_q8((const int8_t *)p + 32 * j + 16);
                sc[g * OB + j] = scale[j];
            } else {
                v_q4(p + 16 * j, scale[j], bias[j], &lo, &hi);
            }
            V_STORE(w + 32 * j, lo);
            V_STORE(w + 32 * j + 16, hi);
        }
    }
}

/* calls of at least WIDE_ROWS rows widen each block once (`block_wide`), into a buffer on the stack
 * (at most 128 KB: K <= WIDE_MAX_K) */
enum { WIDE_ROWS = 8, WIDE_MAX_K = 8192, WIDE_CHUNK = 64 };

/* x: [n] rows ldx floats apart, K used; out: [n] rows ldo floats apart, columns [o0, o1) written
 * (o0, o1 multiples of OB). kind 0: Q4, 1: Q8. */
void qmatmul(const float *x, int64_t n, int64_t ldx, int64_t K, int kind, const uint8_t *q, int64_t o0, int64_t o1,
            float *out, int64_t ldo) {
    int q8 = kind == 1;
    int64_t bb = K / 32 * (q8 ? Q8_BYTES : Q4_BYTES);  /* bytes of one block of OB outputs */
    int wide = n >= WIDE_ROWS && K <= WIDE_MAX_K;
    float buf[wide ? K * OB + K / 32 * OB + 16 : 1];
    float *wb = wide ? (float *)(((uintptr_t)buf + 63) & ~(uintptr_t)63) : NULL, *sc = wb ? wb + K * OB : NULL;
    /* wide calls go 64 rows at a time, so that those rows stay in cache across the blocks */
    for (int64_t r0 = 0; r0 < n; r0 += wide ? WIDE_CHUNK : n)
    for (int64_t o = o0; o < o1; o += OB) {
        const uint8_t *qo = q + o / OB * bb;
        int64_t r1 = wide && r0 + WIDE_CHUNK < n ? r0 + WIDE_CHUNK : n;
        if (wb) widen(q8, K, qo, wb, sc);
        for (int64_t r = r0; r < r1; r += 4) {
            int R = r1 - r < 4 ? (int)(r1 - r) : 4;
            const float *xr = x + r * ldx;
            float *yr = out + r * ldo + o;
#define BLOCK(RR, Q8) (wb ? block_wide(RR, Q8, xr, ldx, K, wb, sc, yr, ldo) : block(RR, Q8, xr, ldx, K, qo, yr, ldo))
            /* one specialisation per row count and kind; the same arithmetic per row */
            if (q8) {
                if (R == 4) BLOCK(4, 1); else if (R == 3) BLOCK(3, 1); else if (R == 2) BLOCK(2, 1); else BLOCK(1, 1);
            } else {
                if (R == 4) BLOCK(4, 0); else if (R == 3) BLOCK(3, 0); else if (R == 2) BLOCK(2, 0); else BLOCK(1, 0);
            }
#undef BLOCK
        }
    }
}
