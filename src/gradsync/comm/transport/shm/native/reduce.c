/* The reductions: the same results, bit for bit, as the Python path's torch calls.
 *
 *     sum    acc + x; integers wrap around (computed unsigned); float16 and bfloat16 are added in
 *            float32 and rounded to nearest-even after every add, as torch's add_ does
 *     avg    sum, then finish divides by N (float16 and bfloat16: in float32, rounded once)
 *     max    NaN if either is NaN (torch.maximum propagates it), else acc > x ? acc : x (x on a
 *            tie, as torch's vectorized maximum returns its second operand: +0 and -0 compare equal)
 *     min    the same with <
 * A NaN result has every bit set, as torch's vectorized maximum and minimum make it.
 *
 * fold_in_rank_order reduces N inputs into one output in one pass over memory: block by block
 * (BLOCK elements, in the L1 cache), out = in[0] (op) in[1], then (op) in[2], ... in rank order,
 * which rounds exactly as the Python path's chain of pairwise calls does.
 */
#include "core.h"

#include <string.h>

#define BLOCK 2048

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TARGETS __attribute__((target_clones("avx2", "default")))
#else
#define TARGETS
#endif

typedef void (*binary_fn)(void *out, const void *a, const void *b, size_t n);

static inline float f32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }
static inline float all_ones_f32(void) { return f32_from_bits(0xFFFFFFFFu); }
static inline double all_ones_f64(void) { uint64_t w = ~(uint64_t)0; double d; memcpy(&d, &w, 8); return d; }

/* bfloat16: the upper half of a float32; rounded to nearest-even (torch's round_to_nearest_even) */
static inline float from_bf16(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }
static inline uint16_t to_bf16(float f) {
    uint32_t w = f32_to_bits(f);
    if (f != f)
        return 0x7FC0;
    return (uint16_t)((w + (((w >> 16) & 1u) + 0x7FFFu)) >> 16);
}

/* float16 (IEEE binary16): exact widening, and narrowing rounded to nearest-even (the conversion
 * torch's c10::Half uses, fp16_ieee_from_fp32_value) */
static inline float from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0) {
        float magnitude = (float)mantissa * 5.9604644775390625e-8f;   /* mantissa x 2^-24, exact */
        return f32_from_bits(sign | f32_to_bits(magnitude));
    }
    if (exponent == 31)
        return f32_from_bits(sign | 0x7F800000u | (mantissa << 13));
    return f32_from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}
static inline uint16_t to_f16(float f) {
    const float scale_to_inf = f32_from_bits(0x77800000u), scale_to_zero = f32_from_bits(0x08800000u);
    float magnitude = f < 0 ? -f : f;
    float base = (magnitude * scale_to_inf) * scale_to_zero;
    uint32_t w = f32_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u, bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u)
        bias = 0x71000000u;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = f32_to_bits(base);
    uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

#define KERNEL(name, T, EXPR)                                                   \
    TARGETS static void name(void *out_, const void *a_, const void *b_, size_t n) { \
        T *out = out_;                                                          \
        const T *a = a_, *b = b_;                                               \
        _Pragma("GCC ivdep") for (size_t i = 0; i < n; i++) {                  \
            T x = a[i], y = b[i];                                               \
            out[i] = (EXPR);                                                    \
        }                                                                       \
    }

KERNEL(sum_f32, float, x + y)
KERNEL(max_f32, float, (x != x || y != y) ? all_ones_f32() : (x > y ? x : y))
KERNEL(min_f32, float, (x != x || y != y) ? all_ones_f32() : (x < y ? x : y))
KERNEL(sum_f64, double, x + y)
KERNEL(max_f64, double, (x != x || y != y) ? all_ones_f64() : (x > y ? x : y))
KERNEL(min_f64, double, (x != x || y != y) ? all_ones_f64() : (x < y ? x : y))
KERNEL(sum_i32, int32_t, (int32_t)((uint32_t)x + (uint32_t)y))
KERNEL(max_i32, int32_t, x > y ? x : y)
KERNEL(min_i32, int32_t, x < y ? x : y)
KERNEL(sum_i64, int64_t, (int64_t)((uint64_t)x + (uint64_t)y))
KERNEL(max_i64, int64_t, x > y ? x : y)
KERNEL(min_i64, int64_t, x < y ? x : y)

#define HALF_KERNELS(suffix, from, to)                                                              \
    KERNEL(sum_##suffix, uint16_t, to(from(x) + from(y)))                                          \
    KERNEL(max_##suffix, uint16_t,                                                                 \
           (from(x) != from(x) || from(y) != from(y)) ? 0xFFFFu : (from(x) > from(y) ? x : y))     \
    KERNEL(min_##suffix, uint16_t,                                                                 \
           (from(x) != from(x) || from(y) != from(y)) ? 0xFFFFu : (from(x) < from(y) ? x : y))

HALF_KERNELS(f16, from_f16, to_f16)
HALF_KERNELS(bf16, from_bf16, to_bf16)

static const binary_fn KERNELS[N_DTYPES][N_OPS] = {
    [F32] = {sum_f32, sum_f32, max_f32, min_f32},
    [F64] = {sum_f64, sum_f64, max_f64, min_f64},
    [F16] = {sum_f16, sum_f16, max_f16, min_f16},
    [BF16] = {sum_bf16, sum_bf16, max_bf16, min_bf16},
    [I32] = {sum_i32, sum_i32, max_i32, min_i32},
    [I64] = {sum_i64, sum_i64, max_i64, min_i64},
};

static const int SIZES[N_DTYPES] = {[F32] = 4, [F64] = 8, [F16] = 2, [BF16] = 2, [I32] = 4, [I64] = 8};

int dtype_size(int dtype) { return SIZES[dtype]; }

void combine(int dtype, int op, void *acc, const void *incoming, size_t n) {
    KERNELS[dtype][op](acc, acc, incoming, n);
}

void fold_in_rank_order(int dtype, int op, void *out, const void *const *inputs, int n_inputs, size_t n) {
    binary_fn kernel = KERNELS[dtype][op];
    size_t size = (size_t)SIZES[dtype];
    char *to = out;
    for (size_t start = 0; start < n; start += BLOCK) {
        size_t length = n - start < BLOCK ? n - start : BLOCK, at = start * size;
        kernel(to + at, (const char *)inputs[0] + at, (const char *)inputs[1] + at, length);
        for (int k = 2; k < n_inputs; k++)
            kernel(to + at, to + at, (const char *)inputs[k] + at, length);
    }
}

void finish(int dtype, int op, void *owned, size_t n, int n_ranks) {
    if (op != AVG)
        return;
    if (dtype == F32) {
        float *x = owned, divisor = (float)n_ranks;
        for (size_t i = 0; i < n; i++)
            x[i] = x[i] / divisor;
    } else if (dtype == F64) {
        double *x = owned, divisor = (double)n_ranks;
        for (size_t i = 0; i < n; i++)
            x[i] = x[i] / divisor;
    } else if (dtype == F16 || dtype == BF16) {
        uint16_t *x = owned;
        float divisor = (float)n_ranks;
        for (size_t i = 0; i < n; i++)
            x[i] = dtype == F16 ? to_f16(from_f16(x[i]) / divisor) : to_bf16(from_bf16(x[i]) / divisor);
    }
}
