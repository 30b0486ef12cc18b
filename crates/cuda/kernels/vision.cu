// The image encoder's kernels (model::vision::encoder on the GPU): the linear layers on
// the tensor cores, LayerNorm, the learned positions, the 2-D rotary step and full
// (bidirectional) attention.
//
// Not bit-identical to the CPU encoder: an image's embedding is a dense computation
// like the text model's attention and norms, so the GPU's bits are its own, the same
// on every run (fixed reduction trees, no float atomics), and within the vision
// fixture's tolerance of transformers. The text model takes the rows as they are.

#include "sc_common.cuh"
#include <cuda_fp16.h>

// ------------------------------------------------------------------ vis_linear
// y[t][o] = epi(Σ_k x[t][k]·w[o][k] + b[o]) for n_tok rows of x (f32) and n_out rows of
// w. The weights are f16 (`whi`; for a file whose weights are not f16, also `wlo`, the
// f16 rounding of what whi leaves, so whi + wlo holds them to about 22 bits). Each
// activation is split the same way, hi = f16(x), lo = f16(x − hi), and the tensor
// cores (mma m16n8k16, f32 accumulation) take whi·hi + whi·lo (+ wlo·hi): products of
// f16 values are exact in f32, so this is an f32 matrix product to about 2^-22 per
// term, at the speed of f16. The activations the encoder multiplies (LayerNorm and
// GELU outputs, attention outputs, pixels) stay far inside f16's range.
//
// Tiles of 128 rows × 128 outputs, K in steps of 32 (the next step's values loaded into
// registers while this one multiplies); 8 warps, each 64 rows × 32 outputs. n_in must
// be a multiple of 8 (the host checks): a row's 8-value pieces are whole or absent.
#define VL_BM 128
#define VL_BN 128
#define VL_BK 32
#define VL_LD (VL_BK + 8)  // halves a shared row holds: 80 bytes, so fragment loads hit 32 banks

#define VL_STORE 0
#define VL_GELU_TANH 1
#define VL_GELU_ERF 2
#define VL_ADD 3

