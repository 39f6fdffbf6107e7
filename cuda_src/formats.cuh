// formats.cuh: every stored format the CUDA kernels read, defined once (the CUDA side of toolkit/formats/).
//
// Each Format record of the registry names its structs here: ``cuda_decoder`` (moe_gemm.cu) and ``kv_row`` (the
// KV cache row codec of kv_store.cu / kv_attention.cu). tests/test_formats_cuh.py compiles this header on the
// host and checks every size below against the Python layouts (``fmt.block``, ``fmt.nbytes``), and that every
// struct a record names exists. Adding a format: its Python module, one decoder (and row) struct here, one
// registry row.
//
// GGML blocks of 32 (toolkit/formats/ggml.py): q8_0 {f16 d; int8 qs[32]} = 34 bytes, q4_0 {f16 d; u8 qs[16]} =
// 18 bytes (element j < 16 the low nibble of byte j, element j + 16 its high nibble).
//
// Decoders (moe_gemm): decode8(w, e, n, k0, v) writes 8 consecutive weights k0..k0+7 of row n of expert e as f32
// (group sizes are multiples of 32, so 8 weights share a scale):
//   F32Dec (unquantized), Int8Dec (W8A16, f32 scale per row), Fp8Dec (W8A8, e4m3 + f32 scale per row),
//   AffineDec<4|3|2> (f16 scale and bias per group, LSB-first dense packing of toolkit/formats/packing.py),
//   Q8_0Dec, Q4_0Dec, Mxfp4Dec (GGML blocks; mxfp4 {u8 e8m0; u8 qs[16]} = 17 bytes, e2m1 codes),
//   Q4_1Dec, Q5_0Dec, Q5_1Dec, Q2_KDec .. Q6_KDec (GGML's other block types, read as stored; ``VALUES`` / ``BYTES``).
// The tensor-core GEMM's packed decoders (AffinePackedDec and those after it) read codes repacked at upload
// (toolkit/gpu/mma_pack.py): affine int2/3/4, the GGML blocks of 32, and q3_K..q6_K.
// KV rows: a cache row is one token of one KV head, hd values stored as hd/32 blocks of BLOCK_BYTES bytes
// (toolkit/model/kv_cache.py: store [B, Hkv, S, hd/32 * BLOCK_BYTES]); f32 rows are "blocks" of 32 floats.
// Warp mapping: lane l owns element l of a block of 32.
//   load(blk, lane)        -> the f32 value of element `lane` (dequant exactly as toolkit/formats/ggml.py)
//   store(x, blk, lane)    quantize the warp's 32 values into one block (every lane of the warp must call it:
//                          it contains shuffles); byte-identical to toolkit.ref.kv_store / PyPI gguf:
//     q8_0: d = absmax / 127, q = round_half_away(x * (1 / d));
//     q4_0: m = the signed value of largest magnitude (first index on a tie), d = m / -8,
//           q = min(15, trunc(x * (1 / d) + 8.5)) in f32 (no FMA contraction: __fmul_rn / __fadd_rn).
//   scale f16 by __float2half_rn (round to nearest even, as numpy's astype(float16)).
#pragma once
#include "common.cuh"

// ---- block structs (the byte layout; the kernels address bytes, these pin the sizes) -------------------------
struct block_q8_0 {
  __half d;
  signed char qs[32];
};
struct block_q4_0 {
  __half d;
  unsigned char qs[16];
};
static_assert(sizeof(block_q8_0) == 34, "q8_0 block: 34 bytes");
static_assert(sizeof(block_q4_0) == 18, "q4_0 block: 18 bytes");

// ---- decoders of the grouped GEMM ---------------------------------------------------------------------------
struct WView {
  const unsigned char* q;  // codes / blocks, row-major [E, N, row_bytes]
  const void* s;           // scales (f32 [E, N] or f16 [E, N, K/group]) or null
  const void* b;           // biases (f16 [E, N, K/group]) or null
  int N, K, group;
};

struct F32Dec {  // unquantized f32 weights: the full-precision experts of a model on the device
  static constexpr bool W8A8 = false;
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const float* q = (const float*)w.q + ((size_t)e * w.N + n) * w.K + k0;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = q[i];
  }
};

struct Int8Dec {
  static constexpr bool W8A8 = false;
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const size_t row = (size_t)e * w.N + n;
    const uint2 q = *(const uint2*)(w.q + row * w.K + k0);  // 8 codes, one 8-byte load (K % 32 == 0, k0 % 8 == 0)
    const float s = ((const float*)w.s)[row];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = float((signed char)(((i < 4 ? q.x : q.y) >> (8 * (i % 4))) & 0xffu)) * s;
  }
  // the 8 stored codes at k0.. of row n (one 8-byte load: the tensor-core kernel issues it k-tiles ahead)
  __device__ __forceinline__ static uint2 fetch8(const WView& w, int e, int n, int k0) {
    return *(const uint2*)(w.q + ((size_t)e * w.N + n) * w.K + k0);
  }
  // 4 codes (a word, byte i = code i) as 2 f16 pairs (codes 0, 1 and 2, 3), exactly; the row scale is applied to
  // the MMA's sums: (q ^ 0x80) = q + 128 as the low byte of the mantissa of 1024 (0x64 above it, placed by one byte
  // permute a pair), minus 1152 (0x6480)
  __device__ __forceinline__ static uint2 f16_pairs(unsigned q) {
    const unsigned x = q ^ 0x80808080u;  // biased codes
    return make_uint2(hsub2_bits(__byte_perm(x, 0x64u, 0x4140), 0x64806480u),
                      hsub2_bits(__byte_perm(x, 0x64u, 0x4342), 0x64806480u));
  }
  // the 8 codes of q as f16 pairs
  __device__ __forceinline__ static uint4 f16_codes(uint2 q) {
    const uint2 a = f16_pairs(q.x), b = f16_pairs(q.y);
    return make_uint4(a.x, a.y, b.x, b.y);
  }
};

