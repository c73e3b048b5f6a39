// Writing the empty state (V = 0, LSE = -inf) into the rows of requests that are empty.
//
// RULE 0 (fixup_zero_kv_rows): request i is empty when kv_lens[i] == 0.
// RULE 1 (mask_empty_context): request i is empty when its context span is empty,
//                              cu_kv[i + 1] <= cu_kv[i].
//
// A persistent grid walks the concatenation of the empty requests' rows (in request order),
// each thread taking the positions congruent to its global index: the work and the bytes
// written scale with the number of empty rows, not with T.
//
// Offsets are trusted for meaning, never for memory: request i's rows [cu_q[i], cu_q[i + 1])
// are clipped to [0, T) and a span with end <= start covers no row, so nothing outside `out`
// and `lse` is ever written whatever the offsets say. Offsets are read at their own width.
#include "common.cuh"

// Each block scans the offsets STEP requests at a time: every thread tests PER_THREAD requests
// (all those loads in flight: one round trip to memory per step) and the block shares the result
// as bit masks in shared memory. Each warp then fetches the query spans of the empty requests
// only (GROUP mask words at once) and serves them in request order. A step without empty
// requests costs one round trip and one barrier.
constexpr int PER_THREAD = 4;  // the kernel's block-wide test names empty[0..3]
constexpr int STEP = ZK_BLOCK_empty_rows_kernel * PER_THREAD;
constexpr int WORDS = STEP / 32;
constexpr int GROUP = 8;

// Tests requests first + j * BLOCK + tid (coalesced), j < PER_THREAD, for emptiness: all the
// loads in flight at once. LENS64: the offsets' width, a compile-time constant so that the loads
// are straight-line code (a branch on the width costs small calls).
template <int RULE, int LENS64>
__device__ __forceinline__ void scan_step(const void* lens, i64 batch, i64 first, bool (&empty)[PER_THREAD]) {
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const i64 r = first + (i64)j * ZK_BLOCK_empty_rows_kernel + threadIdx.x;
    empty[j] = false;
    if (r < batch) {
      const i64 l0 = load_index(lens, LENS64, r);
      empty[j] = RULE == 0 ? l0 == 0 : load_index(lens, LENS64, r + 1) <= l0;
    }
  }
}

template <typename Tv, int VEC, int RULE, int LENS64>
__global__ void __launch_bounds__(ZK_BLOCK_empty_rows_kernel, 4) empty_rows_kernel(
    Tv* out, i64 out_st, i64 out_sh, float* lse, i64 lse_st, i64 lse_sh,
    const void* cu_q, i64 q_is64, const void* lens,
    i64 batch, i64 T, i64 H, i64 D, i64 flat) {
  // The first step's offsets are tested before anything else is set up: a chunk without an
  // empty request (the common call) costs one round trip and one barrier from the kernel's
  // start.
  bool empty[PER_THREAD];
  scan_step<RULE, LENS64>(lens, batch, 0, empty);
  // One barrier decides for the whole block whether this step has any empty request.
  bool found = __syncthreads_or(empty[0] || empty[1] || empty[2] || empty[3]);
  if (!found && batch <= STEP) return;  // uniform: every thread sees the same barrier result

  constexpr int WARPS = ZK_BLOCK_empty_rows_kernel / 32;
  __shared__ unsigned empty_words[WORDS];
  const i64 stride = (i64)gridDim.x * blockDim.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 vecs_per_head = D / VEC;
  const i64 vecs_per_token = H * vecs_per_head;
  Pack<Tv, VEC> zero;
#pragma unroll
  for (int j = 0; j < VEC; ++j) zero.v[j] = from_float<Tv>(0.f);

  // This thread owns positions gtid, gtid + stride, ... of the concatenation of the empty
  // requests' V vectors (pos_v) and LSE entries (pos_l); base_*: where the next request starts.
  i64 pos_v = (i64)blockIdx.x * blockDim.x + threadIdx.x, pos_l = pos_v;
  i64 base_v = 0, base_l = 0;
  for (i64 first = 0; first < batch; first += STEP) {
    if (first != 0) {  // a batch without an empty request costs a round trip and a barrier per step
      scan_step<RULE, LENS64>(lens, batch, first, empty);
      found = __syncthreads_or(empty[0] || empty[1] || empty[2] || empty[3]);
    }
    if (!found) continue;
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {  // word j * WARPS + warp: requests first + 32 * word + bit
      const unsigned m = __ballot_sync(0xffffffffu, empty[j]);
      if (lane == 0) empty_words[j * WARPS + warp] = m;
    }
    __syncthreads();

    for (int w0 = 0; w0 < WORDS; w0 += GROUP) {
      unsigned m[GROUP], any = 0;
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        m[g] = empty_words[w0 + g];
        any |= m[g];
      }
      if (any == 0) continue;  // uniform: no empty request among these 256
      int q0[GROUP], rows[GROUP];  // clipped to [0, T) and T < 2^31: 32 bits suffice
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {  // lanes of empty requests fetch their row spans
        q0[g] = 0;
        rows[g] = 0;
        if ((m[g] >> lane) & 1u) {
          const i64 r = first + 32 * (i64)(w0 + g) + lane;
          const i64 start = clip_row(load_index(cu_q, (int)q_is64, r), T);
          const i64 end = clip_row(load_index(cu_q, (int)q_is64, r + 1), T);
          if (end > start) {
            q0[g] = (int)start;
            rows[g] = (int)(end - start);
          }
        }
      }
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        unsigned todo = __ballot_sync(0xffffffffu, rows[g] > 0);
        while (todo) {  // the warp serves this word's empty requests in order
          const int src = __ffs(todo) - 1;
          todo &= todo - 1;
          const i64 t0 = __shfl_sync(0xffffffffu, q0[g], src);
          const i64 nt = __shfl_sync(0xffffffffu, rows[g], src);

          const i64 end_v = base_v + nt * vecs_per_token;
          for (; pos_v < end_v; pos_v += stride) {
            const i64 i = pos_v - base_v;
            Tv* p;
            if (flat) {  // rows of one request are one contiguous span
              p = out + t0 * out_st + i * VEC;
            } else {
              const i64 tk = i / vecs_per_token;
              const i64 rem = i - tk * vecs_per_token;
              const i64 hh = rem / vecs_per_head;
              p = out + (t0 + tk) * out_st + hh * out_sh + (rem - hh * vecs_per_head) * VEC;
            }
            store_pack<Tv, VEC>(p, zero);
          }
          base_v = end_v;

          const i64 end_l = base_l + nt * H;
          for (; pos_l < end_l; pos_l += stride) {
            const i64 i = pos_l - base_l;
            const i64 tk = i / H;
            lse[(t0 + tk) * lse_st + (i - tk * H) * lse_sh] = neg_inf();
          }
          base_l = end_l;
        }
      }
    }
    __syncthreads();  // every warp has read the words before the next step rewrites them
  }
}