__device__ __forceinline__ void vl_mma(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// GELU, tanh form (the ViT MLP's gelu_pytorch_tanh).
__device__ __forceinline__ float vl_gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

// Exact GELU, x·Φ(x) (the merger's), in double.
__device__ __forceinline__ float vl_gelu_erf(float x) {
  const double v = (double)x;
  return (float)(0.5 * v * (1.0 + erf(v * 0.7071067811865476)));
}

template <bool LO>
__device__ __forceinline__ void vl_body(const float* __restrict__ x, int n_tok, int n_in,
                                        const __half* __restrict__ whi, const __half* __restrict__ wlo,
                                        const float* __restrict__ bias, int n_out, float* y, int epi) {
  __shared__ __align__(16) __half sxh[VL_BM][VL_LD];
  __shared__ __align__(16) __half sxl[VL_BM][VL_LD];
  __shared__ __align__(16) __half swh[VL_BN][VL_LD];
  __shared__ __align__(16) __half swl[LO ? VL_BN : 1][VL_LD];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int t0 = blockIdx.y * VL_BM, o0 = blockIdx.x * VL_BN;
  const int wm = 64 * (warp & 1), wn = 32 * (warp >> 1);

  float4 px[4];
  uint4 pwh[2], pwl[2];
  auto load = [&](int k0) {
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const int e = tid + 256 * q, r = e >> 3, c = k0 + 4 * (e & 7);
      px[q] = (t0 + r < n_tok && c < n_in)
                  ? __ldg(reinterpret_cast<const float4*>(x + (size_t)(t0 + r) * n_in + c))
                  : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int q = 0; q < 2; q++) {
      const int e = tid + 256 * q, r = e >> 2, c = k0 + 8 * (e & 3);
      const bool in = o0 + r < n_out && c < n_in;
      const size_t off = (size_t)(o0 + r) * n_in + c;
      pwh[q] = in ? __ldg(reinterpret_cast<const uint4*>(whi + off)) : make_uint4(0, 0, 0, 0);
      if (LO) pwl[q] = in ? __ldg(reinterpret_cast<const uint4*>(wlo + off)) : make_uint4(0, 0, 0, 0);
    }
  };
  auto split = [](float v, __half& hi, __half& lo) {
    hi = __float2half_rn(v);
    lo = __float2half_rn(v - __half2float(hi));
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;

  load(0);
  for (int k0 = 0; k0 < n_in; k0 += VL_BK) {
    __syncthreads();  // the previous step is consumed
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const int e = tid + 256 * q, r = e >> 3, c = 4 * (e & 7);
      __half h[4], l[4];
      split(px[q].x, h[0], l[0]);
      split(px[q].y, h[1], l[1]);
      split(px[q].z, h[2], l[2]);
      split(px[q].w, h[3], l[3]);
      *reinterpret_cast<__half2*>(&sxh[r][c]) = __halves2half2(h[0], h[1]);
      *reinterpret_cast<__half2*>(&sxh[r][c + 2]) = __halves2half2(h[2], h[3]);
      *reinterpret_cast<__half2*>(&sxl[r][c]) = __halves2half2(l[0], l[1]);
      *reinterpret_cast<__half2*>(&sxl[r][c + 2]) = __halves2half2(l[2], l[3]);
    }
#pragma unroll
    for (int q = 0; q < 2; q++) {
      const int e = tid + 256 * q, r = e >> 2, c = 8 * (e & 3);
      *reinterpret_cast<uint4*>(&swh[r][c]) = pwh[q];
      if (LO) *reinterpret_cast<uint4*>(&swl[r][c]) = pwl[q];
    }
    __syncthreads();
    if (k0 + VL_BK < n_in) load(k0 + VL_BK);
#pragma unroll
    for (int ks = 0; ks < VL_BK; ks += 16) {
      const int c = ks + 2 * t4;
      uint32_t ah[4][4], al[4][4], bh[4][2], bl[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; mi++) {
        const int r = wm + 16 * mi + g;
        ah[mi][0] = *reinterpret_cast<const uint32_t*>(&sxh[r][c]);
        ah[mi][1] = *reinterpret_cast<const uint32_t*>(&sxh[r + 8][c]);
        ah[mi][2] = *reinterpret_cast<const uint32_t*>(&sxh[r][c + 8]);
        ah[mi][3] = *reinterpret_cast<const uint32_t*>(&sxh[r + 8][c + 8]);
        al[mi][0] = *reinterpret_cast<const uint32_t*>(&sxl[r][c]);
        al[mi][1] = *reinterpret_cast<const uint32_t*>(&sxl[r + 8][c]);
        al[mi][2] = *reinterpret_cast<const uint32_t*>(&sxl[r][c + 8]);
        al[mi][3] = *reinterpret_cast<const uint32_t*>(&sxl[r + 8][c + 8]);
      }
#pragma unroll
      for (int ni = 0; ni < 4; ni++) {
        const int n = wn + 8 * ni + g;
        bh[ni][0] = *reinterpret_cast<const uint32_t*>(&swh[n][c]);
        bh[ni][1] = *reinterpret_cast<const uint32_t*>(&swh[n][c + 8]);
        if (LO) {
          bl[ni][0] = *reinterpret_cast<const uint32_t*>(&swl[n][c]);
          bl[ni][1] = *reinterpret_cast<const uint32_t*>(&swl[n][c + 8]);
        }
      }
#pragma unroll
      for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
          vl_mma(acc[mi][ni], al[mi], bh[ni]);
          if (LO) vl_mma(acc[mi][ni], ah[mi], bl[ni]);
          vl_mma(acc[mi][ni], ah[mi], bh[ni]);
        }
    }
  }
#pragma unroll
  for (int mi = 0; mi < 4; mi++)
#pragma unroll
    for (int ni = 0; ni < 4; ni++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int r = t0 + wm + 16 * mi + g + 8 * (k >> 1), o = o0 + wn + 8 * ni + 2 * t4 + (k & 1);
        if (r >= n_tok || o >= n_out) continue;
        float v = acc[mi][ni][k] + bias[o];
        float* dst = y + (size_t)r * n_out + o;
        if (epi == VL_GELU_TANH) v = vl_gelu_tanh(v);
        else if (epi == VL_GELU_ERF) v = vl_gelu_erf(v);
        else if (epi == VL_ADD) v = *dst + v;
        *dst = v;
      }
}

