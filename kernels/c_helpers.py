"""The C a chunk kernel includes before its own code (``coconet.kernels.native``): vector types and their
loads, stores and arithmetic, the streamed stores that fill a cache line, and the bfloat16 and float16
conversions torch makes."""

PRELUDE = """#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

static inline v8 ld(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
/* bfloat16 is float32's upper half: widened exactly, as torch casts it */
typedef unsigned short v8h __attribute__((vector_size(16)));
typedef unsigned int v8u __attribute__((vector_size(32)));
static inline float bf16(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, sizeof f); return f; }
static inline v8 ld_bf16(const uint16_t *p) {
    v8h h; memcpy(&h, p, sizeof h); v8u u = __builtin_convertvector(h, v8u) << 16; return (v8)u;
}
static inline void st(float *p, v8 x) { memcpy(p, &x, sizeof x); }
/* x in every lane (as (v8){0} + x would not be for x = -0.0, which the sign of an infinity after may show) */
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
/* a cast to bfloat16 as torch rounds it (to nearest, ties to even; every NaN 0xffff), kept as the float32 it
   widens back to: stored, its upper half is the bfloat16 */
static inline float round_bf16(float x) {
    uint32_t u; memcpy(&u, &x, sizeof u);
    u = x != x ? 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float f; memcpy(&f, &u, sizeof f); return f;
}
static inline v8 vround_bf16(v8 x) {
    v8u u = (v8u)x, nan = (v8u)(x != x);
    return (v8)((nan & 0xffff0000u) | (~nan & ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u)));
}
static inline uint16_t bits_bf16(float x) { uint32_t u; memcpy(&u, &x, sizeof u); return (uint16_t)(u >> 16); }
static inline v8h vbits_bf16(v8 x) { return __builtin_convertvector((v8u)x >> 16, v8h); }
static inline void st_bf16(uint16_t *p, v8 x) { v8h h = vbits_bf16(x); memcpy(p, &h, sizeof h); }
static inline v8 vabs(v8 x) { return (v8)((v8i)x & 0x7fffffff); }
static inline v8 vsel(v8i m, v8 x, v8 y) { return (v8)(((v8i)x & m) | ((v8i)y & ~m)); }
static inline v8 vmax(v8 x, v8 y) { return vsel((x > y) | (x != x), x, y); }
static inline v8 vmin(v8 x, v8 y) { return vsel((x < y) | (x != x), x, y); }
/* a sum's running totals: four lanes of double, each taking two lanes of every vector summed, so that
   nothing is summed in float (to overflow or round) and the sum costs a few vector operations a line */
typedef float v4 __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));
static inline v4d widen(v8 x) {
    v4 lo, hi; memcpy(&lo, &x, sizeof lo); memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    return __builtin_convertvector(lo, v4d) + __builtin_convertvector(hi, v4d);
}
static inline double hsum4(v4d x) { return (x[0] + x[1]) + (x[2] + x[3]); }
static inline v8 vsqrt(v8 x) {
#ifdef __AVX__
    return (v8)_mm256_sqrt_ps((__m256)x);
#else
    float t[8]; st(t, x); for (int q = 0; q < 8; q++) t[q] = sqrtf(t[q]); return ld(t);
#endif
}
/* one 64-byte line, its address aligned, past the cache */
static inline void stream_line(float *d, v8 x, v8 y) {
#ifdef __AVX__
    _mm256_stream_ps(d, (__m256)x); _mm256_stream_ps(d + 8, (__m256)y);
#else
    float t[16] __attribute__((aligned(64))); st(t, x); st(t + 8, y);
    for (int q = 0; q < 16; q += 4) _mm_stream_ps(d + q, _mm_load_ps(t + q));
#endif
}
"""

F16 = """/* float16 as torch's vectorised cast has it (F16C's conversions): widened exactly, rounded to nearest,
   ties to even. Without F16C, by hand (FP16's fp16_ieee_{to,from}_fp32_value): the same bits but a NaN's payload */
#ifdef __F16C__
static inline float f16(uint16_t x) { return _cvtsh_ss(x); }
static inline uint16_t bits_f16(float x) { return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
static inline v8 vwiden_f16(v8h h) { return (v8)_mm256_cvtph_ps((__m128i)h); }
static inline v8h vbits_f16(v8 x) { return (v8h)_mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT); }
#else
static inline float f16(uint16_t x) {
    const uint32_t w = (uint32_t)x << 16, sign = w & 0x80000000u, two_w = w + w;
    uint32_t u = (two_w >> 4) + (0xe0u << 23); float normal; memcpy(&normal, &u, sizeof u); normal *= 0x1.0p-112f;
    u = (two_w >> 17) | (126u << 23); float subnormal; memcpy(&subnormal, &u, sizeof u); subnormal -= 0.5f;
    const float f = two_w < (1u << 27) ? subnormal : normal;
    memcpy(&u, &f, sizeof u); u |= sign; float r; memcpy(&r, &u, sizeof r); return r;
}
static inline uint16_t bits_f16(float x) {
    float base = (fabsf(x) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w; memcpy(&w, &x, sizeof w);
    const uint32_t shl1 = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1 & 0xff000000u; if (bias < 0x71000000u) bias = 0x71000000u;
    bias = (bias >> 1) + 0x07800000u; float b; memcpy(&b, &bias, sizeof b); base = b + base;
    uint32_t bits; memcpy(&bits, &base, sizeof bits);
    return (uint16_t)((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu)));
}
static inline v8 vwiden_f16(v8h h) { float t[8]; for (int q = 0; q < 8; q++) t[q] = f16(h[q]); return ld(t); }
static inline v8h vbits_f16(v8 x) {
    float t[8]; st(t, x); v8h h; for (int q = 0; q < 8; q++) h[q] = bits_f16(t[q]); return h;
}
#endif
static inline v8 ld_f16(const uint16_t *p) { v8h h; memcpy(&h, p, sizeof h); return vwiden_f16(h); }
static inline float round_f16(float x) { return f16(bits_f16(x)); }
static inline v8 vround_f16(v8 x) { return vwiden_f16(vbits_f16(x)); }
static inline void st_f16(uint16_t *p, v8 x) { v8h h = vbits_f16(x); memcpy(p, &h, sizeof h); }
"""

# one 64-byte line of 32 half-precision values, its address aligned, past the cache: four 16-byte streamed
# stores back to back fill the write-combining buffer whole
HALF_LINE = """static inline void stream_line_TAG(uint16_t *d, v8 x, v8 y, v8 z, v8 w) {
    const v8h h[4] = {vbits_TAG(x), vbits_TAG(y), vbits_TAG(z), vbits_TAG(w)};
    for (int q = 0; q < 4; q++) _mm_stream_si128((__m128i *)d + q, (__m128i)h[q]);
}
"""
