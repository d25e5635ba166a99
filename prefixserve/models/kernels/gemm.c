/* Prompt rows' matmuls on GGUF 4- and 8-bit weights (decode.c `prefill_layer`): a register-tiled
 * matrix multiply whose every output is one fused multiply-add chain over K in order.
 *
 * Weights in qmatmul.c's layout (its header): blocks of 4 outputs, groups of 32 inputs, the value of
 * a weight w = fma(scale, code, bias) (Q4) or scale * code (Q8), one rounding, as qmatmul.c makes it.
 * For a row x and an output o the kernel computes, always the same way:
 *   acc = 0; acc = fma(x_k, w_ok, acc) for k = 0, 1, ..., K - 1; y = acc
 * The vector lanes hold 16 *outputs*, not 16 inputs, so no lane sums are added at the end and the
 * vector width never enters the arithmetic: the AVX-512, AVX2 and plain C bodies give the same bits
 * (fmaf is the fused operation), whatever the row count, the rows' order, the output range a thread
 * was given, or the tile sizes below, which only decide what is computed together.
 *
 * Why not qmatmul.c's order (16 lanes over K, summed by a tree): that order needs each row's inputs
 * and each output's weights in registers together, two loads a fused multiply-add, and on AVX2's 16
 * registers it ran load- and latency-bound (~29 GMAC/s a thread against the 38 two FMA ports allow).
 * Here a step k loads 16 outputs' weights once for MR rows and each row's input once (a broadcast)
 * for all 16: MR x 16 accumulators in registers, FMA-bound. Decode rows keep qmatmul.c: one row per
 * call cannot amortise turning a panel of weights into floats; their KV is never cached as it is
 * (docs/exactness.md), so the two orders never meet in one cached state.
 *
 * Blocking: the rows go in chunks of MC (their inputs of a KC-wide slice stay in L2), a chunk's
 * outputs in panels of 16 whose weights for the slice are turned into floats once (`panel`, KC x 16
 * floats, in L1), then MR rows at a time over the slice; partial sums of a slice wait in `out`
 * (fp32 stores and loads are exact), so slicing K changes no bit.
 */
#include "simd.h"

enum { KC = 192, MC = 512, OB = 4, Q4_BYTES = 96, Q8_BYTES = 144 };

/* Panel-ordered 4-bit weights (kind 2, made from Q4 by `qpanel_pack`), what `panel` reads without
 * turning 8 x 8 tiles over (those transposes were ~40% of a 23-row prompt's matmul time, and a fixed
 * ~15 ms of every prefill step however few its rows): for each 16 outputs (a P4 panel, outputs
 * 16 P ... 16 P + 15) and each group of 32 inputs, P4_BYTES bytes -- 32 rows of 8 bytes, row k's byte j
 * holding output j's code of input k (low nibble) and output j + 8's (high nibble), then the 16
 * outputs' scales and their biases (fp32). A weight's value is Q4's, fma(scale, code, bias). */
enum { P4 = 16, P4_BYTES = 32 * P4 / 2 + 2 * P4 * 4 };

/* The tile's vector: half a panel (H outputs), two a row */
#if defined(__AVX512F__)
#define MR 6   /* 6 rows x 32 outputs: 12 zmm accumulators, 8 loads for 12 fused multiply-adds */
#define NR 32
#define TILE_REGS 1
typedef __m512 hv;
#define H_ZERO() _mm512_setzero_ps()
#define H_LOADU(p) _mm512_loadu_ps(p)
#define H_LOADA(p) _mm512_load_ps(p)
#define H_STOREU(p, v) _mm512_storeu_ps(p, v)
#define H_BCAST(p) _mm512_set1_ps(*(p))
#define H_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif defined(__AVX2__) && defined(__FMA__)
#define MR 6   /* 6 rows x 16 outputs: 12 ymm accumulators of AVX2's 16 registers */
#define NR 16
#define TILE_REGS 1
typedef __m256 hv;
#define H_ZERO() _mm256_setzero_ps()
#define H_LOADU(p) _mm256_loadu_ps(p)
#define H_LOADA(p) _mm256_load_ps(p)
#define H_STOREU(p, v) _mm256_storeu_ps(p, v)
#define H_BCAST(p) _mm256_broadcast_ss(p)
#define H_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define MR 4
#define NR 16
#define TILE_REGS 0  /* plain C: `tile_fixed` below */
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* r[i][j] -> r[j][i] for an 8 x 8 fp32 tile (pure data movement) */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* `panel`'s Q4 values for the 8 outputs of two blocks (the second absent: zeros) at once: each
 * output's 32 values of a group as simd.h's AVX2 v_q4 makes them (fma(scale, code, bias)), 8 x 8
 * tiles turned over in registers */
