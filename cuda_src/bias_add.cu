// bias_add.cu: x f32 [R, C] += b f32 [C] in place (the q/k/v biases; toolkit/ref/bias_add.py).
// Mapping: grid (R, ceil(C / BIAS_THREADS)), block BIAS_THREADS, one element per thread.
// Entry point: bias_add_kernel. Launcher: toolkit/gpu/bias_add.py. Contract: exact (one f32 addition).
// Check: pytest tests/test_cuda_runtime_ops.py -k bias_add.
#include "common.cuh"

constexpr int BIAS_THREADS = 256;

__global__ void __launch_bounds__(BIAS_THREADS)
bias_add_kernel(float* __restrict__ x, const float* __restrict__ b, int C) {
  const int c = blockIdx.y * BIAS_THREADS + threadIdx.x;
  if (c < C) x[(size_t)blockIdx.x * C + c] += b[c];
}
