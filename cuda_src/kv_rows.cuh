// kv_rows.cuh: the KV cache row formats (f32 / q8_0 / q4_0), defined once for kv_store.cu and kv_attention.cu.
//
// A cache row is one token of one KV head: hd values stored as hd/32 blocks of BLOCK_BYTES bytes
// (toolkit/model/kv_cache.py: store [B, Hkv, S, hd/32 * BLOCK_BYTES]); f32 rows are "blocks" of 32 floats.
// Warp mapping: lane l owns element l of a block of 32 (the q4_0 nibble layout: element j < 16 is the low
// nibble of byte j, element j + 16 the high nibble of byte j).
//   load(blk, lane)        -> the f32 value of element `lane` (dequant exactly as toolkit/formats/ggml.py)
//   store(x, blk, lane)    quantize the warp's 32 values into one block (every lane of the warp must call it:
//                          it contains shuffles); byte-identical to toolkit.ref.kv_store / PyPI gguf:
//     q8_0: d = absmax / 127, q = round_half_away(x * (1 / d));
//     q4_0: m = the signed value of largest magnitude (first index on a tie), d = m / -8,
//           q = min(15, trunc(x * (1 / d) + 8.5)) in f32 (no FMA contraction: __fmul_rn / __fadd_rn).
//   scale f16 by __float2half_rn (round to nearest even, as numpy's astype(float16)).
#pragma once
#include "common.cuh"

struct F32Row {
  static constexpr int BLOCK_BYTES = 128;
  __device__ __forceinline__ static float load(const unsigned char* blk, int lane) {
    return reinterpret_cast<const float*>(blk)[lane];
  }
  __device__ __forceinline__ static void store(float x, unsigned char* blk, int lane) {
    reinterpret_cast<float*>(blk)[lane] = x;
  }
};

__device__ __forceinline__ void store_f16(unsigned char* p, float d) {
  const unsigned short h = __half_as_ushort(__float2half_rn(d));
  p[0] = (unsigned char)(h & 0xFF);
  p[1] = (unsigned char)(h >> 8);
}

struct Q8_0Row {  // {f16 d; int8 qs[32]}
  static constexpr int BLOCK_BYTES = 34;
  __device__ __forceinline__ static float load(const unsigned char* blk, int lane) {
    return float((signed char)blk[2 + lane]) * load_f16(blk);
  }
  __device__ __forceinline__ static void store(float x, unsigned char* blk, int lane) {
    const float amax = warp_max(fabsf(x));
    const float d = amax / 127.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = (int)roundf(__fmul_rn(x, inv));  // roundf: half away from zero
    blk[2 + lane] = (unsigned char)(signed char)q;
    if (lane == 0) store_f16(blk, d);
  }
};

struct Q4_0Row {  // {f16 d; u8 qs[16]}
  static constexpr int BLOCK_BYTES = 18;
  __device__ __forceinline__ static float load(const unsigned char* blk, int lane) {
    const int byte = blk[2 + (lane & 15)];
    return float((lane < 16 ? (byte & 15) : (byte >> 4)) - 8) * load_f16(blk);
  }
  __device__ __forceinline__ static void store(float x, unsigned char* blk, int lane) {
    float a = fabsf(x);  // argmax |x|, first index on a tie: (a, i) reduced with "larger a, else smaller i"
    int i = lane;
    for (int o = 16; o > 0; o >>= 1) {
      const float oa = __shfl_xor_sync(FULL_MASK, a, o);
      const int oi = __shfl_xor_sync(FULL_MASK, i, o);
      if (oa > a || (oa == a && oi < i)) { a = oa; i = oi; }
    }
    const float m = __shfl_sync(FULL_MASK, x, i);  // signed
    const float d = m / -8.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = min(15, max(0, (int)__fadd_rn(__fmul_rn(x, inv), 8.5f)));  // int cast truncates
    const int hi = __shfl_down_sync(FULL_MASK, q, 16);  // lane j < 16 packs elements j and j + 16
    if (lane < 16) blk[2 + lane] = (unsigned char)(q | (hi << 4));
    if (lane == 0) store_f16(blk, d);
  }
};
