// topk_softmax_grouped.cu: the DeepSeek-V2 router (toolkit/ref/topk_softmax_grouped.py).
//   logits f32 [T, E] -> weights f32 [T, A], ids int32 [T, A]
//   p = softmax(logits); the A largest p among the topk_group best of n_group groups (group score: its
//   largest p), times scale; never renormalised.
// Mapping: one warp per token, ROUTE_WARPS tokens per block; max/sum by xor-shuffle, p staged in this warp's
//   shared row, then route_pick (routing.cuh).
// Entry point: topk_softmax_grouped_kernel. Launcher: toolkit/gpu/topk_softmax_grouped.py.
// Check: pytest tests/test_cuda_emulated.py -k topk_softmax_grouped (CPU emulation), tests/test_cuda_gpu.py (GPU).
#include "routing.cuh"

__global__ void __launch_bounds__(32 * ROUTE_WARPS)
topk_softmax_grouped_kernel(const float* __restrict__ logits, float* __restrict__ weights, int* __restrict__ ids,
                            int T, int E, int A, int n_group, int topk_group, float scale) {
  __shared__ float p[ROUTE_WARPS][32 * ROUTE_PER_LANE];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int t = blockIdx.x * ROUTE_WARPS + warp;
  if (t >= T) return;  // the whole warp leaves together
  const float* row = logits + (size_t)t * E;
  float mx = __uint_as_float(0xff800000u);
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, row[e]);
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int e = lane; e < E; e += 32) {
    p[warp][e] = expf(row[e] - mx);
    sum += p[warp][e];
  }
  sum = warp_sum(sum);
  for (int e = lane; e < E; e += 32) p[warp][e] = p[warp][e] / sum;
  __syncwarp();
  float* w = weights + (size_t)t * A;
  route_pick(p[warp], p[warp], E, A, n_group, topk_group, false, w, ids + (size_t)t * A);
  if (lane == 0)
    for (int a = 0; a < A; ++a) w[a] = w[a] * scale;
}
