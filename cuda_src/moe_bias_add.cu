// moe_bias_add.cu: per-expert biases on slot-ordered GEMM rows (toolkit/ref/moe_bias_add.py), in place.
//   y f32 [T*A, N], bias f32 [E, N], ids int32 [T, A], weights f32 [T, A] or null ->
//   y[s] += w_s * bias[ids[s]] (w_s = 1 without weights); a slot with id -1 (an expert_map's expert not in this
//   call, toolkit/ref/fused_moe.py) is left alone.
// Mapping: grid (T*A, ceil(N / BIAS_THREADS)), block BIAS_THREADS; one element per thread.
// Entry point: moe_bias_add_kernel. Launcher: toolkit/gpu/moe_bias_add.py.
// Check: pytest tests/test_cuda_emulated.py -k moe_bias_add.
#include "common.cuh"

constexpr int BIAS_THREADS = 256;

__global__ void __launch_bounds__(BIAS_THREADS)
moe_bias_add_kernel(float* __restrict__ y, const float* __restrict__ bias, const int* __restrict__ ids,
                    const float* __restrict__ weights, int N) {
  const int s = blockIdx.x;
  const int n = blockIdx.y * BIAS_THREADS + threadIdx.x;
  const int e = ids[s];
  if (n >= N || e < 0) return;
  const float w = weights ? weights[s] : 1.0f;
  y[(size_t)s * N + n] += w * bias[(size_t)e * N + n];
}
