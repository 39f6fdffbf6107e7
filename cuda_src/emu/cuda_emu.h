// cuda_emu.h: run the CUDA C kernels of cuda_src/ on the CPU, unchanged, for tests without a GPU.
//
// Compiled with g++ -std=c++20 into one translation unit with a .cu file and a launch shim that
// toolkit/gpu/emulate.py generates (`extern "C"` entry points loaded with ctypes).
//   * one CUDA thread = one ucontext fiber; the blocks of a grid run one after another, so `__shared__`
//     becomes `static`; inside a block the scheduler runs each ready fiber until it blocks (barrier or
//     shuffle) or exits, in thread order or, with emu_set_reverse(1), in REVERSE thread order, so a missing
//     `__syncthreads` shows up as a wrong result in one of the two orders.
//   * `__syncthreads` is a block barrier that exited threads drop out of; warp shuffles / ballots go through
//     a per-thread, double-buffered exchange slot plus a warp barrier; a barrier some threads can never
//     reach (divergent `__syncthreads`, shuffle vs block barrier) is reported as a deadlock.
//   * -DCUDA_EMU_THREADS: one std::thread per CUDA thread instead of fibers (same barriers with a mutex):
//     the build used with -fsanitize=address as a stand-in for compute-sanitizer.
//   * atomics through std::atomic_ref; __half / __nv_bfloat16 emulated (round to nearest even).
// `__shared__` is static storage: it is not cleared between blocks or launches (uninitialised on a GPU too,
// but here it holds the previous block's values rather than garbage).
// PTX instructions the tensor-core kernels use are emulated lane by lane in ptx_emu.h (mma.sync, ldmatrix,
// cp.async; reached through the wrappers of cuda_src/mma.cuh, never as inline asm), and wgmma in wgmma_emu.h (the
// wrappers of cuda_src/wgmma.cuh). Dynamic shared memory (mma.cuh DYNAMIC_SMEM) is a 256 KB-aligned allocation per
// kernel, so its addresses are those of a shared window. Not emulated: other inline PTX, TMA, grid sync.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>
#ifdef CUDA_EMU_THREADS
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#else
#include <ucontext.h>
#endif

