/* 16-lane fp32 vectors for the native kernels (attention.c, qmatmul.c, decode.c): AVX-512 intrinsics
 * where the build targets them, two 8-lane AVX2 + FMA halves where it targets AVX2, else plain C over
 * 16 lanes. All three do the same operations lane by lane (one rounding per multiply, add or fused
 * multiply-add) and the same reduction trees; v_exp is one polynomial on AVX-512 and AVX2 (the same
 * bits) and expf in plain C. The ISA level is part of a build's identity (models/native.py). */
#ifndef PREFIXSERVE_SIMD_H
#define PREFIXSERVE_SIMD_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* v_exp's constants, one set for the AVX-512 and AVX2 bodies (their bits must agree): x = n ln2 + r
 * with ln2 split in two (Cody-Waite), e^r by a degree-6 polynomial */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI -0.693359375f
#define EXP_LN2_LO 2.12194440e-4f
#define EXP_P6 1.9875691500e-4f
#define EXP_P5 1.3981999507e-3f
#define EXP_P4 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P2 1.6666665459e-1f
#define EXP_P1 5.0000001201e-1f

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vec;
#define V_ZERO() _mm512_setzero_ps()
#define V_SET1(a) _mm512_set1_ps(a)
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_MAX(a, b) _mm512_max_ps(a, b)
#define V_DIV(a, b) _mm512_div_ps(a, b)
static inline float v_hmax(vec v) { return _mm512_reduce_max_ps(v); } /* max is exact in any order */
/* e^x for x <= 0; -inf (a masked key) gives exactly 0. Cody-Waite range reduction and a degree-6
 * polynomial: x = n ln2 + r, |r| <= ln2 / 2, e^x = 2^n e^r. ~2 ulp. */
