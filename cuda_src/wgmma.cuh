// wgmma.cuh: Hopper's warpgroup MMA (sm_90a), one wrapper per instruction, the same source on a GPU (inline PTX)
// and in the CPU emulation (cuda_src/emu/wgmma_emu.h: the descriptor, the 128-byte swizzle and the accumulator
// fragments of the PTX ISA, section 9.7.15, checked against plain matrix products by tests/test_cuda_wgmma.py).
//
// A warpgroup is 4 consecutive warps (128 threads); every thread of it runs each of these:
//   wgmma_fence()           wgmma.fence.sync.aligned: before the first wgmma, and after the accumulators were
//                           touched by anything else (zeroed, read after a wait)
//   wgmma_e4m3_64x128(d, a, b, acc)  wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3: d [64 x 128] = (acc ?
//                           d : 0) + A [64 x 32 bytes] . B [128 x 32 bytes]^T (scale-d = acc), both K-major in
//                           shared memory, named by descriptors; asynchronous: d is written and A, B are read any
//                           time until the wait that retires it. The sum is not f32's: Hopper's fp8 tensor cores
//                           keep 13 bits of mantissa (below)
//   wgmma_commit()          wgmma.commit_group.sync.aligned: the wgmmas issued since the last commit form a group
//   wgmma_wait<N>()         wgmma.wait_group.sync.aligned N: every group but the newest N has completed
//   fence_proxy_async()     fence.proxy.async.shared::cta: this thread's generic-proxy writes to shared memory
//                           (st.shared, cp.async) become visible to the async proxy that wgmma reads through;
//                           before the barrier that publishes them
// Descriptors (sw128_desc): the operand's rows are 128 bytes (one k-tile of 128 fp8), 8-row atoms of 1024 bytes,
// 16-byte chunk c of row r stored at chunk c ^ (r % 8) of the row (the 128-byte swizzle), the atom 1024-byte aligned
// in the shared window; start address (bits 0-13, >> 4) = the 32-byte slice of K the instruction reads, stride byte
// offset (bits 32-45) 1024 between 8-row groups, leading byte offset unused (1), swizzle mode 1 (bits 62-63).
// Accumulation, Hopper's fp8 tensor cores (the emulator's model, "FP22", e8m13): each instruction aligns d and its
// 32 exact products to the largest one's exponent e, cuts each toward zero to a multiple of 2^(e - 13) and adds
// them. Fitted to an H100 (2026-12-06, tests/test_cuda_wgmma.py's fixture, K 128): its largest error, -23.08984375
// for -23.0781708 at row 36, col 105, the model gives to the bit. Over a long K the cut bits add up (by the model,
// 0.3 % of max|out| at K 4096, 0.01 % when each 128 of K starts afresh): kernels add each k-tile's instructions into
// f32 registers of their own (moe_gemm_wgmma.cu).
// Fragment of d (per warp w of the warpgroup, groupID g = lane / 4, tig t = lane % 4), for j < 16:
//   d[4j], d[4j+1]: row 16w + g, cols 8j + 2t, 2t + 1     d[4j+2], d[4j+3]: row 16w + g + 8, the same cols
#pragma once
#include "mma.cuh"

#if defined(CUDA_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_AVAILABLE 1
#endif

// a shared-memory address as the descriptors and the async proxy see it: its offset in the shared window (18 bits;
// in the emulator, whose shared window is a 256 KB-aligned allocation (DYNAMIC_SMEM), the pointer's low 18 bits)
__device__ __forceinline__ unsigned smem_addr(const void* p) {
#ifdef CUDA_EMU
  return emu::smem_window_addr(p);
#else
  return smem_u32(p);
#endif
}

// the descriptor of a K-major operand slice at `p` (8-row atoms of 128-byte rows, 128-byte swizzle)
__device__ __forceinline__ unsigned long long sw128_desc(const void* p) {
  return (unsigned long long)((smem_addr(p) & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef CUDA_EMU
  emu::wgmma_fence();
#elif defined(WGMMA_AVAILABLE)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef CUDA_EMU
  emu::wgmma_commit();
#elif defined(WGMMA_AVAILABLE)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef CUDA_EMU
  emu::wgmma_wait(N);
#elif defined(WGMMA_AVAILABLE)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ void fence_proxy_async() {
#ifdef CUDA_EMU
  emu::fence_proxy_async();
#elif defined(WGMMA_AVAILABLE)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// the accumulators pinned where they stand: an empty asm that reads and writes each of them, so the compiler moves
// no instruction that defines one (the zeroing, the epilogue's reads) in between a wgmma and the wait that
// completes it. Without it, NVRTC 13.0's ptxas serialized every wgmma (C7515: "non wgmma instructions defining
// accumulator registers ... between start and end of the pipeline stage")
template <int R>
__device__ __forceinline__ void wgmma_fence_operand(float* d) {
#ifndef CUDA_EMU
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

// d[64] = (acc ? d : 0) + A . B^T (m64n128k32, e4m3 x e4m3 -> f32, 13-bit sums as above); the asm names every
// accumulator ("+f") so the compiler keeps them in registers and orders nothing that touches them across it
__device__ __forceinline__ void wgmma_e4m3_64x128(float* d, unsigned long long a, unsigned long long b, bool acc) {
#ifdef CUDA_EMU
  emu::wgmma_e4m3<128>(d, a, b, acc);
#elif defined(WGMMA_AVAILABLE)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(int(acc)));
#else
  __trap();
#endif
}
