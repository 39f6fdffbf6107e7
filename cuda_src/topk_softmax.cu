// topk_softmax.cu: the router (toolkit/ref/topk_softmax.py).
//   logits f32 [T, E] -> weights f32 [T, A], ids int32 [T, A]
//   softmax over E in f32; the A largest probabilities in descending order, ties -> the lower expert id;
//   optionally renormalised so the A weights sum to 1.
// Mapping: one warp per token, TOPK_WARPS tokens per block (grid = ceil(T / TOPK_WARPS), block = 32*TOPK_WARPS);
//   lane l holds experts l, l+32, ... (E <= 32 * TOPK_PER_LANE = 256) in registers; max/sum by xor-shuffle;
//   A rounds of a warp argmax over (p, -id), the winner masked out.
// Entry point: topk_softmax_kernel. Launcher: toolkit/gpu/topk_softmax.py.
// Check: pytest tests/test_cuda_emulated.py -k topk (CPU emulation), tests/test_cuda_gpu.py (GPU);
//   registers: pytest tests/test_cuda_compile.py.
#include "common.cuh"

constexpr int TOPK_WARPS = 4;
constexpr int TOPK_PER_LANE = 8;

__global__ void __launch_bounds__(32 * TOPK_WARPS)
topk_softmax_kernel(const float* __restrict__ logits, float* __restrict__ weights, int* __restrict__ ids,
                    int T, int E, int A, int renormalize) {
  const int lane = threadIdx.x % 32;
  const int t = blockIdx.x * TOPK_WARPS + threadIdx.x / 32;
  if (t >= T) return;  // the whole warp leaves together
  const float* row = logits + (size_t)t * E;  // [E]
  const float NEG_INF = __uint_as_float(0xff800000u);

  float p[TOPK_PER_LANE];  // this lane's experts lane + 32 i
  float mx = NEG_INF;
#pragma unroll
  for (int i = 0; i < TOPK_PER_LANE; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? row[e] : NEG_INF;
    mx = fmaxf(mx, p[i]);
  }
  mx = warp_max(mx);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < TOPK_PER_LANE; ++i) {
    p[i] = lane + 32 * i < E ? expf(p[i] - mx) : 0.0f;
    sum += p[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < TOPK_PER_LANE; ++i) p[i] = lane + 32 * i < E ? p[i] / sum : -1.0f;  // -1: never chosen

  float chosen = 0.0f;
  for (int a = 0; a < A; ++a) {
    float bv = -2.0f;
    int be = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < TOPK_PER_LANE; ++i)
      if (p[i] > bv) { bv = p[i]; be = lane + 32 * i; }  // ascending ids: strict > keeps the lower id
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
      const int oe = __shfl_xor_sync(FULL_MASK, be, o);
      if (ov > bv || (ov == bv && oe < be)) { bv = ov; be = oe; }
    }
#pragma unroll
    for (int i = 0; i < TOPK_PER_LANE; ++i) p[i] = lane + 32 * i == be ? -1.0f : p[i];  // mask the winner
    if (lane == 0) {
      weights[(size_t)t * A + a] = bv;
      ids[(size_t)t * A + a] = be;
    }
    chosen += bv;
  }
  if (renormalize && lane == 0)
    for (int a = 0; a < A; ++a) weights[(size_t)t * A + a] /= chosen;
}
