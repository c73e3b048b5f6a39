// Merging partial attention states (V, LSE) by their log-sum-exp.
//
//   m = max(s_a, s_b);  w_x = base^(s_x - m);  V = (w_a V_a + w_b V_b) / (w_a + w_b)
//   S = m + log_base(w_a + w_b)
//
// Empty rule: an LSE of -inf or +inf gives weight 0 and that input's V never reaches the output
// (it may hold NaN/Inf scratch: it is selected away, never multiplied by zero); two empty inputs
// give (0, -inf). NaN in an LSE propagates to the row.
//
// Sinks (optional, float32 [H], in the LSE's base): attention-sink logits counted once in the
// final normaliser: S' = logaddexp(S, sink_h), out *= base^(S - S').
#include "common.cuh"

// Per-row coefficients: out = ca * V_a + cb * V_b (a zero coefficient: that V is not used),
// and the row's output LSE.
struct RowCoef {
  float ca, cb, lse;
};

// Combine two LSEs; k = log2(base), inv_k = 1 / k.
__device__ __forceinline__ RowCoef combine2(float la, float lb, float k, float inv_k) {
  RowCoef c{0.f, 0.f, neg_inf()};
  if (isnan(la) || isnan(lb)) {  // a bug upstream: make it visible (NaN * V_a is NaN whatever V_a)
    c.ca = quiet_nan();
    c.lse = quiet_nan();
    return c;
  }
  const bool ea = is_empty_lse(la), eb = is_empty_lse(lb);
  if (ea && eb) return c;
  const float m = ea ? lb : (eb ? la : fmaxf(la, lb));
  const float wa = ea ? 0.f : fast_exp2((la - m) * k);
  const float wb = eb ? 0.f : fast_exp2((lb - m) * k);
  const float sum = wa + wb;  // in [1, 2]: the larger weight is exactly 1
  const float inv = 1.f / sum;
  c.ca = wa * inv;
  c.cb = wb * inv;
  c.lse = m + fast_log2(sum) * inv_k;
  return c;
}

// Folds an attention sink into a row's LSE; returns the factor its V is multiplied by.
__device__ __forceinline__ float apply_sink(float& lse, float sink, float k, float inv_k) {
  if (sink == neg_inf() || isnan(lse)) return 1.f;
  if (lse == neg_inf()) {  // no keys at all: the sink takes all the weight, V is 0
    lse = sink;
    return 0.f;
  }
  const float m = fmaxf(lse, sink);
  const float total = m + fast_log2(fast_exp2((lse - m) * k) + fast_exp2((sink - m) * k)) * inv_k;
  const float factor = fast_exp2((lse - total) * k);
  lse = total;
  return factor;
}

// Each warp merges a tile of `tile_rows` (<= 32; fewer when there are few rows, so that more
// warps share them) consecutive rows (token t, head h) in two phases.
//  1. Lane i takes row i of the tile: reads its LSEs (coalesced), computes its coefficients and
//     the element offsets of its row; lane i alone later writes that row's LSE, so out_lse may
//     alias s_a or s_b.
//  2. The warp sweeps the tile's V data, `lanes` threads per row (a power of two <= 32) and
//     32 / lanes rows per pass, U passes at a time so that 2 x U accesses per thread are in
//     flight; coefficients and offsets come from the owning lane by shuffle.
// The per-row math thus runs once per row on all 32 lanes, not on one lane per row group.
constexpr int U = 4;

