// One row's merge, shared by the merge kernels of merge.cu: the coefficients of two LSEs and a
// sink, the option features and the flat kernels' parameter structs, a_empty's per-row test, fp8
// group scales, and two packs merged.
#pragma once
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
