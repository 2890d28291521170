/* The element-wise pieces of compressed optimizer moments, shared by quantize.c (the conversions) and adam.c (the
 * fused update): the operations, in order, of the torch ops of pstar_fx/runtime/quantize.py, each correctly
 * rounded (built with -ffp-contract=off: no fused multiply-adds the ops do not make), so the codes and values are
 * those of the ops bit for bit. Element 0 of a span starts an int8 block (INT8_BLOCK elements, one scale each);
 * `first` is its chunk element, whose random bits it takes.
 */
#ifndef PSTAR_CODES_H
#define PSTAR_CODES_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define INT8_BLOCK 256

/* The counter-based hash of quantize.random_bits: 32 random bits of chunk element `index` under `seed`. */
static inline uint32_t bits_of(uint32_t index, uint32_t seed) {
    uint32_t x = index + seed;
    x *= 0x7FEB352Du;
    x ^= x >> 16;
    x *= 0x2C1B3C6Du;
    x ^= x >> 15;
    x *= 0x297A2D39u;
    x ^= x >> 15;
    return x;
}

static inline uint32_t as_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float as_float(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* bf16 of a float whose low 16 bits are 0, as torch's CPU conversion writes it (a NaN as 0xFFFF). */
static inline uint16_t to_bf16(uint32_t u) {
    return isnan(as_float(u)) ? (uint16_t)0xFFFF : (uint16_t)(u >> 16);
}

/* quantize_bf16 of x with the 16 random bits r16: added below bf16's last bit, then truncated; a NaN takes no bits
 * (its carry could run into the sign: a GPU's NaN, 0x7FFFFFFF, plus the bits is -0.0). */
static inline uint16_t round_bf16_stochastic(float x, uint32_t r16) {
    return to_bf16((as_bits(x) + (isnan(x) ? 0u : r16)) & 0xFFFF0000u);
}

/* torch.amax of |x| over a block (k elements): NaN if any element is NaN. For x >= 0 the bits order as the values
 * do, a NaN's above infinity's, so an integer maximum (which vectorises) finds both. */
static inline float block_amax(const float *restrict x, int64_t k) {
    uint32_t s = 0;
    for (int64_t j = 0; j < k; j++) {
        uint32_t a = as_bits(x[j]) & 0x7FFFFFFFu;
        s = a > s ? a : s;
    }
    return as_float(s);
}

/* quantize_int8's reciprocal of a scale clamped below at fp32's tiny (finite: at most 2^126); NaN stays NaN. */
static inline float inverse(float s) {
    const float tiny = 1.17549435082228750797e-38f;
    return 1.0f / (s < tiny ? tiny : s);
}

/* quantize_int8's codes of one block of m (k elements, inv the reciprocal of its clamped scale): a square-root
 * domain, signed, rounded with the 8 random bits r & 0xFF. The operations, in order, of the torch ops; nan_to_num_
 * last. */
static inline void codes_m(const float *restrict x, const uint32_t *restrict r, float inv, int8_t *restrict q,
                           int64_t k) {
    for (int64_t j = 0; j < k; j++) {
        float a = fabsf(x[j]) * inv;
        a = sqrtf(a) * 127.0f;
        a = a + (float)(int32_t)(r[j] & 0xFFu) * (1.0f / 256.0f);
        a = floorf(a + 0.5f / 256.0f);
        a = a > 127.0f ? 127.0f : a;                          /* clamp_max_: NaN stays NaN */
        a = copysignf(a, x[j]);
        q[j] = (int8_t)(int32_t)(fabsf(a) <= 127.0f ? a : 0.0f);     /* nan_to_num_(0, 0, 0) */
    }
}

/* The same for v: a fourth-root domain, unsigned, the random bits (r >> 8) & 0xFF, and a v > 0 codes as 1 at
 * least (torch.maximum with ceil(min(v * 1e38, 1)), NaN if either is). */
static inline void codes_v(const float *restrict x, const uint32_t *restrict r, float inv, uint8_t *restrict q,
                           int64_t k) {
    for (int64_t j = 0; j < k; j++) {
        float a = fabsf(x[j]) * inv;
        a = sqrtf(sqrtf(a)) * 255.0f;
        a = a + (float)(int32_t)((r[j] >> 8) & 0xFFu) * (1.0f / 256.0f);
        a = floorf(a + 0.5f / 256.0f);
        a = a > 255.0f ? 255.0f : a;
        float t = x[j] * 1e38f;
        t = ceilf(t > 1.0f ? 1.0f : t);
        float mx = a > t ? a : t;                        /* both finite here, or one is NaN: then 0 */
        q[j] = (uint8_t)(int32_t)(__builtin_isunordered(a, t) ? 0.0f : mx);
    }
}


/* dequantize_int8's value of a code: m = sign(q) (q/127)^2 s, v = (q/255)^4 s, op by op, q/127 and q/255 as a
 * multiplication by the fp32 reciprocal (as torch's mul_ by a Python float rounds it). */
static inline float value_m(int8_t q, float s) {
    float x = (float)q * (1.0f / 127.0f);
    return (x * fabsf(x)) * s;
}

static inline float value_v(uint8_t q, float s) {
    float y = (float)q * (1.0f / 255.0f);
    y = y * y;
    return (y * y) * s;
}

#endif
