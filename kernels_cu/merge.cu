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

// Combine two LSEs; k = log2(base), inv_k = 1 / k. Selects only: on the path of every small
// merge, between the loads and the stores. STRAIGHT: the output LSE without a test either, which
// the compiler would otherwise turn into a branch around the logarithm (k > 0 for every base).
template <bool STRAIGHT = false>
__device__ __forceinline__ RowCoef combine2(float la, float lb, float k, float inv_k) {
  const bool nan = isnan(la) || isnan(lb);  // a bug upstream: make it visible (NaN * V_a is NaN)
  const bool ea = is_empty_lse(la), eb = is_empty_lse(lb);
  const float xa = ea ? neg_inf() : la, xb = eb ? neg_inf() : lb;
  const float m0 = fmaxf(xa, xb);
  const float m = m0 == neg_inf() ? 0.f : m0;  // both empty: keep the exponents finite
  const float wa = fast_exp2((xa - m) * k), wb = fast_exp2((xb - m) * k);  // exp2(-inf) = 0
  const float sum = wa + wb;  // in [1, 2] (the larger weight is exactly 1), or 0: both empty
  const float inv = __fdividef(1.f, sum);  // approximate reciprocal: 2 ulp in [1, 2]
  RowCoef c;
  c.ca = nan ? quiet_nan() : (ea ? 0.f : wa * inv);
  c.cb = nan || eb ? 0.f : wb * inv;
  if constexpr (STRAIGHT) {  // lg2(0) = -inf: both empty give m + -inf = -inf without a test
    c.lse = nan ? quiet_nan() : m + fast_log2(sum) * inv_k;
  } else {
    c.lse = nan ? quiet_nan() : (sum > 0.f ? m + fast_log2(sum) * inv_k : neg_inf());
  }
  return c;
}

// Folds an attention sink into a row's LSE; returns the factor its V is multiplied by.
__device__ __forceinline__ float apply_sink(float& lse, float sink, float k, float inv_k) {
  if (sink == neg_inf() || isnan(lse)) return 1.f;
  // no keys at all, or a sink of +inf (-inf returned above; m - m would be NaN below): the
  // sink takes all the weight, V is 0 (as the reference and cp_merge)
  if (lse == neg_inf() || isinf(sink)) {
    lse = sink;
    return 0.f;
  }
  const float m = fmaxf(lse, sink);
  const float total = m + fast_log2(fast_exp2((lse - m) * k) + fast_exp2((sink - m) * k)) * inv_k;
  const float factor = fast_exp2((lse - total) * k);
  lse = total;
  return factor;
}

// Options as compile-time features of the tuned forms (merge_flat, merge_state_heads_kernel):
// FEAT is a bitmask, 0 for the plain call, which compiles without any option's code. Each
// feature's pointers and sizes are the last fields of FlatArgs (unused without the feature).
constexpr int F_A_EMPTY = 1;    // a_empty: rows of requests with kv_lens 0 take state b alone
constexpr int F_A64 = 2;        // ... its offsets int64 (else int32)
constexpr int F_SINKS = 4;      // attention sinks [H]
constexpr int F_ROW_MASK = 8;   // rows with mask 0 are not touched
constexpr int F_OUT_SCALE = 16; // fp8 output, merged / *out_scale
constexpr int F_GROUP_FP8 = 32; // fp8 output with a float32 scale per group of packs
constexpr int F_A_RUN = 64;     // with F_A_EMPTY, the gathered form: spans in a loop (merge_flat_run)
// with F_GROUP_FP8: log2 of the packs of one group in bits 7-9 (FEAT >> F_GROUP_SHIFT & 7), so that
// the group's shuffles and index math are compiled for its size (the g_shr parameter is unused)
constexpr int F_GROUP_SHIFT = 7;

// The parameters of the flat kernels (merge_state_flat_kernel and the gathered forms), one
// struct each kernel takes by value and hands its device functions by reference. Its fields are
// the kernels' parameters by name, C type and order, as zerokv/core/kernels.py describes them
// (tests/test_kernels.py holds the two together): with the struct the only parameter, at offset
// 0, each field at its natural alignment, the host packs it as a parameter list. I: the
// strides' type, int where every offset the kernel forms fits in 32 bits, else i64
// (merge_state_flat64_gathered_kernel).
template <typename Tin, typename Tout, typename I> struct FlatArgs {
  const Tin* va;
  const Tin* vb;
  const float* sa;
  const float* sb;
  Tout* out;
  float* olse;
  int rows, H, packs;  // rows = T H
  unsigned packs_mul;  // fast_div by packs
  int packs_shr;
  unsigned H_mul;  // fast_div by H
  int H_shr;
  I sa_st, sa_sh, sb_st, sb_sh, va_st, va_sh, vb_st, vb_sh, out_st, out_sh, ol_st, ol_sh;
  int prefix_rows;      // rows t >= prefix_rows take state b alone
  int suffix_verbatim;  // past prefix_rows: copy b verbatim (vLLM) instead of the empty rule
  float k, inv_k;       // log2 of the LSE's base, and its inverse
  // the options (FEAT), unused without their feature
  const void* a_cu;    // [a_batch + 1] cu_seqlens_q
  const void* a_lens;  // [a_batch] kv_lens
  int a_batch;
  const unsigned char* row_mask;  // [T]
  const float* sinks;             // [H]
  const float* out_scale;         // one float
  float* bscale;                  // per-group scales: bscale[t bs_st + (h groups + group) bs_sg]
  I bs_st, bs_sg;
  int g_shr;  // unused: FEAT holds the group's size
  int ue8m0;  // scales rounded up to a power of two
};

// merge_state_heads_kernel's parameters: FlatArgs's fields but the four its geometry does not
// need (rows, packs_mul, H_mul, H_shr), in the same order. A struct of its own rather than
// FlatArgs with fields unread: the fields it reads keep the offsets of its former parameter list,
// and with them its time at T = 1 (bench/NOTES.md).
template <typename Tin, typename Tout> struct HeadsArgs {
  const Tin* va;
  const Tin* vb;
  const float* sa;
  const float* sb;
  Tout* out;
  float* olse;
  int H, packs, packs_shr;  // packs a power of two, packs_shr its log2
  int sa_st, sa_sh, sb_st, sb_sh, va_st, va_sh, vb_st, vb_sh, out_st, out_sh, ol_st, ol_sh;
  int prefix_rows;
  int suffix_verbatim;
  float k, inv_k;
  const void* a_cu;
  const void* a_lens;
  int a_batch;
  const unsigned char* row_mask;
  const float* sinks;
  const float* out_scale;
  float* bscale;
  int bs_st, bs_sg;
  int g_shr;
  int ue8m0;
};

