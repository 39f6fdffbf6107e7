// add_rows.cu: h f32 [R, C] += y f32 [n, C] at rows int32 [n] (distinct), h[rows[i]] += y[i]; a row outside [0, R)
//   adds nothing (toolkit/ref/add_rows.py). Hybrid placement: the host experts' rows added back on the device.
// Mapping: grid (n, ceil(C / ADD_ROWS_THREADS)), block ADD_ROWS_THREADS; thread j of block (i, b) adds column
//   b * ADD_ROWS_THREADS + j of row i. Rows are distinct, so no two threads write one element (no atomics).
// Entry point: add_rows_kernel. Launcher: toolkit/gpu/add_rows.py.
// Contract: exact (one f32 addition per element, as NumPy). Check: pytest tests/test_ops.py -k add_rows.
#include "common.cuh"

constexpr int ADD_ROWS_THREADS = 256;

__global__ void __launch_bounds__(ADD_ROWS_THREADS)
add_rows_kernel(float* __restrict__ h, const float* __restrict__ y, const int* __restrict__ rows, int R, int C) {
  const int r = rows[blockIdx.x];
  const int c = blockIdx.y * ADD_ROWS_THREADS + threadIdx.x;
  if ((unsigned)r < (unsigned)R && c < C) h[(size_t)r * C + c] += y[(size_t)blockIdx.x * C + c];
}
