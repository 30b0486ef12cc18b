// Helpers every kernel file shares: explicit float operations, loads, integer tricks.
//
// Everything here is `SC_HD`: compiled for the device by nvcc and, for the host-side
// check of the bit manipulations (crates/cuda/tests/host_decode.cpp), by a plain C++
// compiler. Device code uses the intrinsics; host code a portable transcription.
//
// Float operations are spelled out (sc_mul, sc_add, sc_fma) so that the canonical
// order of docs/design.md is visible in the source and never depends on contraction
// (build.rs also passes --fmad=false).
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define SC_HD __host__ __device__ __forceinline__
#else
#include <math.h>
#include <string.h>
#define SC_HD static inline
#endif

#if defined(__CUDA_ARCH__)
#define SC_DEVICE_CODE 1
#endif

// ---------------------------------------------------------------- float operations

SC_HD float sc_mul(float a, float b) {
#ifdef SC_DEVICE_CODE
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

SC_HD float sc_add(float a, float b) {
#ifdef SC_DEVICE_CODE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

SC_HD float sc_sub(float a, float b) {
#ifdef SC_DEVICE_CODE
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// One fused multiply-add, a single rounding: fma(a, b, c) = a*b + c.
SC_HD float sc_fma(float a, float b, float c) {
#ifdef SC_DEVICE_CODE
  return __fmaf_rn(a, b, c);
#else
  return fmaf(a, b, c);
#endif
}

SC_HD float sc_div(float a, float b) {
#ifdef SC_DEVICE_CODE
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

SC_HD float sc_sqrt(float a) {
#ifdef SC_DEVICE_CODE
  return __fsqrt_rn(a);
#else
  return sqrtf(a);
#endif
}

// int -> f32, round to nearest (exact below 2^24, which every use here is).
SC_HD float sc_i2f(int v) {
#ifdef SC_DEVICE_CODE
  return __int2float_rn(v);
#else
  return (float)v;
#endif
}

// --------------------------------------------------------------- half-width floats

// IEEE binary16 bits -> f32, exact (subnormals included).
SC_HD float sc_f16_to_f32(uint16_t h) {
#ifdef SC_DEVICE_CODE
  return __half2float(__ushort_as_half(h));
#else
  uint32_t s = (uint32_t)(h >> 15) << 31;
  uint32_t e = (h >> 10) & 0x1f;
  uint32_t m = h & 0x3ff;
  uint32_t bits;
  if (e == 0) {
    if (m == 0) {
      bits = s;
    } else {
      // Subnormal: m · 2^-24, exactly representable in f32.
      float v = ldexpf((float)m, -24);
      memcpy(&bits, &v, 4);
      bits |= s;
    }
  } else if (e == 31) {
    bits = s | 0x7f800000u | (m << 13);
  } else {
    bits = s | ((e + 112) << 23) | (m << 13);
  }
  float out;
  memcpy(&out, &bits, 4);
  return out;
#endif
}

// bfloat16 bits -> f32 (the upper half of an f32), exact.
SC_HD float sc_bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
#ifdef SC_DEVICE_CODE
  return __uint_as_float(bits);
#else
  float out;
  memcpy(&out, &bits, 4);
  return out;
#endif
}

// ------------------------------------------------------------------------- loads
// Weights and activations are read-only for a kernel's lifetime: the read-only
// path (__ldg) is valid.

SC_HD uint16_t sc_ld16(const uint8_t* p) {
#ifdef SC_DEVICE_CODE
  return __ldg((const unsigned short*)p);
#else
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
#endif
}

SC_HD uint32_t sc_ld32(const uint8_t* p) {
#ifdef SC_DEVICE_CODE
  return __ldg((const unsigned int*)p);
#else
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
#endif
}

// 8 bytes from an 8-byte aligned address, as two little-endian words.
SC_HD void sc_ld64(const uint8_t* p, uint32_t& w0, uint32_t& w1) {
#ifdef SC_DEVICE_CODE
  uint2 v = __ldg((const uint2*)p);
  w0 = v.x;
  w1 = v.y;
#else
  memcpy(&w0, p, 4);
  memcpy(&w1, p + 4, 4);
#endif
}

// 16 bytes from a 16-byte aligned address, as four little-endian words.
SC_HD void sc_ld128(const uint8_t* p, uint32_t* w) {
#ifdef SC_DEVICE_CODE
  uint4 v = __ldg((const uint4*)p);
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
#else
  memcpy(w, p, 16);
#endif
}

// (hi:lo) >> (8 · byte_shift), low 32 bits; byte_shift in 0..3.
SC_HD uint32_t sc_funnel(uint32_t lo, uint32_t hi, uint32_t byte_shift) {
#ifdef SC_DEVICE_CODE
  return __funnelshift_r(lo, hi, 8 * byte_shift);
#else
  uint64_t v = ((uint64_t)hi << 32) | lo;
  return (uint32_t)(v >> (8 * byte_shift));
#endif
}

// N little-endian words of the 4N bytes at p, for p of any alignment: aligned word
// loads stitched with funnel shifts. Never reads past the 4-byte word holding the last
// byte (so a tensor's last block is safe to read at the end of an allocation).
template <int N>
SC_HD void sc_ld_words(const uint8_t* p, uint32_t* w) {
  uintptr_t a = (uintptr_t)p;
  uint32_t sh = (uint32_t)(a & 3);
  const uint8_t* b = (const uint8_t*)(a - sh);
  uint32_t word[N + 1];
#pragma unroll
  for (int i = 0; i < N; i++) word[i] = sc_ld32(b + 4 * i);
  // The word after the last is needed only when p is not aligned (then it holds the
  // last bytes); an aligned p must not read past its 4N bytes.
  word[N] = sh ? sc_ld32(b + 4 * N) : 0u;
#pragma unroll
  for (int i = 0; i < N; i++) w[i] = sc_funnel(word[i], word[i + 1], sh);
}

// ------------------------------------------------------------- integer tricks

// Σ of the four products of signed bytes of a and b, plus c (exact).
SC_HD int sc_dp4a(uint32_t a, uint32_t b, int c) {
#ifdef SC_DEVICE_CODE
  return __dp4a((int)a, (int)b, c);
#else
  for (int k = 0; k < 4; k++) {
    c += (int)(int8_t)(uint8_t)(a >> (8 * k)) * (int)(int8_t)(uint8_t)(b >> (8 * k));
  }
  return c;
#endif
}

// Byte-wise a - b (mod 256 in each byte).
SC_HD uint32_t sc_vsub4(uint32_t a, uint32_t b) {
#ifdef SC_DEVICE_CODE
  return __vsub4(a, b);
#else
  uint32_t r = 0;
  for (int k = 0; k < 4; k++) {
    uint32_t d = ((a >> (8 * k)) - (b >> (8 * k))) & 0xff;
    r |= d << (8 * k);
  }
  return r;
#endif
}

// __byte_perm(x, y, s) for selectors 0..7 (no sign-replicate mode): byte k of the
// result is byte (s >> 4k) & 7 of the 8 bytes y:x.
SC_HD uint32_t sc_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef SC_DEVICE_CODE
  return __byte_perm(x, y, s);
#else
  uint64_t v = ((uint64_t)y << 32) | x;
  uint32_t r = 0;
  for (int k = 0; k < 4; k++) {
    uint32_t sel = (s >> (4 * k)) & 7;
    r |= (uint32_t)((v >> (8 * sel)) & 0xff) << (8 * k);
  }
  return r;
#endif
}

#if defined(__CUDACC__)
// ------------------------------------------------------- launch order, quantization

// Every kernel starts here. Launched with programmatic stream serialization (the
// executor does so on sm_90 and later, `Gpu::launch`), a kernel may be scheduled
// while the one before it in the stream still runs; `griddepcontrol.wait` holds it
// until that one has finished and its writes are visible, so nothing a kernel reads
// or writes is touched early. It then lets the next kernel be scheduled, which hides
// the launch latency between two kernels of a step. Without the attribute (or
// before sm_90) both are no-ops. Call it before any other memory access.
__device__ __forceinline__ void sc_pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks L2 for the `bytes` bytes at p (a weight row), one 128-byte line a lane. Only
// for memory no kernel writes (weights): it is the one access a kernel may make
// before sc_pdl_enter, so that a step's weights stream in while the kernel before
// still runs.
__device__ __forceinline__ void sc_prefetch_l2(const uint8_t* p, unsigned long long bytes) {
  for (unsigned long long off = (unsigned long long)(threadIdx.x & 31) * 128; off < bytes; off += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}

// Lane `lane` of a full warp holding value v of a 32-value block: the canonical int8
// block of quant::quantize_act_block, written to qs[0..32], *d_out and *sum_out.
// amax = max |x_i|; d = amax / 127; id = d == 0 ? 0 : 1 / d;
// q_i = clamp(round_half_even(x_i * id), -127, 127); sum = Σ q_i.
__device__ __forceinline__ void sc_quant_block(float v, int lane, int8_t* qs, float* d_out,
                                               int* sum_out) {
  // The CPU keeps amax from 0 and takes |x| only when greater: NaN never wins.
  float a = fmaxf(0.0f, fabsf(v));
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, w));
  const float d = sc_div(a, 127.0f);
  const float id = d == 0.0f ? 0.0f : sc_div(1.0f, d);
  const float r = rintf(sc_mul(v, id));
  // Rust's `NaN.clamp(..) as i8` is 0.
  const int q = r != r ? 0 : (int)fminf(fmaxf(r, -127.0f), 127.0f);
  int sum = q;
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
  qs[lane] = (int8_t)q;
  if (lane == 0) {
    *d_out = d;
    *sum_out = sum;
  }
}
#endif