// offsets[i] at the offsets' width, clipped or compared in 64 bits where they are 64-bit
template <bool A64> __device__ __forceinline__ i64 offset_at(const void* p, int i) {
  if constexpr (A64) return __ldg(static_cast<const i64*>(p) + i);
  else return (i64)__ldg(static_cast<const int*>(p) + i);
}

// row_in_empty_request's rule (the same binary search, so that any offsets give the CPU path's
// rows) for a token t < T < 2^31: int arithmetic, the offsets' width a template argument. The
// number of steps depends on B only, so a warp's lanes search in step; lanes of one token read
// the same addresses (one access per step for the warp; the search is the warp's, not the lane's).
template <bool A64>
__device__ __forceinline__ bool a_row_empty(const void* cu, const void* lens, int B, int T, int t) {
  if (B <= 0) return false;
  int lo = 0, hi = B;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (offset_at<A64>(cu, mid) <= (i64)t) lo = mid; else hi = mid;
  }
  const i64 start = offset_at<A64>(cu, lo), end = offset_at<A64>(cu, lo + 1), len = offset_at<A64>(lens, lo);
  return clip_row(start, T) <= t && t < clip_row(end, T) && len == 0;
}

// |x| as its bits with the sign cleared (fabsf under -ftz is an FADD that flushes denormals)
__device__ __forceinline__ float abs_bits(float x) {
  float r;
  asm("abs.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// max with NaN propagation (sm_80 on): one instruction, |x| an operand modifier
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// vLLM's per-group fp8 rule for the group of packs this thread's pack belongs to (2^g_shr
// consecutive threads, aligned): absmax over the group (NaN wins over any other value, so NaN
// shows), scale = max(absmax, 1e-10) / 448 correctly rounded, rounded up to a power of two when
// ue8m0. Every thread of the warp calls it (shuffles); groups wider than a warp (VEC 1 only)
// meet through shared memory. Two forms: the group's size a template argument (the flat forms:
// exactly log2(lanes) shuffle steps) or a run-time g_shr (merge_states).
template <int VEC>
__device__ __forceinline__ float pack_absmax(const float* x) {
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) m = max_nan(m, abs_bits(x[j]));
  return m;
}

// the absmax of a group of `warps` whole warps (aligned) from each warp's; every thread of the
// block calls it (a barrier inside)
template <int BLOCK>
__device__ __forceinline__ float warps_max(float m, int warps) {
  __shared__ float s_max[BLOCK / 32];
  if ((threadIdx.x & 31u) == 0u) s_max[threadIdx.x >> 5] = m;
  __syncthreads();
  const int w0 = (int)(threadIdx.x >> 5) & ~(warps - 1);
  for (int w = 0; w < warps; ++w) m = max_nan(m, s_max[w0 + w]);
  return m;
}

// the group's scale from its absmax m
__device__ __forceinline__ float scale_of_absmax(float m, int ue8m0) {
  // a / 448 correctly rounded for a normal a in three instructions (Markstein, as divide_rn
  // below, with 1 / 448 rounded at compile time); inf and NaN stay as they are
  const float a = max_nan(m, 1e-10f), y = 1.f / 448.f;
  const float q = __fmul_rn(a, y);
  const float s = a < __int_as_float(0x7f800000) ? fmaf(-fmaf(q, 448.f, -a), y, q) : a;
  unsigned u = __float_as_uint(s);
  if (ue8m0 && (u & 0x7fffffu) && u < 0x7f800000u) u = (u & 0xff800000u) + 0x800000u;  // 2^ceil(log2 s)
  return __uint_as_float(u);
}

template <int VEC, int BLOCK, int G_SHR>
__device__ __forceinline__ float group_scale(const float* x, int ue8m0) {
  constexpr int LANES = 1 << G_SHR;
  static_assert(LANES <= BLOCK, "a group within one block");
  float m = pack_absmax<VEC>(x);
#pragma unroll
  for (int o = 1; o < LANES && o < 32; o <<= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
  if constexpr (LANES > 32) m = warps_max<BLOCK>(m, LANES >> 5);
  return scale_of_absmax(m, ue8m0);
}

template <int VEC, int BLOCK>
__device__ __forceinline__ float group_scale(const float* x, int g_shr, int ue8m0) {
  float m = pack_absmax<VEC>(x);
  const int lanes = 1 << g_shr;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1)  // every step, a lane's own value past the group's width: no loop
    m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o & (lanes - 1)));
  if constexpr (VEC == 1) {
    if (lanes > 32) m = warps_max<BLOCK>(m, lanes >> 5);  // the same for every thread of the block
  }
  return scale_of_absmax(m, ue8m0);
}

__device__ __forceinline__ float div_rn(float x, float y) {
  float q;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(x), "f"(y));
  return q;
}

// x[j] / d correctly rounded (as div.rn) for a positive normal d, in three instructions a value:
// y = 1 / d correctly rounded (once), q = x y, r = q d - x (exact, an FMA), q - r y rounded is
// x / d rounded (Markstein's theorem); the residual's sign is chosen so that r = 0 leaves q
// with its sign of zero. d = inf or NaN (a group holding inf or NaN) takes div.rn itself.
template <int VEC>
__device__ __forceinline__ void divide_rn(float* x, float d) {
  if (d < __int_as_float(0x7f800000)) {
    float y;
    asm("rcp.rn.f32 %0, %1;" : "=f"(y) : "f"(d));
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float q = __fmul_rn(x[j], y);
      x[j] = fmaf(-fmaf(q, d, -x[j]), y, q);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) x[j] = div_rn(x[j], d);
  }
}