#define VL_KERNEL(NAME, LO)                                                                              \
  extern "C" __global__ void __launch_bounds__(256, 1)                                                 \
      NAME(const float* __restrict__ x, int n_tok, int n_in, const __half* __restrict__ whi,           \
           const __half* __restrict__ wlo, const float* __restrict__ bias, int n_out, float* y, int epi) { \
    sc_pdl_enter();                                                                                    \
    vl_body<LO>(x, n_tok, n_in, whi, wlo, bias, n_out, y, epi);                                        \
  }
VL_KERNEL(vis_linear, false)
VL_KERNEL(vis_linear_lo, true)

// -------------------------------------------------------------- vis_layernorm
// y[r] = (x[r] − mean)/sqrt(var + eps)·w + b, one block of 256 threads a row; the sums in
// f32 over a fixed tree (each thread's strided partial, then the warps', then warp 0's).
__device__ __forceinline__ float vis_block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // red is free (an earlier sum has been read)
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

extern "C" __global__ void __launch_bounds__(256) vis_layernorm(const float* __restrict__ x, int d,
                                                                const float* __restrict__ w,
                                                                const float* __restrict__ b, float eps,
                                                                float* __restrict__ y) {
  sc_pdl_enter();
  __shared__ float red[32];
  const float* xr = x + (size_t)blockIdx.x * d;
  float s = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i];
  const float mean = vis_block_sum(s, red) / (float)d;
  float q = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float c = xr[i] - mean;
    q += c * c;
  }
  const float inv = 1.0f / sqrtf(vis_block_sum(q, red) / (float)d + eps);
  float* yr = y + (size_t)blockIdx.x * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = (xr[i] - mean) * inv * w[i] + b[i];
}

// -------------------------------------------------------------- vis_pos_add
// x[i][d] += Σ_t wt[i][t]·pos[idx[i][t]][d] over the four bilinear taps, in the CPU's
// order (encoder::interp_taps).
extern "C" __global__ void vis_pos_add(float* __restrict__ x, int n, int h, const float* __restrict__ pos,
                                       const int* __restrict__ idx, const float* __restrict__ wt) {
  sc_pdl_enter();
  const size_t total = (size_t)n * h;
  for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
    const int i = (int)(e / h), dd = (int)(e % h);
    float v = x[e];
#pragma unroll
    for (int t = 0; t < 4; t++) v = v + wt[4 * i + t] * pos[(size_t)idx[4 * i + t] * h + dd];
    x[e] = v;
  }
}

// ------------------------------------------------------------------ vis_rope
// The 2-D rotary step on q and k of qkv ([n][3·h]): each head's pairs (j, j + hd/2)
// rotated by patch i's angle j (cos/sin [n][hd/2]), as encoder::Rope::apply.
extern "C" __global__ void vis_rope(float* __restrict__ qkv, int n, int h, int hd, const float* __restrict__ cs,
                                    const float* __restrict__ sn) {
  sc_pdl_enter();
  const int half = hd >> 1;
  const size_t per = (size_t)2 * h / 2;  // pairs a patch has over q and k: (2h)/2
  const size_t total = (size_t)n * per;
  for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
    const int i = (int)(e / per), p = (int)(e % per);
    const int head = p / half, j = p % half;  // head over q's then k's
    float* a = qkv + (size_t)i * 3 * h + (size_t)head * hd;
    const float c = cs[(size_t)i * half + j], s = sn[(size_t)i * half + j];
    const float u = a[j], v = a[j + half];
    a[j] = u * c - v * s;
    a[j + half] = v * c + u * s;
  }
}

// ------------------------------------------------------------------ vis_attn
// out[i - q0][head] = softmax_j(q_i·k_j·scale)·v over all n patches, for the queries i in
// [q0, q0 + nq) and q, k, v in qkv ([n][3·h]: q, then k, then v, each head's hd values
// together; each query's result is the same whatever range it is in), on the f16 tensor cores
// as vis_linear multiplies: every f32 operand split into f16 hi + lo, three products a
// pair (hi·hi, hi·lo, lo·hi), f32 accumulation. 4 warps a block, 16 queries a warp; keys
// in tiles of 64 (K as [key][dim], V transposed, both split, in shared memory); a flash
// attention's online softmax per row (each row's max and sum over the 4 lanes holding
// it), the division at the end. hd is padded with zeros to HDP (a multiple of 16).
#define VA_Q 64
#define VA_K 64
#define VA_THREADS 128