struct Fp8Dec {
  static constexpr bool W8A8 = true;
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const size_t row = (size_t)e * w.N + n;
    const uint2 q = *(const uint2*)(w.q + row * w.K + k0);  // 8 codes, one 8-byte load
    const float s = ((const float*)w.s)[row];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = e4m3_decode((unsigned char)(((i < 4 ? q.x : q.y) >> (8 * (i % 4))) & 0xffu)) * s;
  }
};

template <int BITS>
struct AffineDec {  // 8 codes = BITS bytes, code i at bits [BITS*i, BITS*(i+1)) (LSB first)
  static constexpr bool W8A8 = false;
  // the 8 codes of k0..k0+7 with aligned 32/16-bit loads only (rows are K*BITS/8 bytes, K % 32 == 0, k0 % 8 == 0:
  // int4's 4 bytes and int2's 2 are aligned; int3's 3 bytes are cut from the one or two aligned words around them)
  __device__ __forceinline__ static unsigned codes8(const WView& w, size_t row, int k0) {
    const unsigned char* base = w.q + row * (size_t)(w.K * BITS / 8);
    const size_t off = (size_t)k0 * BITS / 8;
    if (BITS == 4) return *(const unsigned*)(base + off);
    if (BITS == 2) return *(const unsigned short*)(base + off);
    const unsigned* p = (const unsigned*)(base + (off & ~(size_t)3));
    const int sh = int(off & 3) * 8;
    return sh <= 8 ? p[0] >> sh : __funnelshift_r(p[0], p[1], sh);
  }
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const size_t row = (size_t)e * w.N + n;
    const unsigned u = codes8(w, row, k0);
    const size_t g = row * (size_t)(w.K / w.group) + k0 / w.group;
    const float s = __half2float(((const __half*)w.s)[g]);
    const float z = __half2float(((const __half*)w.b)[g]);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = float((u >> (BITS * i)) & ((1u << BITS) - 1u)) * s + z;
  }
  // the same 8 weights as f16 pairs, by integer tricks: (0x6400 | q) is the f16 1024 + q exactly, minus 1024
  // (exact), then q * s + z in one f16x2 FMA: a single rounding, as the f32 path's final rounding to f16
  __device__ __forceinline__ static uint4 decode8_f16(const WView& w, int e, int n, int k0) {
    const size_t row = (size_t)e * w.N + n;
    return f16x8(codes8(w, row, k0), w, row, k0);
  }
  // 8 codes (LSB first in u) of row `row` (e * N + n) at k0.. -> 4 f16 pairs, scale and bias of their group
  __device__ __forceinline__ static uint4 f16x8(unsigned u, const WView& w, size_t row, int k0) {
    const size_t g = row * (size_t)(w.K / w.group) + k0 / w.group;
    const unsigned s = ((const unsigned short*)w.s)[g], z = ((const unsigned short*)w.b)[g];
    const unsigned s2 = s | (s << 16), z2 = z | (z << 16), m = (1u << BITS) - 1u;
    unsigned o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned h = 0x64006400u | ((u >> (2 * j * BITS)) & m) | (((u >> ((2 * j + 1) * BITS)) & m) << 16);
      o[j] = hfma2_bits(hsub2_bits(h, 0x64006400u), s2, z2);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
  }
};

