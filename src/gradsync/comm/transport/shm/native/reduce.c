/* The reductions: the same results, bit for bit, as the Python path's torch calls (reduce_ops.py).
 *
 *     sum    acc + x; integers wrap around (computed unsigned); float16 and bfloat16: see below
 *     avg    sum, then divided by N (float16 and bfloat16: in float32, before their one rounding)
 *     max    NaN if either is NaN (torch.maximum propagates it), else acc > x ? acc : x (x on a
 *            tie, as torch's vectorized maximum returns its second operand: +0 and -0 compare equal)
 *     min    the same with <
 * A NaN result has every bit set, as torch's vectorized maximum and minimum make it.
 *
 * reduce_inputs reduces N inputs into one output in one pass over memory, block by block (BLOCK
 * elements, in the L1 cache), in the order given: out = in[0] (op) in[1], then (op) in[2], ... as
 * reduce_ops.Reduction.reduce does. float16 and bfloat16 sums are added in a float32 block and
 * rounded to nearest-even once, at the end (torch's float32 add, then its conversion: the Python
 * path's ``acc = in[0].float(); acc.add_(in[k]) ...; out.copy_(acc)``). With GRADSYNC_HALF_SUM=narrow
 * (set_narrow_half_sums) they are rounded after every add instead, as torch's float16/bfloat16
 * add_ does and gloo's running sum: kept to measure what the float32 sum buys.
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

static int narrow_half_sums = 0;

void set_narrow_half_sums(int narrow) { narrow_half_sums = narrow; }

/* float16 and bfloat16 sums in float32: acc = in[0] + in[1], acc += in[k] for the middle inputs, and the
 * last input added as the result is rounded: out = round((acc + in[N-1]) [/ N]); two inputs in one pass,
 * out = round((in[0] + in[1]) [/ N]). The float32 operations are the Python path's, in its order. */
#define WIDE_KERNELS(suffix, from, to)                                                              \
    TARGETS static void widen_##suffix(float *acc, const void *a_, const void *b_, size_t n) {     \
        const uint16_t *a = a_, *b = b_;                                                            \
        _Pragma("GCC ivdep") for (size_t i = 0; i < n; i++) acc[i] = from(a[i]) + from(b[i]);      \
    }                                                                                               \
    TARGETS static void accumulate_##suffix(float *acc, const void *x_, size_t n) {                \
        const uint16_t *x = x_;                                                                     \
        _Pragma("GCC ivdep") for (size_t i = 0; i < n; i++) acc[i] += from(x[i]);                  \
    }                                                                                               \
    TARGETS static void last_sum_##suffix(void *out_, const float *acc, const void *x_, size_t n) { \
        uint16_t *out = out_;                                                                       \
        const uint16_t *x = x_;                                                                     \
        _Pragma("GCC ivdep") for (size_t i = 0; i < n; i++) out[i] = to(acc[i] + from(x[i]));      \
    }                                                                                               \
    TARGETS static void last_avg_##suffix(void *out_, const float *acc, const void *x_, size_t n,  \
                                          float divisor) {                                          \
        uint16_t *out = out_;                                                                       \
        const uint16_t *x = x_;                                                                     \
        _Pragma("GCC ivdep") for (size_t i = 0; i < n; i++)                                         \
            out[i] = to((acc[i] + from(x[i])) / divisor);                                           \
    }                                                                                               \
    TARGETS static void pair_avg_##suffix(void *out_, const void *a_, const void *b_, size_t n,    \
                                          float divisor) {                                          \
        uint16_t *out = out_;                                                                       \
        const uint16_t *a = a_, *b = b_;                                                            \
        _Pragma("GCC ivdep") for (size_t i = 0; i < n; i++)                                         \
            out[i] = to((from(a[i]) + from(b[i])) / divisor);                                       \
    }

WIDE_KERNELS(f16, from_f16, to_f16)
WIDE_KERNELS(bf16, from_bf16, to_bf16)

static void reduce_wide(int dtype, int op, void *out, const void *const *inputs, int n_inputs, size_t n,
                        int n_ranks) {
    int half = dtype == F16;
    float acc[BLOCK], divisor = (float)n_ranks;
    char *to = out;
    const char *const *in = (const char *const *)inputs;
    for (size_t start = 0; start < n; start += BLOCK) {
        size_t length = n - start < BLOCK ? n - start : BLOCK, at = start * 2;
        if (n_inputs == 2) {   /* a sum of two: the narrow kernel's add, which rounds once too */
            if (op == AVG)
                (half ? pair_avg_f16 : pair_avg_bf16)(to + at, in[0] + at, in[1] + at, length, divisor);
            else
                (half ? sum_f16 : sum_bf16)(to + at, in[0] + at, in[1] + at, length);
            continue;
        }
        (half ? widen_f16 : widen_bf16)(acc, in[0] + at, in[1] + at, length);
        for (int k = 2; k < n_inputs - 1; k++)
            (half ? accumulate_f16 : accumulate_bf16)(acc, in[k] + at, length);
        if (op == AVG)
            (half ? last_avg_f16 : last_avg_bf16)(to + at, acc, in[n_inputs - 1] + at, length, divisor);
        else
            (half ? last_sum_f16 : last_sum_bf16)(to + at, acc, in[n_inputs - 1] + at, length);
    }
}

static void fold_in_order(int dtype, int op, void *out, const void *const *inputs, int n_inputs, size_t n) {
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

static void finish(int dtype, int op, void *owned, size_t n, int n_ranks) {
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

void reduce_inputs(int dtype, int op, void *out, const void *const *inputs, int n_inputs, size_t n, int n_ranks) {
    if (n == 0)
        return;
    if ((dtype == F16 || dtype == BF16) && (op == SUM || op == AVG) && !narrow_half_sums && n_inputs >= 2) {
        reduce_wide(dtype, op, out, inputs, n_inputs, n, n_ranks);
        return;
    }
    if (n_inputs == 1) {
        if (out != inputs[0])
            memcpy(out, inputs[0], n * (size_t)SIZES[dtype]);
    } else {
        fold_in_order(dtype, op, out, inputs, n_inputs, n);
    }
    finish(dtype, op, out, n, n_ranks);
}
