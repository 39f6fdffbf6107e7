// nll.cu: negative log-likelihood of each target, for perplexity on the device (toolkit/ref/nll.py).
//   logits f32 [N, V], targets int32 [N] -> out f32 [N] = logsumexp(logits[n]) - logits[n, targets[n]],
//   computed as (m - x_t) + log(sum(exp(x - m))) with m the row max; a target outside [0, V) gives NaN.
// Mapping: one block of NLL_THREADS per row: block max, then block sum of expf(x - m) (strided runs of V).
// Entry point: nll_kernel. Launcher: toolkit/gpu/nll.py.
// Tolerance (f32 sums and expf against the f64 reference): |err| <= 2e-6 + 2e-6 * |nll| (measured: 1.2e-7
//   relative, one ulp of the result, for V up to 262144).
// Check: pytest tests/test_cuda_runtime_ops.py -k nll; registers: pytest tests/test_cuda_compile.py -k nll.
#include "common.cuh"

constexpr int NLL_THREADS = 256;

__global__ void __launch_bounds__(NLL_THREADS)
nll_kernel(const float* __restrict__ logits, const int* __restrict__ targets, float* __restrict__ out, int V) {
  const float* row = logits + (size_t)blockIdx.x * V;  // [V]
  float m = -3.402823466e38f;
  for (int v = threadIdx.x; v < V; v += NLL_THREADS) m = fmaxf(m, row[v]);
  m = block_max(m);
  float sum = 0.0f;
  for (int v = threadIdx.x; v < V; v += NLL_THREADS) sum += expf(row[v] - m);
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    const int t = targets[blockIdx.x];
    out[blockIdx.x] = (unsigned)t < (unsigned)V ? (m - row[t]) + logf(sum) : __uint_as_float(0x7fc00000u);
  }
}