// Row groups. Row (t, h) (numbered t * H + h, the order of V in memory) is merged by `lanes`
// threads (a power of two, at most the block; within one warp when out_lse is written in
// place), each taking packs p = lane, lane + lanes, ... of the row's D / VEC packs (VEC = 1:
// scalar path), PPT (1 or 2) of them per round: one round when PPT = 1 (the host keeps
// packs <= lanes then), rounds of PPT packs per input otherwise. Every thread issues its row's
// LSE loads together with its first V loads: one round trip to memory for most rows. The
// contract lets a kernel load an empty input's V (it lies inside the tensor); it never uses it
// (select, never x 0). The group's first lane writes the row's LSE after a __syncwarp, once
// every lane of the group has read the input LSEs, so out_lse may alias s_a or s_b (the host
// then keeps the group in one warp); each V pack is read and written by one thread, so out may
// alias v_a or v_b.

// A zero coefficient drops that input (an empty one, or one whose weight underflows): its V
// may hold NaN/Inf, so it is selected away, never multiplied by zero. bf16 packs take the
// selects on their bits while widening them, then one FMUL and one FFMA per value (less
// work on small calls); half and float keep a select per value, which measured faster for them.
template <typename Tin, int VEC>
__device__ __forceinline__ void merged_floats(const Pack<Tin, VEC>& a, const Pack<Tin, VEC>& b, float ca, float cb,
                                              float* acc) {
  if constexpr (is_bf16<Tin>::value && VEC % 2 == 0) {
    float xa[VEC], xb[VEC];
    bf16_floats_if<VEC>(ca != 0.f, a, xa);
    bf16_floats_if<VEC>(cb != 0.f, b, xb);
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = fmaf(cb, xb[j], ca * xa[j]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float xa = ca != 0.f ? ca * to_float(a.v[j]) : 0.f;
      const float xb = cb != 0.f ? cb * to_float(b.v[j]) : 0.f;
      acc[j] = xa + xb;
    }
  }
}

template <typename Tin, typename Tout, int VEC>
__device__ __forceinline__ Pack<Tout, VEC> merged(const Pack<Tin, VEC>& a, const Pack<Tin, VEC>& b, float ca, float cb,
                                                  float inv_scale) {
  float acc[VEC];
  merged_floats<Tin, VEC>(a, b, ca, cb, acc);
  return convert_pack<Tout, VEC>(acc, inv_scale);
}

template <typename Tin, typename Tout, int VEC>
__device__ __forceinline__ void store_merged(Tout* dst, const Pack<Tin, VEC>& a, const Pack<Tin, VEC>& b, float ca,
                                             float cb, float inv_scale) {
  store_pack<Tout, VEC>(dst, merged<Tin, Tout, VEC>(a, b, ca, cb, inv_scale));
}

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

// The flat kernel's coefficients and output LSE of a row of token t: past prefix_rows, state b
// alone, by the empty rule or (suffix_verbatim) copied as it is.
__device__ __forceinline__ RowCoef flat_row_coef(int t, float la, float lb, int prefix_rows, int suffix_verbatim,
                                                 float k, float inv_k) {
  RowCoef c = combine2<true>(t < prefix_rows ? la : neg_inf(), lb, k, inv_k);
  const bool verbatim = t >= prefix_rows && suffix_verbatim;
  c.ca = verbatim ? 0.f : c.ca;
  c.cb = verbatim ? 1.f : c.cb;
  c.lse = verbatim ? lb : c.lse;
  return c;
}

// Row r of the flat kernel -> its token (returned) and head. In the natural order r = t H + h,
// that of V in memory. TILE: rows walked in tiles of 8 tokens of one head,
// r = 8 (H (t / 8) + h) + t % 8, up to tiled_rows = H (T & ~7); the rows of the last tokens
// (fewer than 8) after them in the natural order. For an LSE laid [H, T] the rows a warp or a
// block holds then lie 8 beside each other in memory: the output LSE leaves in whole 32-byte
// sectors instead of 4 bytes of a sector from each of 8 blocks, and a warp's LSE loads touch
// fewer sectors (faster from 2^19 threads).
template <bool TILE>
__device__ __forceinline__ int flat_token(unsigned r, int H, unsigned H_mul, int H_shr, unsigned tiled_rows, int& h) {
  if constexpr (TILE) {
    const bool tiled = r < tiled_rows;
    const unsigned n = tiled ? r >> 3 : r;
    const int q = (int)fast_div(n, H_mul, H_shr);
    h = (int)n - q * H;
    return tiled ? q * 8 + (int)(r & 7u) : q;
  } else {
    const int t = (int)fast_div(r, H_mul, H_shr);
    h = (int)r - t * H;
    return t;
  }
}

// The output LSEs of a block, gathered: the rows whose pack 0 lies in the block go through
// shared memory and out from its first threads, so that rows beside each other in out_lse
// leave in one warp's store instead of one store from each row's warp (faster from 2^19
// threads on); with rows in tiles (TILE) an out_lse laid [H, T] takes whole
// sectors. Every thread of the block calls it (a barrier inside): those past the last row with
// has = false.
template <int BLOCK, bool TILE, typename I, bool MASK = false>
__device__ __forceinline__ void store_lse_gathered(float* olse, bool has, unsigned row, float lse, int rows,
                                                   int packs, unsigned packs_mul, int packs_shr, int H,
                                                   unsigned H_mul, int H_shr, unsigned tiled_rows, I ol_st,
                                                   I ol_sh, bool keep = true) {
  __shared__ float s_lse[BLOCK];
  __shared__ unsigned char s_keep[MASK ? BLOCK : 1];  // MASK: rows a row mask leaves alone
  const unsigned i0 = blockIdx.x * (unsigned)BLOCK;
  const unsigned q = fast_div(i0, packs_mul, packs_shr);
  const unsigned first = q + (q * (unsigned)packs != i0);  // the first row whose pack 0 is here
  if (has) s_lse[row - first] = lse;
  if constexpr (MASK) {
    if (has) s_keep[row - first] = keep;
  }
  __syncthreads();
  const unsigned end_thread = min(i0 + (unsigned)BLOCK, (unsigned)rows * (unsigned)packs);
  const unsigned end = fast_div(end_thread - 1u, packs_mul, packs_shr) + 1u;
  const unsigned r = first + threadIdx.x;
  bool write = r < end;
  if constexpr (MASK) write = write && s_keep[threadIdx.x];
  if (write) {
    int h;
    const int t = flat_token<TILE>(r, H, H_mul, H_shr, tiled_rows, h);
    olse[(I)t * ol_st + (I)h * ol_sh] = s_lse[threadIdx.x];
  }
}

