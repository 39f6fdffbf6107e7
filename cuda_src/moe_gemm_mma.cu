// moe_gemm_mma.cu: the grouped GEMM of moe_gemm.cu (toolkit/ref/moe_gemm.py) on tensor cores: mma.sync fragments
// loaded with ldmatrix, activations (and e4m3 weights) streamed through a cp.async pipeline, weights of the other
// formats decoded once per block into the MMA's operand type. One kernel for decode and prefill; the launcher
// (toolkit/gpu/moe_gemm_mma.py) picks block_m and the K split from a table per (format, slots per expert).
//
//   xa: activations in the operand type, [rows, K] (OpF16 / OpBf16: 2-byte elements written by to_op below from
//       f32; OpE4m3: the per-token e4m3 codes of fp8_act_quant.cu, with their scales xs f32 [rows]);
//   w: logical [E, N, K] in one format (arrays as toolkit/formats lays them out), read by the format's decoder of
//       formats.cuh into the operand type, one 16-byte shared store per 8 weights: f16 from the affine int2/3/4
//       codes by integer tricks (decode8_f16: no byte loads, no float conversions; AffinePackedDec and the GGML
//       *PackedDec: codes repacked at upload in this kernel's tile order, 32 per thread per k-tile in one 16-byte
//       load for 4-bit codes, block scales as f16), int8's codes exactly as f16 with the row scale applied to the
//       sums in the epilogue (f16_codes), the other formats through decode8 (f32) and one rounding; e4m3 weights under OpE4m3 are the operand as stored, cp.async'ed like the
//       activations (row scale in the epilogue);
//   mode: 0 rows n0.. of the weight; 1 the block's 64 rows are 32 gate rows and the 32 up rows of the same outputs
//       (gate_up packed with halves), written to their own columns; 2 the same rows with silu_and_mul in the
//       epilogue, out = h f32 [T*A, I];
//   out f32 [split, T*A, N]: split-K partial sums (splitk_sum adds them in a fixed order: deterministic, no
//       atomics), times topk_w[slot] when topk_w is not null (GEMM2's epilogue). Sentinel slots are skipped, and
//       an M-block whose expert is -1 (past the real layout) exits before any barrier or read.
// Block (MmaTile): at BM 16 and 64, 4 warps over MMA_TN = 64 weight rows (16 per warp: the MMA's A operand, "swap
// AB" so that tiny M wastes at most 7 of 8 token columns) x BM tokens (B operand, BM / 8 tiles of 8); at BM 128
// (prefill), 128 weight rows x 128 tokens, 2 x 2 warps of 64 x 64, in dynamic shared memory. Per k-tile of KB = 128
// bytes of K:
//   cp.async the tile kt + STAGES - 1 of activation rows (gathered by sorted_ids; zero-filled past the block's
//   slots) -> decode weight tile kt + 1 to registers (its global loads in flight; repacked affine codes come from
//   a ring of registers fetched Dec::RING_TILES tiles ahead, int8 W8A16 codes ROW_RING_TILES tiles
//   ahead) -> MMAs of tile kt from shared
//   (ldmatrix.x4 of A per warp and of B per pair of token tiles) -> store tile kt + 1's weights -> next.
// Shared rows are ROWB = 144 bytes apart: the 8 row addresses of each ldmatrix phase fall in 8 different 16-byte
// bank groups (no conflicts); stores are 16-byte vectors. At BM 128 (T::WIDE below), rows of 128 bytes swizzled:
// packed codes, a k-tile runs a 64-row sub-tile at a time, its decode beside its own MMAs, the codes loaded into
// registers a sub-tile ahead (into L2 a k-tile and a half ahead); int8 W8A16, q8_0 and the 4-bit codes (DirectA), no
// decoded tile: the codes are copied in beside the activations and each warp makes its A fragments from them.
// Grid (M-blocks, N / rows a block, split): the M-blocks of an expert run side by side on the same weight tile, so
// its weights come from HBM about once (then L2).
#include "formats.cuh"
#include "mma.cuh"

constexpr int MMA_THREADS = 128, MMA_TN = 64;  // 4 warps x 16 weight rows
constexpr int KB = 128;                        // bytes of K per row per k-tile: four MMA steps of 32 bytes
constexpr int ROWB = KB + 16;                  // shared row stride in bytes
constexpr int STAGES = 3;                      // cp.async pipeline depth (2 when e4m3 weights stream too: 48 KB)

// decoders that produce f16 operand pairs directly by integer tricks (formats.cuh decode8_f16); the others decode
// to f32 and round (Op::pack)
template <class Dec, class Op> struct DirectF16 { static constexpr bool value = false; };
template <int B> struct DirectF16<AffineDec<B>, OpF16> { static constexpr bool value = true; };
// decoders of codes repacked at upload in tile order (formats.cuh AffinePackedDec and the GGML ones after it): wide
// loads per thread per k-tile, fetched Dec::RING_TILES k-tiles ahead (3 of int4 and q5, 6 of int3 and int2, 2 of
// q8_0; the k-quants q3_K, q4_K, q5_K those of int3, int4 and q5_1, q6_K 3, q2_K 12: a multiple of its super-block)
template <class Dec> struct Packed { static constexpr bool value = false; };
template <int B> struct Packed<AffinePackedDec<B>> { static constexpr bool value = true; };
template <int B, int O> struct Packed<ScalePackedDec<B, O>> { static constexpr bool value = true; };
template <> struct Packed<Mxfp4PackedDec> { static constexpr bool value = true; };
template <> struct Packed<Q8_0PackedDec> { static constexpr bool value = true; };
template <int O> struct Packed<Q5PackedDec<O>> { static constexpr bool value = true; };
template <> struct Packed<Q6_KPackedDec> { static constexpr bool value = true; };
template <> struct Packed<Q2_KPackedDec> { static constexpr bool value = true; };
// decoders whose codes are the f16 operand, exactly, and whose per-row scale multiplies the sums (int8 W8A16)
template <class Dec, class Op> struct RowScaledF16 { static constexpr bool value = false; };
template <> struct RowScaledF16<Int8Dec, OpF16> { static constexpr bool value = true; };
constexpr int ROW_RING_TILES = 2;  // int8 W8A16: the stored codes of the next 2 k-tiles in registers (8 words each)
// the ring of prefetched codes: k-tiles (PF) and words per tile per thread (RW); 1 x 1 (unused) for the others.
// At block_m 64 (prefill: compute-bound) q2_K's ring is 3 tiles, not int2's 6: its side words made beside 32
// accumulators left NVRTC 13.0's ptxas spilling at sm_80 (168 registers) with 6
template <class Dec, bool RING8, int BM> __host__ __device__ constexpr int ring_tiles() {
  if constexpr (Packed<Dec>::value) return BM >= 64 && Dec::SUPER > 0 ? 3 : Dec::RING_TILES;
  return RING8 ? ROW_RING_TILES : 1;
}
// the field exponent kc[1] of a packed decoder (formats.cuh field_f16): 256 (fields at bit 2), 3-bit codes 128
// (fields at bit 3: AffinePackedDec<3>::q_f16, int3 and q3_K)
template <class Dec> constexpr bool codes3 = __is_base_of(AffinePackedDec<3>, Dec);
// q2_K: a packed decoder whose side is made from factors and a super-block word (Dec::SUPER bytes a row)
template <class Dec> __host__ __device__ constexpr bool super_side() {
  if constexpr (Packed<Dec>::value) return Dec::SUPER > 0;
  return false;
}
// a packed decoder's side words a thread a 64-row sub-tile a k-tile (its 4 chunks' scale-bias words, or 4 f16
// scales in 2), q2_K aside; 1 (unused) for the others
template <class Dec> __host__ __device__ constexpr int side_words() {
  if constexpr (Packed<Dec>::value) return Dec::SIDE == 4 ? 4 : 2;
  return 1;
}
template <class Dec, bool RING8, int CH> __host__ __device__ constexpr int raw_words() {
  if constexpr (Packed<Dec>::value) return Dec::RAW_WORDS;
  return RING8 ? 2 * CH : 1;
}

// a packed decoder's 4 chunks of a thread (zeros where !ok), each chunk's index a template argument: the decoders'
// bit positions are immediates
template <class Dec>
__device__ __forceinline__ void packed_chunks(const unsigned* u, const unsigned* sd, bool ok, uint4* out) {
  const uint4 z = make_uint4(0u, 0u, 0u, 0u);
  out[0] = ok ? Dec::template chunk_f16<0>(u, sd) : z;
  out[1] = ok ? Dec::template chunk_f16<1>(u, sd) : z;
  out[2] = ok ? Dec::template chunk_f16<2>(u, sd) : z;
  out[3] = ok ? Dec::template chunk_f16<3>(u, sd) : z;
}