template <typename Tin, typename Tout, int VEC>
__global__ void __launch_bounds__(ZK_BLOCK_merge_state_kernel, 5) merge_state_kernel(
    const Tin* va, i64 va_st, i64 va_sh,
    const Tin* vb, i64 vb_st, i64 vb_sh,
    Tout* out, i64 out_st, i64 out_sh,
    const float* sa, i64 sa_st, i64 sa_sh,
    const float* sb, i64 sb_st, i64 sb_sh,
    float* olse, i64 ol_st, i64 ol_sh,
    i64 T, i64 H, i64 D, i64 lanes, i64 tile_rows,
    i64 prefix_rows,      // rows t >= prefix_rows take state b alone
    i64 suffix_verbatim,  // past prefix_rows: copy b verbatim (vLLM) instead of the empty rule
    const void* a_cu, const void* a_lens, i64 a_batch, i64 a_is64,  // requests with empty a
    const unsigned char* row_mask,  // rows with mask 0 are not touched (null: all rows)
    const float* sinks,             // [H] attention-sink logits (null: none)
    float k, float inv_k,
    const float* out_scale) {       // fp8 output: out = merged / *out_scale (null: 1)
  const int lane = threadIdx.x & 31;
  const i64 rows = T * H;
  const i64 tile = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const i64 row = tile * tile_rows + lane;

  // -- phase 1: this lane's row --
  RowCoef c{0.f, 0.f, neg_inf()};
  int live = lane < tile_rows && row < rows;
  i64 t = 0, h = 0;
  if (live) {
    split_row(row, H, rows, t, h);
    if (row_mask != nullptr && row_mask[t] == 0) live = 0;
  }
  if (live) {
    bool use_a = t < prefix_rows;
    if (use_a && a_cu != nullptr) use_a = !row_in_empty_request(a_cu, a_lens, (int)a_is64, a_batch, T, t);
    const float lb = sb[t * sb_st + h * sb_sh];
    const float la = use_a ? sa[t * sa_st + h * sa_sh] : neg_inf();
    if (t >= prefix_rows && suffix_verbatim) {
      c.cb = 1.f;
      c.lse = lb;
    } else {
      c = combine2(la, lb, k, inv_k);
      if (sinks != nullptr) {
        const float f = apply_sink(c.lse, sinks[h], k, inv_k);
        c.ca *= f;
        c.cb *= f;
      }
    }
  }

  // -- phase 2: the tile's V data --
  const int per_pass = 32 / (int)lanes;
  const int sub = lane / (int)lanes;
  const int col = lane % (int)lanes;
  const float inv_scale = out_scale != nullptr ? 1.f / *out_scale : 1.f;
  const int passes = ((int)tile_rows + per_pass - 1) / per_pass;
  for (int p0 = 0; p0 < passes; p0 += U) {
    float ca[U], cb[U];
    int tu[U], hu[U];  // T and H < 2^31 (checked on the host); tu < 0: no row to write
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int src = (p0 + u) * per_pass + sub;  // the row's lane in the tile
      ca[u] = __shfl_sync(0xffffffffu, c.ca, src & 31);
      cb[u] = __shfl_sync(0xffffffffu, c.cb, src & 31);
      tu[u] = __shfl_sync(0xffffffffu, live ? (int)t : -1, src & 31);
      hu[u] = __shfl_sync(0xffffffffu, (int)h, src & 31);
      if (p0 + u >= passes || src >= (int)tile_rows) tu[u] = -1;
    }
    for (i64 d = (i64)col * VEC; d < D; d += lanes * VEC) {
      Pack<Tin, VEC> a[U], b[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // every load first: 2 x U in flight
        if (tu[u] >= 0 && ca[u] != 0.f) a[u] = load_pack<Tin, VEC>(va + tu[u] * va_st + hu[u] * va_sh + d);
        if (tu[u] >= 0 && cb[u] != 0.f) b[u] = load_pack<Tin, VEC>(vb + tu[u] * vb_st + hu[u] * vb_sh + d);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (tu[u] < 0) continue;
        float acc[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          acc[j] = 0.f;
          if (ca[u] != 0.f) acc[j] += ca[u] * to_float(a[u].v[j]);
          if (cb[u] != 0.f) acc[j] += cb[u] * to_float(b[u].v[j]);
        }
        const Pack<Tout, VEC> o = convert_pack<Tout, VEC>(acc, inv_scale);
        store_pack<Tout, VEC>(out + tu[u] * out_st + hu[u] * out_sh + d, o);
      }
    }
  }
  if (live && olse != nullptr) olse[t * ol_st + h * ol_sh] = c.lse;
}

