// fp8_act_quant.cu: per-token e4m3 quantization of activations for W8A8 GEMMs
// (toolkit/formats/fp8.py fp8_act_quant_ref): x f32 [T, K] -> q uint8 [T, K] (e4m3fn codes), s f32 [T];
//   s = absmax(row) / 448, q = e4m3(x / (s or 1)), saturating at +-448; bit-identical to the reference.
// Mapping: one block of ACTQ_THREADS per token: block max of |x|, then each thread encodes a strided run of k.
// Entry point: fp8_act_quant_kernel. Launcher: toolkit/gpu/fp8_act_quant.py.
// Check: pytest tests/test_cuda_emulated.py -k fp8 (exact codes and scales).
#include "common.cuh"

constexpr int ACTQ_THREADS = 256;

__global__ void __launch_bounds__(ACTQ_THREADS)
fp8_act_quant_kernel(const float* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scales, int K) {
  const float* row = x + (size_t)blockIdx.x * K;  // [K]
  float amax = 0.0f;
  for (int k = threadIdx.x; k < K; k += ACTQ_THREADS) amax = fmaxf(amax, fabsf(row[k]));
  amax = block_max(amax);
  const float s = amax / 448.0f;
  if (threadIdx.x == 0) scales[blockIdx.x] = s;
  const float div = s != 0.0f ? s : 1.0f;
  unsigned char* out = q + (size_t)blockIdx.x * K;
  for (int k = threadIdx.x; k < K; k += ACTQ_THREADS) out[k] = e4m3_encode(row[k] / div);
}
