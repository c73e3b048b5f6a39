// Rows of requests with kv_lens[i] == 0 get (V = 0, LSE = -inf); other rows are untouched.
#include "empty_rows.cuh"

template <typename T, int VEC>
__global__ void __launch_bounds__(256, 4) fixup_zero_kv_rows_kernel(
    T* out, i64 out_st, i64 out_sh, float* lse, i64 lse_st, i64 lse_sh,
    const void* cu_q, i64 q_is64, const void* kv_lens, i64 lens_is64,
    i64 batch, i64 H, i64 D, i64 flat) {
  write_empty_rows<T, VEC>(out, out_st, out_sh, lse, lse_st, lse_sh, cu_q, q_is64, kv_lens,
                           lens_is64, KV_LENS_ZERO, batch, H, D, flat);
}
