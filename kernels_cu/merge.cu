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

#include "merge_rows.cuh"

// FULL = 0: a call without a_empty, row mask, sinks or fp8 scale that merge_state_flat_kernel
// does not take (LSE written in place, offsets past 2^31), compiled without that code so it fits
// the register budget of full occupancy.
template <int PPT, int FULL> struct MinBlocks { static constexpr int value = PPT == 1 ? (FULL ? 12 : 16) : 8; };

// I: the index type, int when every offset the kernel forms fits in 32 bits (the host picks
// it: fewer instructions before the loads, lower latency), else 64-bit.
template <typename Tin, typename Tout, int VEC, int PPT, int FULL, typename I>
__global__ void __launch_bounds__(ZK_BLOCK_merge_state_kernel, MinBlocks<PPT, FULL>::value) merge_state_kernel(
    const Tin* va, i64 va_st, i64 va_sh,
    const Tin* vb, i64 vb_st, i64 vb_sh,
    Tout* out, i64 out_st, i64 out_sh,
    const float* sa, i64 sa_st, i64 sa_sh,
    const float* sb, i64 sb_st, i64 sb_sh,
    float* olse, i64 ol_st, i64 ol_sh,
    i64 T, i64 H, i64 D, i64 lanes,
    i64 prefix_rows,      // rows t >= prefix_rows take state b alone
    i64 suffix_verbatim,  // past prefix_rows: copy b verbatim (vLLM) instead of the empty rule
    const void* a_cu, const void* a_lens, i64 a_batch, i64 a_is64,  // requests with empty a
    const unsigned char* row_mask,  // rows with mask 0 are not touched (null: all rows)
    const float* sinks,             // [H] attention-sink logits (null: none)
    float k, float inv_k,
    const float* out_scale) {       // fp8 output: out = merged / *out_scale (null: 1)
  const I rows = (I)T * (I)H;
  const I gtid = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x;
  const int shift = __ffs((int)lanes) - 1;
  const I row = gtid >> shift;
  const int col = threadIdx.x & ((int)lanes - 1);
  const bool live = row < rows;  // no early return: the group's lanes meet at __syncwarp
  const I packs = (I)(D / VEC);

  I t = 0, h = 0;
  float la = neg_inf(), lb = neg_inf();
  Pack<Tin, VEC> a[PPT], b[PPT];
  const Tin* pa = va;
  const Tin* pb = vb;
  if (live) {
    t = row / (I)H;
    h = row - t * (I)H;
    la = __ldg(sa + (t * (I)sa_st + h * (I)sa_sh));  // read-only path: each value is read before
    lb = __ldg(sb + (t * (I)sb_st + h * (I)sb_sh));  // the one write that may replace it
    pa = va + (t * (I)va_st + h * (I)va_sh);
    pb = vb + (t * (I)vb_st + h * (I)vb_sh);
#pragma unroll
    for (int u = 0; u < PPT; ++u) {
      const I p = col + (I)u * (I)lanes;
      if (p < packs) {
        a[u] = load_pack<Tin, VEC, true>(pa + p * VEC);
        b[u] = load_pack<Tin, VEC, true>(pb + p * VEC);
      }
    }
  }

  RowCoef c{0.f, 0.f, neg_inf()};
  bool write = live;
  if constexpr (FULL) write = write && (row_mask == nullptr || row_mask[t] != 0);
  if (write) {
    bool use_a = t < prefix_rows;
    if constexpr (FULL) {
      if (use_a && a_cu != nullptr) use_a = !row_in_empty_request(a_cu, a_lens, (int)a_is64, a_batch, T, (i64)t);
    }
    if (t >= prefix_rows && suffix_verbatim) {
      c.cb = 1.f;
      c.lse = lb;
    } else {
      c = combine2(use_a ? la : neg_inf(), lb, k, inv_k);
      if constexpr (FULL) {
        if (sinks != nullptr) {
          const float f = apply_sink(c.lse, sinks[h], k, inv_k);
          c.ca *= f;
          c.cb *= f;
        }
      }
    }
    float inv_scale = 1.f;
    if constexpr (FULL) inv_scale = out_scale != nullptr ? 1.f / *out_scale : 1.f;
    Tout* po = out + (t * (I)out_st + h * (I)out_sh);
#pragma unroll
    for (int u = 0; u < PPT; ++u) {
      const I p = col + (I)u * (I)lanes;
      if (p < packs) store_merged<Tin, Tout, VEC>(po + p * VEC, a[u], b[u], c.ca, c.cb, inv_scale);
    }
    if constexpr (PPT > 1) {  // rows wider than one round (rare: D > 512 in 16-bit): one pack at a time
#pragma unroll 1
      for (I p = col + (I)PPT * (I)lanes; p < packs; p += (I)lanes) {
        const Pack<Tin, VEC> x = load_pack<Tin, VEC, true>(pa + p * VEC);
        const Pack<Tin, VEC> y = load_pack<Tin, VEC, true>(pb + p * VEC);
        store_merged<Tin, Tout, VEC>(po + p * VEC, x, y, c.ca, c.cb, inv_scale);
      }
    }
  }
  __syncwarp();  // every lane of the group has read s_a / s_b before the LSE is written
  if (write && col == 0 && olse != nullptr) olse[t * (I)ol_st + h * (I)ol_sh] = c.lse;
}

