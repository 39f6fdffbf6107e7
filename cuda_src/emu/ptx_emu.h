// ptx_emu.h: the PTX instructions of the tensor-core kernels, emulated lane by lane (included by cuda_emu.h).
//
// Reached through the wrappers of cuda_src/mma.cuh (under CUDA_EMU they call these; on a GPU they are the
// inline asm). Each follows the PTX ISA's description (section 9.7.14 warp-level MMA, 9.7.9.25 cp.async):
//   mma_m16n8k32_bytes  mma.sync.aligned.{m16n8k16 .f16/.bf16 | m16n8k32 .e4m3}.row.col.f32: the warp's 32 lanes
//       publish their A (4 x b32) and B (2 x b32) registers through the wide exchange; each lane rebuilds A
//       [16 rows x 32 bytes] and B [8 cols x 32 bytes] from the documented fragment layout (groupID = lane / 4,
//       tig = lane % 4: A reg0 = row g, bytes 4 tig..; reg1 = row g + 8; reg2 / reg3 = the same rows, bytes
//       16 + 4 tig..; B reg0 = col g, bytes 4 tig..; reg1 = col g, bytes 16 + 4 tig..), and computes its own
//       accumulators d0..d3 = (g, 2 tig), (g, 2 tig + 1), (g + 8, 2 tig), (g + 8, 2 tig + 1): the products
//       exact in f32, summed in k order, then added to c. Every lane of the warp must take part.
//   ldmatrix_x{1,2,4}[.trans]  ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: lanes 8i..8i+7 give the
//       row addresses of matrix i (16-byte aligned); lane L receives, per matrix, row L / 4, b16 elements
//       2 (L % 4) and 2 (L % 4) + 1 (.trans: column L / 4, rows 2 (L % 4) and 2 (L % 4) + 1).
//   cp_async16 / cp_async8 / commit / wait_group  cp.async.{cg 16, ca 8} bytes (src_bytes 0: zero fill): the source is
//       read at issue, the shared destination is written only when a cp.async.wait_group retires its group,
//       so a kernel that reads shared memory before waiting (or before the barrier after the wait, in one of
//       the two thread orders) reads stale data and fails its test. A source that reads bytes must lie in one of
//       the launch's arrays (cuda_emu.h g_globals): a copy past an array's end stops the launch.
#pragma once

namespace emu {
template <int N>
inline uint64_t enter_wide(const uint32_t (&w)[N]) {
  static_assert(N <= 8, "wide exchange: at most 8 words");
  Thread* me = g_cur;
  std::memcpy(me->wide[me->rounds & 1], w, sizeof w);
  return ++me->rounds;
}
inline const uint32_t* read_wide(uint64_t r, int lane, const char* what) {
  Thread* o = lane_thread(g_cur->warp, lane);
  if (!o || o->rounds < r || o->state == DONE) {
    std::snprintf(g_error, sizeof g_error, "%s: lane %d of warp %d did not take part", what, lane, g_cur->warp);
    fail(g_error);
  }
  return o->wide[(r - 1) & 1];
}

// element decoders of the MMA operand kinds (ELEM bytes each)
enum MmaKind { MMA_F16, MMA_BF16, MMA_E4M3 };
inline float e4m3_value(unsigned c) {  // e4m3fn: no infinities, 0x7f / 0xff NaN
  const unsigned e = (c >> 3) & 15u, m = c & 7u;
  float v = e ? std::ldexp(1.0f + float(m) / 8.0f, int(e) - 7) : std::ldexp(float(m) / 8.0f, -6);
  if ((c & 0x7fu) == 0x7fu) v = NAN;
  return (c & 0x80u) ? -v : v;
}
inline const std::vector<float> g_e4m3_to_float = [] {  // all 256 codes once (ldexp per element: ~8 % of the runs)
  std::vector<float> t(256);
  for (unsigned c = 0; c < 256; ++c) t[c] = e4m3_value(c);
  return t;
}();
inline float mma_elem(MmaKind k, const unsigned char* p) {
  uint16_t h;
  switch (k) {
    case MMA_F16: std::memcpy(&h, p, 2); return __half2float(__half{h});
    case MMA_BF16: std::memcpy(&h, p, 2); return __bfloat162float(__nv_bfloat16{h});
    default: return g_e4m3_to_float[*p];
  }
}

// d[4] = A [16 x 32 bytes] . B [32 bytes x 8] + c[4]  (k = 16 two-byte or 32 one-byte elements)
inline void mma_m16n8_32bytes(MmaKind kind, float* d, const uint32_t* a, const uint32_t* b, const float* c) {
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  uint32_t words[6];
  std::memcpy(words, mine, sizeof words);
  uint32_t w8[8] = {words[0], words[1], words[2], words[3], words[4], words[5], 0, 0};
  const uint64_t r = enter_wide(w8);
  warp_sync();
  unsigned char A[16][32], B[8][32];
  for (int l = 0; l < 32; ++l) {
    const uint32_t* o = read_wide(r, l, "mma.sync");
    const int g = l / 4, t = l % 4;
    std::memcpy(&A[g][4 * t], &o[0], 4);
    std::memcpy(&A[g + 8][4 * t], &o[1], 4);
    std::memcpy(&A[g][16 + 4 * t], &o[2], 4);
    std::memcpy(&A[g + 8][16 + 4 * t], &o[3], 4);
    std::memcpy(&B[g][4 * t], &o[4], 4);
    std::memcpy(&B[g][16 + 4 * t], &o[5], 4);
  }
  const int esz = kind == MMA_E4M3 ? 1 : 2, ke = 32 / esz, g = g_cur->lane / 4, t = g_cur->lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float acc = 0.0f;
    for (int k = 0; k < ke; ++k) acc += mma_elem(kind, &A[row][k * esz]) * mma_elem(kind, &B[col][k * esz]);
    d[i] = c[i] + acc;
  }
  warp_sync();  // every lane has read the others' registers before any of them publishes again
}

