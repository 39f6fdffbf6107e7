// clip.cu: x f32 [n] clamped to [-c, c], in place (any shape, flattened; toolkit/ref/clip.py).
// Mapping: grid ceil(n / CLIP_THREADS), block CLIP_THREADS, one element per thread.
// Entry point: clip_kernel. Launcher: toolkit/gpu/clip.py. Contract: exact (fminf / fmaxf, as np.clip).
// Check: pytest tests/test_cuda_runtime_ops.py -k clip; memory-bound: 8*n bytes moved.
#include "common.cuh"

constexpr int CLIP_THREADS = 256;

__global__ void __launch_bounds__(CLIP_THREADS)
clip_kernel(float* __restrict__ x, float c, long long n) {
  const long long i = (long long)blockIdx.x * CLIP_THREADS + threadIdx.x;
  if (i < n) x[i] = fminf(fmaxf(x[i], -c), c);
}
