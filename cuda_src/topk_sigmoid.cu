// topk_sigmoid.cu: the DeepSeek-V3 router (toolkit/ref/topk_sigmoid.py).
//   logits f32 [T, E], bias f32 [E] -> weights f32 [T, A], ids int32 [T, A]
//   s = sigmoid(logits); the choice ranks s + bias among the topk_group best of n_group groups (group score:
//   the sum of its two largest); weights are s of the chosen, renormalised (/ (sum + 1e-20)) when asked,
//   times scale.
// Mapping: one warp per token, ROUTE_WARPS tokens per block; s and s + bias staged in this warp's shared rows,
//   then route_pick (routing.cuh).
// Entry point: topk_sigmoid_kernel. Launcher: toolkit/gpu/topk_sigmoid.py.
// Check: pytest tests/test_cuda_emulated.py -k topk_sigmoid (CPU emulation), tests/test_cuda_gpu.py (GPU).
#include "routing.cuh"

__global__ void __launch_bounds__(32 * ROUTE_WARPS)
topk_sigmoid_kernel(const float* __restrict__ logits, const float* __restrict__ bias, float* __restrict__ weights,
                    int* __restrict__ ids, int T, int E, int A, int n_group, int topk_group, int renormalize,
                    float scale) {
  __shared__ float sel[ROUTE_WARPS][32 * ROUTE_PER_LANE], s[ROUTE_WARPS][32 * ROUTE_PER_LANE];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int t = blockIdx.x * ROUTE_WARPS + warp;
  if (t >= T) return;  // the whole warp leaves together
  for (int e = lane; e < E; e += 32) {
    const float p = 1.0f / (1.0f + expf(-logits[(size_t)t * E + e]));
    s[warp][e] = p;
    sel[warp][e] = p + bias[e];
  }
  __syncwarp();
  float* w = weights + (size_t)t * A;
  const float chosen = route_pick(sel[warp], s[warp], E, A, n_group, topk_group, true, w, ids + (size_t)t * A);
  if (lane == 0) {
    const float div = renormalize ? chosen + 1e-20f : 1.0f;
    for (int a = 0; a < A; ++a) w[a] = w[a] / div * scale;
  }
}