// The affine codes repacked once at upload for the tensor-core kernel (toolkit/gpu/mma_pack.py): per expert, tiles
// of 64 rows x 64 k, each 128 threads x 4*BITS bytes; thread t's bytes are the 8-code chunks t, t+128, t+256, t+384
// of the tile (chunk c: tile row c / 8, k (c % 8) * 8 ..), in the word order q_f16() reads, so the 32 codes a thread
// decodes per k-tile are one 16-byte load (int4), one 8-byte load (int2) or three aligned words (int3). The
// tile's rows are rows 64 R .. (natural) or, for gate_up with `halves`, gate rows 32 R .. and up rows I + 32 R ..
// Each group's f16 scale and bias are one 32-bit word, scale in the low half, in tile order (mma_pack's
// ``_tile_side``: u32 [E, N / 64, K / group, 16, 4]): a thread's 4 chunks' words of a group are one 16-byte load.
// The decoders take those side words (`sd`, SIDE bytes a chunk): sd[J] (a word), or half J % 2 of sd[J / 2] (f16);
// sd[4 + i] holds the field exponent f16x2_int(1 << (10 - 2 i)) in a register (common.cuh field_f16).
// a packed decoder's load of its codes from global memory: ld.global.nc, or with CG ld.global.cg (cached in L2
// only: block_m 128, whose codes a block reads once, so no L1 line is filled for them: moe_gemm_mma.cu)
template <bool CG, class T> __device__ __forceinline__ T ld_code(const unsigned char* p) {
  if constexpr (CG) return __ldcg((const T*)p);
  else return __ldg((const T*)p);
}
template <int J> __device__ __forceinline__ unsigned side_mul(unsigned a, const unsigned* sd) {  // a * chunk J's f16
  return hmul2_half_bits<J % 2>(a, sd[J / 2]);
}
template <int BITS>
struct AffinePackedDec : AffineDec<BITS> {
  static constexpr int TILE_BYTES = 64 * 64 * BITS / 8, SIDE = 4;
  static constexpr int SUPER = 0;  // bytes a row of a super-block's side word (q2_K: 4), none
  static constexpr int RAW_WORDS = BITS;  // a thread's 32 codes of one k-tile: 4 * BITS bytes
  // k-tiles of codes the kernel fetches ahead: 12 registers; int3 6 tiles (18), a multiple of the kernel's 3
  // activation stages (moe_gemm_mma.cu: the stage of every tile of the unrolled ring is then a constant)
  static constexpr int RING_TILES = BITS == 3 ? 6 : 12 / BITS;
  // the raw words of a thread's 32 codes of k-tile kt (a load whose result is first used at decode: the kernel
  // issues it tiles ahead, so it stays in flight meanwhile). p: the tile plus the thread's THREAD_BYTES * tid (the
  // kernel keeps that pointer per thread, so a fetch is one add to it)
  static constexpr int THREAD_BYTES = 4 * BITS;
  template <bool CG = false> __device__ __forceinline__ static void fetch(const unsigned char* p, int tid, unsigned* raw) {
    if (BITS == 4) {
      const uint4 v = ld_code<CG, uint4>(p);
      raw[0] = v.x; raw[1] = v.y; raw[2] = v.z; raw[3] = v.w;
    } else if (BITS == 2) {
      const uint2 v = ld_code<CG, uint2>(p);
      raw[0] = v.x; raw[1] = v.y;
    } else {  // 12 bytes, 4-aligned: three words
      raw[0] = ld_code<CG, unsigned>(p); raw[1] = ld_code<CG, unsigned>(p + 4); raw[2] = ld_code<CG, unsigned>(p + 8);
    }
  }
  // weights 2P, 2P + 1 of chunk J as the exact f16 pair (q - OFF, q' - OFF). mma_pack's word order puts each pair's
  // codes in a field at bit B of both halves of one word (field_f16: one lop3, then one subtraction): int4, nibbles
  // P and P + 4 of the chunk's word, B = 4 (P % 2), the word shifted by 8 for P >= 2; int2, bits 2k and 16 + 2k,
  // k = 4 (J % 2) + P, of the word of chunks J & ~1 and J | 1, B = 2 (k % 4), shifted by 8 for k >= 4; int3, pair
  // i = 4 J + P < 15 whole in word i / 5 at bit mma_pack.THREE[i % 5] = 0, 3, 6 (B = those) or 9, 12 (the word
  // shifted by 9: B = 0, 3; one shift a word), under the exponents kc[0], kc[1] (128 for 3-bit codes:
  // moe_gemm_mma.cu codes3) and kc[3]; pair 15's bit b at bit 15 (and 31) of word b, gathered at B = 6 by three lop3
  // and two shifts
  template <int J, int P, int OFF = 0>
  __device__ __forceinline__ static unsigned q_f16(const unsigned* u, const unsigned* sd) {
    if constexpr (BITS == 3) {
      constexpr int i = 4 * J + P, f = i % 5, B = i < 15 ? 3 * (f % 3) : 6;
      unsigned h;
      if constexpr (i < 15) {
        h = and_or<(7u << B) * 0x10001u>(f >= 3 ? u[i / 5] >> 9 : u[i / 5], sd[4 + (B == 6 ? 3 : B / 3)]);
      } else {
        h = and_or<0x00400040u>(u[0] >> 9, sd[4 + 3]);  // bit 15 of word 0 at 6, under 16's exponent
        h = and_or<0x00800080u>(u[1] >> 8, h);          // word 1's at 7
        h = and_or<0x01000100u>(u[2] >> 7, h);          // word 2's at 8
      }
      return hsub2_bits(h, f16x2_int((1 << (10 - B)) + OFF));
    } else {
      constexpr int k = BITS == 4 ? P : 4 * (J % 2) + P, B = BITS == 4 ? 4 * (P % 2) : 2 * (k % 4);
      const unsigned x = u[BITS == 4 ? J : J / 2], xs = (BITS == 4 ? P >= 2 : k >= 4) ? x >> 8 : x;
      return hsub2_bits(field_f16<B, BITS == 4 ? 4 : 2>(xs, sd + 4), f16x2_int((1 << (10 - B)) + OFF));
    }
  }
  // chunk J -> 8 weights as 4 f16 pairs; sd[J]: its group's scale and bias (mma_pack's ``mma_scale_bias``: scale
  // in the low half), each put in both lanes by the f16x2 instruction's operand selects (hfma2_lohi_bits)
  template <int J> __device__ __forceinline__ static uint4 chunk_f16(const unsigned* u, const unsigned* sd) {
    return make_uint4(hfma2_lohi_bits(q_f16<J, 0>(u, sd), sd[J]), hfma2_lohi_bits(q_f16<J, 1>(u, sd), sd[J]),
                      hfma2_lohi_bits(q_f16<J, 2>(u, sd), sd[J]), hfma2_lohi_bits(q_f16<J, 3>(u, sd), sd[J]));
  }
};

