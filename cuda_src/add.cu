// add.cu: the residual connection in place, h f32 [n] += y f32 [n] (any shape, flattened; toolkit/ref/add.py).
// Mapping: grid ceil(n / ADD_THREADS), block ADD_THREADS, one element per thread.
// Entry point: add_kernel. Launcher: toolkit/gpu/add.py. Contract: exact (one f32 addition, as NumPy).
// Check: pytest tests/test_cuda_runtime_ops.py -k add; memory-bound: 12*n bytes moved.
#include "common.cuh"

constexpr int ADD_THREADS = 256;

__global__ void __launch_bounds__(ADD_THREADS)
add_kernel(float* __restrict__ h, const float* __restrict__ y, long long n) {
  const long long i = (long long)blockIdx.x * ADD_THREADS + threadIdx.x;
  if (i < n) h[i] += y[i];
}
