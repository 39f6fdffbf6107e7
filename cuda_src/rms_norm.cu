// rms_norm.cu: x f32 [T, D], w f32 [D] -> y f32 [T, D], y = x / sqrt(mean(x^2) + eps) * w (toolkit/ref/rms_norm.py).
// Mapping: one block of NORM_THREADS per token: block sum of squares, then each thread scales a strided run of d.
// Entry point: rms_norm_kernel. Launcher: toolkit/gpu/rms_norm.py. Check: pytest tests/test_cuda_emulated.py -k rms.
#include "common.cuh"

constexpr int NORM_THREADS = 256;

__global__ void __launch_bounds__(NORM_THREADS)
rms_norm_kernel(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int D, float eps) {
  const float* row = x + (size_t)blockIdx.x * D;  // [D]
  float ss = 0.0f;
  for (int d = threadIdx.x; d < D; d += NORM_THREADS) ss += row[d] * row[d];
  ss = block_sum(ss);
  const float denom = sqrtf(ss / float(D) + eps);
  float* out = y + (size_t)blockIdx.x * D;
  for (int d = threadIdx.x; d < D; d += NORM_THREADS) out[d] = row[d] / denom * w[d];
}