// f32 activations -> the operand type, two per 32-bit word (GEMM inputs; n_pairs = rows * K / 2)
template <class Op>
__global__ void to_op(const float* __restrict__ x, unsigned* __restrict__ y, long long n_pairs) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n_pairs; i += (long long)gridDim.x * blockDim.x)
    y[i] = Op::pack(x[2 * i], x[2 * i + 1]);
}

// split-K partials [split, n] -> out [n], summed in split order (deterministic; a kernel, so a recorded step or a
// captured CUDA graph replays it like the GEMM)
__global__ void splitk_sum(const float* __restrict__ parts, float* __restrict__ out, long long n, int split) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float v = 0.0f;
    for (int z = 0; z < split; ++z) v += parts[z * n + i];
    out[i] = v;
  }
}

// The block's tile by block_m: decode and small prefill (16, 64): 64 weight rows x BM tokens, 4 warps of 16 rows x
// BM tokens, static shared memory; prefill (128): 128 weight rows x 128 tokens, 4 warps of 64 x 64 (2 x 2), whose
// fragments each serve 4x the MMAs (0.047 shared bytes per f16 FLOP against 0.109 at 64: toolkit/gpu/occupancy.py
// prefill_table), 2-3 stages in 62-74 KB of dynamic shared memory (wide_smem_bytes). MIN_BLOCKS: the blocks per SM
// the register budget is cut for: 4 (128 registers) at 16; 3 (168) at 64, whose accumulators left NVRTC 13.0's
// ptxas spilling fp8 at sm_90 and mxfp4 at sm_80 under 128; 2 (255: 128 accumulators a thread) at 128.
template <int BM> struct MmaTile {
  static constexpr bool WIDE = BM >= 128;
  static constexpr int TN = WIDE ? 128 : MMA_TN;  // weight rows per block
  static constexpr int WR = WIDE ? 2 : 4;         // warps along the weight rows (WC = 4 / WR along the tokens)
  static constexpr int WC = 4 / WR;
  static constexpr int MF = TN / WR / 16;         // A fragments (16 weight rows) per warp
  static constexpr int WN = BM / WC;              // tokens per warp
  static constexpr int MIN_BLOCKS = WIDE ? 2 : BM >= 64 ? 3 : 4;
};
// shared bytes of a block: ST activation stages of BM rows, weight buffers of TN rows (e4m3: cp.async'ed stages)
template <class Op, int BM> __host__ __device__ constexpr int mma_stages() {
  return Op::ELEM == 1 || MmaTile<BM>::WIDE ? 2 : STAGES;
}
template <class Op, int BM> __host__ __device__ constexpr int mma_smem_bytes() {
  return (mma_stages<Op, BM>() * BM + (Op::ELEM == 1 ? mma_stages<Op, BM>() : 2) * MmaTile<BM>::TN) * ROWB;
}
// block_m 128, the decoders whose warps make their A fragments from the codes themselves, with no decoded tile: int8
// W8A16 (its codes the f16 operand exactly, the row scale in the epilogue), and codes packed at upload whose pair
// of a fragment a lane can cut from a shared word: q8_0 (8-bit codes, a scale a row a group of 32), the affine
// 4-bit codes (int4, q4_1, q4_K: a scale-bias word a row a group), q4_0 ((q - 8), a scale a group of 32) and mxfp4
// (e2m1 codes, a scale a group of 32). BITS: code width; SIDE: bytes of a row's side a group (0: int8's row scale,
// in the epilogue); OFF: subtracted; E2M1: the codes are mxfp4's
template <class Dec> struct DirectA { static constexpr bool value = false; };
template <int B, int S, int O, bool F = false> struct DirectSpec {
  static constexpr bool value = true, E2M1 = F;
  static constexpr int BITS = B, SIDE = S, OFF = O;
};
template <> struct DirectA<Int8Dec> : DirectSpec<8, 0, 0> {};
template <> struct DirectA<Q8_0PackedDec> : DirectSpec<8, 2, 0> {};
template <> struct DirectA<AffinePackedDec<4>> : DirectSpec<4, 4, 0> {};
template <> struct DirectA<Q4_0PackedDec> : DirectSpec<4, 2, 8> {};
template <> struct DirectA<Mxfp4PackedDec> : DirectSpec<4, 2, 0, true> {};
// their sides' bytes a stage: 2 sub-tiles x 2 halves of a k-tile (the group of k 0 and of k 32) x 64 rows
template <class Dec> __host__ __device__ constexpr int direct_scale_bytes() {
  if constexpr (DirectA<Dec>::value) return 2 * 2 * 64 * DirectA<Dec>::SIDE;
  return 0;
}
// block_m 128, dynamic shared memory (the launcher's toolkit/gpu/moe_gemm_mma.py dynamic_smem: 62-74 KB, so 2 blocks
// fit an A100's SM (164 KB) as an H100's). The packed codes: 2 activation stages and 2 decoded weight buffers of 128
// rows of KB bytes (swizzled, no padding; their codes go through registers).
// DirectA (no decoded buffer): WIDE_I8_STAGES stages of 128 activation rows of KB bytes, 128 rows of a k-tile's 64
// codes and their sides
constexpr int WIDE_I8_STAGES = 3;
template <class Dec> __host__ __device__ constexpr int wide_smem_bytes() {
  if constexpr (DirectA<Dec>::value)
    return WIDE_I8_STAGES * (128 * KB + 128 * 64 * DirectA<Dec>::BITS / 8 + direct_scale_bytes<Dec>());
  else if constexpr (Packed<Dec>::value) return 2 * (128 + 128) * KB;
  return 0;
}
static_assert(wide_smem_bytes<Int8Dec>() == 73728 && wide_smem_bytes<AffinePackedDec<4>>() == 64512 &&
              wide_smem_bytes<AffinePackedDec<2>>() == 65536 && wide_smem_bytes<Q8_0PackedDec>() == 75264 &&
              wide_smem_bytes<Q4_0PackedDec>() == 62976 && wide_smem_bytes<Mxfp4PackedDec>() == 62976,
              "dynamic_smem");

