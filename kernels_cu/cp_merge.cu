// Context-parallel combine: N ranks hold partial states (V_r, S_r) of the same rows, each over
// its own slice of the KV. After an all-gather of the LSEs every rank computes the same global
//
//   m = max of the usable S_n (and the sink);  sum = sum_n base^(S_n - m) (+ base^(sink - m))
//   S = m + log_base(sum);  rank r's share: f_r V_r with f_r = base^(S_r - m) / sum
//
// writes its share straight into the buffer the reduce-scatter / all-reduce sums (head-major, so
// that rank j's heads are one contiguous chunk), and the finalize kernel converts the sum to the
// output dtype. Empty rule: an LSE of -inf or +inf (and, for vLLM, NaN) is empty: weight 0, and
// that rank writes exact zeros without reading its V (it may hold NaN/Inf scratch). Every rank
// empty: (0, -inf). NaN in any rank's LSE or in the sink (native rule) makes the row NaN on
// every rank, so the sum is NaN. The sink acts as one more state with V = 0 (S = logaddexp(S,
// sink), V scaled by base^(S_old - S)): -inf changes nothing, +inf gives (0, +inf).
#include "common.cuh"

// vLLM's empty-shard rule: row t is empty on this rank when t >= qsl[B] (padding past the batch)
// or when its request q = min(#{i in 1..B : qsl[i] <= t}, B - 1) has seq_lens[q] == 0. The
// count is a binary search (searchsorted for non-decreasing offsets); B = 0 leaves the first rule.
__device__ __forceinline__ bool empty_shard_row(i64 t, const void* seq_lens, int sl_is64, const void* qsl,
                                                int q_is64, i64 batch) {
  if (t >= load_index(qsl, q_is64, batch)) return true;
  if (batch <= 0) return false;
  i64 lo = 0, hi = batch;
  while (lo < hi) {
    const i64 mid = (lo + hi) >> 1;
    if (load_index(qsl, q_is64, mid + 1) <= t) lo = mid + 1; else hi = mid;
  }
  return load_index(seq_lens, sl_is64, lo < batch - 1 ? lo : batch - 1) == 0;
}

// --- this rank's LSE into its slot of the all-gather buffer -------------------------------------
// dst[t * H + h] = s[t, h] (any strides); MASK = 1 applies the empty-shard rule first (-inf).
template <int MASK>
__global__ void __launch_bounds__(ZK_BLOCK_cp_pack_lse_kernel) cp_pack_lse_kernel(
    const float* __restrict__ s, i64 s_st, i64 s_sh, float* __restrict__ dst, i64 T, i64 H,
    const void* seq_lens, i64 sl_is64, const void* qsl, i64 q_is64, i64 batch) {
  const i64 rows = T * H;
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  i64 t, h;
  split_row(i, H, rows, t, h);
  float x = s[t * s_st + h * s_sh];
  if (MASK && empty_shard_row(t, seq_lens, (int)sl_is64, qsl, (int)q_is64, batch)) x = neg_inf();
  dst[i] = x;
}

// --- global LSE and this rank's rescaled share, in the collective's layout ----------------------
// Row (t, h) of V goes to wire[((h / Hn) * T + t) * Hn + h % Hn][0, D): Hn = H / N for the
// reduce-scatter (chunk j holds rank j's heads), Hn = H for the all-reduce. lses is the gathered
// [N, T, H] (rank stride l_sn, [T, H] row-major within). The global LSE of heads
// [lse_h0, lse_h0 + lse_hn) is written to olse[t, h - lse_h0] (any strides; null: not written).
//
// Warp tiles as in the merge kernels: lane i takes row i of a tile of `tile_rows` rows and
// reduces its N LSEs (phase 1); the warp then sweeps the tile's V, `lanes` threads per row,
// CP_U rows in flight, each row's factor and offsets taken from its lane by shuffle (phase 2).
// Warps stride over the tiles, so a grid smaller than the work leaves SMs to a collective
// running beside it (the pipelined combine).
constexpr int CP_U = 4;

__device__ __forceinline__ bool usable_lse(float x) { return isfinite(x); }

