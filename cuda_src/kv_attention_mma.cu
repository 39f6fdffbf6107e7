// kv_attention_mma.cu: kv_attention (toolkit/ref/kv_attention.py) for prefill on tensor cores; launcher:
// toolkit/gpu/kv_attention.py (kind "mma", picked on sm_80+ when T * H / Hkv >= 16), kernels listed in
// toolkit/gpu/kv_attention_mma.py. Same inputs and output as kv_attention.cu's kernels (no key split).
// Check: pytest tests/test_cuda_mma.py -k prefill_attention; PTX: tests/test_cuda_ptx_gate.py.
#include "formats.cuh"
#include "mma.cuh"

#define NEG_INF __int_as_float(0xff800000)

// ---- kv_attention_mma<KRow, VRow>: prefill on tensor cores (hd <= 128, many query rows per KV head) ------------
// Grid (ceil(T * rep / 64), B * Hkv), 4 warps. The block's 64 rows are (query t, head r) pairs of one KV head,
// t-major (row i: t = i / rep, r = i % rep), so every row reads the same keys. Q is rounded to f16 once into
// shared memory; per tile of 32 keys in [min lo, max hi) of the block's rows, K and V are decoded from their stored
// format to f16 in shared memory, then each warp (16 rows): S = Q K^T by mma.sync m16n8k16 (ldmatrix.x4 of Q as A,
// of K rows as B), scale, causal / window mask per (row, key), online softmax per row (the 4 lanes of a row
// reduce by shuffles), P rounded to f16 straight from the S accumulators into A fragments (no shared round trip),
// O += P V by mma with V's fragments from ldmatrix.x4.trans. f32 accumulators and softmax; products of f16.
constexpr int ATT_ROWS = 64, ATT_KT = 32, ATT_HDP = 128 + 8;  // rows per block, keys per tile, padded row (f16)