// GGML blocks of 32 repacked at upload the same way (toolkit/gpu/mma_pack.py): the codes in AffinePackedDec's tile
// and word order, the block scale d as f16 [E, N, K / 32] in `s` (mxfp4: 2^(e - 113), the 2^14 the codes' f16 form
// lacks folded in), or for q4_1 / q5_1 d and the minimum m as one word (as the affine scale and bias); q4_1 is
// AffinePackedDec<4> at group 32. Every weight comes out as
// the stored decoder's f32 value rounded to f16 once: (q - offset) and the e2m1 value are exact in f16, so one
// f16x2 multiply (or q5_1's one FMA) is the only rounding.
template <int BITS, int OFF>  // (q - OFF) * d, d one f16 a group: q4_0 (4 bits, OFF 8), q3_K (3 bits, OFF 4)
struct ScalePackedDec : AffinePackedDec<BITS> {
  static constexpr int SIDE = 2;  // the group's scale, f16
  template <int J> __device__ __forceinline__ static uint4 chunk_f16(const unsigned* u, const unsigned* sd) {
    using A = AffinePackedDec<BITS>;
    return make_uint4(side_mul<J>(A::template q_f16<J, 0, OFF>(u, sd), sd), side_mul<J>(A::template q_f16<J, 1, OFF>(u, sd), sd),
                      side_mul<J>(A::template q_f16<J, 2, OFF>(u, sd), sd), side_mul<J>(A::template q_f16<J, 3, OFF>(u, sd), sd));
  }
};
using Q4_0PackedDec = ScalePackedDec<4, 8>;
// the k-quants q3_K, q4_K, q5_K and q6_K repacked at upload (mma_pack.KQUANTS): codes as int3's, int4's, q5_1's and
// Q6_KPackedDec's (below), each group's scale d * sc (and minimum -dmin * m) rounded to f16 at upload. q4_K is
// AffinePackedDec<4> at group 32, q5_K Q5_1PackedDec; q3_K ((q - 4) * d * sc, groups of 16) is this
using Q3_KPackedDec = ScalePackedDec<3, 4>;
// q2_K repacked at upload with its 2.625 bits a weight kept: int2's codes; its 4-bit factors sc, m a group of 16,
// a thread's 4 chunks' of one k-tile in one word (``_factor_words``: chunk J's sc at bits 4J, its m at 16 + 4J, SIDE
// 1), and the words of the 4 k-tiles of a super-block of 256 side by side (mma_pack's ``mma_factors``: one 16-byte
// load a super-block); and a word (d, -dmin) a super-block row (``mma_super``, SUPER 4: a 16-byte load of the
// thread's 4 rows). side_word<J> makes chunk J's scale-bias word (d * sc, -dmin * m), rounded once as mma_pack rounds
// the other k-quants' at upload: one lop3 puts the pair under the f16 exponent E (field_f16: E = 1024 for even J, 64
// for odd, the word shifted by 8 for J >= 2), then one f16x2 FMA (E + sc, E + m) * (d, -dmin) + bias<J>, bias<J> =
// (-E d, E dmin) made once a super-block: the exact (sc d, -m dmin) rounded once (E d is exact while |d|, dmin <=
// 65504 / 1024: mma_pack.Q2K_MAX_D). The weights are then AffinePackedDec<2>'s. Its ring is 12 k-tiles (3 super-blocks,
// 4 of the 3 activation stages): the tile's place in its super-block is a constant of the unrolled loop
struct Q2_KPackedDec : AffinePackedDec<2> {
  static constexpr int SIDE = 1, SUPER = 4, RING_TILES = 12;
  template <int J> __device__ __forceinline__ static unsigned bias(unsigned dd) {
    return hmul2_bits(dd, J % 2 ? 0xD400D400u : 0xE400E400u);  // (-64, -64), (-1024, -1024): -f16x2_int(E)
  }
  // a thread's 4 rows' super-block words dv -> d[j] and the biases b[j] of its chunks j
  __device__ __forceinline__ static void supers(uint4 dv, unsigned* d, unsigned* b) {
    d[0] = dv.x; d[1] = dv.y; d[2] = dv.z; d[3] = dv.w;
    b[0] = bias<0>(dv.x); b[1] = bias<1>(dv.y); b[2] = bias<2>(dv.z); b[3] = bias<3>(dv.w);
  }
  template <int J>
  __device__ __forceinline__ static unsigned side_word(unsigned f, unsigned dd, unsigned b, const unsigned* kc) {
    return hfma2_bits(field_f16<4 * (J % 2), 4>(J >= 2 ? f >> 8 : f, kc), dd, b);
  }
};
static_assert((0xE400E400u ^ 0x80008000u) == f16x2_int(1024) && (0xD400D400u ^ 0x80008000u) == f16x2_int(64), "bias");

