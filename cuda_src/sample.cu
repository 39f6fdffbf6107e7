// sample.cu: next-token sampling on the device (toolkit/ref/sample.py is the specification).
//   logits f32 [B, V], seen uint8 [B, V] -> out int32 [B]; then seen[b, out[b]] = 1 (scratch f32 [B, V]: work).
//   Scalars shared by every sequence: temperature, top_k, top_p, penalty, seed (u64), step; or per sequence
//   steps int32 [B] on the device (e.g. the cache lengths, so that a recorded step draws anew on each replay).
//   1. penalty (transformers): a seen token's logit l -> l / penalty if l > 0 else l * penalty (f32);
//   2. temperature == 0: argmax, NaN largest and the lowest index on ties (np.argmax); done;
//   3. x = l / temperature; 4. top-k (0 < k < V): keep x >= kth, the k-th largest x with multiplicity;
//   5. e = expf(x - max x) for the kept tokens; 6. top-p (< 1): keep e >= tau, tau the largest e value whose
//   set {e >= tau} holds at least top_p of the mass; 7. u = uniform(seed, step, b) in [0, 1) (53 bits of a
//   splitmix64 chain, bit-identical to the reference), out = the first token in token order whose running sum
//   of kept e exceeds u * (kept sum).
// Mapping: one block per sequence, blockDim = the launcher's choice (a multiple of 32, <= SAMPLE_THREADS, about
//   8 tokens per thread); scratch f32 [B, V] holds each row's e between passes:
//   - top-k: radix select on the ordered bits of x (recomputed from the logits), 4 passes of 8 bits with a
//     shared histogram (integer counts: exact and deterministic);
//   - max of x, then one pass writing e to scratch and summing it: block reductions (strided, coalesced);
//   - top-p: bisection on the bits of tau (30 passes over scratch, a block sum each; the float sum of
//     {e >= t} is monotone in t, so the search returns the exact largest t the kernel's own sums accept);
//   - draw: each thread owns a contiguous chunk of tokens; chunk sums, a block exclusive scan, then the thread
//     whose chunk crosses u * sum scans it; the first crossing (block min) wins. If rounding leaves no crossing,
//     the last kept token is taken. All reductions run in a fixed order: the same inputs give the same token.
//   Cost per sequence: 6 passes over the logits with top-k, 2 without (4 bytes a token, 5 with the penalty's
//   seen flags), then 32 passes over scratch with top-p, 2 without (4 bytes a token); greedy: 1 pass.
// Entry points: sample_kernel, mark_seen_kernel (prefill: seen[b, ids[b, t]] = 1 for t < lengths[b]; ids
//   outside [0, V) skipped). Launcher: toolkit/gpu/sample.py.
// Contract: greedy exact (np.argmax of the penalised logits); sampling token for token equal to the reference
//   except when u lands within f32 rounding of a boundary (the reference sums in f64, the kernel in f32).
// Check: pytest tests/test_cuda_runtime_ops.py -k sample (emulated, forward and reverse thread order, a
//   chi-square test of the drawn frequencies); registers: pytest tests/test_cuda_compile.py -k sample.
#include "common.cuh"

constexpr int SAMPLE_THREADS = 1024;
constexpr int MARK_THREADS = 256;
constexpr int NO_INDEX = 0x7fffffff;

// ---- the counter-based uniform (toolkit/ref/sample.py: splitmix64, uniform) ---------------------------
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ double uniform01(unsigned long long seed, int step, int b) {
  unsigned long long x = splitmix64(seed);
  x = splitmix64(x ^ (unsigned long long)(long long)step);
  x = splitmix64(x ^ (unsigned long long)(long long)b);
  return (double)(x >> 11) * (1.0 / 9007199254740992.0);  // 2^-53
}

// ---- one sequence's tokens as the steps see them -------------------------------------------------------
struct Row {
  const float* logits;        // [V]
  const unsigned char* seen;  // [V]
  float penalty, temperature;

  __device__ float penalised(int i) const {  // step 1
    const float l = logits[i];
    if (penalty == 1.0f || !seen[i]) return l;
    return l > 0.0f ? l / penalty : l * penalty;
  }
  __device__ float scaled(int i) const { return penalised(i) / temperature; }  // step 3
};

// ---- block helpers (every thread calls them; blockDim.x a multiple of 32) ------------------------------
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi) {  // np.argmax order
  if (v != v) return bv == bv || i < bi;
  return bv == bv && (v > bv || (v == bv && i < bi));
}

__device__ int block_argmax(float v, int i) {
  __shared__ float pv[32];
  __shared__ int pi[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL_MASK, v, o);
    const int oi = __shfl_xor_sync(FULL_MASK, i, o);
    if (beats(ov, oi, v, i)) { v = ov; i = oi; }
  }
  if (lane == 0) { pv[warp] = v; pi[warp] = i; }
  __syncthreads();
  v = lane < nwarps ? pv[lane] : __uint_as_float(0xff800000u);
  i = lane < nwarps ? pi[lane] : NO_INDEX;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL_MASK, v, o);
    const int oi = __shfl_xor_sync(FULL_MASK, i, o);
    if (beats(ov, oi, v, i)) { v = ov; i = oi; }
  }
  __syncthreads();
  return i;
}

