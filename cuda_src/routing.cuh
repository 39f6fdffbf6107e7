// routing.cuh: the group-limited top-k shared by the grouped routers (topk_sigmoid.cu, topk_softmax_grouped.cu);
// the spec is keep_groups + the top-k of toolkit/ref/topk_sigmoid.py.
//   One warp per token. sel [E] (selection scores) and wsrc [E] (the weights to report) sit in this warp's
//   shared rows. Lane g < n_group scores group g (sum of its two largest, or its largest); topk_group rounds of
//   a warp argmax over (score, -group) pick the eligible groups (a bit mask); A rounds of a warp argmax over
//   (sel, -id) among eligible experts pick the ids. Ties: the lower group, the lower id.
#pragma once
#include "common.cuh"

constexpr int ROUTE_WARPS = 4;
constexpr int ROUTE_PER_LANE = 8;  // E <= 32 * ROUTE_PER_LANE = 256
constexpr int ROUTE_MAX_GROUPS = 32;

__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {  // largest value, then the lowest index
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
    const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
  }
}

// Writes ids[0..A) and weights[0..A) (lane 0); returns the sum of the chosen weights (every lane).
__device__ __forceinline__ float route_pick(const float* sel, const float* wsrc, int E, int A, int n_group,
                                            int topk_group, bool top2, float* weights, int* ids) {
  const int lane = threadIdx.x % 32;
  const float NEG_INF = __uint_as_float(0xff800000u);
  const int n = E / n_group;  // experts per group
  unsigned kept = FULL_MASK;
  if (n_group > 1 && topk_group < n_group) {
    float gs = NEG_INF;
    if (lane < n_group) {
      float a = NEG_INF, b = NEG_INF;
      for (int e = lane * n; e < lane * n + n; ++e) {
        const float v = sel[e];
        if (v > a) { b = a; a = v; } else if (v > b) { b = v; }
      }
      gs = top2 && n > 1 ? a + b : a;
    }
    kept = 0u;
    for (int r = 0; r < topk_group; ++r) {
      float bv = lane < n_group && !((kept >> lane) & 1u) ? gs : NEG_INF;
      int bg = lane < n_group && !((kept >> lane) & 1u) ? lane : 0x7fffffff;
      warp_argmax(bv, bg);
      kept |= 1u << bg;
    }
  }
  float v[ROUTE_PER_LANE];  // this lane's experts lane + 32 i; ineligible ones never win
  bool ok[ROUTE_PER_LANE];
#pragma unroll
  for (int i = 0; i < ROUTE_PER_LANE; ++i) {
    const int e = lane + 32 * i;
    ok[i] = e < E && ((kept >> (e / n)) & 1u);
    v[i] = ok[i] ? sel[e] : NEG_INF;
  }
  float chosen = 0.0f;
  for (int a = 0; a < A; ++a) {
    float bv = NEG_INF;
    int be = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i)
      if (ok[i] && (v[i] > bv || be == 0x7fffffff)) { bv = v[i]; be = lane + 32 * i; }  // ascending ids
    warp_argmax(bv, be);
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) ok[i] = ok[i] && lane + 32 * i != be;  // mask the winner
    const float w = wsrc[be];
    if (lane == 0) {
      weights[a] = w;
      ids[a] = be;
    }
    chosen += w;
  }
  return chosen;
}