#define CUDA_EMU 1
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint3 { unsigned x, y, z; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
struct alignas(16) float4 { float x, y, z, w; };
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {
enum State { READY, WAIT_BLOCK, WAIT_WARP, DONE };
struct Thread {
  uint3 tid;
  int lane = 0, warp = 0;
  State state = READY;
  uint64_t slot[2] = {0, 0};  // shuffle exchange, double-buffered by round parity
  uint32_t wide[2][8] = {};   // the wider exchange of warp-collective instructions (mma.sync), same parity
  uint64_t rounds = 0;        // exchanges this thread has entered
  struct CpAsync { int group; unsigned char* dst; int bytes; unsigned char data[16]; };
  std::vector<CpAsync> cp_async;  // issued, not yet landed (ptx_emu.h: they land at cp.async.wait_group)
  int cp_groups = 0;              // cp.async groups committed
  struct Wgmma { int group; float* d; uint64_t a, b; uintptr_t window; int n; bool acc; };  // acc: scale-d
  std::vector<Wgmma> wgmma;  // issued, not yet completed (wgmma_emu.h: they complete at wgmma.wait_group)
  int wg_groups = 0;         // wgmma groups committed
  bool wg_fenced = false;    // a wgmma.fence since the last commit
  bool proxy_dirty = false;  // cp.async data landed in shared memory since this thread's last fence.proxy.async
  uintptr_t smem_window = 0; // the shared window of the last descriptor this thread made
#ifndef CUDA_EMU_THREADS
  ucontext_t ctx;             // the fiber's first entry (makecontext / setcontext)
  void* jb[5] = {};           // where it yielded (__builtin_setjmp): resumed by __builtin_longjmp
  bool started = false;
#endif
};
inline thread_local Thread* g_cur = nullptr;
inline dim3 g_grid, g_block;
inline uint3 g_bid;
inline int g_reverse = 0;
inline char g_error[512] = "";  // why the last launch failed (fibers mode reports instead of aborting)
inline std::vector<Thread> g_threads;
inline std::function<void()> g_body;

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda_emu: %s (block %u,%u,%u)\n", what, g_bid.x, g_bid.y, g_bid.z);
  std::fflush(stderr);
  std::abort();
}
// the byte ranges [begin, end) of the launch's array arguments (emu_set_globals, from toolkit/gpu/emulate.py): what
// __ldg and cp.async may read. A read past an array's end stops the launch, as it would fault (or read another
// allocation) on a GPU
inline std::vector<std::pair<uintptr_t, uintptr_t>> g_globals;
inline bool in_globals(const void* p, size_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (const auto& r : g_globals)
    if (a >= r.first && a + n <= r.second) return true;
  return false;
}

inline Thread* lane_thread(int warp, int lane) {
  size_t i = size_t(warp) * 32 + lane;
  return (lane >= 0 && lane < 32 && i < g_threads.size()) ? &g_threads[i] : nullptr;
}

inline void exited() {  // a thread's body returned
  if (!g_cur->wgmma.empty()) fail("a thread exited with a wgmma.mma_async still in flight (no wgmma.wait_group)");
}

#ifdef CUDA_EMU_THREADS
// ---- threads: a barrier that exited threads leave ------------------------------------------------------
struct Barrier {
  std::mutex m;
  std::condition_variable cv;
  int alive = 0, arrived = 0;
  uint64_t gen = 0;
  void arrive() {
    std::unique_lock<std::mutex> l(m);
    uint64_t g = gen;
    if (++arrived == alive) { arrived = 0; ++gen; cv.notify_all(); return; }
    if (!cv.wait_for(l, std::chrono::seconds(30), [&] { return gen != g; })) fail("barrier timeout (deadlock?)");
  }
  void leave() {
    std::lock_guard<std::mutex> l(m);
    if (--alive == arrived && arrived > 0) { arrived = 0; ++gen; cv.notify_all(); }
  }
};
inline Barrier* g_block_bar = nullptr;
inline std::vector<Barrier>* g_warp_bars = nullptr;
inline void block_sync() { g_block_bar->arrive(); }
inline void warp_sync() { (*g_warp_bars)[g_cur->warp].arrive(); }

inline bool run_block(int n) {
  Barrier bb; bb.alive = n;
  std::vector<Barrier> wb((n + 31) / 32);
  for (int i = 0; i < n; ++i) wb[i / 32].alive++;
  g_block_bar = &bb; g_warp_bars = &wb;
  std::vector<std::thread> ts;
  ts.reserve(n);
  for (int i = 0; i < n; ++i)
    ts.emplace_back([i, &bb, &wb] {
      g_cur = &g_threads[i];
      g_body();
      exited();
      wb[i / 32].leave();
      bb.leave();
    });
  for (auto& t : ts) t.join();
  return true;
}
#else
// ---- fibers: a cooperative scheduler per block -------------------------------------------------------
// A switch is GCC's __builtin_setjmp / __builtin_longjmp (stack and frame pointer and a resume address; no signal
// mask): swapcontext saved and restored the signal mask with a system call per switch, and the tensor-core kernels
// switch at every warp-collective instruction (emulation time was ~all switches). ucontext makes each fiber's
// stack and enters it once.
inline void* g_main[5];
inline std::vector<char> g_stacks;
constexpr size_t STACK = 64 * 1024;

[[noreturn]] __attribute__((noinline)) inline void to_main() { __builtin_longjmp(g_main, 1); }
__attribute__((noinline)) inline void yield() {
  if (__builtin_setjmp(g_cur->jb) == 0) to_main();
}
inline void block_sync() { g_cur->state = WAIT_BLOCK; yield(); }
inline void warp_sync() { g_cur->state = WAIT_WARP; yield(); }
inline void fiber_entry() { g_body(); exited(); g_cur->state = DONE; to_main(); }
[[noreturn]] __attribute__((noinline)) inline void resume(Thread& t) {
  if (!t.started) {
    t.started = true;
    setcontext(&t.ctx);
    fail("setcontext failed");
  }
  __builtin_longjmp(t.jb, 1);
}

inline bool run_block(int n) {
  if (g_stacks.size() < size_t(n) * STACK) g_stacks.resize(size_t(n) * STACK);
  for (int i = 0; i < n; ++i) {
    Thread& t = g_threads[i];
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = g_stacks.data() + size_t(i) * STACK;
    t.ctx.uc_stack.ss_size = STACK;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, (void (*)())fiber_entry, 0);
  }
  int nwarps = (n + 31) / 32;
  for (;;) {
    for (int j = 0; j < n; ++j) {
      Thread& t = g_threads[g_reverse ? n - 1 - j : j];
      if (t.state != READY) continue;
      g_cur = &t;
      if (__builtin_setjmp(g_main) == 0) resume(t);  // back here when the fiber yields or ends
    }
    int alive = 0, at_block = 0;
    bool released = false;
    for (int j = 0; j < nwarps; ++j) {  // release ONE warp (the first in run order) whose lanes all wait at a warp
      const int w = g_reverse ? nwarps - 1 - j : j;  // exchange: it runs ahead alone until it blocks again, so a
      int wa = 0, ww = 0;                            // missing __syncthreads between warps shows up as stale data
      for (int i = w * 32; i < std::min(n, w * 32 + 32); ++i) {
        wa += g_threads[i].state != DONE;
        ww += g_threads[i].state == WAIT_WARP;
        at_block += g_threads[i].state == WAIT_BLOCK;
      }
      alive += wa;
      if (wa && ww == wa && !released) {
        released = true;
        for (int i = w * 32; i < std::min(n, w * 32 + 32); ++i) if (g_threads[i].state == WAIT_WARP) g_threads[i].state = READY;
      }
    }
    if (!alive) return true;
    if (released) continue;
    if (at_block != alive) {  // the fibers are abandoned; their stacks are re-made by the next block
      std::snprintf(g_error, sizeof g_error, "deadlock in block (%u,%u,%u): %d of %d live threads wait at "
                    "__syncthreads, the others at a warp shuffle (divergent barrier)", g_bid.x, g_bid.y, g_bid.z, at_block, alive);
      return false;
    }
    for (int i = 0; i < n; ++i) if (g_threads[i].state == WAIT_BLOCK) g_threads[i].state = READY;
  }
}
#endif