#include "merge_flat_rows.cuh"
#include "merge_flat.cuh"

// N-way merge in one pass: v[n, t, h, :] and s[n, t, h] addressed through strides, so both
// [N, T, H, D] and [T, N, H, D] layouts work. The same row groups as merge_state_kernel: each
// lane reduces its row's N LSEs (the group's lanes read the same addresses: one access), then
// sweeps its packs over the inputs, UN packs of NU inputs in flight, skipping the V of empty
// inputs and of inputs whose weight underflows to 0. The outputs must not overlap the inputs.
constexpr int NU = 4;
constexpr int UN = 2;  // packs per input in flight: NU x UN loads, registers for 2 blocks of 128

// merge_states with per-group fp8 output: one pack per lane per step over the row, every lane of
// the warp in every step (a row past the last merges row 0 and stores nothing), so that a
// group's 2^g_shr lanes (at most the row group's, the host keeps lanes >= them) meet in
// group_scale's shuffles.
template <typename Tin, typename Tout, int VEC>
__device__ __forceinline__ void merge_states_groups(bool live, const Tin* pv, i64 v_sn, const float* ps, i64 s_sn,
                                                    Tout* po, i64 N, i64 packs, i64 lanes, int col, float m,
                                                    float scale, float k, float* bscale, i64 bs_at, i64 bs_sg,
                                                    int g_shr, int ue8m0) {
  for (i64 b0 = 0; b0 < packs; b0 += lanes) {
    const i64 p = b0 + col;
    const bool here = live && p < packs;
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
    for (i64 n = 0; n < N && here && scale != 0.f; ++n) {
      const float l = ps[n * s_sn];
      if (is_empty_lse(l)) continue;
      const float w = fast_exp2((l - m) * k) * scale;
      if (w == 0.f) continue;  // selected away: an input whose weight underflows is never read
      const Pack<Tin, VEC> x = load_pack<Tin, VEC>(pv + n * v_sn + p * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += w * to_float(x.v[j]);
    }
    const float gs = group_scale<VEC, ZK_BLOCK_merge_states_kernel>(acc, g_shr, ue8m0);
    divide_rn<VEC>(acc, gs);
    store_pack_if<Tout, VEC>(here, po + p * VEC, convert_pack<Tout, VEC>(acc, 1.f));
    store_float_if(here && (p & ((1 << g_shr) - 1)) == 0, bscale, bs_at + (p >> g_shr) * bs_sg, gs);
  }
}

template <typename Tin, typename Tout, int VEC>
__global__ void __launch_bounds__(ZK_BLOCK_merge_states_kernel) merge_states_kernel(
    const Tin* __restrict__ v, i64 v_sn, i64 v_st, i64 v_sh,
    const float* __restrict__ s, i64 s_sn, i64 s_st, i64 s_sh,
    Tout* __restrict__ out, i64 out_st, i64 out_sh,
    float* __restrict__ olse, i64 ol_st, i64 ol_sh,
    i64 N, i64 T, i64 H, i64 D, i64 lanes, const float* sinks, float k, float inv_k,
    const float* out_scale,
    float* bscale, i64 bs_st, i64 bs_sg, i64 g_shr, i64 ue8m0) {  // per-group fp8 (bscale null: none)
  const i64 rows = T * H;
  const i64 gtid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const int shift = __ffs((int)lanes) - 1;
  const i64 row0 = gtid >> shift;
  const int col = threadIdx.x & ((int)lanes - 1);
  const bool live = row0 < rows;
  // no LSE is read and written by different lanes: no barrier needed; per-group fp8 keeps every
  // lane for its shuffles
  if (!live && bscale == nullptr) return;
  const i64 row = live ? row0 : 0;
  const i64 packs = D / VEC;
  i64 t, h;
  split_row(row, H, rows, t, h);

  // m = max of the non-empty LSEs, scale = 1 / sum of weights
  const float* ps = s + t * s_st + h * s_sh;
  float m = neg_inf();
  bool nan = false;
  for (i64 n = 0; n < N; ++n) {
    const float x = ps[n * s_sn];
    nan |= isnan(x);
    if (!is_empty_lse(x)) m = fmaxf(m, x);
  }
  float sum = 0.f, scale = 0.f;
  if (!nan && m != neg_inf()) {
    for (i64 n = 0; n < N; ++n) {
      const float x = ps[n * s_sn];
      if (!is_empty_lse(x)) sum += fast_exp2((x - m) * k);
    }
    scale = 1.f / sum;
  }
  float row_lse = nan ? quiet_nan() : (sum > 0.f ? m + fast_log2(sum) * inv_k : neg_inf());
  if (sinks != nullptr) scale *= apply_sink(row_lse, sinks[h], k, inv_k);
  if (live && col == 0 && olse != nullptr) olse[t * ol_st + h * ol_sh] = row_lse;
  if (nan) {  // every weight becomes NaN: the row shows the bug
    m = 0.f;
    scale = quiet_nan();
  }
  if (bscale != nullptr) {
    const i64 groups = packs >> g_shr;
    merge_states_groups<Tin, Tout, VEC>(live, v + t * v_st + h * v_sh, v_sn, ps, s_sn, out + t * out_st + h * out_sh,
                                        N, packs, lanes, col, m, scale, k, bscale, t * bs_st + h * groups * bs_sg,
                                        bs_sg, (int)g_shr, (int)ue8m0);
    return;
  }

  const float inv_out = out_scale != nullptr ? 1.f / *out_scale : 1.f;
  const Tin* pv = v + t * v_st + h * v_sh;
  Tout* po = out + t * out_st + h * out_sh;
  for (i64 p0 = col; p0 < packs; p0 += (i64)UN * lanes) {
    float acc[UN][VEC];
#pragma unroll
    for (int u = 0; u < UN; ++u)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[u][j] = 0.f;
    for (i64 n0 = 0; n0 < N; n0 += NU) {
      float w[NU];
      Pack<Tin, VEC> x[NU][UN];
#pragma unroll
      for (int q = 0; q < NU; ++q) {  // every load of these NU inputs first
        w[q] = 0.f;
        const i64 n = n0 + q;
        if (n >= N || scale == 0.f) continue;
        const float l = ps[n * s_sn];
        if (is_empty_lse(l)) continue;
        w[q] = fast_exp2((l - m) * k) * scale;
        if (w[q] == 0.f) continue;
#pragma unroll
        for (int u = 0; u < UN; ++u) {
          const i64 p = p0 + (i64)u * lanes;
          if (p < packs) x[q][u] = load_pack<Tin, VEC>(pv + n * v_sn + p * VEC);
        }
      }
#pragma unroll
      for (int q = 0; q < NU; ++q) {
        if (w[q] == 0.f) continue;
#pragma unroll
        for (int u = 0; u < UN; ++u)
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[u][j] += w[q] * to_float(x[q][u].v[j]);
      }
    }
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      const i64 p = p0 + (i64)u * lanes;
      if (p < packs) store_pack<Tout, VEC>(po + p * VEC, convert_pack<Tout, VEC>(acc[u], inv_out));
    }
  }
}
