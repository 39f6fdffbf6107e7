// kv_attention.cu: GQA causal attention of new queries over a KV cache read in its stored format
// (toolkit/ref/kv_attention.py; the Numba twin is toolkit/cpu/kv_attention.py).
//   q f32 [B, T, H, hd], k_store / v_store [B, Hkv, S, hd/32 * BLOCK_BYTES] (f32 rows or q8_0 / q4_0 blocks,
//   formats in cuda_src/formats.cuh, K and V independently), positions int32 [B, T] -> out f32 [B, T, H, hd].
//   Query head h reads KV head h / (H / Hkv); key j is visible to a query at position p when j <= p and, with a
//   sliding window W > 0, p - j < W. Scores q.k * scale, softmax in f32. sinks f32 [H] or null (gpt-oss): one
//   more logit per head, in the softmax's denominator only (added where the output is normalised).
// Mapping (flash-decoding split over keys):
//   kv_attention_kernel<KRow, VRow>: grid (B*T*Hkv, n_split, ceil(rep / W)), block 32*W threads with
//     W = min(rep, KV_ATT_MAX_WARPS), rep = H / Hkv: warp w of z-block z is query head kh*rep + z*W + w, so the
//     heads sharing a KV head read the same rows at the same time (L1 hits).
//     Lane l holds q[32*i + l] for the hd/32 <= 4 blocks i; for each visible key of its split, each lane decodes
//     element l of every block (KRow::load inside the dot loop), the dot is a warp sum, the online softmax keeps
//     (m, l) per warp and acc[32*i + l] per lane; VRow::load inside the axpy loop. Nothing is dequantized to a
//     temporary. n_split == 1: writes out = acc / l; else the partials (m, l, acc) to ws_ml [B*T*H, n_split, 2],
//     ws_acc [B*T*H, n_split, hd].
//   Split y of a query takes keys [lo + y*c, lo + (y+1)*c) of its own visible range [lo, p] with
//     c = ceil(n / n_split), n = p + 1 - lo: n_split is planned on the host from shapes and a bound on the
//     visible keys (max_keys), the chunk is computed here from the position, so any position is correct with any
//     n_split. A split past the query's keys (n < n_split, e.g. decode early in a big cache or a sliding window
//     smaller than the planned split) is empty: it writes the partial (m = -inf, l = 0, acc = 0).
//   kv_attention_combine: one warp per (b, t, h) (block of 4 warps), lanes over hd: merges the n_split partials
//     (max of m, rescaled sums); empty partials (m = -inf) add nothing and are never put through expf.
//   A query with no visible key at all (only a position < 0, which the runtime rejects on the host) gets 0, not
//   0 / 0: both divisions are guarded.
// Entry points: kv_attention_tiled<KRow, VRow> (hd <= 128, 9 instantiations; below), kv_attention_kernel<Row, Row,
//   18> (MLA's one latent store read as K and V: f32, q8_0, q4_0), kv_attention_combine. Prefill on tensor cores:
//   kv_attention_mma.cu.
// Contract (toolkit/gpu/kv_attention.py): hd a multiple of 32 up to 128, or up to 576 with one format for K and V;
//   H % Hkv == 0. Positions are not read by the
//   launcher (no host synchronisation; the runtime validates them before it copies them): the kernel reads only
//   keys in [0, S) whatever a position holds.
// Tolerance vs the NumPy reference: summation order and expf differ; tests use KV_ATT_TOL (atol/rtol 2e-5/1e-4).
// Check: pytest tests/test_cuda_emulated.py -k kv_attention; registers/spills: pytest tests/test_cuda_compile.py;
//   GPU: pytest tests/test_cuda_gpu.py -k kv. Bench: bytes read = visible rows * row bytes (K and V).
#include "formats.cuh"
#include "mma.cuh"  // cp.async

// NB: the head dim's 32-value blocks a lane may hold: 4 (hd <= 128, GQA) or 18 (hd <= 576: MLA's latent + rope row)
#define NEG_INF __int_as_float(0xff800000)

constexpr int KV_ATT_MAX_WARPS = 8;  // query heads per block

