// kv_store.cu: quantize-on-write of new K or V rows into a preallocated KV cache store (toolkit/ref/kv_store.py).
//   x f32 [B, T, Hkv, hd] new rows, positions int32 [B, T] -> store [B, Hkv, S, hd/32 * Row::BLOCK_BYTES]
//   (f32 rows, or q8_0 / q4_0 GGML blocks along hd): row x[b, t, h] goes to store[b, h, positions[b, t]].
//   Bytes are identical to toolkit.ref.kv_store and to PyPI gguf (formats: cuda_src/formats.cuh).
// Mapping: one warp per 32-value block: lane l holds element l, the block scale comes from a warp reduction
//   (absmax for q8_0, signed max with first-index tie-break for q4_0). Block of KV_STORE_WARPS warps; grid
//   ceil(B*T*Hkv*hd/32 / KV_STORE_WARPS); warps past the end, or whose position is outside [0, S), return
//   before any shuffle (whole warps only). The launcher never reads positions (no host synchronisation).
// Entry point: kv_store_kernel<Row> with Row in {F32Row, Q8_0Row, Q4_0Row}. Launcher: toolkit/gpu/kv_store.py.
// Check: pytest tests/test_cuda_emulated.py -k kv_store (exact bytes, both thread orders); registers/spills:
//   pytest tests/test_cuda_compile.py; GPU: pytest tests/test_cuda_gpu.py -k kv. Bench: python -m toolkit.bench kv
//   (CPU); the store moves B*T*Hkv*hd*4 bytes in plus the block bytes out, a negligible part of a decode step.
#include "formats.cuh"

constexpr int KV_STORE_WARPS = 4;

template <class Row>
__global__ void __launch_bounds__(32 * KV_STORE_WARPS)
kv_store_kernel(const float* __restrict__ x, const int* __restrict__ positions, unsigned char* __restrict__ store,
                int B, int T, int Hkv, int S, int hd) {
  const int lane = threadIdx.x % 32;
  const long long w = (long long)blockIdx.x * KV_STORE_WARPS + threadIdx.x / 32;  // global block of 32 values
  const int nblk = hd / 32;
  const long long n_rows = (long long)B * T * Hkv;
  if (w >= n_rows * nblk) return;
  const long long row = w / nblk;  // (b, t, h) in the order of x
  const int blk = (int)(w % nblk);
  const int h = (int)(row % Hkv);
  const long long bt = row / Hkv;  // b * T + t
  const int b = (int)(bt / T);
  const int p = positions[bt];
  if (p < 0 || p >= S) return;  // validated on the host before the copy, not by the launcher: no write
  const size_t row_bytes = (size_t)nblk * Row::BLOCK_BYTES;
  unsigned char* dst = store + (((size_t)b * Hkv + h) * S + p) * row_bytes + (size_t)blk * Row::BLOCK_BYTES;
  Row::store(x[row * hd + blk * 32 + lane], dst, lane);
}
