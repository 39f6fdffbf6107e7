// mla_kv.cu: the row absorbed MLA caches per token (toolkit/ref/mla_kv.py).
//   kv f32 [N, r+dr] (latent, then rope key), norm_w f32 [r], positions int32 [N], inv_freq f32 [dr/2]
//   -> row f32 [N, r+dr]: rms_norm(kv[:, :r]) * norm_w, then the rope of kv[:, r:] (mla.cuh).
// Mapping: one block of MLA_KV_THREADS per token: block sum of squares, the normed latent, the rope pairs.
// Entry point: mla_kv_kernel. Launcher: toolkit/gpu/mla_kv.py. Check: pytest tests/test_cuda_emulated.py -k mla.
#include "mla.cuh"

constexpr int MLA_KV_THREADS = 256;

__global__ void __launch_bounds__(MLA_KV_THREADS)
mla_kv_kernel(const float* __restrict__ kv, const float* __restrict__ norm_w, const int* __restrict__ positions,
              const float* __restrict__ inv_freq, float* __restrict__ row, int r, int dr, float eps, float scale,
              int interleave) {
  const float* in = kv + (size_t)blockIdx.x * (r + dr);
  float* out = row + (size_t)blockIdx.x * (r + dr);
  float ss = 0.0f;
  for (int d = threadIdx.x; d < r; d += MLA_KV_THREADS) ss += in[d] * in[d];
  ss = block_sum(ss);
  const float denom = sqrtf(ss / float(r) + eps);
  for (int d = threadIdx.x; d < r; d += MLA_KV_THREADS) out[d] = in[d] / denom * norm_w[d];
  mla_rope_row(in + r, out + r, dr, (float)positions[blockIdx.x], inv_freq, scale, interleave);
}
