// gather_rows.cu: x f32 [R, C], rows int32 [n] -> out f32 [n, C] = x[rows] (toolkit/ref/gather_rows.py): each
//   sequence's last token before the final norm; a row outside [0, R) writes zeros and reads nothing.
// Mapping (gather.cuh): grid (n, ceil(C / (4 * GATHER_THREADS))), block GATHER_THREADS; 16-byte Vec4 units
//   when C % 4 == 0 and x/out are 16-byte aligned (decided on the device), else four floats per thread.
// Entry point: gather_rows_kernel. Launcher: toolkit/gpu/gather_rows.py.
// Contract: exact (a copy). Check: pytest tests/test_cuda_runtime_ops.py -k gather; registers: pytest
//   tests/test_cuda_compile.py -k gather.
#include "gather.cuh"

__global__ void __launch_bounds__(GATHER_THREADS)
gather_rows_kernel(const int* __restrict__ rows, const float* __restrict__ x, float* __restrict__ out, int R, int C) {
  gather_row(rows, x, out, R, C);
}
