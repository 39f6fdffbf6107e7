// mla.cuh: the rope of absorbed MLA's rows (shared by mla_q.cu and mla_kv.cu), toolkit/ref/mla_q.py's spec:
//   the dr rope dims of a row, read as interleaved pairs (x[2i], x[2i+1]) or rotate-half pairs (x[i], x[i + dr/2]),
//   written in rotate-half order: out[i] = x1 c - x2 s, out[i + dr/2] = x2 c + x1 s, c/s = cos/sin(pos * inv_freq[i])
//   times scale, each product rounded on its own (as rope.cu).
#pragma once
#include "common.cuh"

__device__ __forceinline__ void mla_rope_row(const float* __restrict__ in, float* __restrict__ out, int dr,
                                             float pos, const float* __restrict__ inv_freq, float scale,
                                             int interleave) {
  const int half = dr / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    c = __fmul_rn(c, scale);
    s = __fmul_rn(s, scale);
    const float x1 = interleave ? in[2 * i] : in[i], x2 = interleave ? in[2 * i + 1] : in[i + half];
    out[i] = __fmul_rn(x1, c) - __fmul_rn(x2, s);
    out[i + half] = __fmul_rn(x2, c) + __fmul_rn(x1, s);
  }
}