template <class Dec, class Op, int BM>
__global__ void __launch_bounds__(MMA_THREADS, MmaTile<BM>::MIN_BLOCKS) moe_gemm_mma(MOE_GEMM_MMA_ARGS) {
  using T = MmaTile<BM>;
  constexpr int KE = KB / Op::ELEM;        // K elements per k-tile
  constexpr bool RAW = Op::ELEM == 1;      // e4m3 weights: stored codes are the operand
  constexpr int TNB = T::TN, HT = TNB / 64;  // weight rows of the block, in 64-row sub-tiles (the packed tiles)
  constexpr int MF = T::MF, NT = T::WN / 8;  // per warp: A fragments of 16 rows, B token tiles of 8
  constexpr int CH = RAW ? 1 : TNB * KE / 8 / MMA_THREADS;  // decode8 chunks per thread per k-tile
  constexpr int ST = mma_stages<Op, BM>();  // activation (and e4m3 weight) stages in flight
  constexpr int SMEM = T::WIDE ? wide_smem_bytes<Dec>() : mma_smem_bytes<Op, BM>();
  static_assert(BM % 16 == 0 && CH >= 1 && BM * (KB / 16) % MMA_THREADS == 0, "BM a multiple of 16");
  unsigned char* smem;
  if constexpr (T::WIDE) {
    DYNAMIC_SMEM(dsmem, SMEM);
    smem = dsmem;
  } else {
    __shared__ __align__(16) unsigned char ssmem[SMEM];
    smem = ssmem;
  }
  auto Xs = reinterpret_cast<unsigned char(*)[BM][ROWB]>(smem);                // [ST][BM][ROWB]
  auto Ws = reinterpret_cast<unsigned char(*)[TNB][ROWB]>(smem + ST * BM * ROWB);  // [RAW ? ST : 2][TNB][ROWB]
  __shared__ int rows[BM], slots[BM];
  const int mb = blockIdx.x, e = expert_ids[mb];
  if (e < 0) return;  // a block past the real layout (block-uniform: no barrier is skipped by part of the block)
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wr = warp / T::WC, wc = warp % T::WC;
  // the block's rows n in 64-row sub-tiles ty = blockIdx.y * HT + n / 64, row r = n % 64 of it. mode 0: weight row
  // ty * 64 + r. mode 1 (halves) / 2 (halves + silu): rows r < 32 are gate rows ty * 32 + r, rows r >= 32 the up
  // rows I + ty * 32 + r - 32 of the same outputs (I = N / 2); mode 1 writes both to their columns of out [slots,
  // N], mode 2 writes h = silu(gate) * up, f32 [slots, I]
  const bool silu = mode == 2, halves = mode != 0;
  const int half = N / 2;
  auto wrow = [&](int n) {  // (HT == 1: n < 64, which the compiler cannot see)
    const int ty = blockIdx.y * HT + (HT == 1 ? 0 : n / 64), r = HT == 1 ? n : n % 64;
    return halves ? (r < 32 ? ty * 32 + r : half + ty * 32 + r - 32) : ty * 64 + r;
  };
  auto wrow_ok = [&](int n) {
    const int ty = blockIdx.y * HT + (HT == 1 ? 0 : n / 64), r = HT == 1 ? n : n % 64;
    return halves ? ty * 32 + r % 32 < half : ty * 64 + r < N;
  };
  const int k_begin = blockIdx.z * k_chunk, k_end = min(K, k_begin + k_chunk);
  const int n_tiles = (k_end - k_begin + KE - 1) / KE;
  for (int m = tid; m < BM; m += MMA_THREADS) {
    const int s = sorted_ids[mb * BM + m];
    slots[m] = s;
    rows[m] = s < n_slots ? (x_is_slots ? s : s / top_k) : -1;
  }
  const size_t row_bytes = (size_t)K * Op::ELEM;
  // block_m 128: each slot's activation row at the k-range's start (null past the block's slots), so a copy is one
  // shared load and one add, not a row index times the row's bytes (int8: 555 -> 521 SASS instructions a k-tile)
  __shared__ const unsigned char* xrow[T::WIDE ? BM : 1];
  if constexpr (T::WIDE)
    for (int m = tid; m < BM; m += MMA_THREADS)
      xrow[m] = rows[m] >= 0 ? xa + rows[m] * row_bytes + (size_t)k_begin * Op::ELEM : nullptr;
  __syncthreads();
  const WView w{wq, ws, wb, N, K, group};
  const int kb_end = k_end * Op::ELEM;

  // each thread's 16-byte copies of an activation stage: XC chunks, chunk i = row m, bytes off.. of it. Below 128
  // the source row of each (fixed over the k-tiles) is a pointer at the k-range's start with its limit (0 past the
  // block's slots), so a k-tile's copy is one add and one compare; at 128 (8 chunks, 128 accumulators) rows[] is read
  constexpr int XC = BM * (KB / 16) / MMA_THREADS, XP = T::WIDE ? 1 : XC;
  const unsigned char* xsrc[XP];
  int xlim[XP];  // a k-tile kt's copy i reads while kt * KB < xlim[i] (0 past the block's slots)
  // and writes row m = tid / (KB / 16) + i * (MMA_THREADS / (KB / 16)) of the stage, bytes (tid % (KB / 16)) * 16..
  const int xdst = (tid / (KB / 16)) * ROWB + (tid % (KB / 16)) * 16;
#pragma unroll
  for (int i = 0; i < XP; ++i) {
    const int c = tid + i * MMA_THREADS, r = rows[c / (KB / 16)], off = (c % (KB / 16)) * 16;
    xsrc[i] = xa + (r >= 0 ? r * row_bytes + (size_t)k_begin * Op::ELEM + off : 0);
    xlim[i] = r >= 0 ? kb_end - k_begin * Op::ELEM - off : 0;
  }
  // tile kt into stage st (kt % ST): one commit group per k-tile, empty past the end (a uniform group count).
  // XSEL (decode, block_m 16): the source is the row's pointer plus kt * KB (in the unrolled ring an immediate
  // offset from a pointer kept per pass: a select that kept a zero-filling copy's address at the row's start cost 3
  // instructions a k-tile; cp.async with src-size 0 reads nothing, so the address may pass the row's end), into the
  // stage at constant offsets from the thread's place; with f16 / bf16 operands past the end too, zero-filled copies
  // into a stage no tile reads (xlim bounds kt: kt * KB < xlim[i] only for kt < n_tiles), so no branch. block_m 64
  // keeps the earlier form: at its 168 registers this one left ptxas spilling AffineDec<3> (sm_80), e4m3 (sm_90)
  // and, under NVRTC 13.0, packed int2 (sm_80)
  constexpr bool XSEL = BM < 64;
  auto load_stage = [&](int kt, int st) {
    if (XSEL && !RAW ? true : kt < n_tiles) {
      const int kb0 = (k_begin + kt * KE) * Op::ELEM;
#pragma unroll
      for (int i = 0; i < XC; ++i) {  // a fixed count: no loop left in the main loop
        const int c = tid + i * MMA_THREADS, m = c / (KB / 16), off = (c % (KB / 16)) * 16;
        if constexpr (XSEL) {
          const bool ok = kt * KB < xlim[i];
          cp_async16(&Xs[st][0][0] + xdst + i * (MMA_THREADS / (KB / 16)) * ROWB, xsrc[i] + kt * KB, ok);
        } else {
          const bool ok = kt * KB < xlim[i];
          cp_async16(&Xs[st][m][off], ok ? xsrc[i] + kt * KB : xa, ok);
        }
      }
      if constexpr (RAW) {  // e4m3 weights: unrolled at decode only (at block_m 64 it left ptxas spilling on sm_90)
#pragma unroll(BM >= 64 ? 1 : TNB * (KB / 16) / MMA_THREADS)
        for (int i = 0; i < TNB * (KB / 16) / MMA_THREADS; ++i) {
          const int c = tid + i * MMA_THREADS, n = c / (KB / 16), off = (c % (KB / 16)) * 16;
          const bool ok = wrow_ok(n) && kb0 + off < kb_end;
          cp_async16(&Ws[st][n][off], ok ? wq + ((size_t)e * N + wrow(n)) * row_bytes + kb0 + off : wq, ok);
        }
      }
    }
    cp_async_commit();
  };
  uint4 wreg[CH];
  // repacked codes: a ring of the raw words of the next PF k-tiles (10-18 registers whatever the width), so each
  // block keeps PF tiles of codes in flight (Little's law at decode: one tile of 2-4 KB per block
  // was too little to stream HBM; toolkit/gpu/occupancy.py). Tile kt's words live in slot kt % PF; the main loop
  // is unrolled by PF so every slot index is a constant (registers, no moves: a move would wait for the load), and
  // where PF is a multiple of the ST activation stages (int2, int3, the 4- and 5-bit codes) so is every stage.
  // int8 W8A16 (codes as the operand, stored layout): a ring of ROW_RING_TILES tiles, each thread's CH 8-code
  // chunks (2 words each) of the tile, zero past the weight's rows and K (zero codes decode to +0). block_m 128
  // (prefill: compute-bound, and 128 accumulators a thread) fetches one tile ahead, of both sub-tiles
  constexpr bool RING8 = RowScaledF16<Dec, Op>::value;
  constexpr int PF = T::WIDE ? 1 : ring_tiles<Dec, RING8, BM>(), RW = HT * raw_words<Dec, RING8, CH / HT>();
  unsigned ring[PF][RW];
  // packed codes, per sub-tile (N / 64 tiles in both layouts; a sub-tile past the weight's rows reads sub-tile 0's,
  // decoded to zeros): the block's first k-tile of codes, and the thread's side values (scales, or scale-bias words)
  // at group 0. Those are in tile order (mma_pack's _tile_side, [E, N / 64, G, 16, 4]: the values of the thread's 4
  // rows of a group side by side), and log2(group) (a power of two), so a tile's are one shift and one load away
  const int gshift = 31 - __clz(group);
  // the packed decoders' field exponents (formats.cuh field_f16, sd[4 + i]) at block_m 16: or'd with a zero ptxas
  // cannot see (group >= 1), so they stay in 4 registers rather than being moved in again every k-tile (int2: 4 of
  // its 102 instructions a k-tile, now 98.5); constants elsewhere (at 64 and 128 registers are dearer than issue)
  const unsigned kz = BM == 16 ? (unsigned)gshift >> 5 : 0u;
  const unsigned kc[4] = {f16x2_int(1024) | kz, f16x2_int(codes3<Dec> ? 128 : 256) | kz, f16x2_int(64) | kz,
                          f16x2_int(16) | kz};
  // the thread's words of the block's first tile (codes), side words and (q2_K) super-block words, of sub-tile 0;
  // sub-tile h's are hstep[0..2] bytes on (0 where it is past the weight's rows: it reads sub-tile 0's), so a
  // 128-row block holds 3 pointers and 3 ints rather than 6 pointers
  const unsigned char *wtile0 = nullptr, *wside0 = nullptr, *wsup0 = nullptr;
  int hstep[3] = {0, 0, 0};
  if constexpr (Packed<Dec>::value) {
    const int rt = blockIdx.y * HT, dt = HT > 1 && rt + 1 < (N >> 6) ? 1 : 0;  // sub-tile 0's row tile, then 1's step
    // (opaque: a fetch or side load is then one multiply-add to the whole pointer: 2 instructions a tile fewer)
    wtile0 = opaque(wq + (((size_t)e * (N >> 6) + rt) * (size_t)(K >> 6) + (k_begin >> 6)) * Dec::TILE_BYTES +
                    tid * Dec::THREAD_BYTES);
    hstep[0] = dt * (K >> 6) * Dec::TILE_BYTES;
    if constexpr (Dec::SUPER > 0) {  // q2_K: the thread's factor words and super-block words of the block's first
      // super-block (k_begin a multiple of 256: the launcher's k_chunk), [E, N / 64, K / 256, 4 (the thread's
      // group in the tile, (tid % 8) / 2), 16 (tid / 8), 4 (the tile), 4 (the chunk)] and [E, N / 64, K / 256, 16, 4]
      const size_t sb = ((size_t)e * (N >> 6) + rt) * (size_t)(K >> 8) + (k_begin >> 8);
      wside0 = opaque((const unsigned char*)ws + ((sb * 4 + (tid % 8) / 2) * 16 + tid / 8) * 16);
      wsup0 = opaque((const unsigned char*)wb + (sb * 64 + (tid / 8) * 4) * Dec::SUPER);
      hstep[1] = dt * (K >> 8) * (4 * 16 * 16);
      hstep[2] = dt * (K >> 8) * (64 * Dec::SUPER);
    } else {
      wside0 = opaque((const unsigned char*)ws +
                      ((((size_t)e * (N >> 6) + rt) * (size_t)(K >> gshift)) * 64 + (tid / 8) * 4) * Dec::SIDE);
      hstep[1] = dt * (K >> gshift) * 64 * Dec::SIDE;
    }
  }
  auto wtile = [&](int h) { return wtile0 + (h ? hstep[0] : 0); };
  auto wside = [&](int h) { return wside0 + (h ? hstep[1] : 0); };
  auto wsup = [&](int h) { return wsup0 + (h ? hstep[2] : 0); };
  auto fetch_tile = [&](int kt, unsigned* raw) {
    if constexpr (Packed<Dec>::value) {  // past the block's last tile its last tile again (an L1 hit): every fetch
      // is a load, whatever kt, so the ring's registers are never merged across a branch (no moves). n_tiles >= 1:
      // the launcher's split is ceil(K / k_chunk), so no slice of K is empty
      const size_t at = (size_t)min(kt, n_tiles - 1) * Dec::TILE_BYTES;
#pragma unroll
      for (int h = 0; h < HT; ++h) Dec::fetch(wtile(h) + at, tid, raw + h * Dec::RAW_WORDS);
    } else if constexpr (RING8) {
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const int c = tid + j * MMA_THREADS, n = c / (KE / 8), k = k_begin + kt * KE + (c % (KE / 8)) * 8;
        const uint2 q = kt < n_tiles && wrow_ok(n) && k < k_end ? Dec::fetch8(w, e, wrow(n), k) : make_uint2(0u, 0u);
        raw[2 * j] = q.x;
        raw[2 * j + 1] = q.y;
      }
    }
  };
  if constexpr (!T::WIDE) {  // (block_m 128 stages its codes in shared memory: below)
#pragma unroll
    for (int i = 0; i < PF; ++i) fetch_tile(i, ring[i]);
  }
  // q2_K at block_m 16: its super-block's factor words (a word a k-tile), its 4 rows' (d, -dmin) words and their
  // biases (Q2_KPackedDec::bias), loaded and made once a super-block: at the tile `phase` 0 of it (a constant of
  // the unrolled ring, PF a multiple of 4), the next super-block's words then prefetched into L2 (held in registers
  // a super-block ahead they cost 12 registers and 4 moves a k-tile); at block_m 64 and 128 (3 tiles a ring) a tile
  // loads its own
  constexpr bool Q2S = super_side<Dec>() && BM == 16;
  unsigned q2f[Q2S ? HT : 1][4], q2d[Q2S ? HT : 1][4], q2b[Q2S ? HT : 1][4];
  static_assert(!Q2S || PF % 4 == 0, "q2_K's super-block phase is a constant of the unrolled ring");
  // the packed decoders' side words (scales, scale-bias words) at block_m 16, q2_K aside: a ring of SR k-tiles
  // fetched SR tiles ahead, as the codes are, so that no load in the main loop is used in the tile that issues it
  // (slot kt % SR, a constant of the unrolled ring: PF a multiple of SR). SW words a thread a sub-tile
  constexpr int SR = Packed<Dec>::value && BM == 16 && !super_side<Dec>() ? (PF % 2 == 0 ? 2 : PF) : 1;
  constexpr int SW = side_words<Dec>();
  static_assert(PF % SR == 0, "the side ring's slot is a constant of the unrolled ring");
  unsigned sring[SR][HT * SW];
  auto fetch_side = [&](int kt, unsigned* sw) {  // past the block's last tile its last tile's again (an L1 hit)
    if constexpr (SR > 1) {
      const unsigned gi = (unsigned)(k_begin + min(kt, n_tiles - 1) * KE + (tid % 8) * 8) >> gshift;
#pragma unroll
      for (int h = 0; h < HT; ++h) {
        const unsigned char* sp = wside(h) + (size_t)gi * (64 * Dec::SIDE);
        if constexpr (SW == 4) {
          const uint4 v = __ldg((const uint4*)sp);
          sw[4 * h] = v.x; sw[4 * h + 1] = v.y; sw[4 * h + 2] = v.z; sw[4 * h + 3] = v.w;
        } else {
          const uint2 v = __ldg((const uint2*)sp);
          sw[2 * h] = v.x; sw[2 * h + 1] = v.y;
        }
      }
    }
  };
