"""Oracles that are not the code under test: zerokv's CPU path *is* ``zerokv.reference``, so a
CPU test that compares with the reference compares the reference with itself. This module never
imports ``zerokv``; it states each rule again, the plain way, in float64:

- :func:`attention`: softmax attention computed directly over keys (a sink is one more logit
  whose value is zero). The defining property of an LSE merge: the states of attention over
  chunks of the keys, merged, equal attention over all keys (``tests/test_oracles.py``).
- :func:`merge`: the merge of N states by ``logaddexp`` over the inputs that are usable (finite
  LSE), their V selected (an empty input's V is never read), plus the edge rules of DESIGN.md:
  every input empty -> ``(0, -inf)``, a NaN LSE -> NaN in the row's V and LSE. It is checked
  against :func:`attention` and against closed forms worked by hand, then used by the CPU tests.
- the empty-row rules as loops over Python ints (:func:`fixup_rows`, :func:`mask_rows`,
  :func:`a_empty_rows`) and :func:`with_empty_rows`; :func:`a_empty_rows_searched`, the search
  the kernel makes, for offsets that are not non-decreasing.
- :func:`group_fp8`: vLLM's per-group fp8 e4m3 rule, each value rounded to the nearest entry of
  the e4m3 table built from the format's definition (:data:`E4M3_TABLE`).
"""

from __future__ import annotations

import numpy as np

LN2 = float(np.log(2.0))


def _ln_of_base(base) -> float:
    """Natural logs per unit of an LSE in ``base`` ("e" or 2)."""
    return 1.0 if str(base) == "e" else LN2


def f64(x) -> np.ndarray:
    """A float64 numpy copy of a torch tensor, numpy array or nested list."""
    if hasattr(x, "detach"):
        return x.detach().double().cpu().numpy()
    return np.array(x, dtype=np.float64)


# --- attention, directly -----------------------------------------------------------------------


def attention(q, k, v, base="e", sink=None, causal_offset=None) -> tuple[np.ndarray, np.ndarray]:
    """Attention over all keys: ``q [T, H, Dk]``, ``k [L, H, Dk]``, ``v [L, H, D]`` ->
    ``(out [T, H, D], lse [T, H])``, logits ``q.k / sqrt(Dk)`` read in units of ``base``
    (``p_l = base^(x_l) / sum base^(x_j)``), ``lse = log_base(sum base^(x_l))``. ``sink [H]``: one
    more logit per head with a zero value. ``causal_offset``: query t sees keys
    ``l <= t + causal_offset`` only. A row with no key it sees and no sink: ``(0, -inf)``."""
    q, k, v = f64(q), f64(k), f64(v)
    T, H, Dk = q.shape
    x = np.einsum("thd,lhd->thl", q, k) / np.sqrt(Dk) * _ln_of_base(base)  # natural units
    if causal_offset is not None:
        unseen = np.arange(k.shape[0])[None, :] > np.arange(T)[:, None] + causal_offset  # [T, L]
        x = np.where(unseen[:, None, :], -np.inf, x)
    vals = np.broadcast_to(v.transpose(1, 0, 2), (H, *v.shape[:1], v.shape[2]))  # [H, L, D]
    if sink is not None:
        sink_x = np.broadcast_to(f64(sink) * _ln_of_base(base), (T, H))[..., None]
        x = np.concatenate([x, sink_x], axis=-1)
        vals = np.concatenate([vals, np.zeros((H, 1, v.shape[2]))], axis=1)
    if x.shape[-1] == 0:
        return np.zeros((T, H, v.shape[2])), np.full((T, H), -np.inf)
    top = x.max(axis=-1, keepdims=True)
    seen = np.isfinite(top)  # a row that sees no key
    top = np.where(seen, top, 0.0)
    p = np.exp(x - top)
    z = p.sum(axis=-1, keepdims=True)
    out = np.einsum("thl,hld->thd", p / np.where(seen, z, 1.0), vals)
    lse = np.where(seen[..., 0], top[..., 0] + np.log(np.where(seen, z, 1.0)[..., 0]), -np.inf)
    return out, lse / _ln_of_base(base)


