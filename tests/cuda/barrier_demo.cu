// barrier_demo.cu: a test fixture for the CPU emulation (tests/test_cuda_emulated.py), not a toolkit kernel.
//   x f32 [n] -> y f32 [n], y[t] = x[t - 1] (y[0] = 0) through shared memory; n <= 256, one block of n threads.
// shift_synced has the __syncthreads between the shared store and the neighbour's load; shift_unsynced lacks it
// (a race on a GPU). In forward thread order the neighbour t-1 has already stored, so the bug hides; the
// emulator's reverse order exposes it. oob_write writes one element past its output (for the ASan build);
// divergent_sync sends the odd lanes of a warp to __syncthreads, the even ones into a full-mask shuffle (a hang).
__global__ void shift_synced(const float* x, float* y) {
  __shared__ float s[256];
  const int t = threadIdx.x;
  s[t] = x[t];
  __syncthreads();
  y[t] = t ? s[t - 1] : 0.0f;
}

__global__ void shift_unsynced(const float* x, float* y) {
  __shared__ float s[256];
  const int t = threadIdx.x;
  s[t] = x[t];
  y[t] = t ? s[t - 1] : 0.0f;
}

__global__ void oob_write(float* y, int n) {
  const int t = threadIdx.x;
  if (t <= n) y[t] = 1.0f;  // off by one: t == n is past the end
}

__global__ void divergent_sync(float* y) {
  if (threadIdx.x % 2) __syncthreads();  // odd lanes at the block barrier, even lanes in a full-mask shuffle
  else y[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}
