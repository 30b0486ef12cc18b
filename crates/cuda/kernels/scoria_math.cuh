// scoria_math.cuh: the GPU side of `model::math` (crates/model/src/math.rs).
//
// Every function here performs exactly the float operations of its Rust
// twin, in the same order, so CPU and GPU results are bit-identical
// (docs/design.md invariant 1). Rules that keep it so:
//   - every fused multiply-add of the Rust side (`f32::mul_add`) is a
//     `__fmaf_rn` here, at the same place, with the same operand order;
//   - every other operation is spelled `__fmul_rn` / `__fadd_rn` / `__fsub_rn`
//     / `__fdiv_rn` / `__fsqrt_rn`, which nvcc never contracts into an FMA and
//     never approximates, whatever `--fmad` or `--use_fast_math` say;
//   - bit manipulation goes through `__float_as_uint` / `__uint_as_float`.
// Subnormal results are computed, not flushed (the arithmetic itself rounds
// them once); compile the kernels WITHOUT `-ftz=true` / `--use_fast_math`,
// since flush-to-zero would also flush subnormal *inputs* of these functions.
// NaN inputs give NaN outputs; a NaN's bits are not specified (the CPU may
// keep an input payload, the GPU produces 0x7fffffff).
//
// Change a formula here only together with math.rs; the pinned bit patterns
// in `model::math::PINNED` are the shared check.
//
// The canonical 32-lane reduction order (math.rs module doc): a sum over
// i in 0..n has 32 accumulators starting at 0.0; accumulator l adds the
// terms of elements l, l+32, l+64, ... in increasing order (a product term is
// rounded before the add, never fused); then acc[l] = acc[l] + acc[l+w] for
// w = 16, 8, 4, 2, 1, and acc[0] is the result. On the GPU lane l of a full
// warp is accumulator l and `sc_warp_sum` is the tree.
//
// Header-only; needs nothing beyond what nvcc provides.
#pragma once

// ---- exp ----------------------------------------------------------------

#define SC_LOG2_E 1.44269502162933349609375f          // 0x3fb8aa3b
#define SC_EXP_LN2_HI 0.693147182464599609375f        // 0x3f317218
#define SC_EXP_LN2_LO (-1.904654212125933356583118e-9f) // 0xb102e308

__device__ __forceinline__ float sc_pow2i(int k) {
    // 2^k for k in -126..=127, from the exponent bits.
    return __uint_as_float((unsigned)(k + 127) << 23);
}

__device__ __forceinline__ bool sc_isnan(float x) {
    return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u;
}

// e^x; mirror of `model::math::exp` (<= 1 ulp over [-87, 88.7]).
__device__ __forceinline__ float sc_exp(float x) {
    if (sc_isnan(x)) return x;
    if (x > 89.0f) return __uint_as_float(0x7f800000u);  // +inf
    if (x < -104.0f) return 0.0f;
    const float kf = rintf(__fmul_rn(x, SC_LOG2_E));  // round half to even
    float r = __fmaf_rn(-kf, SC_EXP_LN2_HI, x);
    r = __fmaf_rn(-kf, SC_EXP_LN2_LO, r);
    float p = __uint_as_float(0x39500d01u);              // 1/5040
    p = __fmaf_rn(p, r, __uint_as_float(0x3ab60b61u));   // 1/720
    p = __fmaf_rn(p, r, __uint_as_float(0x3c088889u));   // 1/120
    p = __fmaf_rn(p, r, __uint_as_float(0x3d2aaaabu));   // 1/24
    p = __fmaf_rn(p, r, __uint_as_float(0x3e2aaaabu));   // 1/6
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    // n in -150..=128; n1, n2 in -75..=64: the first product is exact, the
    // second rounds once (subnormal result) or overflows to +inf.
    const int n = __float2int_rn(kf);  // kf is integral: exact
    const int n1 = n >> 1;             // arithmetic shift (floor), as in Rust
    const int n2 = n - n1;
    return __fmul_rn(__fmul_rn(p, sc_pow2i(n1)), sc_pow2i(n2));
}

// ---- log1p --------------------------------------------------------------

#define SC_LOG_LN2_HI 0.693145751953125f              // 0x3f317200
#define SC_LOG_LN2_LO 1.428606765330187045037746e-6f  // 0x35bfbe8e

// ln(1 + x); mirror of `model::math::ln_1p` (<= 1 ulp over (-1, 1e30]).
__device__ __forceinline__ float sc_log1p(float x) {
    if (sc_isnan(x)) return x;
    if (x < -1.0f) return __uint_as_float(0x7fc00000u);   // NaN
    if (x == -1.0f) return __uint_as_float(0xff800000u);  // -inf
    if (__float_as_uint(x) == 0x7f800000u) return x;      // +inf
    if (x == 0.0f) return x;                              // keeps -0
    const float u = __fadd_rn(1.0f, x);
    // Rounding error of 1 + x relative to u (u - 1 is exact below 2^24).
    const float c = (u < 16777216.0f) ? __fdiv_rn(__fsub_rn(x, __fsub_rn(u, 1.0f)), u) : 0.0f;
    const unsigned bits = __float_as_uint(u);
    int k = (int)(bits >> 23) - 127;
    unsigned mant = bits & 0x007fffffu;
    if (mant > 0x003504f3u) {  // m > sqrt(2): use m/2 and k + 1
        mant |= 0x3f000000u;
        k += 1;
    } else {
        mant |= 0x3f800000u;
    }
    const float f = __fsub_rn(__uint_as_float(mant), 1.0f);
    const float hfsq = __fmul_rn(__fmul_rn(0.5f, f), f);
    const float s = __fdiv_rn(f, __fadd_rn(2.0f, f));
    const float z = __fmul_rn(s, s);
    float r = __uint_as_float(0x3e3a2e8cu);              // 2/11
    r = __fmaf_rn(r, z, __uint_as_float(0x3e638e39u));   // 2/9
    r = __fmaf_rn(r, z, __uint_as_float(0x3e924925u));   // 2/7
    r = __fmaf_rn(r, z, __uint_as_float(0x3ecccccdu));   // 2/5
    r = __fmaf_rn(r, z, __uint_as_float(0x3f2aaaabu));   // 2/3
    r = __fmul_rn(r, z);
    const float kf = (float)k;  // |k| <= 128: exact
    const float lo = __fmaf_rn(kf, SC_LOG_LN2_LO, c);
    const float t = __fmaf_rn(s, __fadd_rn(hfsq, r), lo);
    const float low = __fsub_rn(__fsub_rn(hfsq, t), f);
    return __fmaf_rn(kf, SC_LOG_LN2_HI, -low);
}

