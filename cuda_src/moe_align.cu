// moe_align.cu: vLLM moe_align_block_size (toolkit/ref/moe_align.py), laid out in buffers sized by the
// upper bound so that nothing is read back to the host (the launch plan depends on shapes only).
//   ids int32 [T*A] (expert of each flat slot s = t*A + a), E experts, block_m ->
//   sorted_ids int32 [P_cap] (slots grouped by ascending expert, slot order kept within an expert, each expert's
//   run padded with the sentinel T*A to a multiple of block_m; every slot past the real layout P is the sentinel
//   too), expert_ids int32 [P_cap / block_m] (-1 for every block past the real ones), total int32 [1] = P.
//   P_cap = the worst case T*A + E*(block_m - 1) rounded up to whole blocks (at least one block); the reference's
//   layout is the prefix sorted_ids[:P], expert_ids[:P / block_m]. The kernels write every entry of every output
//   (the launcher may allocate them uninitialised).
// With an expert_map (fused_moe's, vLLM's: global expert id -> local index, -1 when not in this call), the ids are
// first remapped by moe_align_remap; a -1 slot equals no expert e >= 0, so the three kernels give it no block.
//   moe_align_remap    grid (ceil(T*A / ALIGN_THREADS)), block ALIGN_THREADS, one slot per thread:
//                      local[s] = expert_map[ids[s]], -1 where ids[s] lies outside [0, n_map) or the value outside
//                      [-1, E) (the host checks maps when it builds them; here nothing out of range is indexed).
// Three deterministic kernels (no atomics, so the order within an expert is the reference's):
//   moe_align_count    grid (E), block ALIGN_THREADS: counts[e] = #{s : ids[s] == e} (block reduction)
//   moe_align_offsets  grid (1), block 32: padded exclusive scan (lane 0) -> offsets [E+1], expert_ids of the
//                      real blocks, total; then the block's lanes write -1 into expert_ids[P / block_m :].
//   moe_align_scatter  grid (E), block ALIGN_THREADS: in-order compaction of expert e's slots (ballot + warp
//                      totals in shared memory, a running base), then the sentinel padding of expert e's run, and
//                      a 1/E share of the tail sorted_ids[P : P_cap] (sentinel).
// Each of the E blocks reads all T*A ids: cheap at decode and prefill sizes (ids are L2-resident).
// Launcher: toolkit/gpu/moe_align.py. Check: pytest tests/test_cuda_emulated.py -k align (exact prefix and padding,
//   both thread orders); the remap: pytest tests/test_expert_map.py.
#include "common.cuh"

constexpr int ALIGN_THREADS = 256;

__global__ void __launch_bounds__(ALIGN_THREADS)
moe_align_remap(const int* __restrict__ ids, int n, const int* __restrict__ expert_map, int n_map, int E,
                int* __restrict__ local) {
  const int s = blockIdx.x * ALIGN_THREADS + threadIdx.x;
  if (s >= n) return;
  const int g = ids[s];
  const int e = g >= 0 && g < n_map ? expert_map[g] : -1;
  local[s] = e >= 0 && e < E ? e : -1;
}

__global__ void __launch_bounds__(ALIGN_THREADS)
moe_align_count(const int* __restrict__ ids, int n, int* __restrict__ counts) {
  const int e = blockIdx.x;
  int c = 0;
  for (int s = threadIdx.x; s < n; s += ALIGN_THREADS) c += ids[s] == e;
  c = block_sum_int(c);
  if (threadIdx.x == 0) counts[e] = c;
}

__global__ void moe_align_offsets(const int* __restrict__ counts, int E, int block_m, int max_blocks,
                                  int* __restrict__ offsets, int* __restrict__ expert_ids, int* __restrict__ total) {
  __shared__ int real_blocks;
  if (threadIdx.x == 0) {
    int off = 0;
    for (int e = 0; e < E; ++e) {
      offsets[e] = off;
      const int padded = (counts[e] + block_m - 1) / block_m * block_m;
      for (int b = off / block_m; b < (off + padded) / block_m; ++b) expert_ids[b] = e;
      off += padded;
    }
    offsets[E] = off;
    *total = off;
    real_blocks = off / block_m;  // <= max_blocks: off <= T*A + E*(block_m - 1)
  }
  __syncthreads();
  for (int b = real_blocks + threadIdx.x; b < max_blocks; b += blockDim.x) expert_ids[b] = -1;  // no expert
}

__global__ void __launch_bounds__(ALIGN_THREADS)
moe_align_scatter(const int* __restrict__ ids, int n, const int* __restrict__ offsets, int p_cap,
                  int* __restrict__ sorted_ids) {
  __shared__ int warp_hits[ALIGN_THREADS / 32];
  __shared__ int running;  // slots of expert e written so far
  const int e = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int base = offsets[e], end = offsets[e + 1];
  if (threadIdx.x == 0) running = 0;
  __syncthreads();
  for (int start = 0; start < n; start += ALIGN_THREADS) {
    const int s = start + threadIdx.x;
    const bool hit = s < n && ids[s] == e;
    const unsigned m = __ballot_sync(FULL_MASK, hit);
    if (lane == 0) warp_hits[warp] = __popc(m);
    __syncthreads();
    int before = running;
    for (int w = 0; w < warp; ++w) before += warp_hits[w];
    if (hit) sorted_ids[base + before + __popc(m & ((1u << lane) - 1u))] = s;
    __syncthreads();  // everyone has read running and warp_hits
    if (threadIdx.x == 0)
      for (int w = 0; w < ALIGN_THREADS / 32; ++w) running += warp_hits[w];
    __syncthreads();
  }
  for (int j = base + running + threadIdx.x; j < end; j += ALIGN_THREADS) sorted_ids[j] = n;  // sentinel T*A
  // the tail past the real layout (offsets[E] = P), shared by the E blocks
  for (int j = offsets[gridDim.x] + e * ALIGN_THREADS + threadIdx.x; j < p_cap; j += gridDim.x * ALIGN_THREADS)
    sorted_ids[j] = n;
}
