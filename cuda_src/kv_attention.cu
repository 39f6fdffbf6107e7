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
// Entry points: kv_attention_kernel<KRow, VRow, 4> (9 instantiations), kv_attention_kernel<Row, Row, 18> (MLA's
//   one latent store read as K and V: f32, q8_0, q4_0), kv_attention_combine.
// Contract (toolkit/gpu/kv_attention.py): hd a multiple of 32 up to 128, or up to 576 with one format for K and V;
//   H % Hkv == 0. Positions are not read by the
//   launcher (no host synchronisation; the runtime validates them before it copies them): the kernel reads only
//   keys in [0, S) whatever a position holds.
// Tolerance vs the NumPy reference: summation order and expf differ; tests use KV_ATT_TOL (atol/rtol 2e-5/1e-4).
// Check: pytest tests/test_cuda_emulated.py -k kv_attention; registers/spills: pytest tests/test_cuda_compile.py;
//   GPU: pytest tests/test_cuda_gpu.py -k kv. Bench: bytes read = visible rows * row bytes (K and V).
#include "formats.cuh"

// NB: the head dim's 32-value blocks a lane may hold: 4 (hd <= 128, GQA) or 18 (hd <= 576: MLA's latent + rope row)
#define NEG_INF __int_as_float(0xff800000)

constexpr int KV_ATT_MAX_WARPS = 8;  // query heads per block

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
  if (n_split == 1) {
    if (sinks && l > 0.0f) l += expf(sinks[h] - m);  // the sink's logit: in the denominator only
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