static void panel_q4_pair(const uint8_t *a, const uint8_t *b, int64_t bytes, int64_t g0, int64_t g1, float *wp) {
    const __m256i m = _mm256_set1_epi32(15);
    for (int64_t g = g0; g < g1; g++) {
        __m256 r[4][8];  /* [k octet][output] */
        for (int j = 0; j < 8; j++) {
            const uint8_t *base = j < 4 ? a : b;
            if (!base) {
                for (int t = 0; t < 4; t++) r[t][j] = _mm256_setzero_ps();
                continue;
            }
            const uint8_t *p = base + g * bytes;
            int jj = j & 3;
            const __m256 sc = _mm256_set1_ps(((const float *)(p + 64))[jj]), bi = _mm256_set1_ps(((const float *)(p + 80))[jj]);
            __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 * jj)));
            __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 * jj + 8)));
            r[0][j] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(_mm256_and_si256(b0, m)), bi);
            r[1][j] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(_mm256_and_si256(b1, m)), bi);
            r[2][j] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), bi);
            r[3][j] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), bi);
        }
        float *dst = wp + (g - g0) * 32 * NR;
        for (int t = 0; t < 4; t++) {
            transpose8(r[t]);
            for (int i = 0; i < 8; i++) _mm256_store_ps(dst + (8 * t + i) * NR, r[t][i]);
        }
    }
}
#endif

/* wp[k - k0][j0 + j] = weight of output o + j at input k for j < 16, k in [k0, k1) (multiples of 32),
 * from a P4 panel (o a multiple of 16) */
static void panel_p4(int64_t K, const uint8_t *q, int64_t o, int64_t k0, int64_t k1, float *wp, int j0) {
    for (int64_t g = k0 / 32; g < k1 / 32; g++) {
        const uint8_t *p = q + (o / P4 * (K / 32) + g) * P4_BYTES;
        const float *sc = (const float *)(p + 16 * P4), *bi = sc + P4;
        float *dst = wp + (g * 32 - k0) * NR + j0;
#if defined(__AVX512F__)
        const __m512 s = _mm512_loadu_ps(sc), b = _mm512_loadu_ps(bi);
        const __m512i sh = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0), m = _mm512_set1_epi32(15);
        for (int k = 0; k < 32; k++) {
            int64_t row;
            memcpy(&row, p + 8 * k, 8);
            __m512i c = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(row)), sh), m);
            _mm512_store_ps(dst + k * NR, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(c), b));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8), b0 = _mm256_loadu_ps(bi),
                     b1 = _mm256_loadu_ps(bi + 8);
        const __m256i m = _mm256_set1_epi32(15);
        for (int k = 0; k < 32; k++) {
            __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * k)));
            _mm256_store_ps(dst + k * NR, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_and_si256(c, m)), b0));
            _mm256_store_ps(dst + k * NR + 8, _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), b1));
        }
#else
        for (int k = 0; k < 32; k++)
            for (int j = 0; j < 8; j++) {
                int c = p[8 * k + j];
                dst[k * NR + j] = fmaf(sc[j], (float)(c & 15), bi[j]);
                dst[k * NR + j + 8] = fmaf(sc[j + 8], (float)(c >> 4), bi[j + 8]);
            }
#endif
    }
}

/* wp[k - k0][j] = weight of output o + j at input k, k in [k0, k1) (a multiple of 32 apart), j < NR;
 * outputs past `outs` (a partial panel) are 0. kind 0: Q4, 1: Q8, 2: P4. */
