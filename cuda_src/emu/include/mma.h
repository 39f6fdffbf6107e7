// Emulation of <mma.h> (WMMA, namespace nvcuda::wmma) for the sm_80+ code paths, compiled when the emulation
// is built with -D__CUDA_ARCH__=800 (toolkit.gpu.emulate, arch=800). Only what cuda_src uses: tf32 m16n16k8.
// Each thread holds a whole fragment tile, element (r, c) at x[r * cols + c]: the element order is opaque on a
// GPU, so code that treats x[] element-wise (as the 3xTF32 split does) behaves the same. load/store check the
// documented requirements (pointer 32-byte aligned, ldm a multiple of 4 floats); every thread of the warp
// stores the same tile (redundant, harmless). What this cannot check: the hardware fragment mapping itself.
#pragma once
#include <cstdint>
#include "../cuda_emu.h"

namespace nvcuda {
namespace wmma {
struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
namespace precision { struct tf32 {}; }
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K> struct dims;
template <int M, int N, int K> struct dims<matrix_a, M, N, K> { static constexpr int R = M, C = K; };
template <int M, int N, int K> struct dims<matrix_b, M, N, K> { static constexpr int R = K, C = N; };
template <int M, int N, int K> struct dims<accumulator, M, N, K> { static constexpr int R = M, C = N; };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static constexpr int rows = dims<Use, M, N, K>::R, cols = dims<Use, M, N, K>::C, num_elements = rows * cols;
  float x[num_elements];
};

inline float __float_to_tf32(float f) {  // cvt.rna.tf32.f32: 10 mantissa bits, ties away from zero
  unsigned u = __float_as_uint(f);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  return __uint_as_float(u);
}

inline void check_tile(const void* p, unsigned ldm) {
  if (reinterpret_cast<uintptr_t>(p) % 32 || ldm % 4) emu::fail("wmma load/store: pointer not 32-byte aligned or ldm not a multiple of 4");
}

template <class Use, int M, int N, int K, class T, class L>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const float* p, unsigned ldm) {
  check_tile(p, ldm);
  using F = fragment<Use, M, N, K, T, L>;
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c)
      f.x[r * F::cols + c] = std::is_same<L, col_major>::value ? p[size_t(c) * ldm + r] : p[size_t(r) * ldm + c];
}

template <class Use, int M, int N, int K, class T, class L>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, float v) {
  for (float& e : f.x) e = v;
}

template <int M, int N, int K, class TA, class LA, class TB, class LB>
inline void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
  float out[M * N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = c.x[i * N + j];
      for (int k = 0; k < K; ++k) acc += a.x[i * K + k] * b.x[k * N + j];
      out[i * N + j] = acc;
    }
  for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}

template <int M, int N, int K>
inline void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm, layout_t l) {
  check_tile(p, ldm);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) (l == mem_row_major ? p[size_t(r) * ldm + c] : p[size_t(c) * ldm + r]) = f.x[r * N + c];
}
}  // namespace wmma
}  // namespace nvcuda
