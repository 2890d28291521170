/* Compressed optimizer moments on the CPU, one pass per call: the quantisers of pstar_fx/runtime/quantize.py, the
 * same operations in the same order, so that the codes and values are those of the torch ops bit for bit (tested in
 * tests/unit/test_native.py). Built by pstar_fx/runtime/native/__init__.py with -ffp-contract=off (no fused
 * multiply-adds the ops do not make) and loaded through ctypes; plain C and OpenMP, no torch headers.
 *
 * Elements are indexed from the start of the spans given: `first` is the chunk element of element 0 (its random bits
 * are those of that chunk element) and element 0 starts an int8 block (INT8_BLOCK elements, one scale each).
 */
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

/* quantize_bf16 of m and v: m rounds with the hash's low 16 bits, v with its high 16. */
void pstar_quant_bf16(const float *m, const float *v, uint16_t *qm, uint16_t *qv, int64_t n, int32_t first,
                      int32_t seed, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        uint32_t r = bits_of((uint32_t)first + (uint32_t)i, (uint32_t)seed);
        qm[i] = to_bf16((as_bits(m[i]) + (r & 0xFFFFu)) & 0xFFFF0000u);
        qv[i] = to_bf16((as_bits(v[i]) + (r >> 16)) & 0xFFFF0000u);
    }
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

/* quantize_int8's clamp_min_(tiny) of a scale: NaN stays NaN. */
static inline float clamp_tiny(float s) {
    const float tiny = 1.17549435082228750797e-38f;
    return s < tiny ? tiny : s;
}

/* quantize_int8's codes of one block of m (k elements, scale s clamped): a square-root domain, signed, rounded
 * with the 8 random bits r & 0xFF. The operations, in order, of the torch ops; nan_to_num_ last. */
static inline void codes_m(const float *restrict x, const uint32_t *restrict r, float s, int8_t *restrict q,
                           int64_t k) {
    for (int64_t j = 0; j < k; j++) {
        float a = fabsf(x[j]) / s;
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
static inline void codes_v(const float *restrict x, const uint32_t *restrict r, float s, uint8_t *restrict q,
                           int64_t k) {
    for (int64_t j = 0; j < k; j++) {
        float a = fabsf(x[j]) / s;
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

/* quantize_int8 of m (signed codes, the hash's low 8 bits) and v (unsigned, bits 8-15), with their block scales. */
void pstar_quant_int8(const float *m, const float *v, int8_t *qm, uint8_t *qv, float *sm, float *sv, int64_t n,
                      int32_t first, int32_t seed, int threads) {
    int64_t blocks = (n + INT8_BLOCK - 1) / INT8_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * INT8_BLOCK, k = n - lo < INT8_BLOCK ? n - lo : INT8_BLOCK;
        uint32_t r[INT8_BLOCK];
        for (int64_t j = 0; j < k; j++)
            r[j] = bits_of((uint32_t)first + (uint32_t)(lo + j), (uint32_t)seed);
        float am = block_amax(m + lo, k), av = block_amax(v + lo, k);
        sm[b] = am;
        sv[b] = av;
        codes_m(m + lo, r, clamp_tiny(am), qm + lo, k);
        codes_v(v + lo, r, clamp_tiny(av), qv + lo, k);
    }
}

/* dequantize_int8 of m and v into fp32. */
void pstar_dequant_int8(const int8_t *qm, const uint8_t *qv, const float *sm, const float *sv, float *m, float *v,
                        int64_t n, int threads) {
    int64_t blocks = (n + INT8_BLOCK - 1) / INT8_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * INT8_BLOCK, hi = lo + INT8_BLOCK < n ? lo + INT8_BLOCK : n;
        float s = sm[b], t = sv[b];
        for (int64_t j = lo; j < hi; j++) {
            float x = (float)qm[j] / 127.0f;
            m[j] = (x * fabsf(x)) * s;
            float y = (float)qv[j] / 255.0f;
            y = y * y;
            v[j] = (y * y) * t;
        }
    }
}
