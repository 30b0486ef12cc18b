// Host-side check of kernels/sc_formats.cuh: runs the kernels' own per-sub-block decode
// and contribution functions (compiled for the CPU, with the portable versions of the
// intrinsics) in the canonical order a matvec warp uses, and the per-element
// dequantization of the embedding kernel. tests/host_formats.rs feeds it rows made by
// the quant crate and compares the results with quant::dot / dequantize_row bit for
// bit. Built with -ffp-contract=off so that no float operation is fused.
//
// usage: host_formats IN OUT
//   IN:  i32 ty, n_rows, n_cols, row_bytes; weights [n_rows·row_bytes];
//        f32 x [n_cols]; i8 qs [n_cols]; f32 d [n_cols/32]; i32 sums [n_cols/32]
//   OUT: f32 dot [n_rows]; f32 dequant [n_rows·n_cols]
#include <stdio.h>
#include <stdlib.h>

#include "sc_formats.cuh"

static void die(const char* m) {
  fprintf(stderr, "host_formats: %s\n", m);
  exit(2);
}

template <class W>
static float qdot(const uint8_t* row, int n_sub, const int8_t* qs, const float* d, const int* sums,
                  void (*load)(const uint8_t*, int, W&), float (*contrib)(const W&, const uint32_t*, float, int)) {
  float acc[32];
  for (int lane = 0; lane < 32; lane++) {
    acc[lane] = 0.0f;
    for (int s = lane; s < n_sub; s += 32) {
      W w;
      load(row, s, w);
      uint32_t a[8];
      memcpy(a, qs + 32 * s, 32);
      acc[lane] = sc_add(acc[lane], contrib(w, a, d[s], sums[s]));
    }
  }
  for (int w = 16; w > 0; w >>= 1)
    for (int l = 0; l < w; l++) acc[l] = sc_add(acc[l], acc[l + w]);
  return acc[0];
}

static float fdot(const uint8_t* row, int n_cols, const float* x, float (*get)(const uint8_t*, int)) {
  float acc[32];
  for (int lane = 0; lane < 32; lane++) {
    acc[lane] = 0.0f;
    for (int i = lane; i < n_cols; i += 32) acc[lane] = sc_fma(get(row, i), x[i], acc[lane]);
  }
  for (int w = 16; w > 0; w >>= 1)
    for (int l = 0; l < w; l++) acc[l] = sc_add(acc[l], acc[l + w]);
  return acc[0];
}

int main(int argc, char** argv) {
  if (argc != 3) die("usage: host_formats IN OUT");
  FILE* f = fopen(argv[1], "rb");
  if (!f) die("cannot open input");
  int32_t hdr[4];
  if (fread(hdr, 4, 4, f) != 4) die("short header");
  const int ty = hdr[0], n_rows = hdr[1], n_cols = hdr[2], row_bytes = hdr[3];
  const int n_sub = n_cols / 32;
  // One spare byte in front so that rows can start at an odd offset from malloc's
  // alignment when the caller asks for it (the row bytes are what they are).
  uint8_t* w = (uint8_t*)malloc((size_t)n_rows * row_bytes + 16);
  float* x = (float*)malloc(4 * (size_t)n_cols);
  int8_t* qs = (int8_t*)malloc((size_t)n_cols);
  float* d = (float*)malloc(4 * (size_t)n_sub);
  int* sums = (int*)malloc(4 * (size_t)n_sub);
  if (fread(w, 1, (size_t)n_rows * row_bytes, f) != (size_t)n_rows * row_bytes) die("short weights");
  if (fread(x, 4, n_cols, f) != (size_t)n_cols) die("short x");
  if (fread(qs, 1, n_cols, f) != (size_t)n_cols) die("short qs");
  if (fread(d, 4, n_sub, f) != (size_t)n_sub) die("short d");
  if (fread(sums, 4, n_sub, f) != (size_t)n_sub) die("short sums");
  fclose(f);

  FILE* o = fopen(argv[2], "wb");
  if (!o) die("cannot open output");
  for (int r = 0; r < n_rows; r++) {
    const uint8_t* row = w + (size_t)r * row_bytes;
    float v;
    switch (ty) {
      case SC_T_F32: v = fdot(row, n_cols, x, sc_get_f32); break;
      case SC_T_F16: v = fdot(row, n_cols, x, sc_get_f16); break;
      case SC_T_BF16: v = fdot(row, n_cols, x, sc_get_bf16); break;
      case SC_T_Q8_0: v = qdot<WQ8_0>(row, n_sub, qs, d, sums, sc_load_q8_0, sc_contrib_q8_0); break;
      case SC_T_Q4_0: v = qdot<WQ4_0>(row, n_sub, qs, d, sums, sc_load_q4_0, sc_contrib_q4_0); break;
      case SC_T_Q4_K: v = qdot<WK>(row, n_sub, qs, d, sums, sc_load_q4_k, sc_contrib_k); break;
      case SC_T_Q5_K: v = qdot<WK>(row, n_sub, qs, d, sums, sc_load_q5_k, sc_contrib_k); break;
      case SC_T_Q6_K: v = qdot<WQ6_K>(row, n_sub, qs, d, sums, sc_load_q6_k, sc_contrib_q6_k); break;
      case SC_T_IQ4_XS: v = qdot<WIQ4>(row, n_sub, qs, d, sums, sc_load_iq4_xs, sc_contrib_iq4_xs); break;
#define LB_CASE(CODE, NAME, LOAD, CONTRIB) \
  case CODE: v = qdot<WLB>(row, n_sub, qs, d, sums, LOAD, CONTRIB); break;
      SC_LOWBIT_TYPES(LB_CASE)
#undef LB_CASE
      default: die("unknown type code");
    }
    fwrite(&v, 4, 1, o);
  }
  for (int r = 0; r < n_rows; r++) {
    const uint8_t* row = w + (size_t)r * row_bytes;
    for (int i = 0; i < n_cols; i++) {
      const float v = ty >= SC_T_LOWBIT_FIRST ? sc_dequant_lb(ty, row, i) : sc_dequant(ty, row, i);
      fwrite(&v, 4, 1, o);
    }
  }
  fclose(o);
  return 0;
}