static void panel(int kind, int64_t K, const uint8_t *q, int64_t o, int outs, int64_t k0, int64_t k1, float *wp) {
    int q8 = kind == 1;
    int64_t bytes = q8 ? Q8_BYTES : Q4_BYTES, bb = K / 32 * bytes;
    int64_t n = k1 - k0;
    if (kind == 2) {
        for (int j0 = 0; j0 < NR; j0 += P4) {
            if (j0 < outs) {
                panel_p4(K, q, o + j0, k0, k1, wp, j0);
                continue;
            }
            for (int64_t k = 0; k < n; k++)
                for (int j = j0; j < j0 + P4; j++) wp[k * NR + j] = 0.0f;
        }
        return;
    }
#if defined(__AVX2__) && defined(__FMA__)
    if (!q8) {
        for (int j0 = 0; j0 < NR; j0 += 2 * OB) {
            const uint8_t *a = j0 < outs ? q + (o + j0) / OB * bb : NULL;
            const uint8_t *b = j0 + OB < outs ? q + (o + j0 + OB) / OB * bb : NULL;
            if (!a) {
                for (int64_t k = 0; k < n; k++) _mm256_store_ps(wp + k * NR + j0, _mm256_setzero_ps());
                continue;
            }
            panel_q4_pair(a, b, bytes, k0 / 32, k1 / 32, wp + j0);
        }
        return;
    }
#endif
    for (int j0 = 0; j0 < NR; j0 += OB) {
        if (j0 >= outs) {
            for (int64_t k = 0; k < n; k++)
                for (int j = j0; j < j0 + OB; j++) wp[k * NR + j] = 0.0f;
            continue;
        }
        const uint8_t *blk = q + (o + j0) / OB * bb;
        for (int64_t g = k0 / 32; g < k1 / 32; g++) {
            const uint8_t *p = blk + g * bytes;
            float *dst = wp + (g * 32 - k0) * NR + j0;
            for (int j = 0; j < OB; j++) {
                float w[32];
                if (q8) {
                    float s = ((const float *)(p + 128))[j];
                    const int8_t *c = (const int8_t *)p + 32 * j;
                    for (int i = 0; i < 32; i++) w[i] = s * (float)c[i];
                } else {
                    vec lo, hi;
                    v_q4(p + 16 * j, ((const float *)(p + 64))[j], ((const float *)(p + 80))[j], &lo, &hi);
                    V_STORE(w, lo);
                    V_STORE(w + 16, hi);
                }
                for (int i = 0; i < 32; i++) dst[i * NR + j] = w[i];
            }
        }
    }
}

/* rows [0, R) of a tile: c[r][0:16] (ldc apart) = chain over the slice's n inputs from c (or from 0
 * when first), weights wp (n x 16), inputs x (rows ldx apart, the slice's first input at x). The
 * kernel always runs MR rows, rows past R repeating row R - 1 (their results not stored): each
 * accumulator is a named variable, which the compiler keeps in a register (as an array it stored
 * every accumulator to the stack each step). */
#if TILE_REGS
static void tile(int R, const float *x, int64_t ldx, const float *wp, int64_t n, float *c, int64_t ldc, int first) {
    enum { H = NR / 2 };
    const float *x0 = x, *x1 = x + (R > 1) * ldx, *x2 = x + (R > 2 ? 2 : R - 1) * ldx;
    const float *x3 = x + (R > 3 ? 3 : R - 1) * ldx, *x4 = x + (R > 4 ? 4 : R - 1) * ldx;
    const float *x5 = x + (R > 5 ? 5 : R - 1) * ldx;
    hv a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51;
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = H_ZERO();
    if (!first) {
#define LD(r, A0, A1) if (R > r) A0 = H_LOADU(c + r * ldc), A1 = H_LOADU(c + r * ldc + H);
        LD(0, a00, a01) LD(1, a10, a11) LD(2, a20, a21) LD(3, a30, a31) LD(4, a40, a41) LD(5, a50, a51)
#undef LD
    }
    for (int64_t k = 0; k < n; k++) {
        hv w0 = H_LOADA(wp + k * NR), w1 = H_LOADA(wp + k * NR + H), b;
#define STEP(X, A0, A1) b = H_BCAST(X + k), A0 = H_FMA(b, w0, A0), A1 = H_FMA(b, w1, A1);
        STEP(x0, a00, a01) STEP(x1, a10, a11) STEP(x2, a20, a21) STEP(x3, a30, a31) STEP(x4, a40, a41)
        STEP(x5, a50, a51)
#undef STEP
    }
#define ST(r, A0, A1) if (R > r) H_STOREU(c + r * ldc, A0), H_STOREU(c + r * ldc + H, A1);
    ST(0, a00, a01) ST(1, a10, a11) ST(2, a20, a21) ST(3, a30, a31) ST(4, a40, a41) ST(5, a50, a51)
#undef ST
}
#else
static inline __attribute__((always_inline)) void tile_fixed(int R, const float *x, int64_t ldx, const float *wp,
                                                             int64_t n, float *c, int64_t ldc, int first) {
    vec a[MR];
    for (int r = 0; r < R; r++) a[r] = first ? V_ZERO() : V_LOAD(c + r * ldc);
    for (int64_t k = 0; k < n; k++) {
        vec w = V_LOAD(wp + k * NR);
        for (int r = 0; r < R; r++) a[r] = V_FMA(V_SET1(x[r * ldx + k]), w, a[r]);
    }
    for (int r = 0; r < R; r++) V_STORE(c + r * ldc, a[r]);
}