// N-way merge in one pass: v[n, t, h, :] and s[n, t, h] addressed through strides, so both
// [N, T, H, D] and [T, N, H, D] layouts work. Same warp tiles as merge_state_kernel: lane i
// reduces row i's N LSEs (max, then the sum of weights) and writes its LSE; the warp then sweeps
// the tile's V, each lane recomputing an input's weight from its LSE (an L1 hit) and skipping
// the V of empty inputs and of inputs whose weight underflows to 0.
template <typename Tin, typename Tout, int VEC>
__global__ void __launch_bounds__(ZK_BLOCK_merge_states_kernel) merge_states_kernel(
    const Tin* __restrict__ v, i64 v_sn, i64 v_st, i64 v_sh,
    const float* __restrict__ s, i64 s_sn, i64 s_st, i64 s_sh,
    Tout* __restrict__ out, i64 out_st, i64 out_sh,
    float* __restrict__ olse, i64 ol_st, i64 ol_sh,
    i64 N, i64 T, i64 H, i64 D, i64 lanes, i64 tile_rows, const float* sinks, float k, float inv_k,
    const float* out_scale) {
  const int lane = threadIdx.x & 31;
  const i64 rows = T * H;
  const i64 tile = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const i64 row = tile * tile_rows + lane;

  // -- phase 1: this lane's row: m = max of the non-empty LSEs, scale = 1 / sum of weights --
  const int live = lane < tile_rows && row < rows;
  i64 t = 0, h = 0;
  float m = neg_inf(), scale = 0.f;
  if (live) {
    split_row(row, H, rows, t, h);
    const float* ps = s + t * s_st + h * s_sh;
    bool nan = false;
    for (i64 n = 0; n < N; ++n) {
      const float x = ps[n * s_sn];
      nan |= isnan(x);
      if (!is_empty_lse(x)) m = fmaxf(m, x);
    }
    float sum = 0.f;
    if (!nan && m != neg_inf()) {
      for (i64 n = 0; n < N; ++n) {
        const float x = ps[n * s_sn];
        if (!is_empty_lse(x)) sum += fast_exp2((x - m) * k);
      }
      scale = 1.f / sum;
    }
    float row_lse = nan ? quiet_nan() : (sum > 0.f ? m + fast_log2(sum) * inv_k : neg_inf());
    if (sinks != nullptr) scale *= apply_sink(row_lse, sinks[h], k, inv_k);
    if (olse != nullptr) olse[t * ol_st + h * ol_sh] = row_lse;
    if (nan) {  // every weight becomes NaN: the row shows the bug
      m = 0.f;
      scale = quiet_nan();
    }
  }

  // -- phase 2: the tile's V data, U rows per pass in flight --
  const int per_pass = 32 / (int)lanes;
  const int sub = lane / (int)lanes;
  const int col = lane % (int)lanes;
  const float inv_out = out_scale != nullptr ? 1.f / *out_scale : 1.f;
  const int passes = ((int)tile_rows + per_pass - 1) / per_pass;
  for (int p0 = 0; p0 < passes; p0 += U) {
    float mu[U], su[U];
    int tu[U], hu[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int src = (p0 + u) * per_pass + sub;  // the row's lane in the tile
      mu[u] = __shfl_sync(0xffffffffu, m, src & 31);
      su[u] = __shfl_sync(0xffffffffu, scale, src & 31);
      tu[u] = __shfl_sync(0xffffffffu, live ? (int)t : -1, src & 31);
      hu[u] = __shfl_sync(0xffffffffu, (int)h, src & 31);
      if (p0 + u >= passes || src >= (int)tile_rows) tu[u] = -1;
    }
    for (i64 d = (i64)col * VEC; d < D; d += lanes * VEC) {
      float acc[U][VEC];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[u][j] = 0.f;
      for (i64 n = 0; n < N; ++n) {
        Pack<Tin, VEC> x[U];
        float w[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {  // every load of this input first: U in flight
          w[u] = 0.f;
          if (tu[u] < 0 || su[u] == 0.f) continue;
          const float l = s[n * s_sn + tu[u] * s_st + hu[u] * s_sh];
          if (is_empty_lse(l)) continue;
          w[u] = fast_exp2((l - mu[u]) * k) * su[u];
          if (w[u] != 0.f) x[u] = load_pack<Tin, VEC>(v + n * v_sn + tu[u] * v_st + hu[u] * v_sh + d);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (w[u] != 0.f)
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[u][j] += w[u] * to_float(x[u].v[j]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (tu[u] >= 0) store_pack<Tout, VEC>(out + tu[u] * out_st + hu[u] * out_sh + d, convert_pack<Tout, VEC>(acc[u], inv_out));
    }
  }
}