// byte i: (a[i] - to) mod 32, the right rotation that moves bit a[i] of a word to bit `to`
__host__ __device__ constexpr unsigned rot_bytes4(const int (&a)[4], int to) {
  return unsigned((a[0] - to) & 31) | unsigned((a[1] - to) & 31) << 8 | unsigned((a[2] - to) & 31) << 16 |
         unsigned((a[3] - to) & 31) << 24;
}
struct Mxfp4PackedDec : AffinePackedDec<4> {  // e2m1 codes (sign, 2-bit exponent, 1-bit mantissa)
  // code c as the f16 with sign bit 15 and (exponent, mantissa) bits 11..9: e2m1(c) * 2^-14 exactly (c & 7 < 2 are
  // f16 subnormals 0 and 2^-15), times the f16 scale 2^(e - 113) in one rounding. Pair P's (exponent, mantissa)
  // bits sit at EM[P] (and 16 above) of the chunk's word, its signs at SG[P] (mma_pack.E2M1): both moved by one
  // shift and one mask where SG - EM is 6 (pairs 0, 2), else each by its own shift (none for pair 3's sign) and
  // merged by one lop3
  static constexpr int EM[4] = {0, 3, 8, 11}, SG[4] = {6, 7, 14, 15};
  // byte P: the right rotation of a word that puts pair P's (exponent, mantissa) bits at 9 (ROT_EM), its sign at 15
  // (ROT_SG): for a lane that picks its pair at run time (moe_gemm_mma.cu, DirectA at block_m 128)
  static constexpr unsigned ROT_EM = rot_bytes4(EM, 9), ROT_SG = rot_bytes4(SG, 15);
  template <int P> __device__ __forceinline__ static unsigned e2m1_f16(unsigned v) {
    constexpr int ke = 9 - EM[P], ks = 15 - SG[P];
    if constexpr (ke == ks) return shift<ke>(v) & 0x8e008e00u;
    else return and_or<0x80008000u>(shift<ks>(v), shift<ke>(v) & 0x0e000e00u);
  }
  static constexpr int SIDE = 2;  // the scale 2^(e - 113), f16
  template <int J> __device__ __forceinline__ static uint4 chunk_f16(const unsigned* u, const unsigned* sd) {
    return make_uint4(side_mul<J>(e2m1_f16<0>(u[J]), sd), side_mul<J>(e2m1_f16<1>(u[J]), sd),
                      side_mul<J>(e2m1_f16<2>(u[J]), sd), side_mul<J>(e2m1_f16<3>(u[J]), sd));
  }
};

struct Q8_0PackedDec {  // int8 codes: a tile is two halves of 128 threads x 16 bytes (chunks 0-1, then 2-3)
  static constexpr bool W8A8 = false;
  static constexpr int TILE_BYTES = 64 * 64, RAW_WORDS = 8, RING_TILES = 2, SIDE = 2, SUPER = 0;
  static constexpr int THREAD_BYTES = 16;
  template <bool CG = false> __device__ __forceinline__ static void fetch(const unsigned char* p, int tid, unsigned* raw) {  // p: tile + 16 tid
    const uint4 a = ld_code<CG, uint4>(p), b = ld_code<CG, uint4>(p + TILE_BYTES / 2);  // each a warp's 512 contiguous bytes
    raw[0] = a.x; raw[1] = a.y; raw[2] = a.z; raw[3] = a.w; raw[4] = b.x; raw[5] = b.y; raw[6] = b.z; raw[7] = b.w;
  }
  template <int J> __device__ __forceinline__ static uint4 chunk_f16(const unsigned* u, const unsigned* sd) {
    const uint4 q = Int8Dec::f16_codes(make_uint2(u[2 * J], u[2 * J + 1]));  // the codes exactly
    return make_uint4(side_mul<J>(q.x, sd), side_mul<J>(q.y, sd), side_mul<J>(q.z, sd), side_mul<J>(q.w, sd));
  }
};

// q5_0 (OFF 16: (q - 16) * d) and q5_1 (OFF -1: q * d + m): a tile is 128 threads x 16 bytes of low nibbles (as
// int4's), then 128 threads x a word of fifth bits (mma_pack.PLANE[5]: pair P of chunk J at bit 4 (P % 2) + 4 + s_g,
// and 16 above, g = 2J + P / 2, s = -4 .. -1, 4 .. 7: one shift for the two pairs of a g)
template <int OFF>
struct Q5PackedDec {
  static constexpr bool W8A8 = false;
  static constexpr int TILE_BYTES = 64 * 64 * 5 / 8, RAW_WORDS = 5, RING_TILES = 3, SUPER = 0;
  static constexpr int SIDE = OFF < 0 ? 4 : 2;  // q5_1: d and m one word (``mma_scale_bias``); q5_0: d alone
  static constexpr int THREAD_BYTES = 16;  // of the nibbles; the fifth bits' word is at tile + 128 * 16 + 4 tid
  template <bool CG = false> __device__ __forceinline__ static void fetch(const unsigned char* p, int tid, unsigned* raw) {  // p: tile + 16 tid
    const uint4 a = ld_code<CG, uint4>(p);
    raw[0] = a.x; raw[1] = a.y; raw[2] = a.z; raw[3] = a.w;
    raw[4] = ld_code<CG, unsigned>(p + 128 * 16 - tid * 12);
  }
  // pair P: the low nibbles as int4's field at B = 4 (P % 2), the two fifth bits moved to B + 4 and 20 + B by one
  // shift (shared with the other pair of g) and one lop3
  template <int J, int P> __device__ __forceinline__ static unsigned q_f16(const unsigned* u, const unsigned* sd) {
    constexpr int B = 4 * (P % 2), g = 2 * J + P / 2;
    const unsigned h = field_f16<B, 4>(P >= 2 ? u[J] >> 8 : u[J], sd + 4);
    return hsub2_bits(and_or<(16u << B) * 0x10001u>(shift<(g < 4 ? 4 - g : -g)>(u[4]), h),
                      f16x2_int((1 << (10 - B)) + (OFF < 0 ? 0 : OFF)));
  }
  template <int J> __device__ __forceinline__ static uint4 chunk_f16(const unsigned* u, const unsigned* sd) {
    if constexpr (OFF < 0)
      return make_uint4(hfma2_lohi_bits(q_f16<J, 0>(u, sd), sd[J]), hfma2_lohi_bits(q_f16<J, 1>(u, sd), sd[J]),
                        hfma2_lohi_bits(q_f16<J, 2>(u, sd), sd[J]), hfma2_lohi_bits(q_f16<J, 3>(u, sd), sd[J]));
    else
      return make_uint4(side_mul<J>(q_f16<J, 0>(u, sd), sd), side_mul<J>(q_f16<J, 1>(u, sd), sd),
                        side_mul<J>(q_f16<J, 2>(u, sd), sd), side_mul<J>(q_f16<J, 3>(u, sd), sd));
  }
};
using Q5_0PackedDec = Q5PackedDec<16>;
using Q5_1PackedDec = Q5PackedDec<-1>;