// a warp's result for its (b, t, h): out = acc / l (the sink's logit in the denominator only), or with a key split
// the partial (m, l, acc) of split blockIdx.y for kv_attention_combine
template <int NB>
__device__ __forceinline__ void finish_head(const float* acc, float m, float l, const float* sinks, int h, size_t head,
                                            int hd, int nblk, int lane, int n_split, float* out, float* ws_ml,
                                            float* ws_acc) {
  if (n_split == 1) {
    if (sinks && l > 0.0f) l += expf(sinks[h] - m);
#pragma unroll
    for (int i = 0; i < NB; ++i)
      if (i < nblk) out[head * hd + i * 32 + lane] = l > 0.0f ? acc[i] / l : 0.0f;
    return;
  }
  const size_t part = head * n_split + blockIdx.y;
#pragma unroll
  for (int i = 0; i < NB; ++i)
    if (i < nblk) ws_acc[part * hd + i * 32 + lane] = acc[i];
  if (lane == 0) { ws_ml[part * 2] = m; ws_ml[part * 2 + 1] = l; }
}

template <class KRow, class VRow, int NB>
// NB > 4: at least one block per SM, so ptxas keeps the 18-block row in registers (no spill; NB = 4 as before)
__global__ void __launch_bounds__(32 * KV_ATT_MAX_WARPS, NB > 4 ? 1 : 0)
kv_attention_kernel(const float* __restrict__ q, const unsigned char* __restrict__ k_store,
                    const unsigned char* __restrict__ v_store, const int* __restrict__ positions,
                    const float* __restrict__ sinks, float* __restrict__ out, float* __restrict__ ws_ml,
                    float* __restrict__ ws_acc, int B, int T, int H, int Hkv, int S, int hd, float scale, int window,
                    int n_split) {
  const int lane = threadIdx.x % 32;
  const int rep = H / Hkv, nblk = hd / 32;
  const int r = blockIdx.z * (blockDim.x / 32) + threadIdx.x / 32;  // query head within the KV group
  if (r >= rep) return;  // whole warps: the last z-block of a group whose rep is not a multiple of the block
  const int kh = blockIdx.x % Hkv;
  const int bt = blockIdx.x / Hkv;  // b * T + t
  const int b = bt / T;
  const int h = kh * rep + r;
  const int p = positions[bt];
  const int lo = window > 0 ? max(0, p - window + 1) : 0;
  const int hi = min(p + 1, S);  // keys [lo, hi): never a row outside the store
  const int n = max(0, hi - lo);  // visible keys
  const int chunk = (n + n_split - 1) / n_split;
  const int j0 = lo + blockIdx.y * chunk, j1 = min(hi, j0 + chunk);  // empty when j0 >= hi

  const size_t head = (size_t)bt * H + h;  // (b, t, h)
  float qv[NB], acc[NB];
#pragma unroll
  for (int i = 0; i < NB; ++i) {
    qv[i] = i < nblk ? q[head * hd + i * 32 + lane] : 0.0f;
    acc[i] = 0.0f;
  }
  const size_t k_row = (size_t)nblk * KRow::BLOCK_BYTES, v_row = (size_t)nblk * VRow::BLOCK_BYTES;
  const unsigned char* kb = k_store + ((size_t)b * Hkv + kh) * S * k_row;
  const unsigned char* vb = v_store + ((size_t)b * Hkv + kh) * S * v_row;
  float m = NEG_INF, l = 0.0f;
  for (int j = j0; j < j1; ++j) {
    const unsigned char* kr = kb + (size_t)j * k_row;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < NB; ++i)
      if (i < nblk) s += qv[i] * KRow::load(kr + i * KRow::BLOCK_BYTES, lane);
    s = warp_sum(s) * scale;
    if (s > m) {  // online softmax: rescale what was accumulated under the old max
      const float corr = m == NEG_INF ? 0.0f : expf(m - s);
      l *= corr;
#pragma unroll
      for (int i = 0; i < NB; ++i) acc[i] *= corr;
      m = s;
    }
    const float e = expf(s - m);
    l += e;
    const unsigned char* vr = vb + (size_t)j * v_row;
#pragma unroll
    for (int i = 0; i < NB; ++i)
      if (i < nblk) acc[i] += e * VRow::load(vr + i * VRow::BLOCK_BYTES, lane);
  }
  finish_head<NB>(acc, m, l, sinks, h, head, hd, nblk, lane, n_split, out, ws_ml, ws_acc);
}

