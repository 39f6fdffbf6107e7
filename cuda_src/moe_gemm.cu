// moe_gemm.cu: the grouped GEMM over the M-blocks of a moe_align layout, weights in a quantized format
// (toolkit/ref/moe_gemm.py): the f32 kernels. On sm_80+ devices the launcher takes moe_gemm_mma.cu (tensor cores)
// instead, unless MOQE_CUDA_TENSOR_CORES=0; these run where the architecture is unknown (the default emulation).
//   x f32 [T or T*A, K] (GEMM1 reads row s / top_k for slot s; GEMM2 with x_is_slots reads row s), or for W8A8
//   (fp8) the per-token e4m3 codes xq uint8 [rows, K] + scales xs f32 [rows] from fp8_act_quant.cu;
//   w: logical [E, N, K] in one format (arrays as toolkit/formats lays them out); sorted_ids int32 [P],
//   expert_ids int32 [P / BM] -> out f32 [T*A, N] (zero-initialised by the launcher), out[s] = x_row(s) .
//   dequant(w[e]).T, times topk_w[s] when topk_w is not null (GEMM2 epilogue). Sentinel slots (>= n_slots) skipped.
//   The layout is the reference's exact one or moe_align.cu's upper-bound one (P = P_cap): an M-block whose
//   expert_ids entry is -1 (past the real layout) exits at once, before any barrier, with no read of sorted_ids
//   or of the weights and no write (every kernel, both paths); the grid covers all P / BM blocks, so the launch
//   plan depends on shapes only.
// One kernel template per shape regime, one tiny decoder per format (decode8: 8 consecutive weights of a row
// -> f32), all in cuda_src/formats.cuh and named by each Format record's ``cuda_decoder``.
// Kernels:
//   moe_gemm_splitk<Dec, BM>  decode (few slots per expert): grid (ceil(N / SK_WARPS), P / BM, split_k),
//       block 32*SK_WARPS; one warp per output row n, lanes stride K in chunks of 8, each decoded weight chunk
//       reused for the block's <= BM valid slots; warp-sum, atomicAdd into out (split-K over gridDim.z).
//   moe_gemm_tiled<Dec, BM>   prefill: grid (ceil(N / TN), P / BM), block TILE_THREADS; shared tiles
//       As[BM][TK] (gathered activation rows) and Ws[TN][TK] (decoded weights, each chunk decoded once), results
//       through Cs[BM][TN] to a coalesced epilogue. Inner product: 3xTF32 tensor cores (WMMA) on sm_80+ (needs
//       crt/mma.h: a #warning otherwise, which tests/test_cuda_compile.py fails on), the scalar FMA path elsewhere.
//       The CPU emulation runs both: the scalar path by default, the WMMA path with arch=800 (emulated WMMA in
//       cuda_src/emu/include/mma.h; the hardware fragment mapping is checked only on a GPU, tests/test_cuda_gpu.py).
// Contract (checked in toolkit/gpu/moe_gemm.py): K % 32 == 0, contiguous arrays; instantiated for splitk BM=16,
// tiled BM in {16, 64} (toolkit/gpu/moe_gemm.py KERNELS).
// The split-K kernel accumulates with atomicAdd: on a GPU its sums are not bitwise reproducible run to run.
// Check: pytest tests/test_cuda_emulated.py -k moe_gemm (both thread orders, both paths); registers/spills:
//   pytest tests/test_cuda_compile.py; GPU: tests/test_cuda_gpu.py. Bench: python -m toolkit.bench cuda (GEMM1 on
//   Mixtral's shapes; seed-formula and touched-bytes GB/s, fraction of 4.8 TB/s and of the tensor peak).
#include "formats.cuh"  // WView and the decoder of every format

// activation value k of row r: f32, or the decoded per-token e4m3 code for W8A8
template <class Dec>
__device__ __forceinline__ float act(const float* x, const unsigned char* xq, const float* xs, int K, int r, int k) {
  if (Dec::W8A8) return e4m3_decode(xq[(size_t)r * K + k]) * xs[r];
  return x[(size_t)r * K + k];
}

#define MOE_GEMM_ARGS                                                                                        \
  const float *__restrict__ x, const unsigned char *__restrict__ xq, const float *__restrict__ xs,           \
      const unsigned char *__restrict__ wq, const void *__restrict__ ws, const void *__restrict__ wb,        \
      const int *__restrict__ sorted_ids, const int *__restrict__ expert_ids, const float *__restrict__ topk_w, \
      float *__restrict__ out, int n_slots, int top_k, int x_is_slots, int N, int K, int group, int k_chunk

constexpr int SK_WARPS = 4;