// ---- warp exchange: write my slot, meet the warp, read others' slots --------------------------------
template <class T>
inline uint64_t to_bits(T v) { uint64_t b = 0; std::memcpy(&b, &v, sizeof(T)); return b; }
template <class T>
inline T from_bits(uint64_t b) { T v; std::memcpy(&v, &b, sizeof(T)); return v; }

inline uint64_t enter_exchange(uint64_t bits) {
  Thread* me = g_cur;
  me->slot[me->rounds & 1] = bits;
  return ++me->rounds;  // this round's number
}
// the value `lane` wrote in round r, or nothing when that lane did not take part
inline bool read_slot(uint64_t r, int lane, uint64_t* out) {
  Thread* o = lane_thread(g_cur->warp, lane);
  if (!o || o->rounds < r) return false;
  *out = o->slot[(r - 1) & 1];
  return true;
}
template <class T, class Pick>
inline T shuffle(T v, Pick pick) {
  uint64_t r = enter_exchange(to_bits(v));
  warp_sync();
  int src = pick(g_cur->lane);
  uint64_t b;
  return (src >= 0 && read_slot(r, src, &b)) ? from_bits<T>(b) : v;
}
inline unsigned ballot(bool pred) {
  uint64_t r = enter_exchange(pred ? 1 : 0);
  warp_sync();
  unsigned m = 0;
  for (int l = 0; l < 32; ++l) { uint64_t b; if (read_slot(r, l, &b) && b) m |= 1u << l; }
  return m;
}

// ---- the launcher ----------------------------------------------------------------------------------
template <class... A, size_t... I>
inline void call(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <class... A>
inline int launch(void (*k)(A...), dim3 grid, dim3 block, void** args) {
  int n = int(block.x * block.y * block.z);
  g_error[0] = 0;
  if (n <= 0 || n > 1024 || !grid.x || !grid.y || !grid.z) {
    std::snprintf(g_error, sizeof g_error, "bad launch: block of %d threads (1..1024), grid %ux%ux%u", n, grid.x, grid.y, grid.z);
    return 1;
  }
  g_grid = grid; g_block = block;
  g_body = [k, args] { call(k, args, std::index_sequence_for<A...>{}); };
  g_threads.assign(n, Thread{});
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        g_bid = {bx, by, bz};
        for (int i = 0; i < n; ++i) {
          Thread& t = g_threads[i];
          t = Thread{};
          t.tid = {unsigned(i) % block.x, (unsigned(i) / block.x) % block.y, unsigned(i) / (block.x * block.y)};
          t.lane = i % 32; t.warp = i / 32;
        }
        if (!run_block(n)) { g_cur = nullptr; return 2; }
      }
  g_cur = nullptr;
  return 0;
}
template <class... A>
inline int arg_sizes(void (*)(A...), int* out) {
  int i = 0;
  ((out[i++] = int(sizeof(std::remove_cv_t<std::remove_reference_t<A>>))), ...);
  return i;
}
}  // namespace emu