def chunk_states(q, k, v, bounds, base="e", empty_as="zero", seed=0):
    """Per-chunk attention states over the keys ``k[bounds[c]:bounds[c + 1]]``: ``(V [N, T, H, D],
    LSE [N, T, H])``. An empty chunk is the empty state as some kernel writes it: ``empty_as``
    "zero" (0, -inf), "nan_v" (NaN V, -inf), "fa2" (NaN V, +inf)."""
    q, k, v = f64(q), f64(k), f64(v)
    vs, ss = [], []
    rng = np.random.default_rng(seed)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        o, s = attention(q, k[lo:hi], v[lo:hi], base)
        if hi <= lo:
            o = np.full_like(o, np.nan) if empty_as != "zero" else o
            s = np.full_like(s, np.inf) if empty_as == "fa2" else s
            if empty_as == "nan_v":
                o[..., ::2] = np.inf * rng.choice([-1.0, 1.0])
        vs.append(o)
        ss.append(s)
    return np.stack(vs), np.stack(ss)


def random_attention(T, H, D, L, seed, scale=2.0):
    """Random ``(q, k, v)`` float64 with logits spread by ``scale`` (so the weights differ)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H, 16)) * scale
    k = rng.standard_normal((L, H, 16)) * scale
    return q, k, rng.standard_normal((L, H, D))


def random_bounds(L, N, rng, empty=True) -> list[int]:
    """Chunk boundaries ``0 = b_0 <= ... <= b_N = L`` of every size, some chunks empty."""
    cuts = sorted(int(c) for c in rng.integers(0, L + 1, N - 1))
    if empty and N >= 3:
        cuts[0] = 0  # the first chunk empty
        cuts[-1] = cuts[-2]  # and one in the middle
    return [0, *cuts, L]


# --- the merge, the plain way ------------------------------------------------------------------


def merge(v, s, base="e", sinks=None) -> tuple[np.ndarray, np.ndarray]:
    """N-way merge: ``v [N, T, H, D]``, ``s [N, T, H]`` -> ``(out [T, H, D], lse [T, H])``.
    ``S = log_base(sum_usable base^s_i [+ base^sink])``, ``out = sum_usable base^(s_i - S) v_i``;
    usable = finite LSE; a row with none (and no sink) is ``(0, -inf)``; a NaN LSE makes the
    row NaN."""
    v, s = f64(v), f64(s)
    c = _ln_of_base(base)
    usable = np.isfinite(s)
    x = np.where(usable, s * c, -np.inf)
    terms = list(x)
    if sinks is not None:
        terms.append(np.broadcast_to(f64(sinks) * c, x.shape[1:]))
    total = terms[0]
    for t in terms[1:]:
        total = np.logaddexp(total, t)
    out = np.zeros(v.shape[1:])
    finite_total = np.isfinite(total)
    for i in range(v.shape[0]):
        w = np.exp(np.where(usable[i] & finite_total, x[i] - np.where(finite_total, total, 0.0), -np.inf))
        out += w[..., None] * np.where(usable[i][..., None], v[i], 0.0)
    lse = total / c
    bad = np.isnan(s).any(axis=0)
    out[bad] = np.nan
    lse = np.where(bad, np.nan, lse)
    return out, lse


def merge2(v_a, s_a, v_b, s_b, base="e", sinks=None, a_empty=None, prefix_rows=None, verbatim=False):
    """Two-way merge with the row options: rows of ``a_empty`` (bool ``[T]``) and rows
    ``t >= prefix_rows`` do not use state a (the suffix rule: b alone, by the empty rule); with
    ``verbatim`` the rows past ``prefix_rows`` are a copy of state b instead, sinks not applied."""
    v_a, s_a, v_b, s_b = f64(v_a), f64(s_a), f64(v_b), f64(s_b)
    T = s_b.shape[0]
    drop_a = np.zeros(T, dtype=bool)
    if a_empty is not None:
        drop_a |= np.asarray(a_empty, dtype=bool)
    if prefix_rows is not None:
        drop_a[prefix_rows:] = True
    s_a = np.where(drop_a[:, None], -np.inf, s_a)
    v_a = np.where(drop_a[:, None, None], np.nan, v_a)  # never read: any value would do
    out, lse = merge(np.stack([v_a, v_b]), np.stack([s_a, s_b]), base, sinks)
    if verbatim and prefix_rows is not None:
        out[prefix_rows:], lse[prefix_rows:] = v_b[prefix_rows:], s_b[prefix_rows:]
    return out, lse


# --- the empty-row rules, as loops over Python ints --------------------------------------------


def _ints(x) -> list[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [int(i) for i in x]


def _span(cu: list[int], i: int, T: int) -> range:
    """Request i's rows, clipped to [0, T); empty when end <= start."""
    return range(min(max(cu[i], 0), T), min(max(cu[i + 1], 0), T))


def fixup_rows(cu, kv, T: int) -> np.ndarray:
    """Rows of requests with ``kv[i] == 0``."""
    cu, kv = _ints(cu), _ints(kv)
    rows = np.zeros(T, dtype=bool)
    for i in range(len(cu) - 1):
        if kv[i] == 0:
            for t in _span(cu, i, T):
                rows[t] = True
    return rows