/* one specialisation per row count: the same arithmetic per row */
static void tile(int R, const float *x, int64_t ldx, const float *wp, int64_t n, float *c, int64_t ldc, int first) {
    switch (R) {
#define T(k) case k: tile_fixed(k, x, ldx, wp, n, c, ldc, first); break;
        T(1) T(2) T(3) T(4)
#undef T
        default: break;
    }
}
#endif

/* ---- kind 3: X4, prompt rows on int8 activations ----
 * The rows are rounded to int8 per group of 32 inputs exactly as the decode step's (qmatmul.c
 * `quantize_q8x`: d = amax / 127, q_k = nearbyint(x_k / d), sq = d * sum(q)), and for a row and an
 * output o of a Q4 weight (value fma(scale, code, bias)) the kernel computes, always the same way:
 *   acc = 0; for each group g in order: S = sum of code_k * q_k over its 32 inputs (an exact integer,
 *   |S| <= 32 * 15 * 127), acc = fma((float)S, scale_g * d_g, acc), acc = fma(bias_g, sq_g, acc); y = acc
 * The integer sums are exact however they are formed, so AVX2 (maddubs, 16-bit sums of 8 steps,
 * then madd), AVX-512 VNNI (dpbusd on 16 outputs a register, 8 rows a tile) and plain C give the same
 * bits. Why: on AVX2 a multiply-add of 8 fp32 lanes is 8 MACs, a maddubs of 32 bytes 32 (summed in
 * pairs), so with the 16-bit sums added lane-wise and widened once a group the integer step does ~2x
 * the fp32 tile's MACs an instruction; llama.cpp's prompt rows on AVX2 multiply the same way (4-bit
 * weights by int8 activations). The rounding of the activations is the price, the one llama.cpp
 * pays: row-local, so a cached prefix is still exact (docs/exactness.md).
 *
 * Layout (`qx4_pack`, from a Q4 pack): for each 16 outputs (outputs 16 P ... 16 P + 15) and group of 32
 * inputs, X4_BYTES bytes: 8 chunks of 32 bytes, chunk 2 s + h (s < 4, h < 2) holding at byte 4 j + t
 * output 8 h + j's codes of inputs 4 s + t (low nibble) and 16 + 4 s + t (high nibble) -- one Q4 byte
 * each, moved -- then the 16 outputs' scales and their biases (fp32). */
enum { X4 = 16, X4_BYTES = 8 * 32 + 2 * X4 * 4 };

void quantize_q8x(const float *x, int64_t n, int64_t ldx, int64_t K, int8_t *q, float *d, float *sq);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* AVX-512 with VNNI (a Zen 4's set, an Intel Xeon's): the panel's 16 outputs in one zmm, chunks 2 s
 * and 2 s + 1 side by side in one 64-byte load, `dpbusd` adding 4 products into each 32-bit lane, 8
 * rows a tile (32 registers) */
