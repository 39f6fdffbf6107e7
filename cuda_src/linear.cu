// linear.cu: out f32 [M, N] = a f32 [M, K] @ w f32 [N, K]^T (toolkit/ref/linear.py; the bias is bias_add's).
//   The device's dense GEMM for the steps a plan records (a decode step: M = the batch, replayed or captured as
//   a CUDA graph, where cuBLAS cannot be captured through CuPy); eager GEMMs (prefill) stay on cuBLAS
//   (Device.gemm decides; toolkit/gpu/linear.py).
// Mapping: one warp per output column n (a row of w), LINEAR_WARPS columns per block, grid ceil(N / LINEAR_WARPS);
//   the warp walks K (16-byte units when K % 4 == 0 and a, w are 16-byte aligned, decided on the device, else
//   floats), LINEAR_ROWS rows of a at a time in registers (w's row is re-read per group of rows, from L1/L2), then
//   reduces each row's 32 partial sums with shuffles. Warps past N return whole, before any shuffle.
// Entry point: linear_f32. Launcher: toolkit/gpu/linear.py.
// Contract: f32 sums in another order than NumPy's (tests/test_ops.py's linear rows, dot_tol). Check:
//   pytest tests/test_cuda_runtime_ops.py -k linear (emulated); GPU: pytest tests/test_cuda_gpu.py -k linear.
//   Memory-bound: 4*N*K bytes of w per group of LINEAR_ROWS rows.
#include "common.cuh"

constexpr int LINEAR_WARPS = 4;
constexpr int LINEAR_ROWS = 8;

template <bool VEC>
__device__ __forceinline__ void linear_rows(const float* __restrict__ a, const float* __restrict__ wr, int rows,
                                            int K, float (&acc)[LINEAR_ROWS]) {
  const int lane = threadIdx.x % 32;
  if (VEC) {
    const int K4 = K / 4;
#pragma unroll 4
    for (int k = lane; k < K4; k += 32) {
      const float4 b = reinterpret_cast<const float4*>(wr)[k];
#pragma unroll
      for (int r = 0; r < LINEAR_ROWS; ++r) {
        if (r < rows) {
          const float4 x = reinterpret_cast<const float4*>(a + (size_t)r * K)[k];
          acc[r] += x.x * b.x + x.y * b.y + x.z * b.z + x.w * b.w;
        }
      }
    }
  } else {
    for (int k = lane; k < K; k += 32) {
      const float b = wr[k];
#pragma unroll
      for (int r = 0; r < LINEAR_ROWS; ++r)
        if (r < rows) acc[r] += a[(size_t)r * K + k] * b;
    }
  }
}

__global__ void __launch_bounds__(32 * LINEAR_WARPS)
linear_f32(const float* __restrict__ a, const float* __restrict__ w, float* __restrict__ out, int M, int N, int K) {
  const int lane = threadIdx.x % 32;
  const int n = blockIdx.x * LINEAR_WARPS + threadIdx.x / 32;
  if (n >= N) return;  // a whole warp
  const float* wr = w + (size_t)n * K;
  const bool vec = K % 4 == 0 && (((unsigned long long)a | (unsigned long long)w) & 15ull) == 0;
  for (int m0 = 0; m0 < M; m0 += LINEAR_ROWS) {
    const int rows = min(LINEAR_ROWS, M - m0);
    float acc[LINEAR_ROWS];
#pragma unroll
    for (int r = 0; r < LINEAR_ROWS; ++r) acc[r] = 0.0f;
    if (vec)
      linear_rows<true>(a + (size_t)m0 * K, wr, rows, K, acc);
    else
      linear_rows<false>(a + (size_t)m0 * K, wr, rows, K, acc);
#pragma unroll
    for (int r = 0; r < LINEAR_ROWS; ++r) {
      const float s = warp_sum(acc[r]);
      if (lane == 0 && r < rows) out[(size_t)(m0 + r) * N + n] = s;
    }
  }
}
