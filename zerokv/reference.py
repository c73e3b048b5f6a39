"""float64 numpy reference of every zerokv op: the specification the kernels are tested against.

All functions take numpy arrays (any float dtype; computed in float64) and return new arrays;
nothing is modified in place. Conventions are the library's: ``V [T, H, D]``, ``LSE [T, H]``.

Empty rule: an LSE of -inf or +inf gives weight 0 and that V is never used (it may hold NaN);
if every input of a row is empty the row is (0, -inf). NaN in any LSE of a row makes that row's
V and LSE NaN.

Offsets are trusted for meaning, never for memory: request i's rows ``[cu[i], cu[i + 1])`` are
clipped to ``[0, T)``, a span with ``end <= start`` covers no row, and a row that no request
covers is left alone (and is not empty for ``a_empty``).
"""

from __future__ import annotations

import numpy as np


def _base(lse_base: str | int) -> float:
    return np.e if str(lse_base) == "e" else 2.0


def merge_states(
    v: np.ndarray, s: np.ndarray, lse_base: str | int = "e", sinks: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """N-way merge. ``v [N, T, H, D]``, ``s [N, T, H]`` -> ``(out [T, H, D], lse [T, H])``.

    ``sinks [H]``: attention-sink logits (in the LSE's base) counted once in the normaliser."""
    v = np.asarray(v, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    base = _base(lse_base)
    nan = np.isnan(s).any(axis=0)
    usable = np.isfinite(s)  # excludes +-inf (empty) and NaN
    m = np.where(usable, s, -np.inf).max(axis=0, initial=-np.inf)
    live = np.isfinite(m)
    m_safe = np.where(live, m, 0.0)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        w = np.where(usable, np.power(base, np.where(usable, s, 0.0) - m_safe), 0.0)
        total = w.sum(axis=0)
        # An input with weight 0 is never used: its V may be NaN/Inf garbage.
        contrib = np.where(w[..., None] > 0, w[..., None] * np.where(w[..., None] > 0, v, 0.0), 0.0)
        out = contrib.sum(axis=0) / np.where(live, total, 1.0)[..., None]
        lse = np.where(live, m_safe + np.log(np.where(live, total, 1.0)) / np.log(base), -np.inf)
    out = np.where(live[..., None], out, 0.0)
    out = np.where(nan[..., None], np.nan, out)
    lse = np.where(nan, np.nan, lse)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, lse_base)
    return out, lse


def apply_sinks(out, lse, sinks, lse_base: str | int = "e") -> tuple[np.ndarray, np.ndarray]:
    """``S' = logaddexp(S, sink_h)``, ``out *= base^(S - S')``; a row with no keys gets
    ``(0, sink_h)``; a sink of -inf changes nothing; NaN propagates."""
    base = _base(lse_base)
    sink = np.broadcast_to(np.asarray(sinks, dtype=np.float64), lse.shape)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        m = np.maximum(lse, sink)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        total = m_safe + np.log(np.power(base, lse - m_safe) + np.power(base, sink - m_safe)) / np.log(base)
        total = np.where(lse == -np.inf, sink, total)
        total = np.where(sink == -np.inf, lse, total)
        factor = np.where(lse == -np.inf, 0.0, np.power(base, lse - total))
        factor = np.where(sink == -np.inf, 1.0, factor)
    out = np.where(factor[..., None] == 0.0, 0.0, out * factor[..., None])
    return out, total


def merge_state(
    v_a: np.ndarray,
    s_a: np.ndarray,
    v_b: np.ndarray,
    s_b: np.ndarray,
    lse_base: str | int = "e",
    prefix_rows: int | None = None,
    a_empty_rows: np.ndarray | None = None,
    suffix_verbatim: bool = False,
    sinks: np.ndarray | None = None,
    a_empty: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Two-way merge. Rows ``t >= prefix_rows`` take state b alone (with the empty rule, or
    verbatim when ``suffix_verbatim``); rows where ``a_empty_rows[t]`` treat state a as empty
    (its V never used). ``sinks``: as :func:`merge_states` (not on verbatim rows).
    ``a_empty``: ``(cu_seqlens_q, kv_lens)``, the rows of :func:`rows_with_empty_a` (with
    ``a_empty_rows``: either's rows). The options of ``zerokv.merge_state`` that change the
    merged values are keywords here by their names (the CPU path passes them so)."""
    s_a = np.asarray(s_a, dtype=np.float64)
    s_b = np.asarray(s_b, dtype=np.float64)
    T = s_b.shape[0]
    if a_empty is not None:
        rows = rows_with_empty_a(*a_empty, T)
        a_empty_rows = rows if a_empty_rows is None else rows | np.asarray(a_empty_rows, dtype=bool)
    use_a = np.arange(T) < (T if prefix_rows is None else prefix_rows)
    if a_empty_rows is not None:
        use_a &= ~np.asarray(a_empty_rows, dtype=bool)
    s_a_used = np.where(use_a[:, None], s_a, -np.inf)
    out, lse = merge_states(np.stack([v_a, v_b]), np.stack([s_a_used, s_b]), lse_base, sinks)
    if suffix_verbatim and prefix_rows is not None:
        out[prefix_rows:] = np.asarray(v_b, dtype=np.float64)[prefix_rows:]
        lse[prefix_rows:] = s_b[prefix_rows:]
    return out, lse


def rows_of_requests(cu_seqlens_q: np.ndarray, request_mask: np.ndarray, T: int) -> np.ndarray:
    """Boolean ``[T]``: rows that belong to requests with ``request_mask[i]``, each request's
    span clipped to ``[0, T)`` (a span with ``end <= start`` covers no row)."""
    cu = np.clip(np.asarray(cu_seqlens_q, dtype=np.int64), 0, T)
    rows = np.zeros(T, dtype=bool)
    for i in np.flatnonzero(np.asarray(request_mask, dtype=bool)):
        if cu[i + 1] > cu[i]:
            rows[cu[i] : cu[i + 1]] = True
    return rows


def rows_with_empty_a(cu_seqlens_q: np.ndarray, kv_lens: np.ndarray, T: int) -> np.ndarray:
    """Boolean ``[T]`` for ``merge_state(a_empty=...)``: row t's request is the one a binary
    search over ``cu_seqlens_q`` finds (for non-decreasing offsets, the r with
    ``cu[r] <= t < cu[r + 1]``); the row is a-empty when that request's clipped span holds t
    and its ``kv_lens`` is 0. B = 0: no row. The kernel performs the same search."""
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    lens = np.asarray(kv_lens, dtype=np.int64)
    B = len(cu) - 1
    rows = np.zeros(T, dtype=bool)
    if B <= 0:
        return rows
    t = np.arange(T, dtype=np.int64)
    lo, hi = np.zeros(T, dtype=np.int64), np.full(T, B, dtype=np.int64)
    while True:  # the kernel's search, vectorised over rows
        active = hi - lo > 1
        if not active.any():
            break
        mid = (lo + hi) >> 1
        go_right = active & (cu[np.minimum(mid, B)] <= t)
        lo = np.where(go_right, mid, lo)
        hi = np.where(active & ~go_right, mid, hi)
    start, end = np.clip(cu[lo], 0, T), np.clip(cu[lo + 1], 0, T)
    return (start <= t) & (t < end) & (lens[lo] == 0)


def write_empty_rows(out: np.ndarray, lse: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Copies of ``out``/``lse`` (float64) with ``rows`` set to the empty state (0, -inf)."""
    out = np.array(out, dtype=np.float64)
    lse = np.array(lse, dtype=np.float64)
    out[rows] = 0.0
    lse[rows] = -np.inf
    return out, lse


def zero_kv_requests(kv_lens) -> np.ndarray:
    """fixup's rule: request i is empty when ``kv_lens[i] == 0``."""
    return np.asarray(kv_lens) == 0


def empty_context_requests(cu_seqlens_kv) -> np.ndarray:
    """mask's rule: request i is empty when its context span ``[cu_kv[i], cu_kv[i+1])`` is
    (``cu_kv[i+1] <= cu_kv[i]``)."""
    return np.diff(np.asarray(cu_seqlens_kv, dtype=np.int64)) <= 0


def fixup_zero_kv_rows(out, lse, kv_lens, cu_seqlens_q) -> tuple[np.ndarray, np.ndarray]:
    """Rows of requests with ``kv_lens[i] == 0`` become (0, -inf); the rest are unchanged."""
    rows = rows_of_requests(cu_seqlens_q, zero_kv_requests(kv_lens), np.shape(lse)[0])
    return write_empty_rows(out, lse, rows)


def mask_empty_context(out, lse, cu_seqlens_q, cu_seqlens_kv) -> tuple[np.ndarray, np.ndarray]:
    """Rows of requests whose context span is empty (:func:`empty_context_requests`) become
    (0, -inf)."""
    rows = rows_of_requests(cu_seqlens_q, empty_context_requests(cu_seqlens_kv), np.shape(lse)[0])
    return write_empty_rows(out, lse, rows)


def max_error(actual, expected) -> float:
    """Largest absolute difference over the finite expected values; ``inf`` when NaN or
    infinities sit at other places than expected (the one error measure of the self-check,
    the benchmarks and the tests)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return float("inf")
    if (np.isnan(a) != np.isnan(e)).any():
        return float("inf")
    inf = np.isinf(e)
    if (np.isinf(a) != inf).any() or (a[inf] != e[inf]).any():
        return float("inf")
    fin = np.isfinite(e)
    return float(np.abs(a[fin] - e[fin]).max()) if fin.any() else 0.0


# --- per-group fp8 output (vLLM's rule for fp8 block-scaled GEMMs) ------------------------------

FP8_E4M3_MAX = 1.75 * 2.0**8  # e4m3fn's largest finite value (0 1111 110): where conversions saturate
GROUP_SCALE_FLOOR = float(np.float32(1e-10))  # the absmax floor, as a float32 constant


def e4m3_values(x) -> np.ndarray:
    """float64 ``x`` rounded to the nearest fp8 e4m3 value (ties to even), finite values beyond
    +-448 and +-inf saturating to +-448, NaN kept: what ``cvt.rn.satfinite.e4m3`` gives."""
    x = np.asarray(x, dtype=np.float64)
    c = np.clip(np.where(np.isnan(x), 0.0, x), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    _, e = np.frexp(c)  # |c| = m 2^e, m in [0.5, 1): the leading bit is 2^(e - 1)
    step = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)  # 3 fraction bits; denormals in units of 2^-9
    r = np.round(c / step) * step  # exact scaling by a power of two, then round half to even
    return np.where(np.isnan(x), np.nan, r)


def fp8_group_scales(x, group: int, ue8m0: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per-group fp8 e4m3 quantisation of merged rows ``x [T, H, D]`` in groups of ``group``
    values along D: ``(values [T, H, D], scales [T, H * D / group])``, both float64 holding the
    exact fp8 and float32 numbers. The kernels' arithmetic, step by step: ``x`` as float32;
    ``absmax`` of each group (NaN if any value is NaN); ``scale = f32(max(absmax, f32(1e-10)) /
    448)`` correctly rounded; with ``ue8m0`` rounded up to a power of two (``2^ceil(log2 scale)``,
    exact); values ``e4m3(f32(x / scale))`` with saturation at +-448. An all-zero row (the empty
    state) gives zeros and the smallest scale, ``f32(1e-10) / 448``."""
    x32 = np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)
    T, H, D = x32.shape
    if group <= 0 or D % group:
        raise ValueError(f"group: must divide head_dim {D}, got {group}")
    g = x32.reshape(T, H, D // group, group)
    with np.errstate(invalid="ignore"):
        absmax = np.abs(g).max(axis=-1)  # NaN propagates
        scale = (np.maximum(absmax, GROUP_SCALE_FLOOR) / FP8_E4M3_MAX).astype(np.float32).astype(np.float64)
        if ue8m0:
            m, e = np.frexp(np.where(np.isfinite(scale), scale, 1.0))
            up = np.where(m == 0.5, scale, np.ldexp(1.0, e))  # already a power of two, or the next one
            scale = np.where(np.isfinite(scale), up, scale)
        q = (g / scale[..., None]).astype(np.float32).astype(np.float64)
    values = e4m3_values(q).reshape(T, H, D)
    return values, scale.reshape(T, H * (D // group))
