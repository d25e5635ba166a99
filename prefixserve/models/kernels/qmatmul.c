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

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* block_wide's 4-bit arithmetic with AVX2's 16 registers: lanes 0-7 and 8-15 of a 16-lane chain are
 * independent chains, so each half runs alone, for 2 rows x the 4 outputs at a time (8 accumulators,
 * the rows' inputs in registers, the weights read from L1), each chain's fused multiply-adds in
 * block_wide's order (fma(w, x, acc) is fma(x, w, acc)): the same bits, ~10% faster on AVX2 than
 * the generic body (whose 16 accumulators of two halves spill) */
static inline __attribute__((always_inline)) void block_wide_q4(int R, const float *x, int64_t ldx, int64_t K,
                                                                const float *wb, float *out, int64_t ldo) {
    vec acc[4][OB];
    int64_t groups = K / 32;
    for (int h = 0; h < 2; h++)
        for (int rp = 0; rp < R; rp += 2) {
            int RR = R - rp < 2 ? R - rp : 2;
            __m256 a[2][OB];
            for (int r = 0; r < 2; r++)
                for (int j = 0; j < OB; j++) a[r][j] = _mm256_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                const float *w = wb + g * OB * 32 + 8 * h;
                for (int r = 0; r < RR; r++) {
                    const float *xr = x + (rp + r) * ldx + g * 32 + 8 * h;
                    __m256 xl = _mm256_loadu_ps(xr), xh = _mm256_loadu_ps(xr + 16);
                    for (int j = 0; j < OB; j++) {
                        a[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + 32 * j), xl, a[r][j]);
                        a[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + 32 * j + 16), xh, a[r][j]);
                    }
                }
            }
            for (int r = 0; r < RR; r++)
                for (int j = 0; j < OB; j++) {
                    if (h) acc[rp + r][j].hi = a[r][j];
                    else acc[rp + r][j].lo = a[r][j];
                }
        }
    hsum_block(R, acc, out, ldo);
}
#define WIDE_Q4(RR, xr, ldx, K, wb, yr, ldo) block_wide_q4(RR, xr, ldx, K, wb, yr, ldo)
#else
#define WIDE_Q4(RR, xr, ldx, K, wb, yr, ldo) block_wide(RR, 0, xr, ldx, K, wb, NULL, yr, ldo)
#endif

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
#define BLOCK(RR, Q8) (wb ? ((Q8) ? block_wide(RR, Q8, xr, ldx, K, wb, sc, yr, ldo) : WIDE_Q4(RR, xr, ldx, K, wb, yr, ldo)) \
                          : block(RR, Q8, xr, ldx, K, qo, yr, ldo))
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

/* ---- int8 activations: decode rows (decode.c with `q8x`; docs/exactness.md, "Decode") ----
 * A row x of K inputs becomes, per group g of 32: d = amax / 127, q_i = nearbyint(x_i * (1 / d))
 * (all 0 when amax is 0), sq = d * sum(q). An output o then is, with lanes l = 0..3 each holding the
 * elements 4l..4l+3 and 16+4l..16+4l+3 of a group (an exact integer sum):
 *   Q4: acc_l = fma((float)sum(c_e q_e), scale_g * d_g, acc_l), b = fma(bias_g, sq_g, b), groups in
 *       order; y = ((acc_0 + acc_2) + (acc_1 + acc_3)) + b
 *   Q8: the same acc with the signed codes and scale_g; y = (acc_0 + acc_2) + (acc_1 + acc_3)
 * The integer sums are exact and the float steps one rounding each, so AVX2 (maddubs + madd), AVX-512
 * VNNI (dpbusd: the same integers) and plain C (below) give the same bits; llama.cpp's 4-bit x 8-bit
 * dot products do the same kind of arithmetic. */

/* x [n] rows ldx apart -> q [n][K] int8, d and sq [n][K / 32]. The AVX2 body does the plain C's
 * operations (max ignoring NaN, one multiply, rounding to nearest even, NaN -> 0): the same bytes. */
