// common.cuh: device helpers shared by the kernels of cuda_src/ (warp/block reductions, f16 and e4m3 scalars).
//
// Reductions assume blockDim.x is a multiple of 32 (every launcher uses 128 or 256 threads) and that every
// thread of the block calls them (they contain __syncthreads). e4m3_encode is the saturating encoder of
// toolkit/formats/scalar.py (bit-identical to e4m3_encode_ref: clip to +-448, round to nearest even, NaN kept).
#pragma once
#include <cuda_fp16.h>

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}
__device__ __forceinline__ int warp_sum_int(int v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

// Block-wide sum / max: every thread gets the result. The shared scratch is re-used after a barrier.
template <bool IS_MAX>
__device__ __forceinline__ float block_reduce(float v) {
  __shared__ float part[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = IS_MAX ? warp_max(v) : warp_sum(v);
  if (lane == 0) part[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? part[lane] : (IS_MAX ? -3.402823466e38f : 0.0f);
  r = IS_MAX ? warp_max(r) : warp_sum(r);
  __syncthreads();  // part[] may be written again by the next call
  return r;
}
__device__ __forceinline__ float block_sum(float v) { return block_reduce<false>(v); }
__device__ __forceinline__ float block_max(float v) { return block_reduce<true>(v); }

__device__ __forceinline__ int block_sum_int(int v) {
  __shared__ int ipart[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum_int(v);
  if (lane == 0) ipart[warp] = v;
  __syncthreads();
  int r = warp_sum_int(lane < nwarps ? ipart[lane] : 0);
  __syncthreads();
  return r;
}

// little-endian f16 at any even byte offset (GGML block scales, affine scales/biases)
__device__ __forceinline__ float load_f16(const unsigned char* p) {
  return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

__device__ __forceinline__ unsigned char e4m3_encode(float x) {
  const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
  float a = fabsf(x);
  if (a != a) return (unsigned char)(sign | 0x7Fu);
  a = fminf(a, 448.0f);
  if (a < 0.015625f) return (unsigned char)(sign | (unsigned)__float2int_rn(a * 512.0f));  // subnormal: 2^-9 steps
  const unsigned b = __float_as_uint(a);
  const unsigned r = (b + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;  // RNE to 3 mantissa bits (carry bumps exponent)
  return (unsigned char)(sign | (r - 960u));                      // rebias the exponent: (127 - 7) << 3
}

__device__ __forceinline__ float e4m3_decode(unsigned char c) {
  const unsigned e = (c >> 3) & 0xFu, m = c & 7u;
  float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : float(m) * 0.001953125f;
  if ((c & 0x7Fu) == 0x7Fu) v = __uint_as_float(0x7fc00000u);
  return (c & 0x80u) ? -v : v;
}

// f16x2 arithmetic on raw 32-bit pairs (low half = element 0): one rounding each, as the hardware's
// sub.f16x2 / fma.rn.f16x2 / mul.rn.f16x2; emulated with exact double arithmetic and one rounding to f16
#ifdef CUDA_EMU
__device__ __forceinline__ unsigned f16x2_map(unsigned a, unsigned b, unsigned c, int fma) {
  unsigned r = 0;
  for (int i = 0; i < 2; ++i) {
    auto h = [&](unsigned x) { _Float16 f; unsigned short u = (unsigned short)(x >> (16 * i)); std::memcpy(&f, &u, 2); return double(f); };
    const _Float16 v = _Float16(fma == 1 ? h(a) * h(b) + h(c) : fma == 2 ? h(a) * h(b) : h(a) - h(b));
    unsigned short u;
    std::memcpy(&u, &v, 2);
    r |= unsigned(u) << (16 * i);
  }
  return r;
}
__device__ __forceinline__ unsigned hsub2_bits(unsigned a, unsigned b) { return f16x2_map(a, b, 0u, 0); }
__device__ __forceinline__ unsigned hfma2_bits(unsigned a, unsigned b, unsigned c) { return f16x2_map(a, b, c, 1); }
__device__ __forceinline__ unsigned hmul2_bits(unsigned a, unsigned b) { return f16x2_map(a, b, 0u, 2); }
#else
__device__ __forceinline__ unsigned hsub2_bits(unsigned a, unsigned b) {
  unsigned r;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ unsigned hfma2_bits(unsigned a, unsigned b, unsigned c) {
  unsigned r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ unsigned hmul2_bits(unsigned a, unsigned b) {
  unsigned r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
#endif