#define XR 8
static inline __attribute__((always_inline)) void xtile(int R, const int8_t *xq, int64_t K, const float *xd,
                                                        const float *xs, const uint8_t *p, float *out, int64_t ldo) {
    int64_t G = K / 32;
    __m512 y[XR];
    for (int r = 0; r < R; r++) y[r] = _mm512_setzero_ps();
    const __m512i m = _mm512_set1_epi8(15);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = p + g * X4_BYTES;
        const int8_t *xg = xq + g * 32;
        __m512i a[XR];
        for (int r = 0; r < R; r++) a[r] = _mm512_setzero_si512();
        for (int s = 0; s < 4; s++) {
            __m512i c = _mm512_loadu_si512((const void *)(b + 64 * s));
            __m512i lo = _mm512_and_si512(c, m), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), m);
            for (int r = 0; r < R; r++) {
                int32_t v0, v1;
                memcpy(&v0, xg + r * K + 4 * s, 4);
                memcpy(&v1, xg + r * K + 16 + 4 * s, 4);
                a[r] = _mm512_dpbusd_epi32(a[r], lo, _mm512_set1_epi32(v0));
                a[r] = _mm512_dpbusd_epi32(a[r], hi, _mm512_set1_epi32(v1));
            }
        }
        const float *sc = (const float *)(b + 256);
        __m512 s16 = _mm512_loadu_ps(sc), b16 = _mm512_loadu_ps(sc + X4);
        for (int r = 0; r < R; r++) {
            y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r]), _mm512_mul_ps(s16, _mm512_set1_ps(xd[r * G + g])), y[r]);
            y[r] = _mm512_fmadd_ps(b16, _mm512_set1_ps(xs[r * G + g]), y[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * ldo, y[r]);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define XR 4
/* 32 products of 4-bit codes (unsigned, in w) and int8 inputs summed in pairs into i16 lanes
 * (maddubs: 2 x 15 x 127 at most; a group's 8 steps of them fit 16 bits), widened once a group */
#define X_ACC(a, w, x) _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x))
#define X_WIDEN(a) _mm256_madd_epi16(a, _mm256_set1_epi16(1))

/* rows [0, R) of int8 rows xq (K apart; d, sq: G = K / 32 a row) times the 16 outputs of panel p ->
 * out (rows ldo apart) */
static inline __attribute__((always_inline)) void xtile(int R, const int8_t *xq, int64_t K, const float *xd,
                                                        const float *xs, const uint8_t *p, float *out, int64_t ldo) {
    int64_t G = K / 32;
    __m256 y[XR][2];
    for (int r = 0; r < R; r++) y[r][0] = y[r][1] = _mm256_setzero_ps();
    const __m256i m = _mm256_set1_epi8(15);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = p + g * X4_BYTES;
        const int8_t *xg = xq + g * 32;
        __m256i a[XR][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
        for (int s = 0; s < 4; s++) {
            __m256i c0 = _mm256_loadu_si256((const __m256i *)(b + 64 * s));
            __m256i c1 = _mm256_loadu_si256((const __m256i *)(b + 64 * s + 32));
            __m256i w0 = _mm256_and_si256(c0, m), w1 = _mm256_and_si256(c1, m);
            for (int r = 0; r < R; r++) {
                int32_t v;
                memcpy(&v, xg + r * K + 4 * s, 4);
                __m256i xb = _mm256_set1_epi32(v);
                a[r][0] = X_ACC(a[r][0], w0, xb);
                a[r][1] = X_ACC(a[r][1], w1, xb);
            }
            w0 = _mm256_and_si256(_mm256_srli_epi16(c0, 4), m), w1 = _mm256_and_si256(_mm256_srli_epi16(c1, 4), m);
            for (int r = 0; r < R; r++) {
                int32_t v;
                memcpy(&v, xg + r * K + 16 + 4 * s, 4);
                __m256i xb = _mm256_set1_epi32(v);
                a[r][0] = X_ACC(a[r][0], w0, xb);
                a[r][1] = X_ACC(a[r][1], w1, xb);
            }
        }
        const float *sc = (const float *)(b + 256), *bi = sc + X4;
        __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8), b0 = _mm256_loadu_ps(bi), b1 = _mm256_loadu_ps(bi + 8);
        for (int r = 0; r < R; r++) {
            __m256 dx = _mm256_set1_ps(xd[r * G + g]), sq = _mm256_set1_ps(xs[r * G + g]);
            y[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(X_WIDEN(a[r][0])), _mm256_mul_ps(s0, dx), y[r][0]);
            y[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(X_WIDEN(a[r][1])), _mm256_mul_ps(s1, dx), y[r][1]);
            y[r][0] = _mm256_fmadd_ps(b0, sq, y[r][0]);
            y[r][1] = _mm256_fmadd_ps(b1, sq, y[r][1]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * ldo, y[r][0]), _mm256_storeu_ps(out + r * ldo + 8, y[r][1]);
}
#undef X_ACC
#undef X_WIDEN
#else
#define XR 4
static inline void xtile(int R, const int8_t *xq, int64_t K, const float *xd, const float *xs, const uint8_t *p,
                         float *out, int64_t ldo) {
    int64_t G = K / 32;
    for (int r = 0; r < R; r++)
        for (int o = 0; o < X4; o++) {
            int h = o / 8, j = o % 8;
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *b = p + g * X4_BYTES;
                const int8_t *xg = xq + r * K + g * 32;
                int S = 0;
                for (int s = 0; s < 4; s++)
                    for (int t = 0; t < 4; t++) {
                        int c = b[64 * s + 32 * h + 4 * j + t];
                        S += (c & 15) * xg[4 * s + t] + (c >> 4) * xg[16 + 4 * s + t];
                    }
                const float *sc = (const float *)(b + 256);
                acc = fmaf((float)S, sc[o] * xd[r * G + g], acc);
                acc = fmaf(sc[X4 + o], xs[r * G + g], acc);
            }
            out[r * ldo + o] = acc;
        }
}
#endif

/* X4 panels [o0, o1) (multiples of 16) times n rows already rounded by `quantize_q8x` (xq [n][K], xd and
 * xs [n][K / 32]): decode.c's prompt rows quantize once per matmul and take the outputs in chunks */
void xgemm_q8(const int8_t *xq, const float *xd, const float *xs, int64_t n, int64_t K, const uint8_t *q, int64_t o0,
              int64_t o1, float *out, int64_t ldo) {
    int64_t G = K / 32;
    for (int64_t o = o0; o < o1; o += X4) {
        const uint8_t *p = q + o / X4 * G * X4_BYTES;
        for (int64_t r = 0; r < n; r += XR) {
            int R = n - r < XR ? (int)(n - r) : XR;
            const int8_t *xr = xq + r * K;
            const float *dr = xd + r * G, *sr = xs + r * G;
            float *yr = out + r * ldo + o;
            /* one specialisation per row count: the same arithmetic per row */
            switch (R) {
#define T(k) case k: xtile(k, xr, K, dr, sr, p, yr, ldo); break;
                T(1) T(2) T(3) T(4)
#if XR > 4
                T(5) T(6) T(7) T(8)
#endif
#undef T
                default: break;
            }
        }
    }
}

/* kind 3 of qgemm: rows x (fp32) rounded to int8, then X4 panels [o0, o1) (multiples of 16) */
static int xgemm(const float *x, int64_t n, int64_t ldx, int64_t K, const uint8_t *q, int64_t o0, int64_t o1,
                 float *out, int64_t ldo) {
    int64_t G = K / 32;
    int8_t *xq = aligned_alloc(64, (size_t)((n * K + 63) / 64 * 64));
    float *xd = malloc((size_t)(2 * n * G) * sizeof(float));
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -1;
    }
    float *xs = xd + n * G;
    quantize_q8x(x, n, ldx, K, xq, xd, xs);
    xgemm_q8(xq, xd, xs, n, K, q, o0, o1, out, ldo);
    free(xq);
    free(xd);
    return 0;
}