#pragma unroll
  for (int i = 0; i < SR; ++i) fetch_side(i, sring[i]);
  // a packed decoder's side of sub-tile h at k-tile kt as loaded, where no ring holds it (block_m 64 and 128): its
  // 4 chunks' scale-bias words (16 bytes) or f16 scales (8), or q2_K's factor word (f) and its super-block's
  // (d, -dmin) words (v); side_make makes the 4 chunks' side words of it
  struct SideRaw {
    uint4 v;
    unsigned f;
  };
  auto side_load = [&](int kt, int h) {
    SideRaw r{make_uint4(0u, 0u, 0u, 0u), 0u};
    if constexpr (Packed<Dec>::value) {
      if constexpr (Dec::SUPER > 0) {
        const size_t at = (size_t)(kt >> 2);  // the super-block, from the block's first
        r.f = __ldg((const unsigned*)(wside(h) + at * (64 * 16 * Dec::SIDE) + (kt & 3) * 4));
        r.v = __ldg((const uint4*)(wsup(h) + at * (64 * Dec::SUPER)));
      } else {
        const unsigned gi = (unsigned)(k_begin + kt * KE + (tid % 8) * 8) >> gshift;  // the same for every chunk
        const unsigned char* sp = wside(h) + (size_t)gi * (64 * Dec::SIDE);
        if constexpr (Dec::SIDE == 4) {
          r.v = __ldg((const uint4*)sp);  // (ld.global.nc: opaque() hides the const restrict)
        } else {
          const uint2 v = __ldg((const uint2*)sp);
          r.v.x = v.x, r.v.y = v.y;
        }
      }
    }
    return r;
  };
  auto side_make = [&](const SideRaw& r, unsigned* sd) {  // sd[0..3]
    if constexpr (super_side<Dec>()) {
      unsigned d[4], b[4];
      Dec::supers(r.v, d, b);
      sd[0] = Dec::template side_word<0>(r.f, d[0], b[0], kc); sd[1] = Dec::template side_word<1>(r.f, d[1], b[1], kc);
      sd[2] = Dec::template side_word<2>(r.f, d[2], b[2], kc); sd[3] = Dec::template side_word<3>(r.f, d[3], b[3], kc);
    } else {
      sd[0] = r.v.x; sd[1] = r.v.y; sd[2] = r.v.z; sd[3] = r.v.w;
    }
  };
  // a packed decoder's side words of sub-tile h at k-tile kt (sd[0..3]: its 4 chunks' scale-bias words, or 4 f16
  // scales in 2); phase: kt % 4 where Q2S, kt % SR where SR > 1 (where neither, unused)
  auto side_of = [&](int kt, int h, int phase, unsigned* sd) {
    if constexpr (Packed<Dec>::value) {
      if constexpr (SR > 1) {
        const unsigned* sw = sring[phase % SR] + h * SW;
#pragma unroll
        for (int j = 0; j < 4; ++j) sd[j] = j < SW ? sw[j < SW ? j : 0] : 0u;
      } else if constexpr (Q2S) {  // q2_K at block_m 16: the 4 chunks' factor bytes, and their super-block words
        const size_t at = (size_t)(kt >> 2);  // the super-block, from the block's first
        if (phase == 0) {
          const uint4 fv = __ldg((const uint4*)(wside(h) + at * (64 * 16 * Dec::SIDE)));
          const uint4 dv = __ldg((const uint4*)(wsup(h) + at * (64 * Dec::SUPER)));
          q2f[h][0] = fv.x; q2f[h][1] = fv.y; q2f[h][2] = fv.z; q2f[h][3] = fv.w;
          Dec::supers(dv, q2d[h], q2b[h]);
          const size_t nx = (size_t)min((int)at + 1, (n_tiles - 1) >> 2);  // past the block's last: its last
          prefetch_l2(wside(h) + nx * (64 * 16 * Dec::SIDE));
          prefetch_l2(wsup(h) + nx * (64 * Dec::SUPER));
        }
        const unsigned f = q2f[h][phase];
        sd[0] = Dec::template side_word<0>(f, q2d[h][0], q2b[h][0], kc);
        sd[1] = Dec::template side_word<1>(f, q2d[h][1], q2b[h][1], kc);
        sd[2] = Dec::template side_word<2>(f, q2d[h][2], q2b[h][2], kc);
        sd[3] = Dec::template side_word<3>(f, q2d[h][3], q2b[h][3], kc);
      } else {
        side_make(side_load(kt, h), sd);
      }
    }
  };
  // weights of k-tile kt -> registers, in the operand type; `raw`: slot kt % PF of the ring (packed codes); phase:
  // kt % 4 where Q2S, kt % SR where SR > 1 (where neither, unused)
  auto decode_tile = [&](int kt, unsigned* raw, int phase) {
    if constexpr (Packed<Dec>::value) {  // whole tiles (N % 64 == 0, K % 64 == 0, k_chunk % 64 == 0)
      static_assert(CH == 4 * HT && KE == 64, "the packed layout is 64 x 64 tiles, 4 chunks of 8 codes per thread");
#pragma unroll
      for (int h = 0; h < HT; ++h) {  // sub-tile h: rows 64 h + tid / 8 + 16 j, as store_tile puts chunk 4 h + j
        const bool ok = HT == 1 || blockIdx.y * HT + h < (N >> 6);
        unsigned sd[8] = {0u, 0u, 0u, 0u, kc[0], kc[1], kc[2], kc[3]};  // the side words of the thread's 4 chunks
        // (4 words, or 4 f16 in 2), then the field exponents
        side_of(kt, h, phase, sd);
        packed_chunks<Dec>(raw + h * Dec::RAW_WORDS, sd, ok, wreg + 4 * h);  // the slot's words, as fetched
      }
      fetch_tile(kt + PF, raw);  // the slot's next tile, loaded into the slot's registers once they are decoded
      if constexpr (SR > 1) fetch_side(kt + SR, sring[phase % SR]);
    } else if constexpr (RING8) {
#pragma unroll
      for (int j = 0; j < CH; ++j) wreg[j] = Dec::f16_codes(make_uint2(raw[2 * j], raw[2 * j + 1]));
      fetch_tile(kt + PF, raw);  // the slot's next tile
    } else if constexpr (!RAW) {
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const int c = tid + j * MMA_THREADS, n = c / (KE / 8), k = k_begin + kt * KE + (c % (KE / 8)) * 8;
        const bool ok = wrow_ok(n) && k < k_end;
        uint4 r = make_uint4(0u, 0u, 0u, 0u);
        if constexpr (DirectF16<Dec, Op>::value) {
          if (ok) r = Dec::decode8_f16(w, e, wrow(n), k);
        } else {
          float v[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = 0.0f;
          if (ok) Dec::decode8(w, e, wrow(n), k, v);
          r = make_uint4(Op::pack(v[0], v[1]), Op::pack(v[2], v[3]), Op::pack(v[4], v[5]), Op::pack(v[6], v[7]));
        }
        wreg[j] = r;
      }
    }
  };
  // chunk j of a thread is row tid / (KE / 8) + j * (MMA_THREADS / (KE / 8)) of the tile, bytes (tid % (KE / 8)) * 16..
  const int wst = (tid / (KE / 8)) * ROWB + (tid % (KE / 8)) * 16;
  auto store_tile = [&](int buf) {
    if constexpr (!RAW) {
      unsigned char* dst = &Ws[buf][0][0] + wst;
#pragma unroll
      for (int j = 0; j < CH; ++j) *reinterpret_cast<uint4*>(dst + j * (MMA_THREADS / (KE / 8)) * ROWB) = wreg[j];
    }
  };

  float acc[MF][NT][4];
