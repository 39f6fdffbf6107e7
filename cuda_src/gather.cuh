// gather.cuh: the row gather shared by embedding.cu (table[ids]) and gather_rows.cu (x[rows]).
//
// dst[n] = src[idx[n]] for rows of D floats; an index outside [0, n_src) writes a row of zeros and reads nothing.
// Mapping: grid (N, ceil(D / (4 * GATHER_THREADS))), block GATHER_THREADS. The kernel picks its unit itself:
// a Vec4 (one 16-byte load and store) when D % 4 == 0 and both bases are 16-byte aligned (every row then starts
// on a 16-byte boundary), else one float; each thread copies units j, j + gridDim.y * GATHER_THREADS, ...
// (one Vec4, or four floats).
#pragma once
#include "common.cuh"

constexpr int GATHER_THREADS = 128;

struct alignas(16) Vec4 {  // compiles to ld.global.v4.f32 / st.global.v4.f32 (the emulator has no float4)
  float x, y, z, w;
};

template <class T>
__device__ __forceinline__ void gather_units(int r, bool valid, const float* __restrict__ src, float* __restrict__ dst,
                                             int D) {
  constexpr int W = sizeof(T) / sizeof(float);
  const T* s = reinterpret_cast<const T*>(src + (size_t)r * D);
  T* d = reinterpret_cast<T*>(dst + (size_t)blockIdx.x * D);
  for (int j = blockIdx.y * GATHER_THREADS + threadIdx.x; j < D / W; j += gridDim.y * GATHER_THREADS) {
    T v = {};
    if (valid) v = s[j];
    d[j] = v;
  }
}

__device__ __forceinline__ void gather_row(const int* __restrict__ idx, const float* __restrict__ src,
                                           float* __restrict__ dst, int n_src, int D) {
  const int r = idx[blockIdx.x];
  const bool valid = (unsigned)r < (unsigned)n_src;
  const bool vec = D % 4 == 0 && (((unsigned long long)src | (unsigned long long)dst) & 15ull) == 0;
  if (vec) gather_units<Vec4>(valid ? r : 0, valid, src, dst, D);
  else gather_units<float>(valid ? r : 0, valid, src, dst, D);
}
