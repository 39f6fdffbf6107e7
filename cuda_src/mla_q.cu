// mla_q.cu: absorbed MLA's query rows (toolkit/ref/mla_q.py).
//   q f32 [N, H*(dn+dr)], w_uk f32 [H, dn, r], positions int32 [N], inv_freq f32 [dr/2] -> qf f32 [N, H, r+dr]:
//   qf[n, h, :r] = q[n, h, :dn] @ w_uk[h] (the no-rope query taken into the latent space), qf[n, h, r:] = the rope
//   of q[n, h, dn:] (mla.cuh).
// Mapping: grid (N, H), block MLA_THREADS: the head's dn query values staged in shared memory, thread j computes
//   latent columns j, j + MLA_THREADS, ... (w_uk rows read coalesced across threads), then the rope pairs.
// Entry point: mla_q_kernel. Launcher: toolkit/gpu/mla_q.py. Contract: dn <= MLA_MAX_DN.
// Check: pytest tests/test_cuda_emulated.py -k mla.
#include "mla.cuh"

constexpr int MLA_THREADS = 128;
constexpr int MLA_MAX_DN = 512;

__global__ void __launch_bounds__(MLA_THREADS)
mla_q_kernel(const float* __restrict__ q, const float* __restrict__ w_uk, const int* __restrict__ positions,
             const float* __restrict__ inv_freq, float* __restrict__ qf, int H, int dn, int dr, int r, float scale,
             int interleave) {
  __shared__ float qn[MLA_MAX_DN];
  const int n = blockIdx.x, h = blockIdx.y;
  const float* qh = q + ((size_t)n * H + h) * (dn + dr);  // [dn + dr]
  for (int d = threadIdx.x; d < dn; d += MLA_THREADS) qn[d] = qh[d];
  __syncthreads();
  float* out = qf + ((size_t)n * H + h) * (r + dr);  // [r + dr]
  const float* w = w_uk + (size_t)h * dn * r;  // [dn, r]
  for (int j = threadIdx.x; j < r; j += MLA_THREADS) {
    float acc = 0.0f;
    for (int d = 0; d < dn; ++d) acc += qn[d] * w[(size_t)d * r + j];
    out[j] = acc;
  }
  mla_rope_row(qh + dn, out + r, dr, (float)positions[n], inv_freq, scale, interleave);
}