#define threadIdx (::emu::g_cur->tid)
#define blockIdx (::emu::g_bid)
#define blockDim (::emu::g_block)
#define gridDim (::emu::g_grid)
#define warpSize 32

inline void __syncthreads() { emu::block_sync(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_sync(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T> inline T __shfl_sync(unsigned, T v, int src, int w = 32) {
  return emu::shuffle(v, [=](int l) { return (l & ~(w - 1)) + (src & (w - 1)); });
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m, int w = 32) {
  return emu::shuffle(v, [=](int l) { int s = l ^ m; return (s / w == l / w) ? s : -1; });
}
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d, int w = 32) {
  return emu::shuffle(v, [=](int l) { return (l % w) + int(d) < w ? l + int(d) : -1; });
}
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d, int w = 32) {
  return emu::shuffle(v, [=](int l) { return (l % w) >= int(d) ? l - int(d) : -1; });
}
inline unsigned __ballot_sync(unsigned mask, int p) { return emu::ballot(p != 0) & mask; }
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }
inline int __all_sync(unsigned mask, int p) { return emu::ballot(p != 0) == emu::ballot(true); }
inline unsigned __activemask() { return emu::ballot(true); }

// ---- atomics -------------------------------------------------------------------------------------
template <class T> inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T> inline T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v); return cmp; }
template <class T> inline T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p); T o = a.load();
  while (o < v && !a.compare_exchange_weak(o, v)) {}
  return o;
}
template <class T> inline T atomicMin(T* p, T v) {
  std::atomic_ref<T> a(*p); T o = a.load();
  while (v < o && !a.compare_exchange_weak(o, v)) {}
  return o;
}

// ---- math intrinsics -------------------------------------------------------------------------------
template <class A, class B> inline auto min(A a, B b) { return b < a ? b : a; }
template <class A, class B> inline auto max(A a, B b) { return a < b ? b : a; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }  // never contracted
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline int __float2int_rn(float x) { return int(std::nearbyint(x)); }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; std::memcpy(&x, &i, 4); return x; }
inline float __uint_as_float(unsigned i) { float x; std::memcpy(&x, &i, 4); return x; }
template <class T> inline T __ldg(const T* p) {  // ld.global.nc: a read of one of the launch's arrays
  if (!emu::in_globals(p, sizeof(T))) emu::fail("__ldg: an address outside the launch's arrays (past an array's end?)");
  return *p;
}
template <class T> inline T __ldcg(const T* p) {  // ld.global.cg (L2 only): the same read, as checked
  if (!emu::in_globals(p, sizeof(T))) emu::fail("__ldcg: an address outside the launch's arrays (past an array's end?)");
  return *p;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
// byte n of the result: byte (s >> 4n) & 7 of the 8 bytes {x, y} (x bytes 0-3), as PTX prmt's default mode
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long b = (unsigned long long)x | ((unsigned long long)y << 32);
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= unsigned((b >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  return r;
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
  return unsigned(((uint64_t(hi) << 32) | lo) >> (sh & 31));
}
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }

// ---- half and bfloat16 (storage types; arithmetic in float, as the kernels do) ------------------------
struct __half { uint16_t __x; };
struct __nv_bfloat16 { uint16_t __x; };
// f16 -> f32 by a table of all 65536 values, made once from the compiler's own conversion: without F16C, g++ calls
// libgcc's software __extendhfsf2 per value, which was 30 % of the tensor-core kernels' emulation time
inline const std::vector<float> g_half_to_float = [] {
  std::vector<float> t(65536);
  for (uint32_t i = 0; i < 65536; ++i) { const uint16_t b = uint16_t(i); _Float16 f; std::memcpy(&f, &b, 2); t[i] = float(f); }
  return t;
}();
inline float __half2float(__half h) { return g_half_to_float[h.__x]; }
inline __half __float2half_rn(float x) { _Float16 f = _Float16(x); __half h; std::memcpy(&h, &f, 2); return h; }
inline __half __float2half(float x) { return __float2half_rn(x); }
inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(unsigned(h.__x) << 16); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return __nv_bfloat16{b}; }
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{uint16_t((u >> 16) | 0x40)};
  return __nv_bfloat16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
#include "ptx_emu.h"
#include "wgmma_emu.h"