void quantize_q8x(const float *x, int64_t n, int64_t ldx, int64_t K, int8_t *q, float *d, float *sq) {
    int64_t groups = K / 32;
    for (int64_t r = 0; r < n; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * ldx + g * 32;
            int8_t *qg = q + r * K + g * 32;
#if defined(__AVX2__) && defined(__FMA__)
            const __m256 sign = _mm256_set1_ps(-0.0f), top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xg + 8 * i);
                m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);  /* a NaN lane keeps m (the second operand) */
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float amax = _mm_cvtss_f32(m4);
            float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
            __m256i c[4], sum = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                __m256 t = _mm256_mul_ps(v[i], _mm256_set1_ps(id)), number = _mm256_cmp_ps(t, t, _CMP_ORD_Q);
                t = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(t, bottom), top), number);  /* NaN -> 0 */
                c[i] = _mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                sum = _mm256_add_epi32(sum, c[i]);
            }
            /* 32 int32 -> 32 int8 in order (packs work within 128-bit halves, then put back in order) */
            __m256i w01 = _mm256_packs_epi32(c[0], c[1]), w23 = _mm256_packs_epi32(c[2], c[3]);
            __m256i b = _mm256_packs_epi16(w01, w23);
            b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)qg, b);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            d[r * groups + g] = dd;
            sq[r * groups + g] = dd * (float)_mm_cvtsi128_si32(s4);
#else
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xg[i]));
            float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
            int sum = 0;
            for (int i = 0; i < 32; i++) {
                float v = xg[i] * id;
                v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : (v == v ? v : 0.0f));
                int c = (int)nearbyintf(v);
                qg[i] = (int8_t)c;
                sum += c;
            }
            d[r * groups + g] = dd;
            sq[r * groups + g] = dd * (float)sum;
#endif
        }
}

#if defined(__AVX2__) && defined(__FMA__)
/* lane l (of 8): the sum of the 4 products of bytes 4l..4l+3, u unsigned, s signed (no int16
 * saturation: |u| <= 128, |s| <= 127) */
