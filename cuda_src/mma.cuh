// mma.cuh: the tensor-core instructions of the MMA kernels, one wrapper each, the same source on a GPU (inline
// PTX) and in the CPU emulation (cuda_src/emu/ptx_emu.h, lane by lane, checked against plain matrix products by
// tests/test_cuda_emulated.py::test_ptx_*).
//
// Operand kinds (the template parameter ``Op`` of the kernels): every kind moves 32 bytes of K per MMA step, so
// the register fragments are the same bytes whatever the element type, and so are the ldmatrix loads:
//   OpF16   mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32    (sm_80+)   16 elements of 2 bytes
//   OpBf16  mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32  (sm_80+)   16 elements of 2 bytes
//   OpE4m3  mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32  (sm_89+)   32 fp8 e4m3 codes
// Fragments (PTX ISA 9.7.14.5, groupID g = lane / 4, tig t = lane % 4), for A [16 rows x 32 bytes] row-major,
// B [32 bytes x 8 cols] column-major, C/D [16 x 8] f32:
//   a[0]: row g, bytes 4t..4t+3   a[1]: row g+8, same bytes   a[2]: row g, bytes 16+4t..   a[3]: row g+8, bytes 16+4t..
//   b[0]: col g, bytes 4t..4t+3   b[1]: col g, bytes 16+4t..
//   d[0], d[1]: row g, cols 2t, 2t+1     d[2], d[3]: row g+8, cols 2t, 2t+1
// ldmatrix_x4(r, row): lanes 8i..8i+7 give the 16-byte row addresses of 8x8 b16 matrix i; r[i] = row lane/4,
// bytes 4 (lane % 4).. of matrix i: with rows = A's rows (or B's columns), exactly the fragments above.
// cp.async: cp_async16 (16 bytes global -> shared, L2 only (.cg)), cp_async8 (8 bytes, .ca, of which the first src_bytes are
// read); a false `full` / the bytes past src_bytes zero-fill the destination; cp_async_commit,
// cp_async_wait<N> (all committed groups but the newest N have landed; a __syncthreads must follow before other
// threads read them).
#pragma once
#include "common.cuh"
#include <cuda_bf16.h>

#if defined(CUDA_EMU) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define MMA_AVAILABLE 1
#endif
#if defined(CUDA_EMU) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890)
#define MMA_FP8_AVAILABLE 1
#endif

// dynamic shared memory (a block past the 48 KB of static shared memory; the launcher passes `bytes` and raises the
// kernel's limit): `extern __shared__` on a GPU; in the emulator one 256 KB-aligned allocation per kernel, kept like
// its static __shared__, whose pointers' low 18 bits are shared-window addresses (wgmma's descriptors: wgmma_emu.h)
#ifdef CUDA_EMU
#define DYNAMIC_SMEM(name, bytes) static unsigned char* const name = ::emu::shared_window(bytes)
#else
#define DYNAMIC_SMEM(name, bytes) extern __shared__ __align__(16) unsigned char name[]
#endif

// the arguments of the tensor-core moe_gemm kernels (moe_gemm_mma.cu, moe_gemm_wgmma.cu): one launcher
// (toolkit/gpu/moe_gemm_mma.py run_moe_gemm_mma) passes either the same tuple
#define MOE_GEMM_MMA_ARGS                                                                                     \
  const unsigned char *__restrict__ xa, const float *__restrict__ xs, const unsigned char *__restrict__ wq,    \
      const void *__restrict__ ws, const void *__restrict__ wb, const int *__restrict__ sorted_ids,             \
      const int *__restrict__ expert_ids, const float *__restrict__ topk_w, float *__restrict__ out, int n_slots, \
      int top_k, int x_is_slots, int N, int K, int group, int k_chunk, int mode

#ifndef CUDA_EMU
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
#endif

struct OpF16 {
  static constexpr int ELEM = 2;  // bytes per element
  __device__ __forceinline__ static unsigned pack(float lo, float hi) {  // round to nearest even, lo in bits 0..15
    return unsigned(__half_as_ushort(__float2half_rn(lo))) | (unsigned(__half_as_ushort(__float2half_rn(hi))) << 16);
  }
  __device__ __forceinline__ static void mma(float* d, const unsigned* a, const unsigned* b) {
#ifdef CUDA_EMU
    emu::mma_m16n8_32bytes(emu::MMA_F16, d, a, b, d);
#elif defined(MMA_AVAILABLE)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
  }
};

struct OpBf16 {
  static constexpr int ELEM = 2;
  __device__ __forceinline__ static unsigned pack(float lo, float hi) {
    return unsigned(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) | (unsigned(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
  }
  __device__ __forceinline__ static void mma(float* d, const unsigned* a, const unsigned* b) {
#ifdef CUDA_EMU
    emu::mma_m16n8_32bytes(emu::MMA_BF16, d, a, b, d);
#elif defined(MMA_AVAILABLE)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
  }
};

struct OpE4m3 {
  static constexpr int ELEM = 1;
  __device__ __forceinline__ static void mma(float* d, const unsigned* a, const unsigned* b) {
#ifdef CUDA_EMU
    emu::mma_m16n8_32bytes(emu::MMA_E4M3, d, a, b, d);
#elif defined(MMA_FP8_AVAILABLE)
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // sm_80: the launcher never picks an e4m3 kernel below sm_89
#endif
  }
};

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* row) {
#ifdef CUDA_EMU
  emu::ldmatrix<4, false>(r, row);
#elif defined(MMA_AVAILABLE)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(row)));
#else
  __trap();
#endif
}

__device__ __forceinline__ void ldmatrix_x2(unsigned* r, const void* row) {  // lanes 0..15 give the addresses
#ifdef CUDA_EMU
  emu::ldmatrix<2, false>(r, row);
#elif defined(MMA_AVAILABLE)
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(row)));
#else
  __trap();
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* row) {
#ifdef CUDA_EMU
  emu::ldmatrix<4, true>(r, row);
#elif defined(MMA_AVAILABLE)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(row)));
#else
  __trap();
#endif
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src, int src_bytes) {  // .ca; 0..8 bytes read
#ifdef CUDA_EMU
  emu::cp_async<8>(dst, src, src_bytes);
#elif defined(MMA_AVAILABLE)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes));
#else
  __trap();
#endif
}

// a hint that brings the 128-byte line of p into L2 (prefetch.global.L2): no register, nothing waits on it. Emulated
// it moves nothing, but p must lie in one of the launch's arrays (as a load's address must: cuda_emu.h in_globals),
// so a prefetch meant for the tiles a kernel reads names one of them
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef CUDA_EMU
  if (!emu::in_globals(p, 1)) emu::fail("prefetch_l2: an address outside the launch's arrays (past an array's end?)");
#else
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool full) {
#ifdef CUDA_EMU
  emu::cp_async<16>(dst, src, full ? 16 : 0);
#elif defined(MMA_AVAILABLE)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(full ? 16 : 0));
#else
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef CUDA_EMU
  emu::cp_async_commit();
#elif defined(MMA_AVAILABLE)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef CUDA_EMU
  emu::cp_async_wait(N);
#elif defined(MMA_AVAILABLE)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}
