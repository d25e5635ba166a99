/* bf16 matmuls on AMX tiles (Intel Xeon with AMX-BF16), for a bf16 model's dense prefill tiles and
 * logits (models/layers.py `linear`): y = bf16(x W^T + bias), fp32 accumulation.
 *
 * Built with the other kernels by models/native.py; where the compiler targets no AMX (-march=native
 * on a CPU without it) only stubs are built (`amx_ready` returns 0), and callers use torch's matmul.
 *
 * Weights, N outputs (N a multiple of 16) of K inputs (K a multiple of 32), packed once at load
 * (models/amx_tiles.py, native.amx_pack) in the tile layout TDPBF16PS reads: block b of 16 outputs, step s of 32 inputs at
 * element (b * K/32 + s) * 512; in it, row i (input pair 2i, 2i + 1) holds for each output o of the
 * block its two weights, w[o][32s + 2i], w[o][32s + 2i + 1].
 *
 * For a row x and an output o the kernel computes, always the same way: one fp32 accumulator,
 * zero, then for each step s in order the hardware's TDPBF16PS of that step's 32 products (DAZ,
 * FTZ, round to nearest even); then + bias[o] (fp32) and one rounding to bf16 (VCVTNEPS2BF16).
 * Each C-tile element belongs to one row and one output and sees only that row's A-tile row, so a
 * row's bits do not depend on the call's other rows (their count, their values, a zero padding),
 * nor on which outputs or how many threads a call has: row-local by construction
 * (docs/exactness.md). The self-test checks it all the same (runner/selftest.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
enum { MB = 32, /* rows a pass takes: two A tiles */ PANEL_ROWS = 256 /* rows a weight panel serves while in L2 */ };

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* set once this process may use the tiles: attention.c's bf16 path asks before each call */
int amx_granted;

/* 1 when this process may use the tiles (Linux grants the state on request, once per process);
 * models/native.py asks as it loads the kernels */
int amx_ready(void) {
    if (!amx_granted) amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_granted;
}

/* every tile 16 rows of 64 bytes; a constant in memory: the compiler does not see LDTILECFG read a
 * local struct, and dropped the stores that filled one (a #GP at the load) */
static const tile_config TILES = {.palette = 1,
                                  .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                  .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

/* this thread's tiles as TILES says (attention.c uses them so too) */
void amx_tiles_on(void) { _tile_loadconfig(&TILES); }

/* the 16 x 16 fp32 sums at `sums` plus bias, for `rows` real rows: rounded to bf16, or as they are */
static void finish(const float *sums, int rows, const float *bias, void *out, int out_f32, int64_t ldo) {
    __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m512 y = _mm512_add_ps(_mm512_load_ps(sums + 16 * r), b);
        if (out_f32)
            _mm512_storeu_ps((float *)out + r * ldo, y);
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + r * ldo), (__m256i)_mm512_cvtneps_pbh(y));
    }
}