template <class Dec, int BM>
__global__ void __launch_bounds__(32 * SK_WARPS) moe_gemm_splitk(MOE_GEMM_ARGS) {
  __shared__ int rows[BM], slots[BM];
  __shared__ int nvalid;
  const int mb = blockIdx.y, e = expert_ids[mb], lane = threadIdx.x % 32;
  if (e < 0) return;  // a block past the real layout (block-uniform: no barrier is skipped by part of the block)
  const int n = blockIdx.x * SK_WARPS + threadIdx.x / 32;
  if (threadIdx.x == 0) {  // compact the block's real slots (sentinels dropped)
    int c = 0;
    for (int m = 0; m < BM; ++m) {
      const int s = sorted_ids[mb * BM + m];
      if (s < n_slots) { slots[c] = s; rows[c] = x_is_slots ? s : s / top_k; ++c; }
    }
    nvalid = c;
  }
  __syncthreads();
  if (n >= N) return;
  const int nv = nvalid;
  const WView w{wq, ws, wb, N, K, group};
  const int k_end = min(K, (int)blockIdx.z * k_chunk + k_chunk);
  float acc[BM];
#pragma unroll
  for (int m = 0; m < BM; ++m) acc[m] = 0.0f;
  for (int k0 = blockIdx.z * k_chunk + lane * 8; k0 < k_end; k0 += 32 * 8) {
    float wv[8];
    Dec::decode8(w, e, n, k0, wv);
#pragma unroll
    for (int m = 0; m < BM; ++m) {
      if (m < nv) {
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) a += act<Dec>(x, xq, xs, K, rows[m], k0 + i) * wv[i];
        acc[m] += a;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < BM; ++m) {
    if (m < nv) {
      float v = warp_sum(acc[m]);
      if (lane == 0) {
        if (topk_w) v *= topk_w[slots[m]];
        atomicAdd(&out[(size_t)slots[m] * N + n], v);
      }
    }
  }
}

constexpr int TN = 64, TK = 32, TILE_THREADS = 256;
constexpr int TKP = TK + 4, TNP = TN + 4;  // padded rows: multiples of 4 floats (WMMA ldm), 32-byte aligned tiles

// Inner product of one K-tile, two interchangeable paths with zero() / step(As, Ws) / store(Cs):
//   ScalarTile: FMA loops, PER = BM*TN/256 outputs per thread (the path the CPU emulation runs);
//   TcTile (sm_80+): 3xTF32 on the tensor cores through WMMA m16n16k8: a = a_hi + a_lo, b likewise,
//   c += a_hi b_lo + a_lo b_hi + a_hi b_hi (the dropped a_lo b_lo is ~2^-22 relative). Near f32, not at it: the
//   tensor cores' f32 accumulation truncates, ~2^-23 of the running sum per k-step of 8, all one way: measured
//   6.2e-5 of max|out| at K 4096 on an H200 (the splitk kernel, f32 FMA: 1.5e-7); tests/test_cuda_gpu.py -k mixtral.
template <int BM>
struct ScalarTile {
  static constexpr int PER = BM * TN / TILE_THREADS, TM_STEP = TILE_THREADS / TN;
  float acc[PER];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int j = 0; j < PER; ++j) acc[j] = 0.0f;
  }
  __device__ __forceinline__ void step(const float* As, const float* Ws) {
    const int tn = threadIdx.x % TN, tm = threadIdx.x / TN;
#pragma unroll 8
    for (int kk = 0; kk < TK; ++kk) {
      const float wv = Ws[tn * TKP + kk];
#pragma unroll
      for (int j = 0; j < PER; ++j) acc[j] += As[(tm + j * TM_STEP) * TKP + kk] * wv;
    }
  }
  __device__ __forceinline__ void store(float* Cs) {
    const int tn = threadIdx.x % TN, tm = threadIdx.x / TN;
#pragma unroll
    for (int j = 0; j < PER; ++j) Cs[(tm + j * TM_STEP) * TNP + tn] = acc[j];
  }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !__has_include(<crt/mma.h>)