__device__ __forceinline__ uint32_t va_pack(__half a, __half b) {
  return (uint32_t)__half_as_ushort(a) | ((uint32_t)__half_as_ushort(b) << 16);
}

// hi and lo f16 halves of (x, y), each packed as a pair.
__device__ __forceinline__ void va_split2(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __half hx = __float2half_rn(x), hy = __float2half_rn(y);
  hi = va_pack(hx, hy);
  lo = va_pack(__float2half_rn(x - __half2float(hx)), __float2half_rn(y - __half2float(hy)));
}

template <int HD, int HDP>
__device__ __forceinline__ void va_body(const float* __restrict__ qkv, int n, int q0, int nq, int h,
                                        float scale, float* __restrict__ out) {
  constexpr int KS = HDP / 16;  // k-steps over the head's dims
  constexpr int NT = HDP / 8;   // 8-dim output tiles
  constexpr int LDK = HDP + 8;  // halves a shared K row holds
  constexpr int LDV = VA_K + 8; // halves a shared V^T row holds
  __shared__ __align__(16) __half skh[VA_K][LDK];
  __shared__ __align__(16) __half skl[VA_K][LDK];
  __shared__ __align__(16) __half svh[HDP][LDV];
  __shared__ __align__(16) __half svl[HDP][LDV];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int head = blockIdx.y;
  const int r0 = q0 + blockIdx.x * VA_Q + 16 * warp;  // the warp's first query
  const int qend = q0 + nq;                           // past the last query
  const size_t stride = (size_t)3 * h;
  const float* base = qkv + (size_t)head * HD;

  // The padded dims of K and V stay zero.
  if constexpr (HDP > HD) {
    constexpr int PAD = HDP > HD ? HDP - HD : 1;
    for (int e = tid; e < VA_K * PAD; e += VA_THREADS) {
      const int r = e / PAD, d = HD + e % PAD;
      skh[r][d] = skl[r][d] = __float2half_rn(0.0f);
      svh[d][r] = svl[d][r] = __float2half_rn(0.0f);
    }
  }

  // The warp's 16 queries as A fragments (rows g and g + 8), hi and lo.
  uint32_t qh[KS][4], ql[KS][4];
#pragma unroll
  for (int s = 0; s < KS; s++) {
#pragma unroll
    for (int part = 0; part < 4; part++) {
      const int r = r0 + g + 8 * (part & 1), d = 16 * s + 2 * t4 + 8 * (part >> 1);
      float2 v = make_float2(0.f, 0.f);
      if (r < qend && d < HD) v = *reinterpret_cast<const float2*>(base + (size_t)r * stride + d);
      va_split2(v.x, v.y, qh[s][part], ql[s][part]);
    }
  }

  float o[NT][4];
#pragma unroll
  for (int j = 0; j < NT; j++)
#pragma unroll
    for (int k = 0; k < 4; k++) o[j][k] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  constexpr int V4 = HD / 4;
  for (int j0 = 0; j0 < n; j0 += VA_K) {
    __syncthreads();  // the previous tile is consumed
    for (int e = tid; e < VA_K * V4; e += VA_THREADS) {
      const int r = e / V4, d = 4 * (e % V4), j = j0 + r;
      float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), vv = kv;
      if (j < n) {
        const float* row = base + (size_t)j * stride + d;
        kv = *reinterpret_cast<const float4*>(row + h);
        vv = *reinterpret_cast<const float4*>(row + 2 * h);
      }
      uint32_t a, b, c, dd;
      va_split2(kv.x, kv.y, a, b);
      va_split2(kv.z, kv.w, c, dd);
      *reinterpret_cast<uint2*>(&skh[r][d]) = make_uint2(a, c);
      *reinterpret_cast<uint2*>(&skl[r][d]) = make_uint2(b, dd);
      const float vf[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
      for (int q = 0; q < 4; q++) {
        const __half hi = __float2half_rn(vf[q]);
        svh[d + q][r] = hi;
        svl[d + q][r] = __float2half_rn(vf[q] - __half2float(hi));
      }
    }
    __syncthreads();

    // Scores of the warp's 16 rows against the tile's 64 keys.
    float sc[VA_K / 8][4];
#pragma unroll
    for (int nt = 0; nt < VA_K / 8; nt++) {
#pragma unroll
      for (int k = 0; k < 4; k++) sc[nt][k] = 0.0f;
      const int key = 8 * nt + g;
#pragma unroll
      for (int s = 0; s < KS; s++) {
        const int c = 16 * s + 2 * t4;
        uint32_t bh[2], bl[2];
        bh[0] = *reinterpret_cast<const uint32_t*>(&skh[key][c]);
        bh[1] = *reinterpret_cast<const uint32_t*>(&skh[key][c + 8]);
        bl[0] = *reinterpret_cast<const uint32_t*>(&skl[key][c]);
        bl[1] = *reinterpret_cast<const uint32_t*>(&skl[key][c + 8]);
        vl_mma(sc[nt], ql[s], bh);
        vl_mma(sc[nt], qh[s], bl);
        vl_mma(sc[nt], qh[s], bh);
      }
    }
    // Online softmax: row g holds sc[*][0..1], row g + 8 sc[*][2..3].
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < VA_K / 8; nt++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int key = j0 + 8 * nt + 2 * t4 + (k & 1);
        const float v = key < n ? sc[nt][k] * scale : -INFINITY;
        sc[nt][k] = v;
        mx[k >> 1] = fmaxf(mx[k >> 1], v);
      }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float mn = fmaxf(m[r], mx[r]);
      corr[r] = expf(m[r] - mn);
      m[r] = mn;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int j = 0; j < NT; j++) {
      o[j][0] *= corr[0];
      o[j][1] *= corr[0];
      o[j][2] *= corr[1];
      o[j][3] *= corr[1];
    }
