// Evaluates the shared elementwise functions of scoria_math.cuh on given inputs, so
// that the tests can compare them with model::math bit for bit (including the pinned
// tables model::math::PINNED and PINNED_LN_1P). Not used by the executor.

#include "sc_common.cuh"
#include "scoria_math.cuh"

// out[f·n + i] = f(x[i]) for f = exp, sigmoid, silu, softplus, log1p.
extern "C" __global__ void __launch_bounds__(256) math_probe(const float* __restrict__ x, int n,
                                                            float* __restrict__ out) { sc_pdl_enter();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  out[i] = sc_exp(v);
  out[(size_t)n + i] = sc_sigmoid(v);
  out[2 * (size_t)n + i] = sc_silu(v);
  out[3 * (size_t)n + i] = sc_softplus(v);
  out[4 * (size_t)n + i] = sc_log1p(v);
}

// Tests only (the engine's SCORIA_TEST_CUDA_FAULT): one thread writes to `addr`, an
// address the caller picks outside every allocation, so the context gets a real
// CUDA_ERROR_ILLEGAL_ADDRESS (sticky: every later call of the context fails). The
// address is a parameter so that the compiler cannot see the store is invalid.
extern "C" __global__ void fault_probe(unsigned long long addr) { sc_pdl_enter();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *(volatile unsigned int*)addr = 0xdeadbeefu;
  }
}
