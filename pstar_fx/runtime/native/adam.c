/* Adam / AdamW on compressed moments in one pass (pstar_fx/runtime/adam.py's compressed route on the CPU): per int8
 * block of elements, the gradient read and converted to fp32 (unscaled, clipped), m and v dequantised, the update of
 * torch's fused Adam applied to the fp32 parameter (or master), the half-precision parameter written from it, and m
 * and v quantised back with their random bits, all while the block is in registers and L1. No scratch.
 *
 * The update is torch's formula (torch.optim.Adam / AdamW, amsgrad off) in fp32, not its kernel: the last bits can
 * differ from torch._fused_adamw_'s (as the GPU's do); every CPU update of compressed moments runs here, so a chunk's
 * update is the same wherever the plan runs it on the CPU. The quantisers are codes.h's, bit for bit the torch ops'.
 */
#include "codes.h"

enum kind { FP32 = 0, BF16 = 1, FP16 = 2 };

/* fp16 gradients and parameters need the compiler's _Float16 (GCC 12, clang 15 on x86-64); without it the caller
 * keeps fp16 on the torch route (pstar_has_fp16). */
#ifdef __FLT16_MAX__
#define HAVE_FP16 1
#else
#define HAVE_FP16 0
#endif

int pstar_has_fp16(void) { return HAVE_FP16; }

struct adam {            /* the ctypes Structure of pstar_fx/runtime/native/__init__.py; each value computed in
                          * double there and rounded to fp32 once, as torch's kernels take their scalars */
    float decay;          /* AdamW: 1 - lr * weight_decay */
    float weight_decay;   /* Adam: added to the gradient times the parameter */
    float w1;             /* 1 - beta1 */
    float beta2, w2;      /* beta2, 1 - beta2 */
    float eps;
    float step_size;      /* lr / (1 - beta1^step) */
    float bc2_sqrt;       /* sqrt(1 - beta2^step) */
    float inv_scale;      /* fp16's loss scale's inverse, else 1 */
    float coef;           /* the clipping coefficient, else 1 */
    int32_t decoupled, maximize, grad_kind, out_kind;
};

/* torch's conversion of fp32 to bf16: round to nearest even; a NaN as torch's CPU kernels write it (0xFFFF). */
static inline uint16_t round_bf16(float x) {
    uint32_t u = as_bits(x);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return x != x ? (uint16_t)0xFFFF : r;
}

/* The gradient of a block in fp32: converted, times inv_scale, times coef (each a rounding, as the ops do). */
static inline void gradient(const struct adam *a, const void *grad, int64_t lo, int64_t k, float *restrict g) {
    if (a->grad_kind == BF16) {
        const uint16_t *src = (const uint16_t *)grad + lo;
        for (int64_t j = 0; j < k; j++)
            g[j] = as_float((uint32_t)src[j] << 16);
#if HAVE_FP16
    } else if (a->grad_kind == FP16) {
        const _Float16 *src = (const _Float16 *)grad + lo;
        for (int64_t j = 0; j < k; j++)
            g[j] = (float)src[j];
#endif
    } else {
        memcpy(g, (const float *)grad + lo, (size_t)k * 4);
    }
    const float s = a->inv_scale, c = a->coef, sign = a->maximize ? -1.0f : 1.0f;
    for (int64_t j = 0; j < k; j++)
        g[j] = ((g[j] * s) * c) * sign;
}

/* The half-precision parameter written from the fp32 one (none where out_kind is FP32). */
static inline void write_half(const struct adam *a, const float *restrict p, void *out, int64_t lo, int64_t k) {
    if (a->out_kind == BF16) {
        uint16_t *dst = (uint16_t *)out + lo;
        for (int64_t j = 0; j < k; j++)
            dst[j] = round_bf16(p[j]);
#if HAVE_FP16
    } else if (a->out_kind == FP16) {
        _Float16 *dst = (_Float16 *)out + lo;
        for (int64_t j = 0; j < k; j++)
            dst[j] = (_Float16)p[j];
#endif
    }
}

/* One block's update: p (fp32) in place, m and v in place (fp32), the half-precision parameter written. */
static inline void update(const struct adam *a, float *restrict p, const float *restrict g, float *restrict m,
                          float *restrict v, void *out, int64_t lo, int64_t k) {
    const float w1 = a->w1, b2 = a->beta2, w2 = a->w2, decay = a->decay, wd = a->weight_decay;
    const float step_size = a->step_size, bc2 = a->bc2_sqrt, eps = a->eps;
    const int decoupled = a->decoupled;
    for (int64_t j = 0; j < k; j++) {
        float pj = p[j], gj = g[j];
        if (decoupled)
            pj = pj * decay;
        else
            gj = gj + pj * wd;
        float mj = m[j] + w1 * (gj - m[j]);             /* lerp(m, g, 1 - beta1), 1 - beta1 < 0.5 */
        float vj = v[j] * b2 + (gj * gj) * w2;
        float denom = sqrtf(vj) / bc2 + eps;
        p[j] = pj - step_size * mj / denom;
        m[j] = mj;
        v[j] = vj;
    }
    write_half(a, p, out, lo, k);
}