/* out[r][o0:o1] = x[r] W^T for rows r < n (x rows ldx floats apart, K used; out rows ldo apart),
 * kind 0: Q4, 1: Q8 (o0, o1 multiples of 4, qmatmul.c's blocks), 2: P4 (`qpanel_pack`; o0, o1 multiples
 * of 16), 3: X4 (`qx4_pack`, on int8 activations; multiples of 16). Returns 0, or -1 when out of memory. */
int qgemm(const float *x, int64_t n, int64_t ldx, int64_t K, int kind, const uint8_t *q, int64_t o0, int64_t o1,
          float *out, int64_t ldo) {
    if (n <= 0 || o1 <= o0) return 0;
    if (kind == 3) return xgemm(x, n, ldx, K, q, o0, o1, out, ldo);
    float *wp = aligned_alloc(64, (size_t)KC * NR * sizeof(float));
    float *c = aligned_alloc(64, (size_t)MR * NR * sizeof(float));  /* a partial panel's tile */
    if (!wp || !c) {
        free(wp);
        free(c);
        return -1;
    }
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t k1 = k0 + KC < K ? k0 + KC : K;
        for (int64_t r0 = 0; r0 < n; r0 += MC) {
            int64_t r1 = r0 + MC < n ? r0 + MC : n;
            for (int64_t o = o0; o < o1; o += NR) {
                int outs = o1 - o < NR ? (int)(o1 - o) : NR;
                panel(kind, K, q, o, outs, k0, k1, wp);
                for (int64_t r = r0; r < r1; r += MR) {
                    int R = r1 - r < MR ? (int)(r1 - r) : MR;
                    const float *xr = x + r * ldx + k0;
                    if (outs == NR) {
                        tile(R, xr, ldx, wp, k1 - k0, out + r * ldo + o, ldo, k0 == 0);
                        continue;
                    }
                    /* a partial panel: through a full-width tile, its real outputs copied back */
                    for (int i = 0; i < R; i++)
                        for (int j = 0; j < NR; j++) c[i * NR + j] = j < outs && k0 ? out[(r + i) * ldo + o + j] : 0.0f;
                    tile(R, xr, ldx, wp, k1 - k0, c, NR, 0);
                    for (int i = 0; i < R; i++) memcpy(out + (r + i) * ldo + o, c + i * NR, (size_t)outs * sizeof(float));
                }
            }
        }
    }
    free(wp);
    free(c);
    return 0;
}

