// gated_add.cu: the MoE block's output added to the residual in place (toolkit/ref/gated_add.py, Qwen2-MoE):
//   h f32 [R, C] += y f32 [R, C] + s f32 [R, C] / (1 + exp(-g f32 [R]))
//   y: the routed experts' sum; s: the shared expert's output, gated by sigmoid(g). y or s may be a null pointer
//   (absent; g is not read without s). The operations in the reference's order: v = y + s / d, then h + v.
// Mapping: grid (R, ceil(C / GATED_THREADS)), block GATED_THREADS, one element per thread.
// Entry point: gated_add_kernel. Launcher: toolkit/gpu/gated_add.py.
// Tolerance: expf against NumPy's exp (a few ulp of the gate): |err| <= 1e-6 * (|h| + |y| + |s|) (measured 2.1e-7).
// Check: pytest tests/test_cuda_runtime_ops.py -k gated_add.
#include "common.cuh"

constexpr int GATED_THREADS = 256;

__global__ void __launch_bounds__(GATED_THREADS)
gated_add_kernel(float* __restrict__ h, const float* __restrict__ y, const float* __restrict__ s,
                 const float* __restrict__ g, int C) {
  const int c = blockIdx.y * GATED_THREADS + threadIdx.x;
  if (c >= C) return;
  const size_t i = (size_t)blockIdx.x * C + c;
  float v = y ? y[i] : 0.0f;
  if (s) v += s[i] / (1.0f + expf(-g[blockIdx.x]));
  h[i] += v;
}