template <typename Tin, typename Tw, int VEC>
__global__ void __launch_bounds__(ZK_BLOCK_cp_combine_kernel) cp_combine_kernel(
    const Tin* __restrict__ v, i64 v_st, i64 v_sh,
    const float* __restrict__ lses, i64 l_sn,
    Tw* __restrict__ wire,
    float* __restrict__ olse, i64 ol_st, i64 ol_sh,
    const float* __restrict__ sinks,
    i64 N, i64 rank, i64 T, i64 H, i64 D, i64 Hn, i64 lse_h0, i64 lse_hn,
    i64 lanes, i64 tile_rows, i64 nan_empty, float k, float inv_k) {
  const int lane = threadIdx.x & 31;
  const i64 rows = T * H;
  const i64 tiles = (rows + tile_rows - 1) / tile_rows;
  const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
  for (i64 tile = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; tile < tiles; tile += warps) {
    const i64 row = tile * tile_rows + lane;

    // -- phase 1: this lane's row --
    const bool live = lane < tile_rows && row < rows;
    float f = 0.f;
    i64 v_off = 0, w_off = -1;  // w_off < 0: no row
    if (live) {
      i64 t, h;
      split_row(row, H, rows, t, h);
      const float* p = lses + t * H + h;
      bool nan = false;
      float m = neg_inf();
      for (i64 n = 0; n < N; ++n) {
        const float x = p[n * l_sn];
        if (isnan(x)) nan |= !nan_empty;  // vLLM: a NaN LSE counts as empty
        else if (usable_lse(x)) m = fmaxf(m, x);
      }
      const float sk = sinks != nullptr ? sinks[h] : neg_inf();
      nan |= isnan(sk);
      if (usable_lse(sk)) m = fmaxf(m, sk);
      float lse = neg_inf();
      if (nan) {
        f = quiet_nan();
        lse = quiet_nan();
      } else if (sk > 0.f && !usable_lse(sk)) {  // a sink of +inf takes all the weight: (0, +inf)
        lse = sk;
      } else if (m != neg_inf()) {
        float sum = usable_lse(sk) ? fast_exp2((sk - m) * k) : 0.f;
        for (i64 n = 0; n < N; ++n) {
          const float x = p[n * l_sn];  // an L1 hit: read in the first loop
          if (usable_lse(x)) sum += fast_exp2((x - m) * k);
        }
        const float own = p[rank * l_sn];
        f = usable_lse(own) ? fast_exp2((own - m) * k) / sum : 0.f;  // sum >= 1: the max weighs 1
        lse = m + fast_log2(sum) * inv_k;
      }
      const i64 j = h / Hn;
      w_off = ((j * T + t) * Hn + (h - j * Hn)) * D;
      v_off = t * v_st + h * v_sh;
      if (olse != nullptr && h >= lse_h0 && h < lse_h0 + lse_hn) olse[t * ol_st + (h - lse_h0) * ol_sh] = lse;
    }

    // -- phase 2: the tile's V; f == 0 writes zeros and f NaN writes NaN, neither reads V --
    const int per_pass = 32 / (int)lanes;
    const int sub = lane / (int)lanes;
    const int col = lane % (int)lanes;
    const int passes = ((int)tile_rows + per_pass - 1) / per_pass;
    for (int p0 = 0; p0 < passes; p0 += CP_U) {
      float fu[CP_U];
      i64 vo[CP_U], wo[CP_U];
#pragma unroll
      for (int u = 0; u < CP_U; ++u) {
        const int src = (p0 + u) * per_pass + sub;  // the row's lane in the tile
        fu[u] = __shfl_sync(0xffffffffu, f, src & 31);
        vo[u] = __shfl_sync(0xffffffffu, v_off, src & 31);
        wo[u] = __shfl_sync(0xffffffffu, w_off, src & 31);
        if (p0 + u >= passes || src >= (int)tile_rows) wo[u] = -1;
      }
      for (i64 d = (i64)col * VEC; d < D; d += lanes * VEC) {
        Pack<Tin, VEC> x[CP_U];
#pragma unroll
        for (int u = 0; u < CP_U; ++u)  // every load first: CP_U in flight
          if (wo[u] >= 0 && fu[u] != 0.f && !isnan(fu[u])) x[u] = load_pack<Tin, VEC>(v + vo[u] + d);
#pragma unroll
        for (int u = 0; u < CP_U; ++u) {
          if (wo[u] < 0) continue;
          float acc[VEC];
          const bool read = fu[u] != 0.f && !isnan(fu[u]);
#pragma unroll
          for (int q = 0; q < VEC; ++q) acc[q] = read ? fu[u] * to_float(x[u].v[q]) : fu[u];  // fu: 0 or NaN
          store_pack<Tw, VEC>(wire + wo[u] + d, convert_pack<Tw, VEC>(acc, 1.f));
        }
      }
    }
  }
}