def mask_rows(cu, cu_kv, T: int) -> np.ndarray:
    """Rows of requests whose context span ``[cu_kv[i], cu_kv[i + 1])`` is empty."""
    cu, cu_kv = _ints(cu), _ints(cu_kv)
    rows = np.zeros(T, dtype=bool)
    for i in range(len(cu) - 1):
        if cu_kv[i + 1] <= cu_kv[i]:
            for t in _span(cu, i, T):
                rows[t] = True
    return rows


def a_empty_rows(cu, kv, T: int) -> np.ndarray:
    """``a_empty``'s rows for non-decreasing offsets (each row in at most one request): the rows
    of every request with ``kv[i] == 0``, its span clipped to ``[0, T)``. A row of no request is
    not a-empty. Other offsets: :func:`a_empty_rows_searched`."""
    cu, kv = _ints(cu), _ints(kv)
    assert all(cu[i] <= cu[i + 1] for i in range(len(cu) - 1)), "offsets that decrease: a_empty_rows_searched"
    rows = np.zeros(T, dtype=bool)
    for i in range(len(cu) - 1):
        if kv[i] == 0:
            for t in _span(cu, i, T):
                rows[t] = True
    return rows


def a_empty_rows_searched(cu, kv, T: int) -> np.ndarray:
    """``a_empty``'s rows for any offsets (decreasing ones too): row t's request is the one a
    binary search over ``cu`` finds (for non-decreasing offsets the r with ``cu[r] <= t <
    cu[r + 1]``, where it equals :func:`a_empty_rows`); a-empty when that request's clipped
    span holds t and its ``kv`` is 0."""
    cu, kv = _ints(cu), _ints(kv)
    B = len(cu) - 1
    rows = np.zeros(T, dtype=bool)
    if B <= 0:
        return rows
    for t in range(T):
        lo, hi = 0, B
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if cu[mid] <= t:
                lo = mid
            else:
                hi = mid
        rows[t] = t in _span(cu, lo, T) and kv[lo] == 0
    return rows


def with_empty_rows(out, lse, rows) -> tuple[np.ndarray, np.ndarray]:
    """float64 copies of ``out [T, H, D]`` / ``lse [T, H]`` with ``rows`` set to (0, -inf)."""
    out, lse = f64(out).copy(), f64(lse).copy()
    rows = np.asarray(rows, dtype=bool)
    out[rows] = 0.0
    lse[rows] = -np.inf
    return out, lse


# --- per-group fp8 e4m3, from the format's definition -------------------------------------------


def _e4m3_table() -> np.ndarray:
    """Every finite non-negative e4m3 value, indexed by its bit pattern 0x00-0x7e (ascending):
    exponent ``e`` (4 bits, bias 7) and fraction ``m`` (3 bits); ``e = 0`` is subnormal."""
    bits = np.arange(0x7F)
    e, m = bits >> 3, bits & 7
    return np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))


E4M3_TABLE = _e4m3_table()


def e4m3(x) -> np.ndarray:
    """The nearest e4m3 value to each of ``x`` (ties to the even bit pattern), magnitudes past
    448 saturating to 448, NaN kept: the table searched, nothing computed in fp8."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(np.nan_to_num(x)), 448.0)
    hi = np.minimum(np.searchsorted(E4M3_TABLE, a), len(E4M3_TABLE) - 1)  # first entry >= a
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - E4M3_TABLE[lo], E4M3_TABLE[hi] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.where(np.isnan(x), np.nan, np.copysign(E4M3_TABLE[np.where(up, hi, lo)], x))


def group_fp8(x, group: int, ue8m0: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per-group fp8 output of merged rows ``x [T, H, D]``: ``(values [T, H, D], scales
    [T, H * D / group])``. In float32, as the kernels compute: for each group of ``group``
    values along D, ``scale = max(absmax, 1e-10) / 448`` (``ue8m0``: the power of two at or
    above it), values ``e4m3(x / scale)``."""
    x32 = f64(x).astype(np.float32)
    T, H, D = x32.shape
    g = x32.reshape(T, H, D // group, group)
    absmax = np.abs(g).max(axis=-1)
    scale = np.maximum(absmax, np.float32(1e-10)) / np.float32(448.0)  # float32 arithmetic
    if ue8m0:
        scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)))).astype(np.float32)
    values = e4m3(g / scale[..., None])  # the quotient in float32
    return values.reshape(T, H, D), scale.astype(np.float64).reshape(T, H * (D // group))