// q6_K repacked at upload ((q - 32) * d * sc, one f16 scale a group of 16): a tile is 128 threads x 16 bytes of low
// nibbles (as int4's), then 128 threads x two words of the codes' high 2 bits, word J / 2 for chunks J & ~1 and
// J | 1 (mma_pack.Q6_HIGH: pair P of chunk J at bit 8 (J % 2) + 2 (P >= 2) + 4 (P % 2), and 16 above). One shift of
// that word puts pairs P and P + 1 (P even) at bits 4 and 8 (and 20, 24), above their nibbles' fields, and one lop3
// a pair merges them: the 6-bit field sits at B = 4 (P % 2) under 2^(10 - B) (B + 6 <= 10), as q5's does
struct Q6_KPackedDec {
  static constexpr bool W8A8 = false;
  static constexpr int TILE_BYTES = 64 * 64 * 6 / 8, RAW_WORDS = 6, RING_TILES = 3, SIDE = 2, SUPER = 0;
  static constexpr int THREAD_BYTES = 16;  // of the nibbles; the high words are at tile + 128 * 16 + 8 tid
  template <bool CG = false> __device__ __forceinline__ static void fetch(const unsigned char* p, int tid, unsigned* raw) {  // p: tile + 16 tid
    const uint4 a = ld_code<CG, uint4>(p);
    const uint2 b = ld_code<CG, uint2>(p + 128 * 16 - tid * 8);
    raw[0] = a.x; raw[1] = a.y; raw[2] = a.z; raw[3] = a.w; raw[4] = b.x; raw[5] = b.y;
  }
  template <int J, int P> __device__ __forceinline__ static unsigned q_f16(const unsigned* u, const unsigned* sd) {
    constexpr int B = 4 * (P % 2), T = B + 4, at = 8 * (J % 2) + 2 * (P >= 2) + 4 * (P % 2);
    const unsigned h = field_f16<B, 4>(P >= 2 ? u[J] >> 8 : u[J], sd + 4);
    return hsub2_bits(and_or<(3u << T) * 0x10001u>(shift<T - at>(u[4 + J / 2]), h), f16x2_int((1 << (10 - B)) + 32));
  }
  template <int J> __device__ __forceinline__ static uint4 chunk_f16(const unsigned* u, const unsigned* sd) {
    return make_uint4(side_mul<J>(q_f16<J, 0>(u, sd), sd), side_mul<J>(q_f16<J, 1>(u, sd), sd),
                      side_mul<J>(q_f16<J, 2>(u, sd), sd), side_mul<J>(q_f16<J, 3>(u, sd), sd));
  }
};

struct Q8_0Dec {  // block {f16 d; int8 qs[32]}
  static constexpr bool W8A8 = false;
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const size_t row = (size_t)e * w.N + n;
    const unsigned char* blk = w.q + row * (size_t)(w.K / 32 * 34) + (k0 / 32) * 34;
    const float d = load_f16(blk);
    const signed char* qs = (const signed char*)(blk + 2) + k0 % 32;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = float(qs[i]) * d;
  }
};

struct Q4_0Dec {  // block {f16 d; u8 qs[16]}: element j < 16 low nibble of byte j, j + 16 its high nibble
  static constexpr bool W8A8 = false;
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const size_t row = (size_t)e * w.N + n;
    const unsigned char* blk = w.q + row * (size_t)(w.K / 32 * 18) + (k0 / 32) * 18;
    const float d = load_f16(blk);
    const int j0 = k0 % 32, shift = j0 >= 16 ? 4 : 0;
    const unsigned char* qs = blk + 2 + j0 % 16;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = float(int((qs[i] >> shift) & 15) - 8) * d;
  }
};