/* MB staged rows `a` (bf16, K a row) times outputs [n, n + 16 nb) (nb 1 or 2); `rows` of them real */
static void pass(const uint16_t *a, int rows, int64_t K, const uint16_t *w, int64_t n, int nb, const float *bias,
                 void *out, int out_f32, int64_t ldo) {
    int64_t steps = K / 32, lda = 2 * K;
    const uint16_t *b0 = w + n / 16 * steps * 512, *b1 = b0 + steps * 512;
    float sums[4][256] __attribute__((aligned(64)));
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    if (nb == 2) {
        for (int64_t s = 0; s < steps; s++) {
            _tile_loadd(0, a + 32 * s, lda);
            _tile_loadd(1, a + 16 * K + 32 * s, lda);
            _tile_loadd(2, b0 + 512 * s, 64);
            _tile_loadd(3, b1 + 512 * s, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    } else {
        for (int64_t s = 0; s < steps; s++) {
            _tile_loadd(0, a + 32 * s, lda);
            _tile_loadd(1, a + 16 * K + 32 * s, lda);
            _tile_loadd(2, b0 + 512 * s, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(6, 1, 2);
        }
    }
    _tile_stored(4, sums[0], 64);
    _tile_stored(5, sums[1], 64);
    _tile_stored(6, sums[2], 64);
    _tile_stored(7, sums[3], 64);
    int top = rows < 16 ? rows : 16, low = rows - top;
    size_t esz = out_f32 ? 4 : 2;
    for (int j = 0; j < nb; j++) {
        const float *bj = bias ? bias + n + 16 * j : NULL;
        char *o = (char *)out + (n + 16 * j) * esz;
        finish(sums[j], top, bj, o, out_f32, ldo);
        if (low > 0) finish(sums[2 + j], low, bj, o + 16 * ldo * esz, out_f32, ldo);
    }
}

/* rows [r0, r1) of x as bf16 into `a`, zero rows after them up to a whole number of passes */
static void stage(const void *x, int x_f32, int64_t ldx, int64_t K, int64_t r0, int64_t r1, uint16_t *a) {
    int64_t staged = (r1 - r0 + MB - 1) / MB * MB;
    for (int64_t r = r0; r < r1; r++) {
        uint16_t *dst = a + (r - r0) * K;
        if (x_f32) {
            const float *src = (const float *)x + r * ldx;
            for (int64_t k = 0; k < K; k += 16)  /* round to nearest even, as torch's .bfloat16() */
                _mm256_storeu_si256((__m256i *)(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
        } else {
            memcpy(dst, (const uint16_t *)x + r * ldx, (size_t)K * 2);
        }
    }
    memset(a + (r1 - r0) * K, 0, (size_t)(staged - (r1 - r0)) * K * 2);
}

/* out[:, o0:o1] = x W^T (+ bias) for M rows x: [M][ldx], bf16 or fp32 (`x_f32`: rounded to bf16
 * first, one rounding each); out [M][ldo], bf16 or fp32 (`out_f32`); outputs [o0, o1) multiples of
 * 16. 0, or -1 when the staging buffer cannot be had. */
int amx_matmul(const void *x, int x_f32, int64_t M, int64_t ldx, int64_t K, const uint16_t *w, const float *bias,
               int64_t o0, int64_t o1, void *out, int out_f32, int64_t ldo) {
    if (M <= 0 || o1 <= o0) return 0;
    int64_t panel = M < PANEL_ROWS ? (M + MB - 1) / MB * MB : PANEL_ROWS;
    uint16_t *a = aligned_alloc(64, (size_t)(panel * K * 2 + 63) / 64 * 64);
    if (!a) return -1;
    size_t esz = out_f32 ? 4 : 2;
    amx_tiles_on();
    for (int64_t p = 0; p < M; p += PANEL_ROWS) {
        int64_t pe = p + PANEL_ROWS < M ? p + PANEL_ROWS : M;
        stage(x, x_f32, ldx, K, p, pe, a);
        for (int64_t n = o0; n < o1; n += 32) {
            int nb = o1 - n >= 32 ? 2 : 1;
            for (int64_t m = p; m < pe; m += MB)
                pass(a + (m - p) * K, pe - m < MB ? (int)(pe - m) : MB, K, w, n, nb, bias,
                     (char *)out + m * ldo * esz, out_f32, ldo);
        }
    }
    _tile_release();
    free(a);
    return 0;
}

#else

int amx_granted;

int amx_ready(void) { return 0; }

int amx_matmul(const void *x, int x_f32, int64_t M, int64_t ldx, int64_t K, const uint16_t *w, const float *bias,
               int64_t o0, int64_t o1, void *out, int out_f32, int64_t ldo) {
    (void)x, (void)x_f32, (void)M, (void)ldx, (void)K, (void)w, (void)bias, (void)o0, (void)o1, (void)out;
    (void)out_f32, (void)ldo;
    return -2;
}

#endif