template <bool A> struct OffsetT { typedef int type; };  // the offsets' own width
template <> struct OffsetT<true> { typedef i64 type; };

// a_empty for B <= 64 requests by a warp together (every lane calls it, converged), with loads
// that wait on nothing: lane j holds cu and kv_lens of entries j and j + 32, and their
// comparisons with the warp's smallest and largest token become masks (ballots). For offsets in
// order, "cu <= t" holds on a prefix of the entries, and its length k is the binary search's
// answer (entry k - 1) without walking it; tokens of the warp between the two take the entries
// that start between them one by one (one shuffle each; none when the lanes share a token).
// Returns whether lane's token t is in an empty request, or -1 (for every lane) where the
// entries are out of order around these tokens: the caller then takes the plain search.
constexpr int A_WINDOW = 64;

// whether a batch of B requests takes the window (the same for the grid)
__device__ __forceinline__ bool a_windowed(int B) { return B >= 1 && B <= A_WINDOW; }

template <bool A64>
__device__ __forceinline__ int a_row_empty_window(const void* cu, const void* lens, int B, int t) {
  typedef typename OffsetT<A64>::type O;
  constexpr unsigned ALL = 0xffffffffu;
  const O* c = static_cast<const O*>(cu);
  const O* len_of = static_cast<const O*>(lens);
  const int lane = (int)(threadIdx.x & 31u), s1 = lane + 32;
  const O c0 = __ldg(c + min(lane, B - 1)), c1 = __ldg(c + min(s1, B - 1)), c_end = __ldg(c + B);
  const O l0 = __ldg(len_of + min(lane, B - 1)), l1 = __ldg(len_of + min(s1, B - 1));
  const int t_min = __reduce_min_sync(ALL, t), t_max = __reduce_max_sync(ALL, t);
  const unsigned lo0 = __ballot_sync(ALL, lane < B && c0 <= (O)t_min), lo1 = __ballot_sync(ALL, s1 < B && c1 <= (O)t_min);
  const unsigned hi0 = __ballot_sync(ALL, lane < B && c0 <= (O)t_max), hi1 = __ballot_sync(ALL, s1 < B && c1 <= (O)t_max);
  const unsigned z0 = __ballot_sync(ALL, l0 == 0), z1 = __ballot_sync(ALL, l1 == 0);  // bits past B unread
  const bool prefix = (lo0 & (lo0 + 1u)) == 0u && (lo1 & (lo1 + 1u)) == 0u && (lo1 == 0u || lo0 == ~0u) &&
                      (hi0 & (hi0 + 1u)) == 0u && (hi1 & (hi1 + 1u)) == 0u && (hi1 == 0u || hi0 == ~0u);
  if (!prefix) return -1;
  const int k_min = __popc(lo0) + __popc(lo1), k_max = __popc(hi0) + __popc(hi1);
  int k = k_min;
  O prev = (O)t_min;
  for (int s = k_min; s < k_max; ++s) {  // the entries that start in (t_min, t_max]: in order?
    const O x = __shfl_sync(ALL, s < 32 ? c0 : c1, s & 31);
    if (x < prev) return -1;
    prev = x;
    k += x <= (O)t ? 1 : 0;
  }
  if (k == 0) return 0;  // before the first entry: no request (lo = 0 starts after t)
  const unsigned zw = k - 1 < 32 ? z0 : z1;
  return ((zw >> ((k - 1) & 31)) & 1u) && !(k == B && c_end <= (O)t) ? 1 : 0;
}

// Whether token t is in an empty request: by the warp's window where it applies (window:
// a_windowed(B); every lane of the warp calls it then), else by the thread's own search.
template <bool A64>
__device__ __forceinline__ bool a_empty_of(const void* cu, const void* lens, int B, int T, int t, bool window) {
  if (window) {
    const int r = a_row_empty_window<A64>(cu, lens, B, t);
    if (r >= 0) return r != 0;  // the same for the warp
  }
  return a_row_empty<A64>(cu, lens, B, T, t);
}

// a_empty in the flat forms: whether token t's request is empty. On grids of A_SHARED_THREADS
// threads and more the answer is found once per token of a block instead of once per warp: the
// block's tokens t_lo .. t_lo + ntok - 1 (those of its first and last live rows; in tiles of 8
// with TILE) are searched by its first warps (the window, 32 tokens a warp) or threads (the plain
// search, one token each) into shared memory; after a barrier every thread reads its token's
// answer. Smaller grids (a few waves, latency-bound) search in each warp. Called after the
// thread's loads are issued; every thread of the block calls it.
constexpr unsigned A_SHARED_THREADS = 1u << 19;

// The tokens of a block's threads i0 .. i1 (its rows' packs): [t_lo, t_lo + n) from its first
// row's token to its last row's (whole tiles of 8 with TILE), n at most MAX.
template <bool TILE, int MAX>
__device__ __forceinline__ int block_tokens(unsigned i0, unsigned i1, unsigned packs_mul, int packs_shr, int H,
                                            unsigned H_mul, int H_shr, unsigned tiled_rows, int& t_lo) {
  const unsigned r0 = fast_div(i0, packs_mul, packs_shr), r1 = fast_div(i1, packs_mul, packs_shr);
  int h;
  t_lo = flat_token<TILE>(r0, H, H_mul, H_shr, tiled_rows, h);
  int t_hi = flat_token<TILE>(r1, H, H_mul, H_shr, tiled_rows, h);
  if constexpr (TILE) {
    if (r0 < tiled_rows) t_lo &= ~7;
    if (r1 < tiled_rows) t_hi |= 7;
  }
  return min(t_hi - t_lo + 1, MAX);
}

