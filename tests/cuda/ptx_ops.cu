// ptx_ops.cu: test fixtures for the tensor-core instructions of cuda_src/mma.cuh (tests/test_cuda_mma.py), not
// toolkit kernels. Each runs one warp (32 threads) and moves data by the PTX ISA's fragment formulas written out
// here, independently of the emulator, so the emulated instruction is checked against a plain matrix product.
#include "mma.cuh"

// A [16 rows x 8 words] (32 bytes of K per row), B [8 cols x 8 words] (column j: 32 bytes of K), C, D [16 x 8] f32
template <class Op>
__global__ void mma_one(const unsigned* A, const unsigned* B, const float* C, float* D) {
  const int l = threadIdx.x, g = l / 4, t = l % 4;
  const unsigned a[4] = {A[g * 8 + t], A[(g + 8) * 8 + t], A[g * 8 + 4 + t], A[(g + 8) * 8 + 4 + t]};
  const unsigned b[2] = {B[g * 8 + t], B[g * 8 + 4 + t]};
  float d[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
  Op::mma(d, a, b);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}

// M [32 rows x 4 words] staged in shared memory; lane l gives row l (x2: row l % 16) -> out [3][32 lanes][4 words]
__global__ void ldmatrix_all(const unsigned* M, unsigned* out) {
  __shared__ __align__(16) unsigned s[32][4];
  const int l = threadIdx.x;
  for (int i = 0; i < 4; ++i) s[l][i] = M[l * 4 + i];
  __syncthreads();
  unsigned r[4] = {0, 0, 0, 0};
  ldmatrix_x4(r, &s[l][0]);
  for (int i = 0; i < 4; ++i) out[l * 4 + i] = r[i];
  ldmatrix_x2(r, &s[l % 16][0]);
  for (int i = 0; i < 2; ++i) out[128 + l * 4 + i] = r[i];
  ldmatrix_x4_trans(r, &s[l][0]);
  for (int i = 0; i < 4; ++i) out[256 + l * 4 + i] = r[i];
}

// src [3][128] f32 -> out [2][3][128]: three cp.async groups of 16 bytes per lane into zeroed shared memory (the
// third zero-fills the odd lanes' chunks: src_bytes 0); snapshot after wait_group 2 (group 0 must have landed),
// then after wait_group 0 (all).
__global__ void cp_async_groups(const float* src, float* out) {
  __shared__ __align__(16) float s[3][128];
  const int l = threadIdx.x;
  for (int gi = 0; gi < 3; ++gi)
    for (int i = 0; i < 4; ++i) s[gi][l * 4 + i] = -1.0f;
  __syncthreads();
  for (int gi = 0; gi < 3; ++gi) {
    cp_async16(&s[gi][l * 4], src + gi * 128 + l * 4, gi < 2 || l % 2 == 0);
    cp_async_commit();
  }
  cp_async_wait<2>();
  __syncthreads();
  for (int gi = 0; gi < 3; ++gi)
    for (int i = 0; i < 4; ++i) out[gi * 128 + l * 4 + i] = s[gi][l * 4 + i];
  cp_async_wait<0>();
  __syncthreads();
  for (int gi = 0; gi < 3; ++gi)
    for (int i = 0; i < 4; ++i) out[384 + gi * 128 + l * 4 + i] = s[gi][l * 4 + i];
}

// src [128] f32 -> out [128]: lane l reads src[4 l + past ..] (4 floats) by __ldg (how 0) or one cp.async (how 1).
// With past 4 the last lane reads the 16 bytes after src's end: the emulator stops the launch (emu::in_globals)
__global__ void read_at(const float* src, const int* args, float* out) {
  __shared__ __align__(16) float s[128];
  const int l = threadIdx.x, past = args[0], how = args[1];
  if (how == 0) {
    for (int i = 0; i < 4; ++i) out[4 * l + i] = __ldg(src + 4 * l + past + i);
  } else if (how == 2) {  // a prefetch of the line at the offset, then the reads in bounds
    prefetch_l2(src + 4 * l + past);
    for (int i = 0; i < 4; ++i) out[4 * l + i] = __ldg(src + 4 * l + i);
  } else {
    cp_async16(&s[4 * l], src + 4 * l + past, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int i = 0; i < 4; ++i) out[4 * l + i] = s[4 * l + i];
  }
}
