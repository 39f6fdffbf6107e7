// wgmma_emu.h: Hopper's warpgroup MMA (cuda_src/wgmma.cuh), emulated thread by thread (included by cuda_emu.h).
//
// Follows the PTX ISA (section 9.7.15): wgmma.mma_async reads its operands from shared memory through 64-bit
// matrix descriptors and writes the issuing thread's accumulator fragment, asynchronously. Here:
//   * issue records the operation; wgmma.commit_group closes a group; wgmma.wait_group N retires every committed
//     group but the newest N, in order, and only then reads shared memory and adds to the accumulators. So a kernel
//     that reads its accumulators before the wait, or overwrites an operand's shared memory before the wait that
//     retires its readers, gets a wrong result; an uncommitted wgmma never completes.
//   * descriptors: start address (bits 0-13, in 16-byte units, in the 256 KB shared window), stride byte offset
//     (bits 32-45) between 8-row groups, base offset (49-51) 0, swizzle mode (62-63) 1 = 128 bytes: byte k of row r
//     of a K-major operand is at start + (r / 8) * SBO + (r % 8) * 128 + k, with address bits 4-6 XOR bits 7-9. Only
//     this mode is emulated (any other descriptor fails).
//   * fragment: thread lane (g = lane / 4, t = lane % 4) of warp w % 4 of its warpgroup holds, for j < N / 8,
//     d[4j + i] = row 16 (w % 4) + g + 8 (i / 2), col 8j + 2t + i % 2.
//   * the sum, as Hopper's fp8 tensor cores make it (wgmma.cuh: "FP22"): d (0 when scale-d is 0) and the 32 exact
//     products aligned to the largest one's exponent e, each cut toward zero to a multiple of 2^(e - 13), added
//     exactly (in double: at most 33 terms of 14 bits).
//   * checked: a wgmma.fence before each batch of wgmmas (cleared at every commit), a fence.proxy.async after this
//     thread's cp.async data landed in shared memory and before its next wgmma, every lane of the warp issuing the
//     same descriptors, operands in dynamic shared memory, and no wgmma still in flight when a thread exits.
#pragma once

namespace emu {
inline std::vector<std::pair<uintptr_t, size_t>>& shared_windows() {
  static std::vector<std::pair<uintptr_t, size_t>> w;
  return w;
}
// the emulated dynamic shared memory of one kernel (DYNAMIC_SMEM): 256 KB-aligned, so a pointer's low 18 bits are
// its address in the shared window, as the GPU's descriptors see it
inline unsigned char* shared_window(size_t bytes) {
  constexpr size_t W = size_t(1) << 18;
  if (bytes > W) fail("dynamic shared memory past 256 KB");
  auto* p = static_cast<unsigned char*>(std::aligned_alloc(W, W));
  if (!p) fail("dynamic shared memory: out of memory");
  std::memset(p, 0, W);
  shared_windows().push_back({uintptr_t(p), W});
  return p;
}
inline unsigned smem_window_addr(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (auto& [base, size] : shared_windows())
    if (a >= base && a < base + size) {
      g_cur->smem_window = base;
      return unsigned(a - base);
    }
  fail("wgmma: a shared-memory operand outside dynamic shared memory (DYNAMIC_SMEM)");
}

inline void check_desc(uint64_t d) {
  if ((d >> 62) != 1) fail("wgmma: only the 128-byte swizzle (descriptor mode 1) is emulated");
  if ((d >> 49) & 7u) fail("wgmma: a descriptor base offset other than 0 is not emulated");
  if (((d & 0x3FFFu) << 4) % 128 + 32 > 128) fail("wgmma: a 32-byte K slice crossing a 128-byte swizzled row");
}
// byte k of row r of the K-major operand named by descriptor d
inline const unsigned char* sw128_byte(uint64_t d, uintptr_t window, int r, int k) {
  const unsigned start = unsigned(d & 0x3FFFu) << 4, sbo = unsigned((d >> 32) & 0x3FFFu) << 4;
  const unsigned lin = start + unsigned(r / 8) * sbo + unsigned(r % 8) * 128u + unsigned(k);
  const unsigned phys = lin ^ (((lin >> 7) & 7u) << 4);
  return reinterpret_cast<const unsigned char*>(window + (phys & 0x3FFFFu));
}

inline void wgmma_fence() { g_cur->wg_fenced = true; }
inline void fence_proxy_async() { g_cur->proxy_dirty = false; }

template <int N>
inline void wgmma_e4m3(float* d, uint64_t a, uint64_t b, bool acc) {
  static_assert(N % 8 == 0 && N <= 256, "wgmma n: a multiple of 8 up to 256");
  Thread* me = g_cur;
  if (!me->wg_fenced) fail("wgmma.mma_async without a wgmma.fence before its batch");
  if (me->proxy_dirty) fail("wgmma.mma_async after cp.async data landed, without a fence.proxy.async");
  check_desc(a);
  check_desc(b);
  const uint32_t mine[8] = {uint32_t(a), uint32_t(a >> 32), uint32_t(b), uint32_t(b >> 32), 0, 0, 0, 0};
  const uint64_t r = enter_wide(mine);
  warp_sync();
  for (int l = 0; l < 32; ++l)
    if (std::memcmp(read_wide(r, l, "wgmma.mma_async"), mine, 16))
      fail("wgmma.mma_async: the lanes of a warp gave different descriptors");
  warp_sync();
  me->wgmma.push_back(Thread::Wgmma{-1, d, a, b, me->smem_window, N, acc});
}
inline void wgmma_commit() {
  Thread* me = g_cur;
  for (auto& op : me->wgmma) if (op.group < 0) op.group = me->wg_groups;
  ++me->wg_groups;
  me->wg_fenced = false;
}
// d + sum of p[0..31] as the tensor core adds them (above)
inline float fp22_sum(float d, const float* p) {
  float big = std::fabs(d);
  for (int k = 0; k < 32; ++k) big = std::max(big, std::fabs(p[k]));
  if (big == 0.0f) return 0.0f;
  int e;
  std::frexp(big, &e);  // big = m 2^e, m in [0.5, 1): the largest exponent is e - 1
  const double q = std::ldexp(1.0, e - 1 - 13);
  double s = std::trunc(double(d) / q) * q;
  for (int k = 0; k < 32; ++k) s += std::trunc(double(p[k]) / q) * q;
  return float(s);
}
inline void wgmma_retire(const Thread::Wgmma& op) {
  const float* f8 = g_e4m3_to_float.data();  // ptx_emu.h's table, the one mma.sync reads
  const int w = g_cur->warp % 4, g = g_cur->lane / 4, t = g_cur->lane % 4;
  float p[32];
  for (int j = 0; j < op.n / 8; ++j)
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * w + g + 8 * (i / 2), col = 8 * j + 2 * t + i % 2;
      for (int k = 0; k < 32; ++k)
        p[k] = f8[*sw128_byte(op.a, op.window, row, k)] * f8[*sw128_byte(op.b, op.window, col, k)];
      op.d[4 * j + i] = fp22_sum(op.acc ? op.d[4 * j + i] : 0.0f, p);
    }
}
inline void wgmma_wait(int n) {  // retire every committed group but the newest n, oldest first
  Thread* me = g_cur;
  std::vector<Thread::Wgmma> keep;
  for (auto& op : me->wgmma) {
    if (op.group >= 0 && op.group < me->wg_groups - n) wgmma_retire(op);
    else keep.push_back(op);
  }
  me->wgmma.swap(keep);
}
}  // namespace emu