// Whether each of the tokens t_lo .. t_lo + n - 1 is in an empty request, into s_empty: by the
// block's warps (the window, 32 tokens a warp) or threads (the plain search, one token each);
// every thread of the block calls it (a barrier at the end).
template <bool A64, int BLOCK>
__device__ __forceinline__ void search_tokens(unsigned char* s_empty, const void* cu, const void* lens, int B, int T,
                                              int t_lo, int n, bool window) {
  if (window) {
    for (int j0 = (int)(threadIdx.x & ~31u); j0 < n; j0 += BLOCK) {
      const int j = min(j0 + (int)(threadIdx.x & 31u), n - 1);
      const bool e = a_empty_of<A64>(cu, lens, B, T, t_lo + j, true);
      if (j0 + (int)(threadIdx.x & 31u) < n) s_empty[j] = e;
    }
  } else {
    for (int j = (int)threadIdx.x; j < n; j += BLOCK) s_empty[j] = a_row_empty<A64>(cu, lens, B, T, t_lo + j);
  }
  __syncthreads();
}

// search_tokens past the window (B > 64), in merge_flat_run: the block copies cu and kv_lens into
// shared memory behind the answers' n bytes (s_empty's free part: no shared memory of its own)
// in one round trip, and each token's binary search (a_row_empty's, step for step: any offsets
// give the same rows; written again, as a helper over both readers changed the register use of
// the runs' 12 kernels) reads the copy instead of paying one round trip a level. For batches
// whose copy fits (staged_fits: about 250 requests with int32 offsets, 125 with int64); every
// thread calls it (two barriers).
__device__ __forceinline__ int staged_at(int n) { return (n + 7) & ~7; }  // the copy's first byte: aligned

template <bool A64, int NTOK>
__device__ __forceinline__ bool staged_fits(int B, int n) {
  typedef typename OffsetT<A64>::type O;
  return B > A_WINDOW && staged_at(n) + (2 * B + 1) * (int)sizeof(O) <= NTOK;
}

template <bool A64, int BLOCK>
__device__ __forceinline__ void search_tokens_staged(unsigned char* s_empty, const void* cu, const void* lens, int B,
                                                     int T, int t_lo, int n) {
  typedef typename OffsetT<A64>::type O;
  O* s_cu = reinterpret_cast<O*>(s_empty + staged_at(n));
  O* s_len = s_cu + B + 1;
  for (int e = (int)threadIdx.x; e <= B; e += BLOCK) {
    s_cu[e] = (O)offset_at<A64>(cu, e);
    if (e < B) s_len[e] = (O)offset_at<A64>(lens, e);
  }
  __syncthreads();
  for (int j = (int)threadIdx.x; j < n; j += BLOCK) {
    const int t = t_lo + j;
    int lo = 0, hi = B;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if ((i64)s_cu[mid] <= (i64)t) lo = mid; else hi = mid;
    }
    s_empty[j] = clip_row((i64)s_cu[lo], T) <= t && t < clip_row((i64)s_cu[lo + 1], T) && s_len[lo] == 0;
  }
  __syncthreads();
}

// token t's answer from search_tokens; outside the range (none by construction): its own search
template <bool A64>
__device__ __forceinline__ bool searched_token(const unsigned char* s_empty, const void* cu, const void* lens, int B,
                                               int T, int t_lo, int n, int t) {
  const int j = t - t_lo;
  return (unsigned)j < (unsigned)n ? s_empty[j] != 0 : a_row_empty<A64>(cu, lens, B, T, t);
}

template <bool A64, int BLOCK, bool TILE>
__device__ __forceinline__ bool token_empty(const void* cu, const void* lens, int B, int T, int t, int rows,
                                            int packs, unsigned packs_mul, int packs_shr, int H, unsigned H_mul,
                                            int H_shr, unsigned tiled_rows) {
  const bool window = a_windowed(B);
  if (gridDim.x * (unsigned)BLOCK < A_SHARED_THREADS) return a_empty_of<A64>(cu, lens, B, T, t, window);
  constexpr int SPAN = BLOCK + 32;  // tokens one block's rows can reach (BLOCK + 24 in tiles of 8)
  __shared__ unsigned char s_empty[SPAN];
  const unsigned i0 = blockIdx.x * (unsigned)BLOCK;
  const unsigned i1 = min(i0 + (unsigned)BLOCK, (unsigned)rows * (unsigned)packs) - 1u;
  int t_lo;
  const int ntok = block_tokens<TILE, SPAN>(i0, i1, packs_mul, packs_shr, H, H_mul, H_shr, tiled_rows, t_lo);
  search_tokens<A64, BLOCK>(s_empty, cu, lens, B, T, t_lo, ntok, window);
  return searched_token<A64>(s_empty, cu, lens, B, T, t_lo, ntok, t);
}

// The four loads of pack `pack` of row (t, h), issued before any arithmetic, then the merge and
// its V store (predicated on live); returns the row's coefficients and output LSE. Offsets in
// the strides' type I. P: FlatArgs or HeadsArgs.
template <typename Tin, typename Tout, int VEC, typename I, typename P>
__device__ __forceinline__ RowCoef merge_pack(const P& p, bool live, int t32, int h32, int pack) {
  const I t = t32, h = h32, d = pack * VEC;
  const Pack<Tin, VEC> a = load_pack<Tin, VEC, true>(p.va + (t * p.va_st + h * p.va_sh + d));
  const Pack<Tin, VEC> b = load_pack<Tin, VEC, true>(p.vb + (t * p.vb_st + h * p.vb_sh + d));
  const float la = __ldg(p.sa + (t * p.sa_st + h * p.sa_sh));
  const float lb = __ldg(p.sb + (t * p.sb_st + h * p.sb_sh));
  const RowCoef c = flat_row_coef(t32, la, lb, p.prefix_rows, p.suffix_verbatim, p.k, p.inv_k);
  store_pack_if<Tout, VEC>(live, p.out + (t * p.out_st + h * p.out_sh + d),
                           merged<Tin, Tout, VEC>(a, b, c.ca, c.cb, 1.f));
  return c;
}