// --- the reduced sum [T, Hn, D] (contiguous) to the output: dtype, strides, fp8 scale -----------
// `lanes` threads per row, 32 / lanes rows per warp, the grid striding over the rows; a thread
// converts VEC elements a step.
template <typename Tw, typename Tout, int VEC>
__global__ void __launch_bounds__(ZK_BLOCK_cp_finalize_kernel) cp_finalize_kernel(
    const Tw* __restrict__ src, Tout* __restrict__ out, i64 o_st, i64 o_sh,
    i64 T, i64 Hn, i64 D, i64 lanes, const float* out_scale) {
  const int lane = threadIdx.x & 31;
  const i64 rows = T * Hn;
  const int per_pass = 32 / (int)lanes;
  const i64 step = (i64)gridDim.x * (blockDim.x >> 5) * per_pass;
  const int col = lane % (int)lanes;
  const float inv_scale = out_scale != nullptr ? 1.f / *out_scale : 1.f;
  const i64 first = (((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * per_pass + lane / (int)lanes;
  for (i64 row = first; row < rows; row += step) {
    i64 t, h;
    split_row(row, Hn, rows, t, h);
    const Tw* in = src + row * D;
    Tout* o = out + t * o_st + h * o_sh;
#pragma unroll 4
    for (i64 d = (i64)col * VEC; d < D; d += lanes * VEC) {
      const Pack<Tw, VEC> x = load_pack<Tw, VEC>(in + d);
      float acc[VEC];
#pragma unroll
      for (int q = 0; q < VEC; ++q) acc[q] = to_float(x.v[q]);
      store_pack<Tout, VEC>(o + d, convert_pack<Tout, VEC>(acc, inv_scale));
    }
  }
}

// --- all-to-all: this rank's state into the send buffer, one chunk per peer ---------------------
// Chunk j (at j * chunk bytes) carries heads [j * Hn, (j + 1) * Hn) for peer j: V as [T, Hn, D] in
// the wire type Tw, then at lse_off the float32 LSE [T, Hn] (its bits travel as wire elements).
// Both blocks start on 16 bytes. `1 << lanes_log2` threads per row, VEC elements a step. The LSE
// is written by the row's first thread: a NaN becomes -inf with nan_empty (vLLM), and MASK = 1
// applies the empty-shard rule. V is copied as it is (the combine never uses an empty row's V).
template <typename Tin, typename Tw, int VEC, int MASK>
__global__ void __launch_bounds__(ZK_BLOCK_cp_a2a_pack_kernel) cp_a2a_pack_kernel(
    const Tin* __restrict__ v, i64 v_st, i64 v_sh, const float* __restrict__ s, i64 s_st, i64 s_sh,
    unsigned char* __restrict__ send, i64 chunk, i64 lse_off, i64 T, i64 H, i64 Hn, i64 D,
    i64 lanes_log2, i64 nan_empty, const void* seq_lens, i64 sl_is64, const void* qsl, i64 q_is64,
    i64 batch) {
  const i64 rows = T * H;
  const i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 row = g >> lanes_log2;
  const i64 lanes = (i64)1 << lanes_log2;
  const i64 col = g & (lanes - 1);
  if (row >= rows) return;
  i64 t, h;
  split_row(row, H, rows, t, h);
  const i64 j = (unsigned)h / (unsigned)Hn;  // H < 2^31
  const i64 r = t * Hn + (h - j * Hn);       // the row within the peer's chunk
  unsigned char* base = send + j * chunk;
  Tw* dst = reinterpret_cast<Tw*>(base) + r * D;
  const Tin* src = v + t * v_st + h * v_sh;
  for (i64 d = col * VEC; d < D; d += lanes * VEC) {
    const Pack<Tin, VEC> x = load_pack<Tin, VEC, true>(src + d);
    float f[VEC];
#pragma unroll
    for (int q = 0; q < VEC; ++q) f[q] = to_float(x.v[q]);
    store_pack<Tw, VEC>(dst + d, convert_pack<Tw, VEC>(f, 1.f));
  }
  if (col == 0) {
    float x = s[t * s_st + h * s_sh];
    if (nan_empty && isnan(x)) x = neg_inf();
    if (MASK && empty_shard_row(t, seq_lens, (int)sl_is64, qsl, (int)q_is64, batch)) x = neg_inf();
    reinterpret_cast<float*>(base + lse_off)[r] = x;
  }
}
