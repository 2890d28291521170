/* Compressed optimizer moments on the CPU: the conversions of pstar_fx/runtime/quantize.py, one pass per call (bit
 * for bit the torch ops: tests/unit/test_native.py). Built by pstar_fx/runtime/native/__init__.py and loaded through
 * ctypes; plain C and OpenMP, no torch headers.
 */
#include "codes.h"

/* quantize_bf16 of m and v: m rounds with the hash's low 16 bits, v with its high 16. */
void pstar_quant_bf16(const float *m, const float *v, uint16_t *qm, uint16_t *qv, int64_t n, int32_t first,
                      int32_t seed, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        uint32_t r = bits_of((uint32_t)first + (uint32_t)i, (uint32_t)seed);
        qm[i] = round_bf16_stochastic(m[i], r & 0xFFFFu);
        qv[i] = round_bf16_stochastic(v[i], r >> 16);
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
        codes_m(m + lo, r, inverse(am), qm + lo, k);
        codes_v(v + lo, r, inverse(av), qv + lo, k);
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
            m[j] = value_m(qm[j], s);
            v[j] = value_v(qv[j], t);
        }
    }
}