#warning "crt/mma.h missing (pip cuda-toolkit[crt]): moe_gemm_tiled falls back to the scalar path"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && __has_include(<crt/mma.h>)
#include <mma.h>
#define MOE_GEMM_TENSOR_CORES 1
template <int BM>
struct TcTile {
  static constexpr int TILES = (BM / 16) * (TN / 16), PER_WARP = (TILES + TILE_THREADS / 32 - 1) / (TILE_THREADS / 32);
  using FA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 8, nvcuda::wmma::precision::tf32, nvcuda::wmma::row_major>;
  using FB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 8, nvcuda::wmma::precision::tf32, nvcuda::wmma::col_major>;
  using FC = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 8, float>;
  FC c[PER_WARP];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int p = 0; p < PER_WARP; ++p) nvcuda::wmma::fill_fragment(c[p], 0.0f);
  }
  template <class F>
  __device__ __forceinline__ static void split(F& hi, F& lo) {
#pragma unroll
    for (int i = 0; i < hi.num_elements; ++i) {
      const float v = hi.x[i];
      hi.x[i] = nvcuda::wmma::__float_to_tf32(v);
      lo.x[i] = nvcuda::wmma::__float_to_tf32(v - hi.x[i]);
    }
  }
  __device__ __forceinline__ void step(const float* As, const float* Ws) {
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int p = 0; p < PER_WARP; ++p) {
      const int t = warp + p * (TILE_THREADS / 32);
      const int mt = t / (TN / 16), nt = t % (TN / 16);
#pragma unroll
      for (int kk = 0; kk < TK && t < TILES; kk += 8) {
        FA a_hi, a_lo;
        FB b_hi, b_lo;
        nvcuda::wmma::load_matrix_sync(a_hi, As + mt * 16 * TKP + kk, TKP);  // A [16, 8] row-major
        nvcuda::wmma::load_matrix_sync(b_hi, Ws + nt * 16 * TKP + kk, TKP);  // B [8, 16] = Ws^T: col-major
        split(a_hi, a_lo);
        split(b_hi, b_lo);
        nvcuda::wmma::mma_sync(c[p], a_lo, b_hi, c[p]);
        nvcuda::wmma::mma_sync(c[p], a_hi, b_lo, c[p]);
        nvcuda::wmma::mma_sync(c[p], a_hi, b_hi, c[p]);
      }
    }
  }
  __device__ __forceinline__ void store(float* Cs) {
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int p = 0; p < PER_WARP; ++p) {
      const int t = warp + p * (TILE_THREADS / 32);
      if (t < TILES)
        nvcuda::wmma::store_matrix_sync(Cs + (t / (TN / 16)) * 16 * TNP + (t % (TN / 16)) * 16, c[p], TNP,
                                        nvcuda::wmma::mem_row_major);
    }
  }
};
template <int BM> using Tile = TcTile<BM>;
#else
template <int BM> using Tile = ScalarTile<BM>;
#endif

template <class Dec, int BM>
__global__ void __launch_bounds__(TILE_THREADS, 2) moe_gemm_tiled(MOE_GEMM_ARGS) {  // <= 128 registers
  __shared__ __align__(32) float As[BM * TKP];  // [BM, TK] activations of the block's slots
  __shared__ __align__(32) float Ws[TN * TKP];  // [TN, TK] decoded weights
  __shared__ __align__(32) float Cs[BM * TNP];  // [BM, TN] results, for the epilogue
  __shared__ int rows[BM], slots[BM];
  const int tid = threadIdx.x, mb = blockIdx.y, e = expert_ids[mb], n0 = blockIdx.x * TN;
  if (e < 0) return;  // a block past the real layout (block-uniform: no barrier is skipped by part of the block)
  for (int m = tid; m < BM; m += TILE_THREADS) {
    const int s = sorted_ids[mb * BM + m];
    slots[m] = s;
    rows[m] = s < n_slots ? (x_is_slots ? s : s / top_k) : -1;
  }
  __syncthreads();
  const WView w{wq, ws, wb, N, K, group};
  Tile<BM> tile;
  tile.zero();
  for (int k0 = 0; k0 < K; k0 += TK) {
    for (int i = tid; i < BM * TK; i += TILE_THREADS) {
      const int m = i / TK, kk = i % TK, r = rows[m];
      As[m * TKP + kk] = r >= 0 ? act<Dec>(x, xq, xs, K, r, k0 + kk) : 0.0f;
    }
    for (int c = tid; c < TN * (TK / 8); c += TILE_THREADS) {
      const int nn = c / (TK / 8), kc = (c % (TK / 8)) * 8;
      float v[8];
      if (n0 + nn < N) Dec::decode8(w, e, n0 + nn, k0 + kc, v);
      else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) Ws[nn * TKP + kc + i] = v[i];
    }
    __syncthreads();
    tile.step(As, Ws);
    __syncthreads();
  }
  tile.store(Cs);
  __syncthreads();
  for (int i = tid; i < BM * TN; i += TILE_THREADS) {  // epilogue: routing weight, scatter rows to their slots
    const int m = i / TN, n = n0 + i % TN;
    if (rows[m] >= 0 && n < N) {
      float v = Cs[m * TNP + i % TN];
      if (topk_w) v *= topk_w[slots[m]];
      out[(size_t)slots[m] * N + n] = v;
    }
  }
}