// ---- kv_attention_tiled<KRow, VRow>: the GQA path (hd <= 128), keys in tiles ------------------------------------
// Same grid, split and outputs as kv_attention_kernel. The block's warps (the query heads of one KV head) share
// each tile of KV_TILE keys: its raw K and V rows (stored bytes, contiguous in the cache) are cp.async'ed into
// shared memory one tile ahead (two stages, 8-byte copies of the aligned words covering the tile's byte range;
// rows past the chunk are never read from the store), so each row crosses the bus once per block
// however many heads read it. Per tile and warp: lane l scores key l % 16 over the blocks i with i % 2 == l / 16
// (two lanes per key, one shuffle to add), reading q from shared memory and the key in its stored format
// (KRow::load); one online-softmax step per tile (warp max, exp, warp sum); then lane l accumulates output
// dims 32 i + l over the tile's keys, the probabilities broadcast by shuffles and V read as stored (VRow::load).
constexpr int KV_TILE = 16;

template <class KRow, class VRow>
__global__ void __launch_bounds__(32 * KV_ATT_MAX_WARPS)
kv_attention_tiled(const float* __restrict__ q, const unsigned char* __restrict__ k_store,
                   const unsigned char* __restrict__ v_store, const int* __restrict__ positions,
                   const float* __restrict__ sinks, float* __restrict__ out, float* __restrict__ ws_ml,
                   float* __restrict__ ws_acc, int B, int T, int H, int Hkv, int S, int hd, float scale, int window,
                   int n_split) {
  constexpr int NB = 4, KB_MAX = NB * KRow::BLOCK_BYTES, VB_MAX = NB * VRow::BLOCK_BYTES;
  __shared__ __align__(16) unsigned char kt[2][KV_TILE * KB_MAX + 8], vt[2][KV_TILE * VB_MAX + 8];
  __shared__ float qs[KV_ATT_MAX_WARPS][NB * 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nthreads = blockDim.x;
  const int rep = H / Hkv, nblk = hd / 32;
  const int r = blockIdx.z * (blockDim.x / 32) + warp;  // query head within the KV group
  const bool active = r < rep;  // the last z-block of a group may have idle warps: they still copy and sync
  const int kh = blockIdx.x % Hkv, bt = blockIdx.x / Hkv, b = bt / T;
  const int h = kh * rep + (active ? r : 0);
  const int p = positions[bt];
  const int lo = window > 0 ? max(0, p - window + 1) : 0;
  const int hi = min(p + 1, S);
  const int n = max(0, hi - lo);
  const int chunk = (n + n_split - 1) / n_split;
  const int j0 = lo + blockIdx.y * chunk, j1 = min(hi, j0 + chunk);
  const size_t head = (size_t)bt * H + h;
  for (int d = lane; d < NB * 32; d += 32) qs[warp][d] = active && d < hd ? q[head * hd + d] : 0.0f;
  const int k_row = nblk * KRow::BLOCK_BYTES, v_row = nblk * VRow::BLOCK_BYTES;
  const unsigned char* kb = k_store + ((size_t)b * Hkv + kh) * S * k_row;
  const unsigned char* vb = v_store + ((size_t)b * Hkv + kh) * S * v_row;
  const int n_tiles = j1 > j0 ? (j1 - j0 + KV_TILE - 1) / KV_TILE : 0;
  // a tile's rows are one contiguous byte range of each store, aligned only to 2 bytes (q8_0 rows of hd 32 are
  // 34 bytes): it is copied as the aligned 8-byte words that cover it, the last one cut (src-size < 8); the rows
  // start `kd` / `vd` bytes into the stage. Store bases are 8-byte aligned (every allocation is).
  auto load_range = [&](unsigned char* dst, const unsigned char* src, int bytes) {
    const unsigned char* a0 = (const unsigned char*)((size_t)src & ~(size_t)7);
    const unsigned char* end = src + bytes;
    for (const unsigned char* c = a0 + threadIdx.x * 8; c < end; c += nthreads * 8)
      cp_async8(dst + (c - a0), c, (int)min((long long)8, (long long)(end - c)));
  };
  auto load_tile = [&](int t) {  // keys j0 + t*KV_TILE .. of both stores -> stage t % 2
    const int jt = j0 + t * KV_TILE, valid = min(KV_TILE, j1 - jt);
    load_range(kt[t % 2], kb + (size_t)jt * k_row, valid * k_row);
    load_range(vt[t % 2], vb + (size_t)jt * v_row, valid * v_row);
    cp_async_commit();
  };
  auto misalign = [&](const unsigned char* src) { return (int)((size_t)src & 7); };
  float acc[NB], m = NEG_INF, l = 0.0f;
#pragma unroll
  for (int i = 0; i < NB; ++i) acc[i] = 0.0f;
  if (n_tiles) load_tile(0);
  for (int t = 0; t < n_tiles; ++t) {
    if (t + 1 < n_tiles) load_tile(t + 1);
    else cp_async_commit();  // an empty group: the wait below always leaves the newest group pending
    cp_async_wait<1>();
    __syncthreads();  // tile t (and, the first time, qs) visible to every warp
    const int jt = j0 + t * KV_TILE, key = lane % KV_TILE;
    const unsigned char* kr = &kt[t % 2][misalign(kb + (size_t)jt * k_row) + key * k_row];
    const unsigned char* vt0 = &vt[t % 2][misalign(vb + (size_t)jt * v_row)];
    float s = 0.0f;
#pragma unroll
    for (int i = lane / KV_TILE; i < NB; i += 2) {
      if (i < nblk) {
        const unsigned char* blk = kr + i * KRow::BLOCK_BYTES;
#pragma unroll 2  // 8 made NVRTC 13.0's ptxas spill 4 bytes at sm_80 (q8_0 keys, q4_0 values)
        for (int e = 0; e < 32; ++e) s += qs[warp][i * 32 + e] * KRow::load(blk, e);
      }
    }
    s = (s + __shfl_xor_sync(FULL_MASK, s, KV_TILE)) * scale;
    if (jt + key >= j1) s = NEG_INF;  // past the chunk (zero-filled stage bytes, or the previous tile's)
    const float m_new = fmaxf(m, warp_max(s));  // the tile has >= 1 visible key: m_new is finite
    const float corr = m == NEG_INF ? 0.0f : expf(m - m_new);
    const float pk = s == NEG_INF ? 0.0f : expf(s - m_new);
    l = l * corr + warp_sum(lane < KV_TILE ? pk : 0.0f);
    m = m_new;
#pragma unroll
    for (int i = 0; i < NB; ++i) acc[i] *= corr;
    const int valid = min(KV_TILE, j1 - jt);  // the stage past them holds stale bytes: never multiplied, even by 0
    for (int k2 = 0; k2 < valid; ++k2) {
      const float pj = __shfl_sync(FULL_MASK, pk, k2);
      const unsigned char* vr = vt0 + k2 * v_row;
#pragma unroll
      for (int i = 0; i < NB; ++i)
        if (i < nblk) acc[i] += pj * VRow::load(vr + i * VRow::BLOCK_BYTES, lane);
    }
    __syncthreads();  // every warp is done with stage t % 2 before tile t + 2 is copied into it
  }
  cp_async_wait<0>();
  if (!active) return;
  finish_head<NB>(acc, m, l, sinks, h, head, hd, nblk, lane, n_split, out, ws_ml, ws_acc);
}

constexpr int KV_COMBINE_WARPS = 4;

__global__ void __launch_bounds__(32 * KV_COMBINE_WARPS)
kv_attention_combine(const float* __restrict__ ws_ml, const float* __restrict__ ws_acc, const float* __restrict__ sinks,
                     float* __restrict__ out, int n_heads, int H, int hd, int n_split) {
  const int lane = threadIdx.x % 32;
  const long long head = (long long)blockIdx.x * KV_COMBINE_WARPS + threadIdx.x / 32;
  if (head >= n_heads) return;
  const float* ml = ws_ml + head * n_split * 2;
  float M = NEG_INF;
  for (int s = 0; s < n_split; ++s) M = fmaxf(M, ml[2 * s]);
  float L = 0.0f;
  for (int s = 0; s < n_split; ++s) L += ml[2 * s] == NEG_INF ? 0.0f : ml[2 * s + 1] * expf(ml[2 * s] - M);
  if (sinks && L > 0.0f) L += expf(sinks[head % H] - M);  // the sink's logit: in the denominator only
  for (int d = lane; d < hd; d += 32) {
    float a = 0.0f;
    for (int s = 0; s < n_split; ++s)
      if (ml[2 * s] != NEG_INF) a += ws_acc[(head * n_split + s) * hd + d] * expf(ml[2 * s] - M);
    out[head * hd + d] = L > 0.0f ? a / L : 0.0f;  // L = 0 only when no split saw a key
  }
}
