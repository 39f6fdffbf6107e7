// rope.cu: rotary position embedding in place, the "rotate half" convention (toolkit/ref/rope.py).
//   x f32 [B, T, n, hd], positions int32 [B, T], inv_freq f32 [half] (half = hd/2, or less: partial rotary rotates
//   the first 2*half dims of each head and leaves the rest), scale f32:
//   angle = float(pos) * inv_freq[i] (one f32 product, as the reference), c = cos(angle) * scale,
//   s = sin(angle) * scale; x1 = x[..., i], x2 = x[..., i + half] become x1*c - x2*s and x2*c + x1*s, each
//   product rounded on its own (__fmul_rn: no fused multiply-add), so only sincosf differs from NumPy.
// Mapping: one block of ROPE_THREADS per token (grid = B*T): sincosf once per frequency into shared memory,
//   then the n * hd/2 pairs of the token, consecutive threads on consecutive i (coalesced per head).
// Entry point: rope_kernel. Launcher: toolkit/gpu/rope.py. Contract: hd even, hd/2 <= ROPE_MAX_HALF.
// Tolerance: |err| <= 1e-6 * max|x| * scale (sincosf against NumPy's f32 sin/cos, positions up to 1e5;
//   measured 1.4e-7 emulated; CUDA's sincosf is within 2 ulp).
// Check: pytest tests/test_cuda_runtime_ops.py -k rope; registers: pytest tests/test_cuda_compile.py -k rope.
#include "common.cuh"

constexpr int ROPE_THREADS = 128;
constexpr int ROPE_MAX_HALF = 256;

__global__ void __launch_bounds__(ROPE_THREADS)
rope_kernel(float* __restrict__ x, const int* __restrict__ positions, const float* __restrict__ inv_freq,
            int n, int half, int hd, float scale) {
  __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
  const float pos = (float)positions[blockIdx.x];
  for (int i = threadIdx.x; i < half; i += ROPE_THREADS) {
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    cs[i] = __fmul_rn(c, scale);
    sn[i] = __fmul_rn(s, scale);
  }
  __syncthreads();
  float* tok = x + (size_t)blockIdx.x * n * hd;  // [n, hd]; dims past 2 * half (partial rotary) are left alone
  for (int p = threadIdx.x; p < n * half; p += ROPE_THREADS) {
    const int h = p / half, i = p - h * half;
    float* row = tok + (size_t)h * hd;
    const float x1 = row[i], x2 = row[i + half], c = cs[i], s = sn[i];
    row[i] = __fmul_rn(x1, c) - __fmul_rn(x2, s);
    row[i + half] = __fmul_rn(x2, c) + __fmul_rn(x1, s);
  }
}
