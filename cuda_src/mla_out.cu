// mla_out.cu: absorbed MLA's attention output back to per-head values (toolkit/ref/mla_out.py).
//   att f32 [N, H, r+dr] (the first r values of each head are the latent output), w_uv f32 [H, r, dv]
//   -> out f32 [N, H*dv]: out[n, h*dv + j] = att[n, h, :r] @ w_uv[h][:, j].
// Mapping: grid (N, H), block MLA_OUT_THREADS: the head's r latent values staged in shared memory, thread j
//   computes columns j, j + MLA_OUT_THREADS, ... (w_uv rows read coalesced across threads).
// Entry point: mla_out_kernel. Launcher: toolkit/gpu/mla_out.py. Contract: r <= MLA_MAX_R.
// Check: pytest tests/test_cuda_emulated.py -k mla.
#include "common.cuh"

constexpr int MLA_OUT_THREADS = 128;
constexpr int MLA_MAX_R = 1024;

__global__ void __launch_bounds__(MLA_OUT_THREADS)
mla_out_kernel(const float* __restrict__ att, const float* __restrict__ w_uv, float* __restrict__ out, int H,
               int r, int c, int dv) {
  __shared__ float lat[MLA_MAX_R];
  const int n = blockIdx.x, h = blockIdx.y;
  const float* a = att + ((size_t)n * H + h) * c;  // [c], the first r used
  for (int d = threadIdx.x; d < r; d += MLA_OUT_THREADS) lat[d] = a[d];
  __syncthreads();
  const float* w = w_uv + (size_t)h * r * dv;  // [r, dv]
  float* o = out + ((size_t)n * H + h) * dv;
  for (int j = threadIdx.x; j < dv; j += MLA_OUT_THREADS) {
    float acc = 0.0f;
    for (int d = 0; d < r; ++d) acc += lat[d] * w[(size_t)d * dv + j];
    o[j] = acc;
  }
}
