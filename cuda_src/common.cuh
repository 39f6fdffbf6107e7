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

// p, with how it was computed hidden from the compiler (no instruction): a pointer made of a kernel parameter plus
// an offset is then kept whole in a register pair, not rebuilt from the two at every address it is used in
template <class T> __device__ __forceinline__ T* opaque(T* p) {
#ifndef CUDA_EMU
  asm("" : "+l"(p));
#endif
  return p;
}

// x << D, or x >> -D for negative D
template <int D> __device__ __forceinline__ unsigned shift(unsigned x) { return D >= 0 ? x << (D & 31) : x >> (-D & 31); }

// (a & M) | c, one lop3 (look-up table 0xEA) whatever the operands: the C compiler's and + or of two immediates
// stays two instructions in SASS (LOP3 takes one immediate). c is the immediate C when given, else the register c
constexpr unsigned long long NO_IMM = ~0ull;
template <unsigned M, unsigned long long C = NO_IMM> __device__ __forceinline__ unsigned and_or(unsigned a, unsigned c = 0u) {
#ifdef CUDA_EMU
  return (a & M) | (C == NO_IMM ? c : unsigned(C));
#else
  unsigned r;
  if constexpr (C == NO_IMM)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(M), "r"(c));
  else
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(M), "n"(unsigned(C)));
  return r;
#endif
}

// the f16 bits of an integer 0 <= v < 2048 (exact), in both halves of a word
__host__ __device__ constexpr unsigned f16x2_int(int v) {
  int e = 0;
  while ((2 << e) <= v) ++e;
  const unsigned h = v ? unsigned(((e + 15) << 10) | ((v << (10 - e)) & 0x3FF)) : 0u;
  return h | (h << 16);
}
static_assert(f16x2_int(1024) == 0x64006400u && f16x2_int(64) == 0x54005400u && f16x2_int(1032) == 0x64086408u &&
              f16x2_int(72) == 0x54805480u && f16x2_int(16) == 0x4C004C00u && f16x2_int(1) == 0x3C003C00u, "f16x2_int");
// codes of W bits at bit B of both halves of x as the f16 pair 2^(10 - B) + q, exactly: one lop3 puts them under
// the exponent of 2^(10 - B), whose unit in the last place is 2^-B (B + W <= 10, so q fits that mantissa). The
// caller subtracts 2^(10 - B) (plus any offset of the format; exact) with one f16x2 subtraction.
template <int B, int W> __device__ __forceinline__ unsigned field_f16(unsigned x) {
  static_assert(B >= 0 && B + W <= 10, "the field fits the mantissa of 2^(10 - B)");
  constexpr unsigned m = ((1u << W) - 1u) << B;
  return and_or<m | (m << 16), f16x2_int(1 << (10 - B))>(x);
}
// the same with the exponent's pair from a register, kc[B / 2] = f16x2_int(1 << (10 - B)) (B even): the decode loop
// of moe_gemm_mma sets kc once, or'd with a zero ptxas cannot see, so it keeps them in registers (an immediate it
// moves into a register again every k-tile: LOP3 takes one immediate, and the mask is the other operand)
template <int B, int W> __device__ __forceinline__ unsigned field_f16(unsigned x, const unsigned* kc) {
  static_assert(B >= 0 && B % 2 == 0 && B + W <= 10, "the field fits the mantissa of 2^(10 - B)");
  constexpr unsigned m = ((1u << W) - 1u) << B;
  return and_or<m | (m << 16)>(x, kc[B / 2]);
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
// f16x2 products with one half of a word in both lanes: a * (s, s) + (z, z), s and z the low and high halves of
// sz; a * (h, h), h half H of w. The halves are put in both lanes by an f16 pack, which ptxas folds into the
// instruction's operand selects (HFMA2 / HMUL2 R.H0_H0, R.H1_H1 on sm_90: no byte permute)
__device__ __forceinline__ unsigned hfma2_lohi_bits(unsigned a, unsigned sz) {
#ifdef CUDA_EMU
  return hfma2_bits(a, __byte_perm(sz, 0u, 0x1010), __byte_perm(sz, 0u, 0x3232));
#else
  unsigned r;
  asm("{.reg .f16 l, h;\n.reg .b32 s, z;\nmov.b32 {l, h}, %2;\nmov.b32 s, {l, l};\nmov.b32 z, {h, h};\n"
      "fma.rn.f16x2 %0, %1, s, z;}" : "=r"(r) : "r"(a), "r"(sz));
  return r;
#endif
}
template <int H> __device__ __forceinline__ unsigned hmul2_half_bits(unsigned a, unsigned w) {
#ifdef CUDA_EMU
  return hmul2_bits(a, __byte_perm(w, 0u, H ? 0x3232 : 0x1010));
#else
  unsigned r;
  if constexpr (H)
    asm("{.reg .f16 l, h;\n.reg .b32 s;\nmov.b32 {l, h}, %2;\nmov.b32 s, {h, h};\nmul.rn.f16x2 %0, %1, s;}"
        : "=r"(r) : "r"(a), "r"(w));
  else
    asm("{.reg .f16 l, h;\n.reg .b32 s;\nmov.b32 {l, h}, %2;\nmov.b32 s, {l, l};\nmul.rn.f16x2 %0, %1, s;}"
        : "=r"(r) : "r"(a), "r"(w));
  return r;
#endif
}
