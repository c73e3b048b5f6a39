// The flat kernels (merge.cu): a pack's merge with and without options, merge_flat and its
// gathered runs, and the entry points merge_state_flat_kernel, merge_state_heads_kernel and the
// gathered forms.
#pragma once
#include "merge_flat_rows.cuh"

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