// merge_pack with the option features of FEAT (nonzero). a_empty: whether the row's request is
// empty comes from `empty_of(t)` (token_empty in the flat forms, a_empty_of in the heads form).
// v_a is loaded with v_b and the answer awaited while the loads are in flight (the contract lets
// a kernel load an empty input's V; it is selected away, never used), unless the caller knows
// before the loads that state a goes unused (load_a false: merge_flat_run). keep: the row is
// written (row mask). An unused state's V is dropped by a select, never multiplied by zero.
template <typename Tin, typename Tout, int VEC, int FEAT, int BLOCK, typename I, typename P, typename EmptyOf>
__device__ __forceinline__ RowCoef merge_pack_opt(const P& p, bool live, int t32, int h32, int pack, bool& keep,
                                                  const EmptyOf& empty_of, bool load_a = true) {
  constexpr bool A_EMPTY = (FEAT & F_A_EMPTY) != 0;
  const I t = t32, h = h32, d = pack * VEC;
  // the row mask's byte, loaded first: ptxas otherwise issues it after the merge's arithmetic, a
  // second round trip before the store
  unsigned mask = 1u;
  if constexpr ((FEAT & F_ROW_MASK) != 0)
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(mask) : "l"(p.row_mask + t32));
  Pack<Tin, VEC> a;
  const Pack<Tin, VEC> b = load_pack<Tin, VEC, true>(p.vb + (t * p.vb_st + h * p.vb_sh + d));
  if (load_a) a = load_pack<Tin, VEC, true>(p.va + (t * p.va_st + h * p.va_sh + d));
  else a = Pack<Tin, VEC>{};  // selected away below: the bits do not matter
  const float la = __ldg(p.sa + (t * p.sa_st + h * p.sa_sh));
  const float lb = __ldg(p.sb + (t * p.sb_st + h * p.sb_sh));
  float sink = 0.f;
  if constexpr ((FEAT & F_SINKS) != 0) sink = __ldg(p.sinks + h32);
  keep = live;
  if constexpr ((FEAT & F_ROW_MASK) != 0) keep = live && mask != 0u;
  bool use_a = t32 < p.prefix_rows;
  if constexpr (A_EMPTY) use_a = !empty_of(t32) && use_a;
  RowCoef c = combine2<true>(use_a ? la : neg_inf(), lb, p.k, p.inv_k);
  if constexpr ((FEAT & F_SINKS) != 0) {
    const float f = apply_sink(c.lse, sink, p.k, p.inv_k);
    c.ca *= f;
    c.cb *= f;
  }
  const bool verbatim = t32 >= p.prefix_rows && p.suffix_verbatim;
  c.ca = verbatim ? 0.f : c.ca;
  c.cb = verbatim ? 1.f : c.cb;
  c.lse = verbatim ? lb : c.lse;
  float acc[VEC];
  merged_floats<Tin, VEC>(a, b, c.ca, c.cb, acc);
  Tout* po = p.out + (t * p.out_st + h * p.out_sh + d);
  if constexpr ((FEAT & F_GROUP_FP8) != 0) {
    constexpr int G_SHR = (FEAT >> F_GROUP_SHIFT) & 7;
    const float scale = group_scale<VEC, BLOCK, G_SHR>(acc, p.ue8m0);
    divide_rn<VEC>(acc, scale);
    store_pack_if<Tout, VEC>(keep, po, convert_pack<Tout, VEC>(acc, 1.f));
    // the group's number in its token: (h packs + pack) >> G_SHR, packs a multiple of the group's
    // (h packs + pack < 2^31: the host keeps every thread index 32-bit)
    const I at = t * p.bs_st + (I)((h32 * p.packs + pack) >> G_SHR) * p.bs_sg;
    store_float_if(keep && (pack & ((1 << G_SHR) - 1)) == 0, p.bscale, (i64)at, scale);
  } else {
    float inv_scale = 1.f;
    if constexpr ((FEAT & F_OUT_SCALE) != 0) inv_scale = 1.f / __ldg(p.out_scale);
    store_pack_if<Tout, VEC>(keep, po, convert_pack<Tout, VEC>(acc, inv_scale));
  }
  return c;
}

// The engine's common call (no a_empty, row mask, sinks or fp8 scale; out_lse not written in
// place) in the smallest form: one thread per pack of V (thread i: row i / packs, pack i % packs,
// both without a division), the two V loads and the two LSE loads issued before any arithmetic.
// I: the type of the strides and of the offsets formed from them; int when every tensor spans
// fewer than 2^31 elements, else long long (merge_state_flat64_gathered_kernel); the thread
// index is 32-bit in all (the host keeps rows x packs below 2^31).
//
// SMALL = 1 (grids of one wave, where a call is latency-bound): no branch before the loads, so
// every parameter load is issued at once and the four loads go out together; a thread past the
// last row loads row 0 (inside the tensors) and stores nothing. Faster on grids of one wave,
// slower on grids of many waves, which take SMALL = 0 and its early return; the gathered forms need every thread at their barrier, so they take
// SMALL = 1 too. The smallest calls take merge_state_heads_kernel (below) instead. In every
// form, nothing branches after the loads either: the stores are predicated
// instructions, not code a branch jumps over (a branch region there cost up to 0.05 µs of a
// 1.4 µs call).
//
// GATHER: the rows' output LSEs through shared memory (store_lse_gathered), else each from its
// row's pack-0 thread. TILE: rows in tiles of 8 tokens (flat_token), for an out_lse laid [H, T].
//
// FEAT (option features, nonzero): merge_pack_opt; no early return (the per-group scales' shuffles
// need every thread of the warp), so SMALL does not matter.
template <typename Tin, typename Tout, int VEC, int SMALL, int BLOCK, typename I, bool GATHER = false,
          bool TILE = false, int FEAT = 0>
