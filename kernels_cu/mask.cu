// Rows of requests whose context span is empty (cu_kv[i + 1] == cu_kv[i]) get
// (V = 0, LSE = -inf), V and LSE in one launch; other rows are untouched.
#include "empty_rows.cuh"

template <typename T, int VEC>
__global__ void __launch_bounds__(256, 4) mask_empty_context_kernel(
    T* out, i64 out_st, i64 out_sh, float* lse, i64 lse_st, i64 lse_sh,
    const void* cu_q, i64 q_is64, const void* cu_kv, i64 kv_is64,
    i64 batch, i64 H, i64 D, i64 flat) {
  write_empty_rows<T, VEC>(out, out_st, out_sh, lse, lse_st, lse_sh, cu_q, q_is64, cu_kv,
                           kv_is64, CONTEXT_SPAN_EMPTY, batch, H, D, flat);
}