static inline vec v_exp(vec x) {
    const vec lo = _mm512_set1_ps(-87.0f);
    __mmask16 dead = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vec r = _mm512_fmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    vec p = _mm512_set1_ps(EXP_P6);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    vec r2 = _mm512_mul_ps(r, r);
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    p = _mm512_scalef_ps(p, n);
    return _mm512_maskz_mov_ps((__mmask16)~dead, p);
}
/* 16 bf16 (raw uint16) -> fp32, exact */
static inline vec v_load_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
/* 16 bytes of 4-bit codes -> table[code] for their low nibbles (lo) and their high ones (hi) */
static inline vec V_IOTA(void) { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
static inline void v_q4(const uint8_t *p, float scale, float bias, vec *lo, vec *hi) {
    vec table = _mm512_fmadd_ps(_mm512_set1_ps(scale), V_IOTA(), _mm512_set1_ps(bias));
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_permutexvar_ps(b, table);  /* uses the index's low 4 bits only */
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
/* 16 int8 -> fp32, exact */
static inline vec v_q8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vec V_ABS(vec v) { return _mm512_abs_ps(v); }
/* lanes where g < 0 take b, the others a */
static inline vec v_if_negative(vec g, vec a, vec b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), a, b);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* lanes 0-7 in lo, 8-15 in hi */
typedef struct { __m256 lo, hi; } vec;
static inline vec v_pair(__m256 lo, __m256 hi) { vec r = {lo, hi}; return r; }
static inline vec V_ZERO(void) { return v_pair(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vec V_SET1(float a) { return v_pair(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
static inline vec V_LOAD(const float *p) { return v_pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void V_STORE(float *p, vec v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline vec V_FMA(vec a, vec b, vec c) { return v_pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
static inline vec V_ADD(vec a, vec b) { return v_pair(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline vec V_MUL(vec a, vec b) { return v_pair(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline vec V_SUB(vec a, vec b) { return v_pair(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline vec V_MAX(vec a, vec b) { return v_pair(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline vec V_DIV(vec a, vec b) { return v_pair(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
static inline float v_hmax(vec v) { /* max is exact in any order */
    __m256 m = _mm256_max_ps(v.lo, v.hi);
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    b = _mm_max_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}
/* the AVX-512 v_exp's steps on 8 lanes; its scalef(p, n) is p * 2^n here, one rounding either way
 * (n >= -126, so 2^n is a normal float and the product is one correctly rounded multiply) */
static inline __m256 v_exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P6);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    __m256 r2 = _mm256_mul_ps(r, r);
    p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(dead, p);
}
static inline vec v_exp(vec x) { return v_pair(v_exp8(x.lo), v_exp8(x.hi)); }
static inline __m256 v_bf16_8(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline vec v_load_bf16(const uint16_t *p) { return v_pair(v_bf16_8(p), v_bf16_8(p + 8)); }
/* fma(scale, code, bias) for 8 codes (int32 lanes): the AVX-512 body's table entry, computed in place */
static inline __m256 v_q4_8(__m256i codes, __m256 scale, __m256 bias) {
    return _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(codes), bias);
}
static inline void v_q4(const uint8_t *p, float scale, float bias, vec *lo, vec *hi) {
    const __m256i m = _mm256_set1_epi32(15);
    const __m256 s = _mm256_set1_ps(scale), b = _mm256_set1_ps(bias);
    __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    *lo = v_pair(v_q4_8(_mm256_and_si256(b0, m), s, b), v_q4_8(_mm256_and_si256(b1, m), s, b));
    *hi = v_pair(v_q4_8(_mm256_srli_epi32(b0, 4), s, b), v_q4_8(_mm256_srli_epi32(b1, 4), s, b));
}
static inline vec v_q8(const int8_t *p) {
    return v_pair(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))));
}
static inline vec V_ABS(vec v) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return v_pair(_mm256_and_ps(v.lo, m), _mm256_and_ps(v.hi, m));
}
/* lanes where g < 0 take b, the others a */
static inline vec v_if_negative(vec g, vec a, vec b) {
    const __m256 z = _mm256_setzero_ps();
    return v_pair(_mm256_blendv_ps(a.lo, b.lo, _mm256_cmp_ps(g.lo, z, _CMP_LT_OQ)),
                  _mm256_blendv_ps(a.hi, b.hi, _mm256_cmp_ps(g.hi, z, _CMP_LT_OQ)));
}
static inline vec V_IOTA(void) {
    return v_pair(_mm256_set_ps(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set_ps(15, 14, 13, 12, 11, 10, 9, 8));
}
#else
typedef struct { float f[16]; } vec;
static inline vec V_ZERO(void) { vec r; for (int i = 0; i < 16; i++) r.f[i] = 0.0f; return r; }
static inline vec V_SET1(float a) { vec r; for (int i = 0; i < 16; i++) r.f[i] = a; return r; }
static inline vec V_LOAD(const float *p) { vec r; memcpy(r.f, p, 64); return r; }
static inline void V_STORE(float *p, vec v) { memcpy(p, v.f, 64); }
static inline vec V_FMA(vec a, vec b, vec c) { vec r; for (int i = 0; i < 16; i++) r.f[i] = fmaf(a.f[i], b.f[i], c.f[i]); return r; }
static inline vec V_ADD(vec a, vec b) { vec r; for (int i = 0; i < 16; i++) r.f[i] = a.f[i] + b.f[i]; return r; }
static inline vec V_MUL(vec a, vec b) { vec r; for (int i = 0; i < 16; i++) r.f[i] = a.f[i] * b.f[i]; return r; }
static inline vec V_SUB(vec a, vec b) { vec r; for (int i = 0; i < 16; i++) r.f[i] = a.f[i] - b.f[i]; return r; }
static inline vec V_MAX(vec a, vec b) { vec r; for (int i = 0; i < 16; i++) r.f[i] = a.f[i] > b.f[i] ? a.f[i] : b.f[i]; return r; }
static inline vec V_DIV(vec a, vec b) { vec r; for (int i = 0; i < 16; i++) r.f[i] = a.f[i] / b.f[i]; return r; }
static inline float v_hmax(vec v) { float m = v.f[0]; for (int i = 1; i < 16; i++) m = v.f[i] > m ? v.f[i] : m; return m; }
static inline vec v_exp(vec x) { vec r; for (int i = 0; i < 16; i++) r.f[i] = expf(x.f[i]); return r; }
static inline vec v_load_bf16(const uint16_t *p) {
    vec r;
    for (int i = 0; i < 16; i++) {
        uint32_t u = (uint32_t)p[i] << 16;
        memcpy(&r.f[i], &u, 4);
    }
    return r;
}
static inline vec V_IOTA(void) { vec r; for (int i = 0; i < 16; i++) r.f[i] = (float)i; return r; }
static inline void v_q4(const uint8_t *p, float scale, float bias, vec *lo, vec *hi) {
    vec table = V_FMA(V_SET1(scale), V_IOTA(), V_SET1(bias));
    for (int i = 0; i < 16; i++) {
        lo->f[i] = table.f[p[i] & 15];
        hi->f[i] = table.f[p[i] >> 4];
    }
}
static inline vec v_q8(const int8_t *p) { vec r; for (int i = 0; i < 16; i++) r.f[i] = (float)p[i]; return r; }
static inline vec V_ABS(vec v) { vec r; for (int i = 0; i < 16; i++) r.f[i] = fabsf(v.f[i]); return r; }
static inline vec v_if_negative(vec g, vec a, vec b) {
    vec r;
    for (int i = 0; i < 16; i++) r.f[i] = g.f[i] < 0.0f ? b.f[i] : a.f[i];
    return r;
}
#endif

/* t[i] += t[i + w] for w = 8, 4, 2, 1: a fixed tree over the 16 lanes */
#if defined(__AVX512F__)
static inline float hsum(vec v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline float hsum(vec v) {
    __m256 a = _mm256_add_ps(v.lo, v.hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}
/* lane j = hsum of 8 vectors' 8 lanes (after the w = 8 step), by its tree: w = 4 as 128-bit halves,
 * w = 2 and 1 as in-lane shuffles */
static inline __m256 hsum8x8(const __m256 u[8]) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(u[2 * i], u[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(u[2 * i], u[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* r holds vectors 0 2 4 6 | 1 3 5 7: back in order */
    return _mm256_permutevar8x32_ps(r, _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0));
}
#else
static inline float hsum(vec v) {
    float t[16];
    V_STORE(t, v);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i] + t[i + w];
    return t[0];
}
#endif
/* 16 vectors -> one: lane j = hsum(t[j]), by hsum's very tree (w = 8, 4, 2, 1, the lower lane
 * first), so the same bits as 16 hsums; AVX-512: 46 vector ops instead of 16 trees' 128 */
static inline vec hsum16(const vec t[16]) {
#if defined(__AVX512F__)
    vec c[8], d[4], f[2];
    for (int i = 0; i < 8; i++)
        c[i] = V_ADD(_mm512_shuffle_f32x4(t[i], t[i + 8], 0x44), _mm512_shuffle_f32x4(t[i], t[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        d[i] = V_ADD(_mm512_shuffle_f32x4(c[i], c[i + 4], 0x88), _mm512_shuffle_f32x4(c[i], c[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        f[i] = V_ADD(_mm512_shuffle_ps(d[i], d[i + 2], 0x44), _mm512_shuffle_ps(d[i], d[i + 2], 0xEE));
    vec r = V_ADD(_mm512_shuffle_ps(f[0], f[1], 0x88), _mm512_shuffle_ps(f[0], f[1], 0xDD));
    /* r's lane L holds the sum of t[0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15]: back in order */
    const __m512i order = _mm512_set_epi32(15, 13, 14, 12, 7, 5, 6, 4, 11, 9, 10, 8, 3, 1, 2, 0);
    return _mm512_permutexvar_ps(order, r);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 u[16];
    for (int i = 0; i < 16; i++) u[i] = _mm256_add_ps(t[i].lo, t[i].hi);
    return v_pair(hsum8x8(u), hsum8x8(u + 8));
#else
    vec r;
    for (int j = 0; j < 16; j++) r.f[j] = hsum(t[j]);
    return r;
#endif
}
#endif