#pragma unroll
    for (int nt = 0; nt < VA_K / 8; nt++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float p = expf(sc[nt][k] - m[k >> 1]);
        sc[nt][k] = p;
        l[k >> 1] += p;
      }
    // O += P·V: P's C fragments of key tiles 2s and 2s + 1 are the A fragment of k-step s.
#pragma unroll
    for (int s = 0; s < VA_K / 16; s++) {
      uint32_t ph[4], pl[4];
      va_split2(sc[2 * s][0], sc[2 * s][1], ph[0], pl[0]);
      va_split2(sc[2 * s][2], sc[2 * s][3], ph[1], pl[1]);
      va_split2(sc[2 * s + 1][0], sc[2 * s + 1][1], ph[2], pl[2]);
      va_split2(sc[2 * s + 1][2], sc[2 * s + 1][3], ph[3], pl[3]);
      const int c = 16 * s + 2 * t4;
#pragma unroll
      for (int j = 0; j < NT; j++) {
        const int dim = 8 * j + g;
        uint32_t bh[2], bl[2];
        bh[0] = *reinterpret_cast<const uint32_t*>(&svh[dim][c]);
        bh[1] = *reinterpret_cast<const uint32_t*>(&svh[dim][c + 8]);
        bl[0] = *reinterpret_cast<const uint32_t*>(&svl[dim][c]);
        bl[1] = *reinterpret_cast<const uint32_t*>(&svl[dim][c + 8]);
        vl_mma(o[j], pl, bh);
        vl_mma(o[j], ph, bl);
        vl_mma(o[j], ph, bh);
      }
    }
  }
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float t = l[r];
    t += __shfl_xor_sync(0xffffffffu, t, 1);
    t += __shfl_xor_sync(0xffffffffu, t, 2);
    inv[r] = 1.0f / t;
  }
#pragma unroll
  for (int j = 0; j < NT; j++)
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const int r = r0 + g + 8 * (k >> 1), d = 8 * j + 2 * t4 + (k & 1);
      if (r < qend && d < HD) out[(size_t)(r - q0) * h + (size_t)head * HD + d] = o[j][k] * inv[k >> 1];
    }
}

#define VA_KERNEL(HD, HDP)                                                                            \
  extern "C" __global__ void __launch_bounds__(VA_THREADS)                                           \
      vis_attn_hd##HD(const float* __restrict__ qkv, int n, int q0, int nq, int h, float scale,      \
                      float* __restrict__ out) {                                                      \
    sc_pdl_enter();                                                                                   \
    va_body<HD, HDP>(qkv, n, q0, nq, h, scale, out);                                                  \
  }
VA_KERNEL(16, 16)
VA_KERNEL(32, 32)
VA_KERNEL(64, 64)
VA_KERNEL(72, 80)
VA_KERNEL(80, 80)
