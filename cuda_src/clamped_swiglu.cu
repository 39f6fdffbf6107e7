// clamped_swiglu.cu: gpt-oss's expert activation (toolkit/ref/clamped_swiglu.py).
//   x f32 [T, 2I] -> out f32 [T, I]: g = min(x[:, :I], limit), u = clip(x[:, I:], -limit, limit),
//   out = (u + 1) * g * sigmoid(alpha * g).
// Mapping: as silu_and_mul.cu: grid (T, ceil(I / (SWIGLU_THREADS * SWIGLU_PER_THREAD))), block SWIGLU_THREADS.
// Entry point: clamped_swiglu_kernel. Launcher: toolkit/gpu/clamped_swiglu.py.
// Check: pytest tests/test_cuda_emulated.py -k clamped_swiglu.
#include "common.cuh"

constexpr int SWIGLU_THREADS = 256;
constexpr int SWIGLU_PER_THREAD = 4;

__global__ void __launch_bounds__(SWIGLU_THREADS)
clamped_swiglu_kernel(const float* __restrict__ x, float* __restrict__ out, int I, float alpha, float limit) {
  const float* g = x + (size_t)blockIdx.x * 2 * I;  // [I] gate
  const float* u = g + I;                            // [I] up
  float* o = out + (size_t)blockIdx.x * I;
  const int j0 = blockIdx.y * SWIGLU_THREADS * SWIGLU_PER_THREAD + threadIdx.x;
#pragma unroll
  for (int r = 0; r < SWIGLU_PER_THREAD; ++r) {
    const int j = j0 + r * SWIGLU_THREADS;
    if (j < I) {
      const float gv = fminf(g[j], limit);
      const float uv = fminf(fmaxf(u[j], -limit), limit);
      o[j] = (uv + 1.0f) * (gv / (1.0f + expf(-alpha * gv)));
    }
  }
}
