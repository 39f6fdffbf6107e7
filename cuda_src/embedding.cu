// embedding.cu: ids int32 [N], table f32 [V, D] -> out f32 [N, D] = table[ids] (toolkit/ref/embedding.py);
//   an id outside [0, V) writes a row of zeros (the host validates ids; the kernel never reads outside the table).
// Mapping (gather.cuh): grid (N, ceil(D / (4 * GATHER_THREADS))), block GATHER_THREADS; 16-byte Vec4 units
//   when D % 4 == 0 and table/out are 16-byte aligned (decided on the device), else four floats per thread.
// Entry point: embedding_kernel. Launcher: toolkit/gpu/embedding.py.
// Contract: exact (a copy). Check: pytest tests/test_cuda_runtime_ops.py -k embedding; registers: pytest
//   tests/test_cuda_compile.py -k embedding. Memory-bound: 8*N*D bytes moved.
#include "gather.cuh"

__global__ void __launch_bounds__(GATHER_THREADS)
embedding_kernel(const int* __restrict__ ids, const float* __restrict__ table, float* __restrict__ out, int V, int D) {
  gather_row(ids, table, out, V, D);
}