/* the Q4 block (qmatmul.c's layout, `groups` groups of 32 inputs a row) holding output a's group g */
static inline const uint8_t *q4_block(const uint8_t *q, int64_t a, int64_t groups, int64_t g) {
    return q + (a / OB * groups + g) * Q4_BYTES;
}

/* the scales, then the biases, of outputs o ... o + 15 at group g -> dst (32 floats: P4's and X4's tail) */
static void panel_scales(const uint8_t *q, int64_t o, int64_t groups, int64_t g, uint8_t *dst) {
    for (int j = 0; j < 16; j++) {
        const uint8_t *pa = q4_block(q, o + j, groups, g);
        memcpy(dst + 4 * j, pa + 64 + 4 * ((o + j) % OB), 4);
        memcpy(dst + 4 * (16 + j), pa + 80 + 4 * ((o + j) % OB), 4);
    }
}

/* Q4 weights q (qmatmul.c's layout, N outputs, a multiple of 16, by K inputs) -> P4 at dst
 * (N / 16 * K / 32 * P4_BYTES bytes): the same codes, scales and biases, reordered */
void qpanel_pack(const uint8_t *q, int64_t N, int64_t K, uint8_t *dst) {
    int64_t groups = K / 32;
    for (int64_t o = 0; o < N; o += P4)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *d = dst + (o / P4 * groups + g) * P4_BYTES;
            for (int j = 0; j < 8; j++) {
                int64_t a = o + j, b = o + j + 8;  /* the outputs sharing a byte */
                const uint8_t *ca = q4_block(q, a, groups, g) + 16 * (a % OB), *cb = q4_block(q, b, groups, g) + 16 * (b % OB);
                for (int k = 0; k < 16; k++) {
                    d[8 * k + j] = (uint8_t)((ca[k] & 15) | (cb[k] & 15) << 4);
                    d[8 * (k + 16) + j] = (uint8_t)((ca[k] >> 4) | (cb[k] >> 4) << 4);
                }
            }
            panel_scales(q, o, groups, g, d + 16 * P4);
        }
}

/* Q4 weights q (as qpanel_pack takes) -> X4 at dst (N / 16 * K / 32 * X4_BYTES bytes): the same codes,
 * scales and biases, reordered */
void qx4_pack(const uint8_t *q, int64_t N, int64_t K, uint8_t *dst) {
    int64_t groups = K / 32;
    for (int64_t o = 0; o < N; o += X4)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *d = dst + (o / X4 * groups + g) * X4_BYTES;
            for (int j = 0; j < X4; j++) {
                const uint8_t *ca = q4_block(q, o + j, groups, g) + 16 * ((o + j) % OB);
                for (int s = 0; s < 4; s++) memcpy(d + 64 * s + 32 * (j / 8) + 4 * (j % 8), ca + 4 * s, 4);
            }
            panel_scales(q, o, groups, g, d + 256);
        }
}