__device__ __forceinline__ void merge_flat(const FlatArgs<Tin, Tout, I>& p) {
  static_assert(!GATHER || SMALL, "the gathered form's barrier needs every thread");
  const unsigned i = blockIdx.x * (unsigned)BLOCK + threadIdx.x;
  const unsigned row0 = fast_div(i, p.packs_mul, p.packs_shr);
  const bool live = row0 < (unsigned)p.rows;
  if (!SMALL && FEAT == 0 && !live) return;
  const unsigned row = live ? row0 : 0u;
  const int pack = live ? (int)(i - row0 * (unsigned)p.packs) : 0;
  unsigned tiled_rows = 0;  // rows in tiles of 8 tokens: H (T & ~7), the same for every thread
  if constexpr (TILE) tiled_rows = (fast_div((unsigned)p.rows, p.H_mul, p.H_shr) & ~7u) * (unsigned)p.H;
  int h32;
  const int t32 = flat_token<TILE>(row, p.H, p.H_mul, p.H_shr, tiled_rows, h32);
  RowCoef c;
  bool keep = live;
  if constexpr (FEAT == 0) {
    c = merge_pack<Tin, Tout, VEC, I>(p, live, t32, h32, pack);
  } else {
    const int T = (int)fast_div((unsigned)p.rows, p.H_mul, p.H_shr);
    const auto empty_of = [&](int t) {
      return token_empty<(FEAT & F_A64) != 0, BLOCK, TILE>(p.a_cu, p.a_lens, p.a_batch, T, t, p.rows, p.packs,
                                                            p.packs_mul, p.packs_shr, p.H, p.H_mul, p.H_shr,
                                                            tiled_rows);
    };
    c = merge_pack_opt<Tin, Tout, VEC, FEAT, BLOCK, I>(p, live, t32, h32, pack, keep, empty_of);
  }
  const I t = t32, h = h32;
  if constexpr (GATHER) {
    if (p.olse != nullptr)  // the same for the whole block
      store_lse_gathered<BLOCK, TILE, I, (FEAT & F_ROW_MASK) != 0>(
          p.olse, live && pack == 0, row, c.lse, p.rows, p.packs, p.packs_mul, p.packs_shr, p.H, p.H_mul, p.H_shr,
          tiled_rows, p.ol_st, p.ol_sh, keep);
  } else {
    store_float_if(keep && pack == 0 && p.olse != nullptr, p.olse, t * p.ol_st + h * p.ol_sh, c.lse);
  }
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// a_empty in runs of spans (F_A_RUN; the gathered form from the forms' threshold): the
// first L blocks take A_RUN_SPANS consecutive spans of BLOCK packs each, the grid's last blocks
// (its tail, so that no SM waits on long blocks at the end) one span each; the host launches
// G = L + S - L K blocks for S spans, so L = ceil((S - G) / (K - 1)). The block's tokens (those
// its spans reach) are searched once into shared memory before any of its loads (span 0's v_b
// and LSEs prefetched to L2 meanwhile), by its first warps (the window, 32 tokens a warp) or
// threads (the plain search, one token each); after the barrier every span knows before its
// loads whether a row uses state a, and a row of an empty request (or past prefix_rows) does
// not load v_a. Searched while the first span's loads were in flight, the search spilled a
// pending LSE load and waited on it. Output LSEs from each row's
// pack-0 thread (the gathered store's barrier per span cost more than it saved). Past 64
// requests the search reads a shared copy of the offsets where it fits (search_tokens_staged).
constexpr unsigned A_RUN_SPANS = 4;

// p by value: read through a reference, ptxas spills in the runs with 64-bit offsets under the
// 32-register bound (bench/NOTES.md)
template <typename Tin, typename Tout, int VEC, int BLOCK, bool TILE, int FEAT>
__device__ __forceinline__ void merge_flat_run(const FlatArgs<Tin, Tout, int> p) {
  constexpr unsigned K = A_RUN_SPANS;
  constexpr bool A64 = (FEAT & F_A64) != 0;
  constexpr int NTOK = (int)K * BLOCK + 32;  // tokens a long block's rows can reach (K BLOCK + 24 in tiles of 8)
  __shared__ __align__(16) unsigned char s_empty[NTOK];  // the answers (and the staged offsets)
  const unsigned total = (unsigned)p.rows * (unsigned)p.packs, S = (total + (unsigned)BLOCK - 1u) / (unsigned)BLOCK;
  const unsigned G = gridDim.x, b = blockIdx.x;
  const unsigned L = S > G ? min(G, (S - G + K - 2u) / (K - 1u)) : 0u;
  const unsigned spans = b < L ? K : 1u, first = b < L ? b * K : L * K + (b - L);
  const int T = (int)fast_div((unsigned)p.rows, p.H_mul, p.H_shr);
  unsigned tiled_rows = 0;  // rows in tiles of 8 tokens (flat_token)
  if constexpr (TILE) tiled_rows = ((unsigned)T & ~7u) * (unsigned)p.H;
  // the block's tokens (block_tokens's lines, written again: through it this form's SASS changed)
  const unsigned r0 = fast_div(first * (unsigned)BLOCK, p.packs_mul, p.packs_shr);
  const unsigned r1 = fast_div(min((first + spans) * (unsigned)BLOCK, total) - 1u, p.packs_mul, p.packs_shr);
  int h_any;
  int t_lo = flat_token<TILE>(r0, p.H, p.H_mul, p.H_shr, tiled_rows, h_any);
  int t_hi = flat_token<TILE>(r1, p.H, p.H_mul, p.H_shr, tiled_rows, h_any);
  if constexpr (TILE) {
    if (r0 < tiled_rows) t_lo &= ~7;
    if (r1 < tiled_rows) t_hi |= 7;
  }
  const int ntok = min(t_hi - t_lo + 1, NTOK);
  // the thread's row of span j (past the last row: row 0, nothing stored), its pack and token:
  // merge_flat's lines, written again (the plain form's early return sits between them there,
  // and a shared helper changed that form's SASS)
  const auto span_row = [&](unsigned j, bool& live, int& pack, int& h) {
    const unsigned i = (first + j) * (unsigned)BLOCK + threadIdx.x;
    const unsigned row0 = fast_div(i, p.packs_mul, p.packs_shr);
    live = row0 < (unsigned)p.rows;
    pack = live ? (int)(i - row0 * (unsigned)p.packs) : 0;
    return flat_token<TILE>(live ? row0 : 0u, p.H, p.H_mul, p.H_shr, tiled_rows, h);
  };
  // span 0's, found before the search: after its barrier only the loads are left on the path
  // (the index math after the barrier was the small grids' cost)
  bool live0;
  int pack0, h0;
  const int t0 = span_row(0u, live0, pack0, h0);
  // span 0's v_b and LSEs on their way to L2 while the block searches: a prefetch holds no
  // register, so the search still needs no spill (the first wave otherwise waits with nothing in
  // flight)
  if (live0) {
    prefetch_l2(p.vb + (t0 * p.vb_st + h0 * p.vb_sh + pack0 * VEC));
    if (pack0 == 0) {
      prefetch_l2(p.sa + (t0 * p.sa_st + h0 * p.sa_sh));
      prefetch_l2(p.sb + (t0 * p.sb_st + h0 * p.sb_sh));
    }
  }
  if (!staged_fits<A64, NTOK>(p.a_batch, ntok))
    search_tokens<A64, BLOCK>(s_empty, p.a_cu, p.a_lens, p.a_batch, T, t_lo, ntok, a_windowed(p.a_batch));
  else
    search_tokens_staged<A64, BLOCK>(s_empty, p.a_cu, p.a_lens, p.a_batch, T, t_lo, ntok);
  for (unsigned j = 0; j < spans; ++j) {
    bool live = live0;
    int pack = pack0, t32 = t0, h32 = h0;
    if (j > 0) t32 = span_row(j, live, pack, h32);
    const bool empty = searched_token<A64>(s_empty, p.a_cu, p.a_lens, p.a_batch, T, t_lo, ntok, t32);
    bool keep = live;
    const RowCoef c = merge_pack_opt<Tin, Tout, VEC, FEAT, BLOCK, int>(
        p, live, t32, h32, pack, keep, [&](int) { return empty; }, !(empty || t32 >= p.prefix_rows));
    store_float_if(keep && pack == 0 && p.olse != nullptr, p.olse, t32 * p.ol_st + h32 * p.ol_sh, c.lse);
  }
}

// The entry points of merge_flat, one per block size and index width: each takes its parameters
// as one FlatArgs (tests/test_kernels.py holds the descriptions in zerokv/core/kernels.py
// against its fields).
template <typename Tin, typename Tout, int VEC, int SMALL, int FEAT = 0>
__global__ void __launch_bounds__(ZK_BLOCK_merge_state_flat_kernel)
    merge_state_flat_kernel(const FlatArgs<Tin, Tout, int> p) {
  merge_flat<Tin, Tout, VEC, SMALL, ZK_BLOCK_merge_state_flat_kernel, int, false, false, FEAT>(p);
}

// The smallest calls (a few thousand packs: the launch and one round trip to memory): grid
// (head groups, T), blocks of ZK_BLOCK threads, each holding BLOCK / packs heads of one token
// (packs a power of two, packs_shr its log2): thread i of block (g, t) takes pack i % packs of
// row (t, g * BLOCK / packs + i / packs). Token, head and pack come from the block and thread
// indices by a mask and shifts, with no division between the kernel's start and its four
// loads: faster than the flat kernel's SMALL form at T = 1 (in blocks of (packs, heads) threads
// the same code measured slower). A thread past the last head
// loads head 0 and stores nothing. 16-bit inputs may come in packs of 8 bytes (VEC 4; merge.py
// picks).
template <typename Tin, typename Tout, int VEC, int FEAT = 0>
__global__ void __launch_bounds__(ZK_BLOCK_merge_state_heads_kernel)
    merge_state_heads_kernel(const HeadsArgs<Tin, Tout> p) {
  const int i = (int)threadIdx.x;
  const int pack = i & (p.packs - 1);
  const int h0 = (int)blockIdx.x * (ZK_BLOCK_merge_state_heads_kernel >> p.packs_shr) + (i >> p.packs_shr);
  const bool live = h0 < p.H;
  const int t = (int)blockIdx.y, h = live ? h0 : 0;
  RowCoef c;
  bool keep = live;
  if constexpr (FEAT == 0) {
    c = merge_pack<Tin, Tout, VEC, int>(p, live, t, h, pack);
  } else {
    c = merge_pack_opt<Tin, Tout, VEC, FEAT, ZK_BLOCK_merge_state_heads_kernel, int>(
        p, live, t, h, pack, keep, [&](int tok) {
          return a_empty_of<(FEAT & F_A64) != 0>(p.a_cu, p.a_lens, p.a_batch, (int)gridDim.y, tok,
                                                 a_windowed(p.a_batch));
        });
  }
  store_float_if(keep && pack == 0 && p.olse != nullptr, p.olse, t * p.ol_st + h * p.ol_sh, c.lse);
}

// The many-waves form from 2^19 threads on, in blocks of 512 with the output LSE gathered
// (store_lse_gathered); its SMALL = 1 form (no early return), which measured even with SMALL = 0
// on these grids. TILE = 1 for an out_lse laid [H, T] (merge.py). With F_A_RUN: merge_flat_run.
template <typename Tin, typename Tout, int VEC, int TILE, int FEAT = 0>
__global__ void __launch_bounds__(ZK_BLOCK_merge_state_flat_gathered_kernel, FEAT ? 4 : 0)
    merge_state_flat_gathered_kernel(const FlatArgs<Tin, Tout, int> p) {
  if constexpr ((FEAT & F_A_RUN) != 0)
    merge_flat_run<Tin, Tout, VEC, ZK_BLOCK_merge_state_flat_gathered_kernel, TILE != 0, FEAT>(p);
  else
    merge_flat<Tin, Tout, VEC, 1, ZK_BLOCK_merge_state_flat_gathered_kernel, int, true, TILE != 0, FEAT>(p);
}

// The same for tensors past 2^31 elements: 64-bit strides and offsets, the thread index still
// 32-bit; aligned calls only; rows in the natural order for either out_lse layout (in tiles, an
// [H, T] out_lse measured slower at the largest shapes). Held to 32
// registers, 4 blocks per SM: unbounded, the GPU's NVRTC gave the fp16 form 34 registers
// (3 blocks per SM, slower; 32 from another NVRTC).
template <typename Tin, typename Tout, int VEC, int FEAT = 0>
__global__ void __launch_bounds__(ZK_BLOCK_merge_state_flat64_gathered_kernel, 4)
    merge_state_flat64_gathered_kernel(const FlatArgs<Tin, Tout, i64> p) {
  merge_flat<Tin, Tout, VEC, 1, ZK_BLOCK_merge_state_flat64_gathered_kernel, i64, true, false, FEAT>(p);
}

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
