// wgmma_ops.cu: a test fixture for the warpgroup MMA of cuda_src/wgmma.cuh (tests/test_cuda_wgmma.py), not a toolkit
// kernel. One warpgroup (128 threads) stages A [64 x 128] and B [128 x 128] e4m3 codes (rows of 128 bytes of K) in
// shared memory under the 128-byte swizzle, written out here from the PTX ISA's formula (16-byte chunk c of row r at
// chunk c ^ (r % 8), 8-row atoms of 1024 bytes), runs four wgmma m64n128k32 (K slices of 32 bytes: the descriptor's
// start advanced 32 bytes each), and writes D [64 x 128] by the documented accumulator fragment. `mode` breaks one
// rule at a time, for the emulator's checks:
//   0 as documented   1 no wgmma.fence   2 no fence.proxy.async after the copies   3 no commit (the wait retires
//   nothing)   4 B overwritten by B2 (plain stores) after the issue, before the wait   5 D read before the wait
#include "wgmma.cuh"

__global__ void wgmma_tile(const unsigned char* A, const unsigned char* B, const unsigned char* B2, float* D, int mode) {
  DYNAMIC_SMEM(dsmem, 3 * 64 * 128 + 1024);
  unsigned char* sa = dsmem + ((1024u - (smem_addr(dsmem) & 1023u)) & 1023u);  // [64][128], then B [128][128]
  unsigned char* sb = sa + 64 * 128;
  const int tid = threadIdx.x;
  auto at = [](int r, int c) { return r * 128 + ((c ^ (r % 8)) << 4); };
  for (int c = tid; c < 64 * 8; c += 128) cp_async16(sa + at(c / 8, c % 8), A + c * 16, true);
  for (int c = tid; c < 128 * 8; c += 128) cp_async16(sb + at(c / 8, c % 8), B + c * 16, true);
  cp_async_commit();
  cp_async_wait<0>();
  if (mode != 2) fence_proxy_async();
  __syncthreads();
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.0f;
  if (mode != 1) wgmma_fence();
  for (int ks = 0; ks < 4; ++ks) wgmma_e4m3_64x128(d, sw128_desc(sa + ks * 32), sw128_desc(sb + ks * 32), ks > 0);
  if (mode != 3) wgmma_commit();
  float early[64];
  for (int i = 0; i < 64; ++i) early[i] = mode == 5 ? d[i] : 0.0f;
  if (mode == 4) {
    __syncthreads();
    for (int c = tid; c < 128 * 8; c += 128)
      for (int b = 0; b < 16; ++b) sb[at(c / 8, c % 8) + b] = B2[c * 16 + b];
    __syncthreads();
  }
  wgmma_wait<0>();
  const int w = (tid / 32) % 4, g = (tid % 32) / 4, t = tid % 4;
  for (int j = 0; j < 16; ++j)
    for (int i = 0; i < 4; ++i)
      D[(16 * w + g + 8 * (i / 2)) * 128 + 8 * j + 2 * t + i % 2] = mode == 5 ? early[4 * j + i] : d[4 * j + i];
}
