// positions.cu: a step's token positions and the cache lengths after it (toolkit/ref/positions.py).
//   lens int32 [B] (tokens each sequence holds; updated in place), lengths int32 [B] (valid new tokens),
//   T -> positions int32 [B, T] = lens[b] + t (padding slots too), then lens[b] += lengths[b].
// Mapping: one block of POS_THREADS per sequence: every thread reads lens[b], writes a strided run of t; after
//   a barrier thread 0 writes the new length (so no thread reads the updated value).
// Entry point: positions_kernel. Launcher: toolkit/gpu/positions.py. Contract: exact.
// Check: pytest tests/test_cuda_runtime_ops.py -k positions.
#include "common.cuh"

constexpr int POS_THREADS = 128;

__global__ void __launch_bounds__(POS_THREADS)
positions_kernel(int* __restrict__ lens, const int* __restrict__ lengths, int* __restrict__ positions, int T) {
  const int b = blockIdx.x;
  const int start = lens[b];
  for (int t = threadIdx.x; t < T; t += POS_THREADS) positions[(size_t)b * T + t] = start + t;
  __syncthreads();
  if (threadIdx.x == 0) lens[b] = start + lengths[b];
}