void pstar_adam_bf16(const struct adam *a, float *p32, void *out, const void *grad, uint16_t *qm, uint16_t *qv,
                     int64_t n, int32_t first, int32_t seed, int threads) {
    int64_t blocks = (n + INT8_BLOCK - 1) / INT8_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * INT8_BLOCK, k = n - lo < INT8_BLOCK ? n - lo : INT8_BLOCK;
        float g[INT8_BLOCK], m[INT8_BLOCK], v[INT8_BLOCK];
        gradient(a, grad, lo, k, g);
        for (int64_t j = 0; j < k; j++) {
            m[j] = as_float((uint32_t)qm[lo + j] << 16);
            v[j] = as_float((uint32_t)qv[lo + j] << 16);
        }
        update(a, p32 + lo, g, m, v, out, lo, k);
        for (int64_t j = 0; j < k; j++) {
            uint32_t r = bits_of((uint32_t)first + (uint32_t)(lo + j), (uint32_t)seed);
            qm[lo + j] = round_bf16_stochastic(m[j], r & 0xFFFFu);
            qv[lo + j] = round_bf16_stochastic(v[j], r >> 16);
        }
    }
}

void pstar_adam_int8(const struct adam *a, float *p32, void *out, const void *grad, int8_t *qm, uint8_t *qv,
                     float *sm, float *sv, int64_t n, int32_t first, int32_t seed, int threads) {
    int64_t blocks = (n + INT8_BLOCK - 1) / INT8_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * INT8_BLOCK, k = n - lo < INT8_BLOCK ? n - lo : INT8_BLOCK;
        float g[INT8_BLOCK], m[INT8_BLOCK], v[INT8_BLOCK];
        uint32_t r[INT8_BLOCK];
        gradient(a, grad, lo, k, g);
        const float s = sm[b], t = sv[b];
        for (int64_t j = 0; j < k; j++) {
            m[j] = value_m(qm[lo + j], s);
            v[j] = value_v(qv[lo + j], t);
        }
        update(a, p32 + lo, g, m, v, out, lo, k);
        for (int64_t j = 0; j < k; j++)
            r[j] = bits_of((uint32_t)first + (uint32_t)(lo + j), (uint32_t)seed);
        float am = block_amax(m, k), av = block_amax(v, k);
        sm[b] = am;
        sv[b] = av;
        codes_m(m, r, inverse(am), qm + lo, k);
        codes_v(v, r, inverse(av), qv + lo, k);
    }
}


/* Adam / AdamW on fp32 moments in mixed precision (pstar_fx/runtime/adam.py's exact route on the CPU): torch's fused
 * CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp), its vector loop's operations as its x86-64 build rounds
 * them, on the fp32 master, with the gradient converted from bf16 or fp16, unscaled and clipped as the torch route's
 * ops do it, and the half-precision parameter written from the master: one pass over the chunk where the torch route
 * makes three (the gradient into fp32 scratch, the kernel, the parameter's copy). torch's compiler contracts the
 * kernel's multiply-adds: m is its lerp's fused multiply-add, v fma((1 - beta2) g, g, v beta2), Adam's decay
 * fma(p, weight_decay, g); the parameter is p + (-step_size m) / (sqrt(v) / bc2 + eps). torch's scalar loop, which
 * takes a tensor's last n % 16 elements, may round otherwise: the caller gives those to torch (n here is a multiple
 * of 16), and checks once per process and kind of update that this reproduces torch's kernel bit for bit (another
 * build of torch, or a processor without fused multiply-adds, may not: the torch route then serves). */
#define EXACT_BLOCK 1024

void pstar_adam_exact(const struct adam *a, float *p32, void *out, const void *grad, float *m, float *v, int64_t n,
                      int threads) {
    const float w1 = a->w1, b2 = a->beta2, w2 = a->w2, decay = a->decay, wd = a->weight_decay;
    const float neg_step = -a->step_size, bc2 = a->bc2_sqrt, eps = a->eps;
    /* torch's lerp: m + w1 (g - m) where |w1| < 0.5, else g + (w1 - 1) (g - m), each one fused multiply-add */
    const int small = fabsf(w1) < 0.5f;
    const float coeff = small ? w1 : w1 - 1.0f;
    const int decoupled = a->decoupled, decays = a->weight_decay != 0.0f;
    int64_t blocks = (n + EXACT_BLOCK - 1) / EXACT_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * EXACT_BLOCK, k = n - lo < EXACT_BLOCK ? n - lo : EXACT_BLOCK;
        float g[EXACT_BLOCK];
        float *restrict p = p32 + lo, *restrict mb = m + lo, *restrict vb = v + lo;
        gradient(a, grad, lo, k, g);
        for (int64_t j = 0; j < k; j++) {
            float pj = p[j], gj = g[j];
            if (decays) {
                if (decoupled)
                    pj = pj * decay;
                else
                    gj = fmaf(pj, wd, gj);
            }
            float mj = fmaf(coeff, gj - mb[j], small ? mb[j] : gj);
            float vj = fmaf(w2 * gj, gj, vb[j] * b2);
            float denom = sqrtf(vj) / bc2 + eps;
            p[j] = pj + (neg_step * mj) / denom;
            mb[j] = mj;
            vb[j] = vj;
        }
        write_half(a, p, out, lo, k);
    }
}
