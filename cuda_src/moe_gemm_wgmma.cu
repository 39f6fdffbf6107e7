// moe_gemm_wgmma.cu: the prefill GEMM of fp8 (e4m3 W8A8) experts on Hopper's warpgroup MMA (sm_90a): the same op and
// arguments as moe_gemm_mma.cu (toolkit/ref/moe_gemm.py; launcher toolkit/gpu/moe_gemm_wgmma.py, reached through
// run_moe_gemm_mma at block_m 128), for the tiles where mma.sync's e4m3 (half of Hopper's fp8 rate: ptxas makes it
// two f16 HMMA) and its 64 x 64 warp tiles cap prefill at 0.5 of the dense peak (toolkit/gpu/occupancy.py).
//
//   xa u8 [rows, K]: fp8_act_quant.cu's per-token e4m3 codes, xs f32 [rows] their scales; wq u8 [E, N, K] the
//   stored e4m3 weight codes, ws f32 [E, N] their row scales; mode 0: out f32 [split, T*A, N], split-K partials,
//   times topk_w[slot] when topk_w is not null (GEMM2); mode 2: GEMM1 of gate_up [E, 2I, K] with silu_and_mul in the
//   epilogue, out = h f32 [T*A, I] (no split). K % 16 == 0.
// Block: 2 warpgroups (256 threads) x 128 weight rows (warpgroup q: rows 64q..64q+63, the wgmma's A, "swap AB" as in
// moe_gemm_mma) x 128 tokens (the M-block of moe_align: B), 64 f32 accumulators a thread and 64 for a k-tile's own
// sum. Per k-tile of 128 bytes of K: cp.async the tile kt + 3 of weights and of gathered activation rows (zero past
// the rows and K) into stage (kt + 3) % 4 of 4, each 16 KB operand in 8-row atoms of 128-byte rows under the
// 128-byte swizzle (wgmma.cuh), then four wgmma m64n128k32 from stage kt % 4 into a fresh sum of the tile's own,
// committed as one group and waited for (wgmma_wait<0>), the sum then added into the f32 accumulators: Hopper's fp8
// wgmma sums with 13 bits of mantissa (wgmma.cuh), so no more than a k-tile's four add up there (as DeepSeek-V3's
// FP8 GEMMs promote every 128 of K). Stage (kt + 3) % 4 was last read by tile kt - 1, done before the barrier.
// Shared memory: 4 stages x 32 KB + 1 KB to align the atoms = 132 KB (dynamic), one block an SM. Design ceiling
// 0.8 of the fp8 dense peak by shared-memory traffic (toolkit/gpu/occupancy.py prefill_table).
#include "wgmma.cuh"

constexpr int WG_THREADS = 256, WG_TN = 128, WG_BM = 128;  // threads, weight rows, tokens a block
constexpr int WG_KB = 128, WG_STAGES = 4, WG_AHEAD = 3;    // bytes of K a k-tile; stages; tiles copied ahead
constexpr int WG_TILE = WG_TN * WG_KB;                     // bytes of one operand's k-tile (16 KB)
constexpr int WG_SMEM = WG_STAGES * 2 * WG_TILE + 1024;    // the launcher's dynamic shared memory (dynamic_smem)
static_assert(WG_BM * WG_KB == WG_TILE && WG_AHEAD == WG_STAGES - 1, "a stage is free once its tile's wgmmas are done");
static_assert(WG_SMEM == 132096 && WG_SMEM <= 227 * 1024, "toolkit/gpu/moe_gemm_wgmma.py SMEM, within an SM's 227 KB");

__global__ void __launch_bounds__(WG_THREADS, 1) moe_gemm_wgmma_e4m3(MOE_GEMM_MMA_ARGS) {  // (wb, group: unused)
  DYNAMIC_SMEM(dsmem, WG_SMEM);
  // the atoms 1024-byte aligned in the shared window (the swizzle is of address bits 4-9)
  unsigned char* smem = dsmem + ((1024u - (smem_addr(dsmem) & 1023u)) & 1023u);
  __shared__ int rows[WG_BM], slots[WG_BM];
  const int mb = blockIdx.x, e = expert_ids[mb];
  if (e < 0) return;  // a block past the real layout (block-uniform)
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid / 32) % 4;
  for (int m = tid; m < WG_BM; m += WG_THREADS) {
    const int s = sorted_ids[mb * WG_BM + m];
    slots[m] = s;
    rows[m] = s < n_slots ? (x_is_slots ? s : s / top_k) : -1;
  }
  __syncthreads();
  const int n0 = blockIdx.y * WG_TN;
  // the weight row of shared row R of the block (and whether it exists). mode 0: row n0 + R. mode 2 (GEMM1 with
  // silu_and_mul, gate_up [E, 2I, K]): warpgroup q's 64 rows are the gate and up rows of 32 outputs, laid so that a
  // thread holds both of an output: its warp w's rows 16w + g are the gate rows of outputs c = (2 blockIdx.y + q) 32 +
  // 8w + g, its rows 16w + 8 + g the up rows I + c of the same outputs (the wgmma fragment's d[4j + 2 + p] is row g + 8)
  const bool silu = mode == 2;
  const int half = N / 2;
  auto out_col = [&](int R) { return (blockIdx.y * 2 + R / 64) * 32 + (R % 64 / 16) * 8 + R % 8; };
  auto wrow = [&](int R) { return silu ? (R % 16 < 8 ? out_col(R) : half + out_col(R)) : n0 + R; };
  auto wrow_ok = [&](int R) { return silu ? out_col(R) < half : n0 + R < N; };
  const int k_begin = blockIdx.z * k_chunk, k_end = min(K, k_begin + k_chunk);
  const int n_tiles = (k_end - k_begin + WG_KB - 1) / WG_KB;

  // tile kt into stage st: 1024 copies of 16 bytes an operand, 4 a thread each: rows i * 32 + tid / 8 (i < 4) of the
  // weights and of the tokens, chunk tid % 8, stored at chunk (tid % 8) ^ (row % 8) of its row (row % 8 = tid / 8 % 8
  // for every i). Sources fixed over the k-tiles: a pointer at the k-range's start (row 0's when the row is past the
  // weight or the block's slots, at most K - 16: a valid address for the zero-filling copies). One commit group a
  // tile, empty past the last. Written this way, not as one loop over both operands, the copies have no branch:
  // ptxas 13.0 serialized every wgmma on that form (C7515, which the compile gate fails)
  constexpr int CP = WG_TILE / 16 / WG_THREADS;  // 4
  const int ch = tid % 8, r0 = tid / 8, k0 = min(k_begin + ch * 16, K - 16);
  const int dst = r0 * WG_KB + ((ch ^ (r0 % 8)) << 4);
  const unsigned char* wsrc[CP];
  const unsigned char* xsrc[CP];
  bool wok[CP], xok[CP];