#pragma unroll
  for (int f = 0; f < MF; ++f)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[f][j][0] = acc[f][j][1] = acc[f][j][2] = acc[f][j][3] = 0.0f;
  const int a_row = wr * MF * 16 + lane % 16, b_row = wc * T::WN + (lane / 16) * 8 + lane % 8;  // ldmatrix rows
  // block_m 16 and 64, the MMAs of k-step ks (32 bytes of K) of a tile: weights wt, activations xt (shared). 16
  // weight rows a warp: its A fragment, then B a pair of token tiles at a time (block_m 128: mma_wide below)
  auto mma_step = [&](const unsigned char* wt, const unsigned char* xt, int ks) {
    static_assert(T::WIDE || MF == 1, "16 weight rows a warp below block_m 128");
    unsigned a[4];
    ldmatrix_x4(a, wt + a_row * ROWB + ks * 32 + (lane / 16) * 16);
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      unsigned b[4];
      ldmatrix_x4(b, xt + (b_row + j * 8) * ROWB + ks * 32 + ((lane / 8) % 2) * 16);
      Op::mma(acc[0][j], a, b);
      Op::mma(acc[0][j + 1], a, b + 2);
    }
  };
  // block_m 128, both forms below. Activation stages from smem, rows of KB bytes, 16-byte chunk c of row r stored at
  // chunk c ^ (r % 8): no padding, and the 8 rows of an ldmatrix phase, or the 8 chunks a quarter-warp copies or
  // stores to a row, each in banks of their own. The thread's copy rows are tid / 8 + 16 i, its chunk tid % 8: one
  // place for all of them (xoff)
  unsigned char* const Xw = smem;
  const int xoff = (tid / 8) * KB + (((tid % 8) ^ ((tid / 8) % 8)) << 4);
  auto copy_x = [&](int kt, int st, int i0, int n) {  // activation chunks i0 .. i0 + n - 1 of tile kt into stage st
    const int kb = kt * KB + (tid % 8) * 16;  // bytes on from the k-range's start
#pragma unroll
    for (int ii = 0; ii < n; ++ii) {
      const int i = i0 + ii;
      const unsigned char* p = xrow[tid / 8 + 16 * i];
      // (past the end or the block's slots a copy reads nothing, src-size 0: its address is not selected)
      cp_async16(Xw + st * (BM * KB) + xoff + i * 16 * KB, p + kb, p != nullptr && kb < kb_end - k_begin * Op::ELEM);
    }
  };
  // the B fragments of k-step ks of stage st (the warp's NT token tiles, a pair an ldmatrix; rows b_row + 8 j are the
  // lane's mod 8, so each fragment's swizzle is the lane's), and an A fragment f meeting all of them
  // (b: 2 NT words, token tiles j and j + 1's fragments at 2 j)
  auto b_frags = [&](int st, int ks, unsigned* b) {
    const unsigned char* xt = Xw + st * (BM * KB) + b_row * KB + (((2 * ks + (lane / 8) % 2) ^ (lane % 8)) << 4);
#pragma unroll
    for (int j = 0; j < NT; j += 2) ldmatrix_x4(b + 2 * j, xt + j * 8 * KB);
  };
  auto mma_row = [&](int f, const unsigned* a, const unsigned* b) {
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      Op::mma(acc[f][j], a, b + 2 * j);
      Op::mma(acc[f][j + 1], a, b + 2 * j + 2);
    }
  };
  if constexpr (T::WIDE && DirectA<Dec>::value) {
    // block_m 128, DirectA (int8 W8A16, q8_0, int4 / q4_1 / q4_K, q4_0, mxfp4): no decoded weights. A k-tile's codes
    // are copied as they are into shared memory beside its activations (cp.async, WIDE_I8_STAGES stages), with the
    // packed codes' sides, and each warp makes its own A fragments from them: a fragment row's 4 codes of a k-step
    // (k 2t, 2t + 1 and 2t + 8, 2t + 9, t = lane % 4) by two 2-byte shared loads and a byte permute (8-bit codes,
    // then Int8Dec::f16_pairs) or two word loads, each shifted by 4t and put under an f16 exponent by one lop3 (4-bit
    // codes: the pair the packed order keeps at nibbles t and t + 4; mxfp4's e2m1 placed as its decoder places it),
    // then the row's side as the format's decoder
    // applies it (bit-identical: int8's row scale multiplies the sums in the epilogue). The two warps that share a
    // weight row both convert it, but no decoded tile is stored and read back by ldmatrix: shared bytes a k-step 4 x
    // 64 x 32 (activation fragments) + 4 x 64 x 32 (the code loads: a 2- or 4-byte load takes a wavefront, as
    // ldmatrix of the row would) + 128 x 32 + 128 x 16 x bits / 8 (the copies in) + the sides (copied in, a
    // wavefront or two a warp read back): int8 0.043 B/FLOP, 0.73 of the dense peak, where the decoded tile with its
    // codes staged was 0.055, 0.57 (q8_0 0.69 against 0.57; int4 0.69, q4_0 and mxfp4 0.72 against 0.62:
    // occupancy.prefill_table)
    using DA = DirectA<Dec>;
    static_assert(RowScaledF16<Int8Dec, Op>::value, "DirectA makes f16 operands (OpF16)");
    static_assert(KE == 64 && MF == 4 && NT == 8 && XC == 8 && HT == 2,
                  "block_m 128: 4 warps of 64 x 64, k-tiles of 64");
    constexpr bool PK = DA::SIDE > 0;  // packed at upload: tiles of 64 x 64 in the packed order, a side a group
    constexpr int S = WIDE_I8_STAGES, CB = 128 * KE * DA::BITS / 8, SB = direct_scale_bytes<Dec>();  // bytes a stage
    constexpr int TB = 64 * KE * DA::BITS / 8, SS = 64 * DA::SIDE;  // a packed tile; a sub-tile's side of a group
    constexpr int NC = CB / 16 / MMA_THREADS;  // the thread's 16-byte code copies a k-tile: 4 (8-bit), 2 (4-bit)
    // Xw: [S][BM][KB] activations
    unsigned char* const Cw = smem + S * BM * KB;  // [S][CB] codes (int8 [128 rows][64]; packed, the 2 tiles) ...
    unsigned char* const Sw = Cw + S * CB;         // [S][2 sub-tiles][2 halves][16][4] sides (packed)
    // ... swizzled so that the 8 rows of a warp's code load fall in distinct banks: int8 chunk q of row r at
    // q ^ (r / 2 % 4); packed, each 128 threads' 16 bytes of a tile (q8_0 its 2 halves) thread t's at slot
    // t / 8 * 8 + (t ^ t / 8) % 8, the place of the thread's activation chunk in a stage (xoff)
    // the thread's code copies (sources and limits fixed over the k-tiles; past the weight's rows or K a copy reads
    // nothing: src-size 0). int8: rows tid / 4 + 32 i of the block, chunk tid % 4 (16 codes). Packed: copy i is part
    // i % (NC / 2) of sub-tile i / (NC / 2)'s tile, the thread's 16 bytes (a sub-tile past the weight's rows reads
    // sub-tile 0's)
    const int coff = PK ? xoff : (tid / 4) * KE + (((tid % 4) ^ ((tid / 8) % 4)) << 4);
    const unsigned char* csrc[NC];
    int clim[NC];  // int8: tile kt's copy i reads while kt * KE < clim[i]
#pragma unroll
    for (int i = 0; i < NC; ++i) {
      if constexpr (PK) {  // the block's tile pointers (wtile: the thread's 16 bytes of the first part)
        static_assert(Dec::TILE_BYTES == TB && TB == NC / 2 * MMA_THREADS * 16 && Dec::THREAD_BYTES == 16,
                      "packed: NC / 2 parts of 128 x 16 bytes");
        csrc[i] = wtile(i / (NC / 2)) + (i % (NC / 2)) * (MMA_THREADS * 16);
        clim[i] = 0;
      } else {
        const int n = tid / 4 + 32 * i;
        const bool ok = wrow_ok(n);
        csrc[i] = wq + (ok ? ((size_t)e * N + wrow(n)) * K + k_begin + (tid % 4) * 16 : 0);
        clim[i] = ok ? k_end - k_begin - (tid % 4) * 16 : 0;
      }
    }
    // the sides: thread c < SB / 16 copies 16 bytes c % (SS / 16) of block c / (SS / 16) = (sub-tile, half), the
    // group of k 32 x half of the k-tile (mma_pack's tile order, [E, N / 64, K / group, 16, 4] x SIDE bytes)
    const int sblk = tid / (SS > 0 ? SS / 16 : 1);
    // (wside: the block's side pointers, the thread's 4 rows at (tid / 8) * 4)
    const unsigned char* ssrc =
        PK ? wside(sblk / 2) - (tid / 8) * 4 * DA::SIDE + (tid % (SS > 0 ? SS / 16 : 1)) * 16 : nullptr;
    auto copy_tile = [&](int kt, int st) {  // tile kt's activations, codes (and sides) into stage st: one group
      copy_x(kt, st, 0, XC);
#pragma unroll
      for (int i = 0; i < NC; ++i) {
        if constexpr (PK)  // (past the block's last tile: zeros, into a stage no tile reads)
          cp_async16(Cw + st * CB + i * (CB / NC) + coff, csrc[i] + (size_t)kt * TB, kt < n_tiles);
        else
          cp_async16(Cw + st * CB + coff + i * 32 * KE, csrc[i] + kt * KE, kt * KE < clim[i]);
      }
      if constexpr (PK) {
        if (tid < SB / 16) {
          const unsigned gi = (unsigned)(k_begin + kt * KE + 32 * (sblk % 2)) >> gshift;
          cp_async16(Sw + st * SB + tid * 16, ssrc + (size_t)gi * SS, kt < n_tiles);
        }
      }
      cp_async_commit();
    };
    // the lane's code bytes, rows g and g + 8 of fragment f of the warp's 64 rows (block rows wr * 64 + 16 f + g),
    // k 2t.. of the k-step's first 8 codes and of its second 8. int8: row r's chunk ks at ks ^ (r / 2 % 4), the same
    // for rows g and g + 8: cl ^ (ks << 4), then + 8. Packed: sub-tile wr's tile, thread slot (g or g + 8) * 8 +
    // (kk ^ g) for the 8 codes kk (2 ks, 2 ks + 1) of the row: q8_0 half f / 2, byte (f % 2) * 8 + 2t of the slot;
    // 4-bit, word f (the pair at nibbles t and t + 4; mxfp4's bits split as mma_pack.E2M1 places them)
    const int g4 = lane / 4, t4 = lane % 4;
    // mxfp4: the right rotations that put the lane's pair's (exponent, mantissa) and sign bits at 9 and 15
    const unsigned e2m1_re = (Mxfp4PackedDec::ROT_EM >> (8 * t4)) & 31u;
    const unsigned e2m1_rs = (Mxfp4PackedDec::ROT_SG >> (8 * t4)) & 31u;
    const int cl = PK ? wr * TB + g4 * 128 + (g4 << 4) + (DA::BITS == 8 ? 2 * t4 : 0)
                      : (wr * 64 + g4) * KE + 2 * t4 + (((g4 >> 1) & 3) << 4);
    // the 2 pairs of a row of a fragment (k 2t, 2t + 1 and 2t + 8, 2t + 9) as exact f16: q (int8, q8_0), q - OFF
    auto pairs = [&](const unsigned char* p0, const unsigned char* p1) {
      if constexpr (DA::BITS == 8) {
        return Int8Dec::f16_pairs(
            __byte_perm((unsigned)*(const unsigned short*)p0, (unsigned)*(const unsigned short*)p1, 0x5410));
      } else if constexpr (DA::E2M1) {
        // e2m1 * 2^-14 as f16, Mxfp4PackedDec::e2m1_f16's bits: the lane's pair t's (exponent, mantissa) bits rotated
        // from Mxfp4PackedDec::EM[t] to 9-11 (and 25-27), its signs from SG[t] to 15 and 31 (one funnel shift each,
        // by the lane's amounts: a rotation moves the masked bits as a shift would)
        auto e2m1 = [&](unsigned w) {
          return and_or<0x80008000u>(__funnelshift_r(w, w, e2m1_rs), __funnelshift_r(w, w, e2m1_re) & 0x0e000e00u);
        };
        return make_uint2(e2m1(*(const unsigned*)p0), e2m1(*(const unsigned*)p1));
      } else {
        const unsigned w0 = *(const unsigned*)p0 >> (4 * t4), w1 = *(const unsigned*)p1 >> (4 * t4);
        return make_uint2(hsub2_bits(field_f16<0, 4>(w0), f16x2_int(1024 + DA::OFF)),
                          hsub2_bits(field_f16<0, 4>(w1), f16x2_int(1024 + DA::OFF)));
      }
    };
    auto mma_k = [&](int st, int ks) {  // k-step ks of the tile in stage st, 64 x 64 a warp
      unsigned b[16];  // (2 NT: 8 token tiles a warp at block_m 128)
      b_frags(st, ks, b);
      const unsigned char* c0 = Cw + st * CB + (PK ? cl ^ ((2 * ks) << 4) : cl ^ (ks << 4));
      const unsigned char* c1 = PK ? Cw + st * CB + (cl ^ ((2 * ks + 1) << 4)) : c0 + 8;
      // the packed side of rows g and g + 8 of fragments 0-3: f16 scales (one 8-byte load each) or scale-bias words
      // (16 bytes), of the k-step's half of the k-tile
      uint4 slo = make_uint4(0u, 0u, 0u, 0u), shi = slo;
      if constexpr (PK) {
        const unsigned char* sp = Sw + st * SB + (wr * 2 + ks / 2) * SS + g4 * (4 * DA::SIDE);
        if constexpr (DA::SIDE == 2) {
          const uint2 a = *(const uint2*)sp, c = *(const uint2*)(sp + 8 * 4 * DA::SIDE);
          slo = make_uint4(a.x, a.y, 0u, 0u), shi = make_uint4(c.x, c.y, 0u, 0u);
        } else {
          slo = *(const uint4*)sp, shi = *(const uint4*)(sp + 8 * 4 * DA::SIDE);
        }
      }
#pragma unroll
      for (int f = 0; f < MF; ++f) {
        // fragment f's row g, and its row g + 8
        const int fo = !PK ? f * 16 * KE : DA::BITS == 8 ? (f / 2) * (TB / 2) + (f % 2) * 8 : f * 4;
        const int ho = PK ? 8 * 128 : 8 * KE;
        const uint2 lo = pairs(c0 + fo, c1 + fo), hi = pairs(c0 + fo + ho, c1 + fo + ho);
        unsigned a[4] = {lo.x, hi.x, lo.y, hi.y};  // the m16n8k16 A fragment's order
        if constexpr (DA::SIDE == 2) {  // times the row's f16 scale (side_mul)
          const unsigned sl = f < 2 ? slo.x : slo.y, sh = f < 2 ? shi.x : shi.y;
#pragma unroll
          for (int i = 0; i < 4; ++i)
            a[i] = f % 2 ? hmul2_half_bits<1>(a[i], i % 2 ? sh : sl) : hmul2_half_bits<0>(a[i], i % 2 ? sh : sl);
        } else if constexpr (DA::SIDE == 4) {  // times the scale plus the bias (AffinePackedDec::chunk_f16)
          const unsigned wl = f == 0 ? slo.x : f == 1 ? slo.y : f == 2 ? slo.z : slo.w;
          const unsigned wh = f == 0 ? shi.x : f == 1 ? shi.y : f == 2 ? shi.z : shi.w;
#pragma unroll
          for (int i = 0; i < 4; ++i) a[i] = hfma2_lohi_bits(a[i], i % 2 ? wh : wl);
        }
        mma_row(f, a, b);
      }
    };
#pragma unroll
    for (int s = 0; s < S - 1; ++s) copy_tile(s, s);
    int st = 0;  // kt % S
    for (int kt = 0; kt < n_tiles; ++kt) {
      cp_async_wait<S - 2>();  // this thread's copies of tile kt have landed ...
      __syncthreads();         // ... and everyone's, and everyone is done with tile kt - 1's stage
      copy_tile(kt + S - 1, st == 0 ? S - 1 : st - 1);  // past the last tile zero-filled, into a stage no tile reads
#pragma unroll
      for (int ks = 0; ks < KB / 32; ++ks) mma_k(st, ks);
      st = st == S - 1 ? 0 : st + 1;
    }
  } else if constexpr (T::WIDE) {
    // block_m 128, packed codes. Per k-tile kt, a sub-tile h (64 weight rows) at a time: 2 of the MMA k-steps of
    // tile kt, and beside them that sub-tile's share of the copy of tile kt + 1's activations (cp.async, one group a
    // k-tile), its decode of tile kt + 1's codes into the other weight buffer, then the load of the next decode's
    // codes into the registers that decode has just read (rq: RAW_WORDS registers, a sub-tile ahead), and the
    // prefetch into L2 of tile kt + 3's (so that load, a k-tile and a half later, finds them there). So a warp's
    // decode issues in the shadow of its own MMAs (ptxas schedules the two together) rather than in a phase of its
    // own between barriers. The codes pass the shared-memory array once (a load's returned wavefronts,
    // ld.global.cg: no L1 line), where a cp.async stage of them passed it twice (copied in, read back): 2-6 bits x
    // 128 rows x 16 bytes a k-step fewer (q6_K 0.58 -> 0.62 of the dense peak: occupancy.prefill_table), and 4-12 KB
    // less shared memory a block. (Unrolling the sub-tile loop, with a ring of both sub-tiles' codes a k-tile ahead,
    // issued 15-25 % fewer instructions but took all 255 registers and spilled under one NVRTC or another.)
    static_assert(ST == 2 && HT == 2 && KB / 32 == 2 * HT && XC % HT == 0 && KE == 64 && NT == 8 && Packed<Dec>::value,
                  "block_m 128: 2 stages, 2 sub-tiles of 2 k-steps, f16 operands of packed codes");
    // Xw: [2][BM][KB] activation stages; the decoded weights are stored as they are (rows of KB bytes at xoff)
    unsigned char* const Ww = smem + 2 * BM * KB;  // [2][TNB][KB] decoded weight buffers
    unsigned rq[Dec::RAW_WORDS];  // the thread's codes of the next sub-tile to decode, as loaded
    auto load_codes = [&](int kt, int h) {  // sub-tile h of tile kt's; past the block's last tile, its last tile's
      Dec::template fetch<true>(wtile(h) + (size_t)min(kt, n_tiles - 1) * Dec::TILE_BYTES, tid, rq);
    };
    // sub-tile h of tile kt's codes into L2, a 128-byte line a thread (TILE_BYTES / 128 threads, contiguous)
    const int pf_off = tid * (128 - Dec::THREAD_BYTES);  // from the thread's place in the tile to its line
    auto prefetch_codes = [&](int kt, int h) {
      if (tid * 128 < Dec::TILE_BYTES)
        prefetch_l2(wtile(h) + pf_off + (size_t)min(kt, n_tiles - 1) * Dec::TILE_BYTES);
    };
    // sub-tile h from the codes rq holds -> weight buffer wb, with its side as loaded (side_load)
    auto decode_sub = [&](int h, int wb, const SideRaw& side) {
      unsigned sd[8] = {0u, 0u, 0u, 0u, kc[0], kc[1], kc[2], kc[3]};
      side_make(side, sd);
      // each chunk stored as it is made (4 registers live, not 16). A sub-tile past the weight's rows decodes
      // sub-tile 0's codes: its rows' sums are never written, and no other row's sums read them
      uint4* dst = reinterpret_cast<uint4*>(Ww + wb * (TNB * KB) + h * 64 * KB + xoff);
      dst[0] = Dec::template chunk_f16<0>(rq, sd);
      dst[KB] = Dec::template chunk_f16<1>(rq, sd);  // (rows 16 j on: 16 x KB bytes, KB uint4)
      dst[2 * KB] = Dec::template chunk_f16<2>(rq, sd);
      dst[3 * KB] = Dec::template chunk_f16<3>(rq, sd);
    };
    // the MMAs of k-step ks of the tile in stage / buffer st, 64 x 64 a warp: its NT token tiles' B fragments, then
    // each A fragment meets all of them. Rows a_row + 16 f and b_row + 8 j are the lane's (mod 8), so each
    // fragment's swizzle is the lane's
    auto mma_wide = [&](int st, int ks) {
      const unsigned char* wt = Ww + st * (TNB * KB) + a_row * KB + (((2 * ks + lane / 16) ^ (lane % 8)) << 4);
      unsigned b[16];  // (2 NT: 8 token tiles a warp at block_m 128)
      b_frags(st, ks, b);
#pragma unroll
      for (int f = 0; f < MF; ++f) {
        unsigned a[4];
        ldmatrix_x4(a, wt + f * 16 * KB);
        mma_row(f, a, b);
      }
    };
    // the prologue: tile 0's activations and codes; its decode, and tiles 1 and 2 into L2
    load_codes(0, 0);
    copy_x(0, 0, 0, XC);
    cp_async_commit();
#pragma unroll
    for (int h = 0; h < HT; ++h) {
      prefetch_codes(1, h), prefetch_codes(2, h);
      decode_sub(h, 0, side_load(0, h));
      load_codes(h, h ^ 1);  // tile 0's sub-tile 1, then tile 1's sub-tile 0
    }
    // the side of the next sub-tile to decode, loaded one sub-tile ahead (a loop-carried value: no ring to index):
    // loaded where it was used, its latency stood before the decode's first dependent instruction, and so before
    // every MMA issued after it
    SideRaw side_next = side_load(min(1, n_tiles - 1), 0);
    for (int kt = 0; kt < n_tiles; ++kt) {
      const int st = kt & 1;  // tile kt's activation stage and weight buffer
      cp_async_wait<0>();  // this thread's copies of tile kt's activations have landed ...
      __syncthreads();     // ... and everyone's, and everyone is done with tile kt - 1's stage and buffer
#pragma unroll 1
      for (int h = 0; h < HT; ++h) {  // past the last tile the copies zero-fill (and the loads read the last codes
        // again) into a stage and registers no tile reads, and the decode stores into a buffer no tile reads
        const SideRaw side = side_next;  // tile kt + 1's, sub-tile h (past the block's last tile its last tile's)
        side_next = side_load(min(h ? kt + 2 : kt + 1, n_tiles - 1), h ^ 1);  // the next: the other sub-tile
        copy_x(kt + 1, st ^ 1, h * (XC / HT), XC / HT);
        prefetch_codes(kt + 3, h);
        mma_wide(st, 2 * h);
        decode_sub(h, st ^ 1, side);       // tile kt + 1's sub-tile h, with its side ...
        load_codes(kt + 1 + h, h ^ 1);  // ... then the next decode's codes into the same registers
        mma_wide(st, 2 * h + 1);
      }
      cp_async_commit();
    }
  } else {  // block_m 16 and 64
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) load_stage(s, s);
    decode_tile(0, ring[0], 0);
    store_tile(0);
    int st_run = 0;  // tile kt's activation stage, kt % ST, where the unrolled ring does not make it a constant
    for (int kt0 = 0; kt0 < n_tiles; kt0 += PF) {
#pragma unroll
      for (int s = 0; s < PF; ++s) {
        const int kt = kt0 + s;
        if (kt >= n_tiles) break;  // block-uniform
        const int st = PF % ST == 0 ? s % ST : st_run;  // kt0 a multiple of PF, so of ST: kt % ST == s % ST
        cp_async_wait<ST - 2>();  // this thread's copies of tile kt have landed ...
        __syncthreads();              // ... and everyone's; tile kt - 1's buffers are free again
        load_stage(kt + ST - 1, st == 0 ? ST - 1 : st - 1);
        const bool next = kt + 1 < n_tiles;
        if (next) decode_tile(kt + 1, ring[(s + 1) % PF], (s + 1) % (Q2S ? 4 : SR));
        const unsigned char* wt = &Ws[RAW ? st : kt % 2][0][0];
        const unsigned char* xt = &Xs[st][0][0];
#pragma unroll
        for (int ks = 0; ks < KB / 32; ++ks) mma_step(wt, xt, ks);
        if (next) store_tile((kt + 1) % 2);
        if constexpr (PF % ST != 0) st_run = st == ST - 1 ? 0 : st + 1;
      }
    }
  }
  cp_async_wait<0>();  // no copy may still be landing when the block's shared memory is reused

  // epilogue: lane holds rows n = wr * MF * 16 + 16 f + g (+8) of the block, tokens wc * WN + 8j + 2t (+1)
  const int g = lane / 4, t = lane % 4;
  auto row_of = [&](int f, int i) { return wr * MF * 16 + f * 16 + g + (i >> 1) * 8; };
  auto tok_of = [&](int j, int i) { return wc * T::WN + j * 8 + 2 * t + (i & 1); };
  if constexpr (RAW || RowScaledF16<Dec, Op>::value) {  // e4m3 and int8 row scales (f32 [E, N]), then the activation's
    float wsc[MF][2];
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = row_of(f, 2 * h);
        wsc[f][h] = wrow_ok(n) ? ((const float*)ws)[(size_t)e * N + wrow(n)] : 1.0f;
      }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {  // token tok_of(j, p): one activation scale for every row the thread holds
        const int m = tok_of(j, p);
        const float sx = RAW ? (rows[m] >= 0 ? xs[rows[m]] : 0.0f) : 1.0f;
#pragma unroll
        for (int f = 0; f < MF; ++f)
#pragma unroll
          for (int h = 0; h < 2; ++h) acc[f][j][2 * h + p] *= wsc[f][h] * sx;
      }
    }
  }
  if (silu) {
    if constexpr (MF > 1) {  // a warp's 64 rows are one sub-tile: gate rows (fragments 0, 1) and the up rows of the
      // same outputs (fragments 2, 3) in the same thread's registers
      const int ty = blockIdx.y * HT + wr;
#pragma unroll
      for (int f = 0; f < MF / 2; ++f) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int m = tok_of(j, i), n = ty * 32 + f * 16 + g + (i >> 1) * 8;
            if (rows[m] < 0 || n >= half) continue;
            const float gate = acc[f][j][i];  // silu(gate) * up, as silu_and_mul.cu
            out[(size_t)slots[m] * half + n] = gate / (1.0f + expf(-gate)) * acc[f + MF / 2][j][i];
          }
        }
      }
      return;
    } else {  // warps 2-3 (up rows) hand their sums to warps 0-1 (gate rows of the same outputs) through shared
      static_assert(sizeof(float) * (MMA_TN / 2) * (BM + 1) <= ST * BM * ROWB, "the up sums fit in the drained stages");
      float(*up)[BM + 1] = reinterpret_cast<float(*)[BM + 1]>(smem);  // [32 rows][BM tokens]
      __syncthreads();  // every warp is done reading the activation stages
      if (warp >= 2) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) up[(warp - 2) * 16 + g + (i >> 1) * 8][tok_of(j, i)] = acc[0][j][i];
      }
      __syncthreads();
      if (warp >= 2) return;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = tok_of(j, i), r = row_of(0, i), n = blockIdx.y * (MMA_TN / 2) + r;
          if (rows[m] < 0 || n >= half) continue;
          const float gate = acc[0][j][i];  // silu(gate) * up, as silu_and_mul.cu
          out[(size_t)slots[m] * half + n] = gate / (1.0f + expf(-gate)) * up[r][m];
        }
      }
      return;
    }
  }
  float* o = out + (size_t)blockIdx.z * n_slots * N;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {  // token tok_of(j, p): its slot and routing weight once for the thread's rows
      const int m = tok_of(j, p);
      if (rows[m] < 0) continue;
      const int slot = slots[m];
      const float tw = topk_w ? topk_w[slot] : 1.0f;
#pragma unroll
      for (int f = 0; f < MF; ++f)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row_of(f, 2 * h);
          if (wrow_ok(r)) o[(size_t)slot * N + wrow(r)] = topk_w ? acc[f][j][2 * h + p] * tw : acc[f][j][2 * h + p];
        }
    }
  }
}