struct Mxfp4Dec {  // block {u8 e (e8m0); u8 qs[16]}: e2m1 codes, nibbles as q4_0; value 2^(e-127) * e2m1(q)
  static constexpr bool W8A8 = false;
  __device__ __forceinline__ static float e2m1(unsigned c) {  // 0, 0.5, 1, 1.5, 2, 3, 4, 6 with sign bit 3
    const unsigned m = c & 7u;  // m >= 2: (1 + (m & 1) / 2) * 2^((m >> 1) - 1), built as f32 bits
    const float mag = m < 2u ? 0.5f * float(m) : __uint_as_float(((126u + (m >> 1)) << 23) | ((m & 1u) << 22));
    return (c & 8u) ? -mag : mag;
  }
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const size_t row = (size_t)e * w.N + n;
    const unsigned char* blk = w.q + row * (size_t)(w.K / 32 * 17) + (k0 / 32) * 17;
    const unsigned ex = blk[0];  // 2^(e - 127) as f32 bits: exact, subnormal 2^-127 for e = 0 (as ggml's e8m0)
    const float d = __uint_as_float(ex ? ex << 23 : 0x00400000u);
    const int j0 = k0 % 32, shift = j0 >= 16 ? 4 : 0;
    const unsigned char* qs = blk + 1 + j0 % 16;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = e2m1((qs[i] >> shift) & 15u) * d;
  }
};
struct block_mxfp4 {
  unsigned char e;
  unsigned char qs[16];
};
static_assert(sizeof(block_mxfp4) == 17, "mxfp4 block: 17 bytes");

// ---- GGML q4_1 / q5_0 / q5_1 and the k-quants (toolkit/formats/kquant.py): decoders read the stored blocks ---------
// BYTES per block of VALUES; decode8's 8 values never straddle a block or a scale group (groups of 16 or 32).
template <int VALUES, int BYTES>
struct GgmlBlock {
  static constexpr bool W8A8 = false;
  __device__ __forceinline__ static const unsigned char* block(const WView& w, int e, int n, int k0) {
    const size_t row = (size_t)e * w.N + n;
    return w.q + row * (size_t)(w.K / VALUES * BYTES) + (size_t)(k0 / VALUES) * BYTES;
  }
  __device__ __forceinline__ static unsigned load_u32(const unsigned char* p) {
    return unsigned(p[0]) | (unsigned(p[1]) << 8) | (unsigned(p[2]) << 16) | (unsigned(p[3]) << 24);
  }
};

template <bool HIGH, bool MIN, int OFF, int QH, int QS>  // q4_1 {d, m, qs}, q5_0 {d, qh, qs}, q5_1 {d, m, qh, qs}
struct Blk32Dec : GgmlBlock<32, QS + 16> {
  static constexpr int VALUES = 32, BYTES = QS + 16;
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const unsigned char* blk = GgmlBlock<32, QS + 16>::block(w, e, n, k0);
    const float d = load_f16(blk), m = MIN ? load_f16(blk + 2) : 0.0f;
    const unsigned qh = HIGH ? GgmlBlock<32, QS + 16>::load_u32(blk + QH) : 0u;
    const int j0 = k0 % 32, shift = j0 >= 16 ? 4 : 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = ((blk[QS + (j0 + i) % 16] >> shift) & 15) | (HIGH ? int((qh >> (j0 + i)) & 1u) << 4 : 0);
      v[i] = MIN ? float(q) * d + m : float(q - OFF) * d;
    }
  }
};
using Q4_1Dec = Blk32Dec<false, true, 0, 0, 4>;
using Q5_0Dec = Blk32Dec<true, false, 16, 2, 6>;
using Q5_1Dec = Blk32Dec<true, true, 0, 4, 8>;

struct Q2_KDec : GgmlBlock<256, 84> {  // {u8 scales[16] (sc | m << 4); u8 qs[64]; f16 d; f16 dmin}
  static constexpr int VALUES = 256, BYTES = 84;
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const unsigned char* blk = block(w, e, n, k0);
    const int j = k0 % 256, h = j / 128, r = (j % 128) / 32, l0 = j % 32;
    const int sc = blk[j / 16];
    const float dl = load_f16(blk + 80) * float(sc & 15), ml = load_f16(blk + 82) * float(sc >> 4);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = dl * float((blk[16 + 32 * h + l0 + i] >> (2 * r)) & 3) - ml;
  }
};