// ---- activations --------------------------------------------------------

// 1 / (1 + e^-x); mirror of `model::math::sigmoid`.
__device__ __forceinline__ float sc_sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, sc_exp(-x)));
}

// x / (1 + e^-x); mirror of `model::math::silu`.
__device__ __forceinline__ float sc_silu(float x) {
    return __fdiv_rn(x, __fadd_rn(1.0f, sc_exp(-x)));
}

// x above 20, else ln(1 + e^x); mirror of `model::math::softplus`.
__device__ __forceinline__ float sc_softplus(float x) {
    return (x > 20.0f) ? x : sc_log1p(sc_exp(x));
}

// ---- norm scales (sqrt and division correctly rounded on both sides) ----

// 1 / sqrt(ss / n + eps); mirror of `model::math::rms_scale` (n is the
// element count as f32, i.e. `n as f32` on the CPU: exact below 2^24).
__device__ __forceinline__ float sc_rms_scale(float ss, float n, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, n), eps)));
}

// 1 / sqrt(ss + eps); mirror of `model::math::l2_scale`.
__device__ __forceinline__ float sc_l2_scale(float ss, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ss, eps)));
}

// ---- canonical 32-lane reductions ---------------------------------------

// The combining tree of the canonical order over a full warp (all 32 lanes
// must call it): after the step for w, lane l holds acc[l mod w] of the CPU
// tree acc[l] = acc[l] + acc[l+w] (float addition is commutative, so lane
// l >= w computing acc[l] + acc[l-w] gets the same bits). Every lane returns
// the result acc[0].
__device__ __forceinline__ float sc_warp_sum(float acc) {
#pragma unroll
    for (int w = 16; w >= 1; w >>= 1) {
        acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, w));
    }
    return acc;
}

// sc_warp_sum of N lane values at once (N = 2, 4 or 8: v[i] is sum i's value in this
// lane), in log2(N) + 5 shuffles instead of 5·N. At each of the first log2(N) steps
// the lanes with bit w set keep the upper half of their values and hand the lower
// half to lane l ^ w, which keeps the lower half: every node is still the sum of the
// same two values (commutative), so each sum has the bits sc_warp_sum gives it. Sum i
// ends in lanes i·(32/N) .. i·(32/N) + 32/N − 1; the return value is this lane's.
template <int N>
__device__ __forceinline__ float sc_warp_sum_split(const float (&v)[N]) {
    static_assert(N == 2 || N == 4 || N == 8, "sc_warp_sum_split: N is 2, 4 or 8");
    const int lane = threadIdx.x & 31;
    float k[N];
#pragma unroll
    for (int i = 0; i < N; i++) k[i] = v[i];
#pragma unroll
    for (int h = N / 2, w = 16; h >= 1; h >>= 1, w >>= 1) {
        const bool up = (lane & w) != 0;
#pragma unroll
        for (int i = 0; i < h; i++) {
            const float keep = up ? k[h + i] : k[i];
            const float give = up ? k[i] : k[h + i];
            k[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, give, w));
        }
    }
#pragma unroll
    for (int w = 16 / N; w >= 1; w >>= 1) {
        k[0] = __fadd_rn(k[0], __shfl_xor_sync(0xffffffffu, k[0], w));
    }
    return k[0];
}

// Σ x[i] over i in 0..n in the canonical order, by one full warp; mirror of
// `model::math::sum`. Every lane returns the result.
__device__ __forceinline__ float sc_warp_sum_n(const float* x, int n) {
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int i = lane; i < n; i += 32) acc = __fadd_rn(acc, x[i]);
    return sc_warp_sum(acc);
}

// Σ x[i]² in the canonical order (square rounded, then added), by one full
// warp; mirror of `model::math::sum_sq`.
__device__ __forceinline__ float sc_warp_sum_sq(const float* x, int n) {
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int i = lane; i < n; i += 32) acc = __fadd_rn(acc, __fmul_rn(x[i], x[i]));
    return sc_warp_sum(acc);
}

// Σ a[i]·b[i] in the canonical order (product rounded, then added), by one
// full warp; mirror of `model::math::dot`.
__device__ __forceinline__ float sc_warp_dot(const float* a, const float* b, int n) {
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int i = lane; i < n; i += 32) acc = __fadd_rn(acc, __fmul_rn(a[i], b[i]));
    return sc_warp_sum(acc);
}