template <bool IS_MAX>
__device__ int block_extreme_int(int v) {
  __shared__ int part[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  for (int o = 16; o > 0; o >>= 1) {
    const int w = __shfl_xor_sync(FULL_MASK, v, o);
    v = IS_MAX ? max(v, w) : min(v, w);
  }
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < nwarps ? part[lane] : (IS_MAX ? -NO_INDEX : NO_INDEX);
  for (int o = 16; o > 0; o >>= 1) {
    const int w = __shfl_xor_sync(FULL_MASK, v, o);
    v = IS_MAX ? max(v, w) : min(v, w);
  }
  __syncthreads();
  return v;
}

// Exclusive prefix sum over threads in thread order; *total gets the sum of all (the same on every thread).
__device__ float block_exclusive_scan(float v, float* total) {
  __shared__ float warp_total[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  float inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    const float up = __shfl_up_sync(FULL_MASK, inc, o);
    if (lane >= o) inc += up;
  }
  float exc = __shfl_up_sync(FULL_MASK, inc, 1);
  if (lane == 0) exc = 0.0f;
  if (lane == 31) warp_total[warp] = inc;
  __syncthreads();
  float before = 0.0f, all = 0.0f;
  for (int w = 0; w < nwarps; ++w) {
    if (w == warp) before = all;
    all += warp_total[w];
  }
  __syncthreads();
  *total = all;
  return before + exc;
}

// ---- top-k: the k-th largest x, by radix select on its ordered bits ----------------------------------
__device__ __forceinline__ unsigned order_key(float x) {  // x < y <=> key(x) < key(y); -0 counts as +0
  unsigned b = __float_as_uint(x);
  if (b == 0x80000000u) b = 0u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ float kth_largest(const Row& r, int V, int k) {
  __shared__ int hist[256];
  __shared__ unsigned s_digit;
  __shared__ int s_rest;
  unsigned prefix = 0u, mask = 0u;
  int rest = k;  // rank of the wanted key among the keys that match prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += blockDim.x) hist[d] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const unsigned key = order_key(r.scaled(i));
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xFFu], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the digit holding the rest-th largest, from the top
      int d = 255;
      for (; d > 0 && hist[d] < rest; --d) rest -= hist[d];
      s_digit = (unsigned)d;
      s_rest = rest;
    }
    __syncthreads();
    prefix |= s_digit << shift;
    mask |= 0xFFu << shift;
    rest = s_rest;
  }
  return key_value(prefix);
}

// ---- the kernels --------------------------------------------------------------------------------------
__global__ void __launch_bounds__(SAMPLE_THREADS)
sample_kernel(const float* __restrict__ logits, unsigned char* __restrict__ seen, float* __restrict__ scratch,
              int* __restrict__ out, int V, float temperature, int top_k, float top_p, float penalty,
              unsigned long long seed, int step, const int* __restrict__ steps) {
  const int b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
  const Row r{logits + (size_t)b * V, seen + (size_t)b * V, penalty, temperature};
  int choice;
  if (temperature == 0.0f) {  // greedy
    float bv = __uint_as_float(0xff800000u);
    int bi = NO_INDEX;
    for (int i = tid; i < V; i += nt) {
      const float l = r.penalised(i);
      if (beats(l, i, bv, bi)) { bv = l; bi = i; }
    }
    choice = block_argmax(bv, bi);
  } else {
    const float kth = top_k > 0 && top_k < V ? kth_largest(r, V, top_k) : __uint_as_float(0xff800000u);
    float mx = -3.402823466e38f;
    for (int i = tid; i < V; i += nt) mx = fmaxf(mx, r.scaled(i));
    const float m = block_max(mx);
    float* e = scratch + (size_t)b * V;  // [V] the kept e, 0 for the tokens top-k drops
    float sum = 0.0f;
    for (int i = tid; i < V; i += nt) {
      const float x = r.scaled(i);
      e[i] = x >= kth ? expf(x - m) : 0.0f;
      sum += e[i];
    }
    const float total = block_sum(sum);  // its barrier also publishes e[] to the whole block
    float tau = 0.0f;                    // keep e >= tau
    if (top_p < 1.0f) {
      const float target = top_p * total;
      unsigned t = 0u;  // bits of tau: the largest t with mass(e >= t) >= target (e <= 1, so bit 30 stays 0)
      for (int bit = 29; bit >= 0; --bit) {
        const unsigned cand = t | (1u << bit);
        const float c = __uint_as_float(cand);
        float mass = 0.0f;
        for (int i = tid; i < V; i += nt) mass += e[i] >= c ? e[i] : 0.0f;
        if (block_sum(mass) >= target) t = cand;
      }
      tau = __uint_as_float(t);
    }
    // draw: this thread's chunk [lo, hi) of tokens, in token order
    const int chunk = (V + nt - 1) / nt;
    const int lo = min(V, tid * chunk), hi = min(V, lo + chunk);
    float part = 0.0f;
    for (int i = lo; i < hi; ++i) part += e[i] >= tau ? e[i] : 0.0f;
    float kept;
    float run = block_exclusive_scan(part, &kept);
    const double target = uniform01(seed, steps ? steps[b] : step, b) * (double)kept;
    int first = NO_INDEX, last = -1;
    for (int i = lo; i < hi; ++i) {
      if (e[i] > 0.0f && e[i] >= tau) {
        run += e[i];
        last = i;
        if ((double)run > target) { first = i; break; }
      }
    }
    first = block_extreme_int<false>(first);
    last = block_extreme_int<true>(last);
    choice = first != NO_INDEX ? first : max(last, 0);
  }
  if (tid == 0) {  // every thread is past its last read of seen (the reductions above end in a barrier)
    out[b] = choice;
    seen[(size_t)b * V + choice] = 1;
  }
}

__global__ void __launch_bounds__(MARK_THREADS)
mark_seen_kernel(const int* __restrict__ ids, const int* __restrict__ lengths, unsigned char* __restrict__ seen,
                 int T, int V) {
  const int b = blockIdx.x, t = blockIdx.y * MARK_THREADS + threadIdx.x;
  if (t >= T || t >= lengths[b]) return;
  const int id = ids[(size_t)b * T + t];
  if ((unsigned)id < (unsigned)V) seen[(size_t)b * V + id] = 1;
}