struct Q3_KDec : GgmlBlock<256, 110> {  // {u8 hmask[32]; u8 qs[64]; u8 scales[12] (6-bit, -32); f16 d}
  static constexpr int VALUES = 256, BYTES = 110;
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const unsigned char* blk = block(w, e, n, k0);
    const int j = k0 % 256, h = j / 128, r = (j % 128) / 32, l0 = j % 32, g = j / 16;
    const int lo = g < 8 ? (blk[96 + g] & 15) : (blk[96 + g - 8] >> 4);
    const int sc = (lo | (((blk[104 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32;
    const float dl = load_f16(blk + 108) * float(sc);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = ((blk[32 + 32 * h + l0 + i] >> (2 * r)) & 3) - (((blk[l0 + i] >> (4 * h + r)) & 1) ? 0 : 4);
      v[i] = dl * float(q);
    }
  }
};

__device__ __forceinline__ void scale_min_k4(int g, const unsigned char* s, int& sc, int& m) {  // 12 bytes, 8 groups
  if (g < 4) {
    sc = s[g] & 63;
    m = s[g + 4] & 63;
  } else {
    sc = (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4);
    m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

template <bool Q5>  // q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}, q5_K adds u8 qh[32] before qs
struct QK_KDec : GgmlBlock<256, Q5 ? 176 : 144> {
  static constexpr int VALUES = 256, BYTES = Q5 ? 176 : 144;
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const unsigned char* blk = GgmlBlock<256, BYTES>::block(w, e, n, k0);
    const int j = k0 % 256, c = j / 64, g = j / 32, shift = 4 * ((j % 64) / 32), l0 = j % 32;
    int sc, m;
    scale_min_k4(g, blk + 4, sc, m);
    const float dl = load_f16(blk) * float(sc), ml = load_f16(blk + 2) * float(m);
    const unsigned char* qs = blk + (Q5 ? 48 : 16) + 32 * c + l0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = ((qs[i] >> shift) & 15) | (Q5 ? ((blk[16 + l0 + i] >> g) & 1) << 4 : 0);
      v[i] = dl * float(q) - ml;
    }
  }
};
using Q4_KDec = QK_KDec<false>;
using Q5_KDec = QK_KDec<true>;

struct Q6_KDec : GgmlBlock<256, 210> {  // {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}
  static constexpr int VALUES = 256, BYTES = 210;
  __device__ __forceinline__ static void decode8(const WView& w, int e, int n, int k0, float* v) {
    const unsigned char* blk = block(w, e, n, k0);
    const int j = k0 % 256, h = j / 128, jj = j % 128, qt = jj / 32, l0 = jj % 32;
    const float dl = load_f16(blk + 208) * float((signed char)blk[192 + j / 16]);
    const unsigned char* ql = blk + 64 * h + 32 * (qt & 1) + l0;
    const unsigned char* qh = blk + 128 + 32 * h + l0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = (((ql[i] >> (4 * (qt >> 1))) & 15) | (((qh[i] >> (2 * qt)) & 3) << 4)) - 32;
      v[i] = dl * float(q);
    }
  }
};

// ---- KV cache rows -------------------------------------------------------------------------------------------
struct F32Row {
  static constexpr int BLOCK_BYTES = 128;  // 32 floats
  __device__ __forceinline__ static float load(const unsigned char* blk, int lane) {
    return reinterpret_cast<const float*>(blk)[lane];
  }
  __device__ __forceinline__ static void store(float x, unsigned char* blk, int lane) {
    reinterpret_cast<float*>(blk)[lane] = x;
  }
};

// The block scale as one aligned 16-bit store (every q8_0 / q4_0 block starts at an even byte: 34- and 18-byte
// blocks in rows of whole blocks, in buffers aligned to 256). Not as two byte stores: NVRTC 13.0 at sm_90 compiled
// ``p[0] = h & 0xFF`` to ``st.global.u8`` of the f16 register, and on an H200 that wrote 0 for the low byte (the high
// byte was right; measured at 09db99c, tests/test_cuda_gpu.py -k kv_store).
__device__ __forceinline__ void store_f16(unsigned char* p, float d) {
  *reinterpret_cast<unsigned short*>(p) = __half_as_ushort(__float2half_rn(d));
}

struct Q8_0Row {  // {f16 d; int8 qs[32]}
  static constexpr int BLOCK_BYTES = sizeof(block_q8_0);
  __device__ __forceinline__ static float load(const unsigned char* blk, int lane) {
    return float((signed char)blk[2 + lane]) * load_f16(blk);
  }
  __device__ __forceinline__ static void store(float x, unsigned char* blk, int lane) {
    const float amax = warp_max(fabsf(x));
    const float d = amax / 127.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = (int)roundf(__fmul_rn(x, inv));  // roundf: half away from zero
    blk[2 + lane] = (unsigned char)(signed char)q;
    if (lane == 0) store_f16(blk, d);
  }
};

struct Q4_0Row {  // {f16 d; u8 qs[16]}
  static constexpr int BLOCK_BYTES = sizeof(block_q4_0);
  __device__ __forceinline__ static float load(const unsigned char* blk, int lane) {
    const int byte = blk[2 + (lane & 15)];
    return float((lane < 16 ? (byte & 15) : (byte >> 4)) - 8) * load_f16(blk);
  }
  __device__ __forceinline__ static void store(float x, unsigned char* blk, int lane) {
    float a = fabsf(x);  // argmax |x|, first index on a tie: (a, i) reduced with "larger a, else smaller i"
    int i = lane;
    for (int o = 16; o > 0; o >>= 1) {
      const float oa = __shfl_xor_sync(FULL_MASK, a, o);
      const int oi = __shfl_xor_sync(FULL_MASK, i, o);
      if (oa > a || (oa == a && oi < i)) { a = oa; i = oi; }
    }
    const float m = __shfl_sync(FULL_MASK, x, i);  // signed
    const float d = m / -8.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = min(15, max(0, (int)__fadd_rn(__fmul_rn(x, inv), 8.5f)));  // int cast truncates
    const int hi = __shfl_down_sync(FULL_MASK, q, 16);  // lane j < 16 packs elements j and j + 16
    if (lane < 16) blk[2 + lane] = (unsigned char)(q | (hi << 4));
    if (lane == 0) store_f16(blk, d);
  }
};