#pragma unroll
  for (int i = 0; i < CP; ++i) {
    const int r = i * (WG_THREADS / 8) + r0;
    wok[i] = wrow_ok(r);
    wsrc[i] = wq + (wok[i] ? ((size_t)e * N + wrow(r)) * K : 0) + k0;
    xok[i] = rows[r] >= 0;
    xsrc[i] = xa + (xok[i] ? (size_t)rows[r] * K : 0) + k0;
  }
  auto load_stage = [&](int kt, int st) {
    if (kt < n_tiles) {
      const bool kin = k_begin + kt * WG_KB + ch * 16 < k_end;
      unsigned char* sw = smem + st * 2 * WG_TILE + dst;
#pragma unroll
      for (int i = 0; i < CP; ++i) {
        const bool w_in = wok[i] && kin, x_in = xok[i] && kin;  // a zero-filled copy names its k-range's start
        cp_async16(sw + i * (WG_THREADS / 8) * WG_KB, wsrc[i] + (w_in ? kt * WG_KB : 0), w_in);
        cp_async16(sw + WG_TILE + i * (WG_THREADS / 8) * WG_KB, xsrc[i] + (x_in ? kt * WG_KB : 0), x_in);
      }
    }
    cp_async_commit();
  };

  // acc: the f32 sums of the tiles done so far; part: one k-tile's. Hopper's fp8 wgmma keeps 13 bits of mantissa in
  // its sums (wgmma.cuh), so each k-tile's four wgmmas start afresh (scale-d 0) in part, which is added into acc in
  // f32 once they are done: 0.01 % of max|out| at K 4096 by the emulator's model, against 0.3 % when the wgmmas add up
  // all of K. (Two such sums in turn, one in flight while the other is added, is what ptxas serializes: C7514.)
  float acc[64], part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int s = 0; s < WG_AHEAD; ++s) load_stage(s, s);
  for (int kt = 0; kt < n_tiles; ++kt) {
    cp_async_wait<WG_AHEAD - 1>();  // this thread's copies of tile kt have landed ...
    fence_proxy_async();            // ... are visible to wgmma's async proxy ...
    __syncthreads();                // ... and so are everyone's; every warpgroup is done with tile kt - 1
    load_stage(kt + WG_AHEAD, (kt + WG_AHEAD) % WG_STAGES);
    const unsigned char* wt = smem + (kt % WG_STAGES) * 2 * WG_TILE;
    wgmma_fence_operand<64>(part);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < WG_KB / 32; ++ks)  // A: this warpgroup's 64 weight rows; B: the 128 tokens
      wgmma_e4m3_64x128(part, sw128_desc(wt + wg * 64 * WG_KB + ks * 32), sw128_desc(wt + WG_TILE + ks * 32), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();  // tile kt's group has completed (the copies of the next three tiles land meanwhile)
    wgmma_fence_operand<64>(part);
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] += part[i];
  }
  cp_async_wait<0>();  // no copy still landing when the block's shared memory is reused

  // epilogue: thread holds shared rows R = 64 wg + 16 warp + g (+8), tokens 8j + 2t (+1): each sum times its row's
  // scale times its token's, as moe_gemm_mma's epilogue rounds them
  const int g = lane / 4, t = lane % 4, R0 = wg * 64 + warp * 16 + g;
  float wsc[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) wsc[h] = wrow_ok(R0 + 8 * h) ? ((const float*)ws)[(size_t)e * N + wrow(R0 + 8 * h)] : 0.0f;
  // mode 2: h [T*A, I] = silu(gate) * up of output out_col(R0), the gate in d[4j + p], the up in d[4j + 2 + p]
  const int c = out_col(R0);
  if (silu && c >= half) return;
  float* o = out + (size_t)blockIdx.z * n_slots * N;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int m = 8 * j + 2 * t + p;
      if (rows[m] < 0) continue;
      const int slot = slots[m];
      const float sx = xs[rows[m]];
      float v[2];  // sum * (row scale * token scale)
#pragma unroll
      for (int h = 0; h < 2; ++h) v[h] = acc[4 * j + 2 * h + p] * (wsc[h] * sx);
      if (silu) {
        out[(size_t)slot * half + c] = v[0] / (1.0f + expf(-v[0])) * v[1];  // as silu_and_mul.cu
        continue;
      }
      const float tw = topk_w ? topk_w[slot] : 1.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (wrow_ok(R0 + 8 * h)) o[(size_t)slot * N + wrow(R0 + 8 * h)] = topk_w ? v[h] * tw : v[h];
    }
  }
}
