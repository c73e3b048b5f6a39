// Writing the empty state (V = 0, LSE = -inf) into the rows of requests that are empty.
//
// A persistent grid walks the concatenation of the empty requests' rows (in request order),
// each thread taking the positions congruent to its global index. The work and the bytes
// written scale with the number of empty rows, not with T, no row is skipped whatever the
// query lengths, and a batch with no empty request costs one warp-wide scan of the offsets.
#pragma once
#include "common.cuh"

enum EmptyRule { KV_LENS_ZERO = 0, CONTEXT_SPAN_EMPTY = 1 };

// Requests scanned per step by each warp: SCAN_GROUPS x 32, their loads all in flight at once,
// so a batch without empty requests costs about one memory latency per 256 requests.
constexpr int SCAN_GROUPS = 8;

template <typename T, int VEC>
__device__ void write_empty_rows(
    T* out, i64 out_st, i64 out_sh, float* lse, i64 lse_st, i64 lse_sh,
    const void* cu_q, i64 q_is64, const void* lens, i64 lens_is64, int rule,
    i64 batch, i64 H, i64 D, i64 flat) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  const int lane = threadIdx.x & 31;
  const i64 vecs_per_head = D / VEC;
  const i64 vecs_per_token = H * vecs_per_head;
  Pack<T, VEC> zero;
#pragma unroll
  for (int j = 0; j < VEC; ++j) zero.v[j] = from_float<T>(0.f);

  // This thread owns positions gtid, gtid + stride, ... of the concatenation of the empty
  // requests' V vectors (pos_v) and LSE entries (pos_l); base_*: where the next request starts.
  i64 pos_v = (i64)blockIdx.x * blockDim.x + threadIdx.x, pos_l = pos_v;
  i64 base_v = 0, base_l = 0;
  for (i64 first = 0; first < batch; first += 32 * SCAN_GROUPS) {
    bool empty[SCAN_GROUPS];
#pragma unroll
    for (int g = 0; g < SCAN_GROUPS; ++g) {  // each lane looks at one request per group
      const i64 r = first + g * 32 + lane;
      empty[g] = false;
      if (r < batch) {
        empty[g] = rule == KV_LENS_ZERO
            ? load_index(lens, (int)lens_is64, r) == 0
            : load_index(lens, (int)lens_is64, r + 1) == load_index(lens, (int)lens_is64, r);
      }
    }
    int q0[SCAN_GROUPS], rows[SCAN_GROUPS];  // token offsets < 2^31 (checked on the host)
#pragma unroll
    for (int g = 0; g < SCAN_GROUPS; ++g) {  // lanes of empty requests fetch their row spans
      q0[g] = 0;
      rows[g] = 0;
      if (empty[g]) {
        const i64 r = first + g * 32 + lane;
        q0[g] = (int)load_index(cu_q, (int)q_is64, r);
        rows[g] = (int)load_index(cu_q, (int)q_is64, r + 1) - q0[g];
      }
    }
#pragma unroll
    for (int g = 0; g < SCAN_GROUPS; ++g) {
      unsigned todo = __ballot_sync(0xffffffffu, rows[g] > 0);
      while (todo) {  // the warp serves this group's empty requests in order
        const int src = __ffs(todo) - 1;
        todo &= todo - 1;
        const i64 t0 = __shfl_sync(0xffffffffu, q0[g], src);
        const i64 nt = __shfl_sync(0xffffffffu, rows[g], src);

        const i64 end_v = base_v + nt * vecs_per_token;
        for (; pos_v < end_v; pos_v += stride) {
          const i64 i = pos_v - base_v;
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
}