static inline __m256i dot4(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
/* (a0 + a2) + (a1 + a3) */
static inline float hsum4(__m128 a) {
    __m128 t = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline __attribute__((always_inline)) void block_x(int R, int q8, const int8_t *xq, int64_t K,
                                                          const float *xd, const float *xs, const uint8_t *q,
                                                          float *out, int64_t ldo) {
    __m256 acc[4][2]; /* [row][pair p]: lanes 0-3 output 2p, 4-7 output 2p + 1 */
    __m128 bacc[4];   /* [row]: the 4 outputs' bias terms */
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps(), bacc[r] = _mm_setzero_ps();
    const __m256i m = _mm256_set1_epi8(15);
    int64_t groups = K / 32;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = q + g * (q8 ? Q8_BYTES : Q4_BYTES);
        const float *scale = (const float *)(p + (q8 ? 128 : 64));
        __builtin_prefetch(p + PREFETCH);
        __builtin_prefetch(p + PREFETCH + 64);
        if (q8) __builtin_prefetch(p + PREFETCH + 128);
        __m256i lo[2], hi[2], c[OB], a[OB];
        if (q8) {
            for (int j = 0; j < OB; j++) {
                c[j] = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
                a[j] = _mm256_abs_epi8(c[j]);
            }
        } else {
            for (int pr = 0; pr < 2; pr++) { /* outputs 2pr, 2pr + 1: codes 0..15 of each in lo, 16..31 in hi */
                __m256i b = _mm256_loadu_si256((const __m256i *)(p + 32 * pr));
                lo[pr] = _mm256_and_si256(b, m);
                hi[pr] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
            }
        }
        __m128 sc = _mm_loadu_ps(scale);
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + r * K + g * 32;
            __m128 sd = _mm_mul_ps(sc, _mm_set1_ps(xd[r * groups + g]));
            __m256 sdp[2] = {_mm256_set_m128(_mm_shuffle_ps(sd, sd, 0x55), _mm_shuffle_ps(sd, sd, 0x00)),
                             _mm256_set_m128(_mm_shuffle_ps(sd, sd, 0xFF), _mm_shuffle_ps(sd, sd, 0xAA))};
            __m256i s[2];
            if (q8) {
                __m256i x = _mm256_loadu_si256((const __m256i *)xr), pj[OB];
                for (int j = 0; j < OB; j++) pj[j] = dot4(a[j], _mm256_sign_epi8(x, c[j]));
                for (int pr = 0; pr < 2; pr++)
                    s[pr] = _mm256_add_epi32(_mm256_permute2x128_si256(pj[2 * pr], pj[2 * pr + 1], 0x20),
                                             _mm256_permute2x128_si256(pj[2 * pr], pj[2 * pr + 1], 0x31));
            } else {
                __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xr));
                __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xr + 16)));
                for (int pr = 0; pr < 2; pr++) s[pr] = _mm256_add_epi32(dot4(lo[pr], xl), dot4(hi[pr], xh));
                bacc[r] = _mm_fmadd_ps(_mm_loadu_ps(scale + 4), _mm_set1_ps(xs[r * groups + g]), bacc[r]);
            }
            for (int pr = 0; pr < 2; pr++) acc[r][pr] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[pr]), sdp[pr], acc[r][pr]);
        }
    }
    for (int r = 0; r < R; r++) {
        float b[4];
        _mm_storeu_ps(b, bacc[r]);
        for (int j = 0; j < OB; j++) {
            __m256 v = acc[r][j / 2];
            float y = hsum4(j % 2 ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v));
            out[r * ldo + j] = q8 ? y : y + b[j];
        }
    }
}
#else
static inline void block_x(int R, int q8, const int8_t *xq, int64_t K, const float *xd, const float *xs,
                           const uint8_t *q, float *out, int64_t ldo) {
    int64_t groups = K / 32;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < OB; j++) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, b = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *p = q + g * (q8 ? Q8_BYTES : Q4_BYTES);
                const float *scale = (const float *)(p + (q8 ? 128 : 64));
                const int8_t *xr = xq + r * K + g * 32;
                float sd = scale[j] * xd[r * groups + g];
                for (int l = 0; l < 4; l++) {
                    int s = 0;
                    for (int h = 0; h < 2; h++)
                        for (int k = 0; k < 4; k++) {
                            int e = 16 * h + 4 * l + k;
                            int c = q8 ? (int)((const int8_t *)p)[32 * j + e]
                                       : (h ? p[16 * j + e - 16] >> 4 : p[16 * j + e] & 15);
                            s += c * xr[e];
                        }
                    acc[l] = fmaf((float)s, sd, acc[l]);
                }
                if (!q8) b = fmaf(scale[4 + j], xs[r * groups + g], b);
            }
            float y = (acc[0] + acc[2]) + (acc[1] + acc[3]);
            out[r * ldo + j] = q8 ? y : y + b;
        }
}
#endif

/* qmatmul's outputs [o0, o1) from rows quantized by quantize_q8x (q [n][K], d and sq [n][K / 32]) */
void qmatmul_x(const int8_t *xq, const float *xd, const float *xs, int64_t n, int64_t K, int kind,
               const uint8_t *q, int64_t o0, int64_t o1, float *out, int64_t ldo) {
    int q8 = kind == 1;
    int64_t bb = K / 32 * (q8 ? Q8_BYTES : Q4_BYTES), groups = K / 32;
    for (int64_t o = o0; o < o1; o += OB) {
        const uint8_t *qo = q + o / OB * bb;
        for (int64_t r = 0; r < n; r += 4) {
            int R = n - r < 4 ? (int)(n - r) : 4;
            const int8_t *xr = xq + r * K;
            const float *dr = xd + r * groups, *sr = xs + r * groups;
            float *yr = out + r * ldo + o;
            if (q8) {
                if (R == 4) block_x(4, 1, xr, K, dr, sr, qo, yr, ldo); else if (R == 3) block_x(3, 1, xr, K, dr, sr, qo, yr, ldo);
                else if (R == 2) block_x(2, 1, xr, K, dr, sr, qo, yr, ldo); else block_x(1, 1, xr, K, dr, sr, qo, yr, ldo);
            } else {
                if (R == 4) block_x(4, 0, xr, K, dr, sr, qo, yr, ldo); else if (R == 3) block_x(3, 0, xr, K, dr, sr, qo, yr, ldo);
                else if (R == 2) block_x(2, 0, xr, K, dr, sr, qo, yr, ldo); else block_x(1, 0, xr, K, dr, sr, qo, yr, ldo);
            }
        }
    }
}
