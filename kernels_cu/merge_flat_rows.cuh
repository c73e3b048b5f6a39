// The flat kernels' rows (merge.cu): a row's coefficients and token, the output LSEs gathered
// through shared memory, and whether a row's request is empty (a_empty: a warp's window, a
// block's search).
#pragma once
#include "merge_rows.cuh"

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