template <int X, bool TRANS>
inline void ldmatrix(uint32_t* out, const void* row) {
  if (reinterpret_cast<uintptr_t>(row) % 16) fail("ldmatrix: row address not 16-byte aligned");
  const uint64_t r = enter_exchange(reinterpret_cast<uint64_t>(row));
  warp_sync();
  const int L = g_cur->lane;
  for (int i = 0; i < X; ++i) {
    auto rowp = [&](int j) {
      uint64_t b;
      if (!read_slot(r, 8 * i + j, &b)) fail("ldmatrix: a lane giving a row address did not take part");
      return reinterpret_cast<const unsigned char*>(b);
    };
    if (!TRANS) {
      std::memcpy(&out[i], rowp(L / 4) + 4 * (L % 4), 4);
    } else {
      uint16_t lo, hi;
      std::memcpy(&lo, rowp(2 * (L % 4)) + 2 * (L / 4), 2);
      std::memcpy(&hi, rowp(2 * (L % 4) + 1) + 2 * (L / 4), 2);
      out[i] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
  }
  warp_sync();
}

template <int BYTES>
inline void cp_async(void* dst, const void* src, int src_bytes) {  // cp.async of 4, 8 or 16 bytes
  if (reinterpret_cast<uintptr_t>(dst) % BYTES || reinterpret_cast<uintptr_t>(src) % BYTES)
    fail("cp.async: an address not aligned to the copy size");
  Thread::CpAsync op{-1, static_cast<unsigned char*>(dst), BYTES, {}};
  if (src_bytes < 0 || src_bytes > BYTES) fail("cp.async: src-size larger than the copy size");
  if (src_bytes > 0 && !in_globals(src, size_t(src_bytes)))
    fail("cp.async: a source outside the launch's arrays (past an array's end?)");
  std::memcpy(op.data, src, size_t(src_bytes));  // the rest of the destination is zero-filled
  g_cur->cp_async.push_back(op);
}
inline void cp_async_commit() {
  Thread* me = g_cur;
  for (auto& op : me->cp_async) if (op.group < 0) op.group = me->cp_groups;
  ++me->cp_groups;
}
inline void cp_async_wait(int n) {  // land every committed group but the newest n
  Thread* me = g_cur;
  std::vector<Thread::CpAsync> keep;
  for (auto& op : me->cp_async) {
    if (op.group >= 0 && op.group < me->cp_groups - n) {
      std::memcpy(op.dst, op.data, op.bytes);
      me->proxy_dirty = true;  // wgmma reads it only after this thread's fence.proxy.async (wgmma_emu.h)
    } else {
      keep.push_back(op);
    }
  }
  me->cp_async.swap(keep);
}
}  // namespace emu
