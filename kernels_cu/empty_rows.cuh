// Writing the empty state (V = 0, LSE = -inf) into the rows of requests that are empty.
//
// A persistent grid walks the concatenation of the empty requests' rows (in request order),
// each thread taking the positions congruent to its global index. The work and the bytes
// written scale with the number of empty rows, not with T, no row is skipped whatever the
// query lengths, and a batch with no empty request costs one warp-wide scan of the offsets.
#pragma once
#include "common.cuh"

enum EmptyRule { KV_LENS_ZERO = 0, CONTEXT_SPAN_EMPTY = 1 };

// First position >= base, in a range starting at `base`, that belongs to thread `gtid`.
__device__ __forceinline__ i64 first_owned(i64 base, i64 gtid, i64 stride) {
  return ((gtid - base % stride) % stride + stride) % stride;
}

template <typename T, int VEC>
__device__ void write_empty_rows(
    T* out, i64 out_st, i64 out_sh, float* lse, i64 lse_st, i64 lse_sh,
    const void* cu_q, i64 q_is64, const void* lens, i64 lens_is64, int rule,
    i64 batch, i64 H, i64 D, i64 flat) {
  const i64 gtid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  const int lane = threadIdx.x & 31;
  const i64 vecs_per_head = D / VEC;
  const i64 vecs_per_token = H * vecs_per_head;
  Pack<T, VEC> zero;
#pragma unroll
  for (int j = 0; j < VEC; ++j) zero.v[j] = from_float<T>(0.f);

  i64 base_v = 0, base_l = 0;  // where the next empty request starts in the concatenation
  for (i64 first = 0; first < batch; first += 32) {
    // Each lane looks at one request; the warp then serves the empty ones in order.
    const i64 r = first + lane;
    i64 q0 = 0, rows = 0;
    if (r < batch) {
      const bool empty = rule == KV_LENS_ZERO
          ? load_index(lens, (int)lens_is64, r) == 0
          : load_index(lens, (int)lens_is64, r + 1) == load_index(lens, (int)lens_is64, r);
      if (empty) {
        q0 = load_index(cu_q, (int)q_is64, r);
        rows = load_index(cu_q, (int)q_is64, r + 1) - q0;
      }
    }
    unsigned todo = __ballot_sync(0xffffffffu, rows > 0);
    while (todo) {
      const int src = __ffs(todo) - 1;
      todo &= todo - 1;
      const i64 t0 = __shfl_sync(0xffffffffu, q0, src);
      const i64 nt = __shfl_sync(0xffffffffu, rows, src);

      const i64 nv = nt * vecs_per_token;
      for (i64 i = first_owned(base_v, gtid, stride); i < nv; i += stride) {
        T* p;
        if (flat) {  // rows of one request are one contiguous span
          p = out + t0 * out_st + i * VEC;
        } else {
          const i64 tk = i / vecs_per_token;
          const i64 rem = i - tk * vecs_per_token;
          const i64 hh = rem / vecs_per_head;
          p = out + (t0 + tk) * out_st + hh * out_sh + (rem - hh * vecs_per_head) * VEC;
        }
        store_pack<T, VEC>(p, zero);
      }
      base_v += nv;

      const i64 nl = nt * H;
      for (i64 i = first_owned(base_l, gtid, stride); i < nl; i += stride) {
        const i64 tk = i / H;
        lse[(t0 + tk) * lse_st + (i - tk * H) * lse_sh] = neg_inf();
      }
      base_l += nl;
    }
  }
}
