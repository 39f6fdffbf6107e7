// moe_combine.cu: y f32 [T*A, D] (one row per routed slot, routing weight applied) -> out f32 [T, D], the sum
// over each token's A slots (toolkit/ref/moe_combine.py).
// Mapping: grid (T, ceil(D / COMBINE_THREADS)), block COMBINE_THREADS, one output element per thread, the A
// slots summed in slot order.
// Entry point: moe_combine_kernel. Launcher: toolkit/gpu/moe_combine.py. Check: pytest tests/test_cuda_emulated.py -k combine.
#include "common.cuh"

constexpr int COMBINE_THREADS = 256;

__global__ void __launch_bounds__(COMBINE_THREADS)
moe_combine_kernel(const float* __restrict__ y, float* __restrict__ out, int D, int A) {
  const int d = blockIdx.y * COMBINE_THREADS + threadIdx.x;
  if (d >= D) return;
  const float* src = y + (size_t)blockIdx.x * A * D + d;  // slot rows t*A .. t*A + A-1
  float acc = 0.0f;
  for (int a = 0; a < A; ++a) acc += src[(size_t)a * D];
  out[(size_t)blockIdx.x * D + d] = acc;
}