template <class KRow, class VRow>
__global__ void __launch_bounds__(128)
kv_attention_mma(const float* __restrict__ q, const unsigned char* __restrict__ k_store,
                 const unsigned char* __restrict__ v_store, const int* __restrict__ positions,
                 const float* __restrict__ sinks, float* __restrict__ out, int B, int T, int H, int Hkv, int S, int hd,
                 float scale, int window) {
  __shared__ __align__(16) unsigned short Qs[ATT_ROWS][ATT_HDP], Ks[ATT_KT][ATT_HDP], Vs[ATT_KT][ATT_HDP];
  __shared__ int rpos[ATT_ROWS], krange[2];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, tg = lane % 4;
  const int b = blockIdx.y / Hkv, kh = blockIdx.y % Hkv, rep = H / Hkv, nrows = T * rep, row0 = blockIdx.x * ATT_ROWS;
  auto head_of = [&](int i) { return ((size_t)b * T + i / rep) * H + kh * rep + i % rep; };  // (b, t, h) of row i
  for (int r = tid; r < ATT_ROWS; r += 128) rpos[r] = row0 + r < nrows ? positions[b * T + (row0 + r) / rep] : -1;
  for (int idx = tid; idx < ATT_ROWS * hd; idx += 128) {
    const int r = idx / hd, d = idx % hd;
    Qs[r][d] = __half_as_ushort(__float2half_rn(row0 + r < nrows ? q[head_of(row0 + r) * hd + d] : 0.0f));
  }
  __syncthreads();
  if (tid == 0) {  // the keys any row of the block sees: [min lo, max hi)
    int lo = S, hi = 0;
    for (int r = 0; r < ATT_ROWS; ++r) {
      const int pr = rpos[r];
      if (pr < 0) continue;
      lo = min(lo, window > 0 ? max(0, pr - window + 1) : 0);
      hi = max(hi, min(pr + 1, S));
    }
    krange[0] = lo;
    krange[1] = hi;
  }
  __syncthreads();
  const int klo = krange[0], khi = krange[1], nblk = hd / 32;
  const int k_row = nblk * KRow::BLOCK_BYTES, v_row = nblk * VRow::BLOCK_BYTES;
  const unsigned char* kb = k_store + ((size_t)b * Hkv + kh) * S * k_row;
  const unsigned char* vb = v_store + ((size_t)b * Hkv + kh) * S * v_row;
  const int p0 = rpos[warp * 16 + g], p1 = rpos[warp * 16 + g + 8];
  float o[16][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  for (int kt0 = klo; kt0 < khi; kt0 += ATT_KT) {
    __syncthreads();  // the previous tile's K / V are consumed
    for (int idx = tid; idx < ATT_KT * hd; idx += 128) {
      const int key = idx / hd, d = idx % hd, j = kt0 + key;
      const bool ok = j < khi;
      Ks[key][d] = __half_as_ushort(__float2half_rn(ok ? KRow::load(kb + (size_t)j * k_row + (d / 32) * KRow::BLOCK_BYTES, d % 32) : 0.0f));
      Vs[key][d] = __half_as_ushort(__float2half_rn(ok ? VRow::load(vb + (size_t)j * v_row + (d / 32) * VRow::BLOCK_BYTES, d % 32) : 0.0f));
    }
    __syncthreads();
    float sc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
    for (int ks = 0; ks < hd / 16; ++ks) {
      unsigned a[4];
      ldmatrix_x4(a, &Qs[warp * 16 + lane % 16][ks * 16 + (lane / 16) * 8]);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        unsigned bk[4];
        ldmatrix_x4(bk, &Ks[np * 16 + (lane / 16) * 8 + lane % 8][ks * 16 + ((lane / 8) % 2) * 8]);
        OpF16::mma(sc[2 * np], a, bk);
        OpF16::mma(sc[2 * np + 1], a, bk + 2);
      }
    }
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int pr = i < 2 ? p0 : p1, j = kt0 + nt * 8 + 2 * tg + (i & 1);
        const bool vis = pr >= 0 && j <= pr && j < khi && (window <= 0 || pr - j < window);
        sc[nt][i] = vis ? sc[nt][i] * scale : NEG_INF;
        mx[i >> 1] = fmaxf(mx[i >> 1], sc[nt][i]);
      }
    }
    float corr[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {  // the 4 lanes of a row (same g) hold its 32 scores
      mx[h2] = fmaxf(mx[h2], __shfl_xor_sync(FULL_MASK, mx[h2], 1));
      mx[h2] = fmaxf(mx[h2], __shfl_xor_sync(FULL_MASK, mx[h2], 2));
      const float mn = fmaxf(m[h2], mx[h2]);
      corr[h2] = (m[h2] == NEG_INF || mn == NEG_INF) ? 0.0f : expf(m[h2] - mn);
      m[h2] = mn;
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sc[nt][i] = sc[nt][i] == NEG_INF ? 0.0f : expf(sc[nt][i] - m[i >> 1]);
        sum[i >> 1] += sc[nt][i];
      }
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      sum[h2] += __shfl_xor_sync(FULL_MASK, sum[h2], 1);
      sum[h2] += __shfl_xor_sync(FULL_MASK, sum[h2], 2);
      l[h2] = l[h2] * corr[h2] + sum[h2];
    }
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      o[nt][0] *= corr[0]; o[nt][1] *= corr[0];
      o[nt][2] *= corr[1]; o[nt][3] *= corr[1];
    }
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {  // P [16 rows x 16 keys] as the A operand, straight from the accumulators
      const unsigned a[4] = {OpF16::pack(sc[2 * kk][0], sc[2 * kk][1]), OpF16::pack(sc[2 * kk][2], sc[2 * kk][3]),
                             OpF16::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), OpF16::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
      for (int dn = 0; dn < 8; ++dn) {
        if (dn < hd / 16) {
          unsigned bv[4];
          ldmatrix_x4_trans(bv, &Vs[kk * 16 + lane % 8 + ((lane / 8) % 2) * 8][dn * 16 + (lane / 16) * 8]);
          OpF16::mma(o[2 * dn], a, bv);
          OpF16::mma(o[2 * dn + 1], a, bv + 2);
        }
      }
    }
  }
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int r = row0 + warp * 16 + g + 8 * h2;
    if (r >= nrows) continue;
    const size_t head = head_of(r);
    float L = l[h2];
    if (sinks && L > 0.0f) L += expf(sinks[head % H] - m[h2]);  // the sink's logit: in the denominator only
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      if (nt < hd / 8) {
        out[head * hd + nt * 8 + 2 * tg] = L > 0.0f ? o[nt][2 * h2] / L : 0.0f;
        out[head * hd + nt * 8 + 2 * tg + 1] = L > 0.0f ? o[nt][2 * h2 + 1] / L : 0.0f;
      }
    }
  }
}
