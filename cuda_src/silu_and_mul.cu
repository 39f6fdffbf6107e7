// silu_and_mul.cu: x f32 [T, 2I] -> out f32 [T, I], out = silu(x[:, :I]) * x[:, I:] (toolkit/ref/silu_and_mul.py).
// Mapping: grid (T, ceil(I / (SILU_THREADS * SILU_PER_THREAD))), block SILU_THREADS; each thread a strided run of j.
// Entry point: silu_and_mul_kernel. Launcher: toolkit/gpu/silu_and_mul.py.
// Check: pytest tests/test_cuda_emulated.py -k silu; memory-bound: 12 bytes moved per output (bench: GB/s = 12*T*I / t).
#include "common.cuh"

constexpr int SILU_THREADS = 256;
constexpr int SILU_PER_THREAD = 4;

__global__ void __launch_bounds__(SILU_THREADS)
silu_and_mul_kernel(const float* __restrict__ x, float* __restrict__ out, int I) {
  const float* g = x + (size_t)blockIdx.x * 2 * I;  // [I] gate
  const float* u = g + I;                            // [I] up
  float* o = out + (size_t)blockIdx.x * I;
  const int j0 = blockIdx.y * SILU_THREADS * SILU_PER_THREAD + threadIdx.x;
#pragma unroll
  for (int r = 0; r < SILU_PER_THREAD; ++r) {
    const int j = j0 + r * SILU_THREADS;
    if (j < I) {
      const float gv = g[j];
      o[j] = gv / (1.0f + expf(-gv)) * u[j];
    }
  }
}
