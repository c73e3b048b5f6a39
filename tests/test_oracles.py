"""The oracles of ``oracles.py`` hold (attention over split keys, closed forms worked by hand,
the merge's algebraic laws), and the float64 reference and the CPU path (which runs the
reference) agree with them. None of the expectations here comes from ``zerokv.reference``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_close
from oracles import (
    a_empty_rows,
    a_empty_rows_searched,
    attention,
    chunk_states,
    f64,
    fixup_rows,
    mask_rows,
    merge,
    merge2,
    random_attention,
    random_bounds,
    with_empty_rows,
)
from states import make_states

import zerokv
from zerokv import reference
from zerokv.compat import flashinfer, vllm

INF, NAN = float("inf"), float("nan")
LN2, LN3 = float(np.log(2)), float(np.log(3))
EXACT = {"rtol": 1e-12, "atol": 1e-12}


def _close(got, want, what="", impl="oracle"):
    """The same NaN/inf places; finite values to 1e-12 (float64), or for the CPU path's float32
    within two float32 roundings (the inputs' and the output's)."""
    if impl.startswith("cpu"):
        assert_close(np.asarray(got), np.asarray(want), torch.float32, what, roundings=2)
    else:
        assert_close(np.asarray(got), np.asarray(want), torch.float64, what)


# --- the split-keys property: merged chunk states are attention over all keys ---------------

SPLITS = [  # (T, H, D, keys, chunks); every case holds empty chunks, so ``empty_as`` matters
    (5, 3, 8, 40, 4),  # two chunks of keys, two empty
    (7, 2, 5, 33, 5),
    (3, 4, 16, 9, 8),  # more chunks than keys: several empty
    (4, 1, 3, 0, 3),  # no keys at all: every chunk empty
]


def _split(case, base, empty_as, sinks, seed):
    T, H, D, L, N = case
    q, k, v = random_attention(T, H, D, L, seed)
    bounds = random_bounds(L, N, np.random.default_rng(seed))
    sizes = np.diff(bounds)
    assert (sizes == 0).any(), f"{case}: no empty chunk, the empty_as variants would be one test"
    assert L == 0 or (sizes > 0).sum() >= 2, f"{case}: one chunk holds every key, nothing to merge"
    vs, ss = chunk_states(q, k, v, bounds, base, empty_as, seed)
    sink = None if not sinks else np.random.default_rng(seed + 1).standard_normal(H) * 2
    return (q, k, v), (vs, ss), sink


@pytest.mark.parametrize("case", SPLITS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("base", ["e", 2])
@pytest.mark.parametrize("empty_as", ["zero", "nan_v", "fa2"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_merged_chunks_are_attention_over_all_keys(case, base, empty_as, sinks):
    """The defining property, for the oracle and the reference alike."""
    (q, k, v), (vs, ss), sink = _split(case, base, empty_as, sinks, seed=sum(case))
    want = attention(q, k, v, base, sink)
    _close(merge(vs, ss, base, sink)[0], want[0], "oracle out")
    _close(merge(vs, ss, base, sink)[1], want[1], "oracle lse")
    got = reference.merge_states(vs, ss, base, sink)
    _close(got[0], want[0], "reference out")
    _close(got[1], want[1], "reference lse")


@pytest.mark.parametrize("case", SPLITS[:3], ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("base", ["e", 2])
@pytest.mark.parametrize("empty_as", ["zero", "nan_v", "fa2"])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_cpu_merge_states_is_attention_over_all_keys(case, base, empty_as, kind):
    """zerokv.merge_states on the CPU, float32 states of the chunks (the sinks once, at the end)."""
    (q, k, v), (vs, ss), sink = _split(case, base, empty_as, True, seed=7 * sum(case))
    want = attention(q, k, v, base, sink)
    v32, s32, k32 = vs.astype(np.float32), ss.astype(np.float32), sink.astype(np.float32)
    if kind == "torch":
        v32, s32, k32 = (torch.from_numpy(x) for x in (v32, s32, k32))
    out, lse = zerokv.merge_states(v32, s32, lse_base=base, sinks=k32)
    # the inputs were rounded to float32 once and the output once: two roundings of float32, the
    # inputs' moving the weights by up to |s| 2^-24 (the float32 bound's ACC)
    assert_close(np.asarray(out), want[0], torch.float32, "out", roundings=2, arithmetic="float32")
    assert_close(np.asarray(lse), want[1], torch.float32, "lse", roundings=2, arithmetic="float32")
    # of the float32 inputs it was given: the CPU path's float64 and one rounding
    exact = merge(v32, s32, base, k32)
    assert_close(np.asarray(out), exact[0], torch.float32, "out of the float32 chunks")
    assert_close(np.asarray(lse), exact[1], torch.float32, "lse of the float32 chunks")


@pytest.mark.parametrize("case", SPLITS[:3], ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("base", ["e", 2])
@pytest.mark.parametrize("empty_as", ["zero", "fa2"])
def test_cpu_two_way_chain_is_attention_over_all_keys(case, base, empty_as):
    """merge_state folded over the chunks, left to right, float64 kept between steps by a
    float32 chain (one rounding per step), the sinks on the last step only."""
    (q, k, v), (vs, ss), sink = _split(case, base, empty_as, True, seed=3 * sum(case))
    want = attention(q, k, v, base, sink)
    acc_v, acc_s = torch.from_numpy(vs[0]).float(), torch.from_numpy(ss[0]).float()
    n = len(vs)
    for i in range(1, n):
        extra = {"sinks": torch.from_numpy(sink).float()} if i == n - 1 else {}
        nv, ns = torch.from_numpy(vs[i]).float(), torch.from_numpy(ss[i]).float()
        acc_v, acc_s = zerokv.merge_state(acc_v, acc_s, nv, ns, lse_base=base, **extra)
    # float32 between the steps: a rounded LSE moves the next step's weights (the float32 bound)
    assert_close(acc_v, want[0], torch.float32, "out", roundings=2 * n, arithmetic="float32")
    assert_close(acc_s, want[1], torch.float32, "lse", roundings=2 * n, arithmetic="float32")


# --- closed forms, worked by hand --------------------------------------------------------------


def _pair(s_a, s_b, v_a=None, v_b=None, D=4):
    """One row of one head: ``v_a = [1, 2, 3, 4]``, ``v_b = [10, 20, 30, 40]`` by default."""
    v_a = np.arange(1.0, D + 1) if v_a is None else np.asarray(v_a, dtype=np.float64)
    v_b = 10 * np.arange(1.0, D + 1) if v_b is None else np.asarray(v_b, dtype=np.float64)
    return (v_a[None, None], np.array([[s_a]]), v_b[None, None], np.array([[s_b]]))


VA, VB = np.arange(1.0, 5), 10 * np.arange(1.0, 5)
ROW = np.full(4, NAN)

# (name, s_a, s_b, v_a, v_b, base, expected out row, expected lse)
CLOSED = [
    ("equal", 0.0, 0.0, VA, VB, "e", (VA + VB) / 2, LN2),
    ("equal_base2", 5.0, 5.0, VA, VB, 2, (VA + VB) / 2, 6.0),
    ("three_to_one", LN3, 0.0, VA, VB, "e", 0.75 * VA + 0.25 * VB, 2 * LN2),
    ("one_to_three", 0.0, LN3, VA, VB, "e", 0.25 * VA + 0.75 * VB, 2 * LN2),
    ("three_to_one_base2", 1.0 + np.log2(3), 1.0, VA, VB, 2, 0.75 * VA + 0.25 * VB, 3.0),
    ("a_minus_inf_nan_v", -INF, 1.5, ROW, VB, "e", VB, 1.5),
    ("a_plus_inf_nan_v", INF, 1.5, ROW, VB, "e", VB, 1.5),
    ("b_plus_inf_nan_v", -0.5, INF, VA, ROW, "e", VA, -0.5),
    ("b_plus_inf_finite_v", -0.5, INF, VA, VB, 2, VA, -0.5),
    ("a_plus_inf_inf_v", INF, 2.0, np.full(4, INF), VB, 2, VB, 2.0),
    ("both_minus_inf", -INF, -INF, ROW, ROW, "e", np.zeros(4), -INF),
    ("both_plus_inf", INF, INF, VA, VB, "e", np.zeros(4), -INF),
    ("mixed_markers", INF, -INF, ROW, VB, 2, np.zeros(4), -INF),
    ("nan_a", NAN, 0.0, VA, VB, "e", ROW, NAN),
    ("nan_b_a_empty", -INF, NAN, ROW, VB, "e", ROW, NAN),
    ("gap_1e4", 1e4, 0.0, VA, VB, "e", VA, 1e4),
    ("gap_-1e4", -1e4, 3.0, VA, VB, 2, VB, 3.0),
]


@pytest.mark.parametrize("impl", ["oracle", "reference", "cpu_torch", "cpu_numpy"])
@pytest.mark.parametrize("case", CLOSED, ids=lambda c: c[0])
def test_merge_closed_forms(case, impl):
    _, s_a, s_b, v_a, v_b, base, want_out, want_lse = case
    args = _pair(s_a, s_b, v_a, v_b)
    if impl == "oracle":
        got = merge2(*args, base=base)
    elif impl == "reference":
        got = reference.merge_state(*args, lse_base=base)
    else:
        t = [torch.from_numpy(x).float() for x in args]
        t = t if impl == "cpu_torch" else [x.numpy() for x in t]
        got = [f64(torch.as_tensor(x)) for x in zerokv.merge_state(*t, lse_base=base)]
    dtype = torch.float64 if impl in ("oracle", "reference") else torch.float32
    assert_close(got[0][0, 0], want_out, dtype, "out", roundings=2)  # float32 inputs and output
    assert_close(got[1][0, 0], want_lse, dtype, "lse", roundings=2)


@pytest.mark.parametrize("impl", ["oracle", "reference", "cpu"])
def test_sinks_closed_forms(impl):
    """Heads: a sink equal to the LSE halves V (S + ln 2); a sink of -inf changes nothing; one of
    +inf takes every weight (0, +inf); a sink of ln 3 over S = 0 keeps a quarter (LSE ln 4).
    Row 1 has no keys: (0, sink)."""
    v = np.tile(np.arange(1.0, 4), (2, 4, 1))  # [T=2, H=4, D=3]
    s = np.array([[0.0, 0.0, 0.0, 0.0], [-INF, -INF, -INF, -INF]])
    sinks = np.array([0.0, -INF, INF, LN3])
    empty_v = np.full_like(v, NAN)
    args = (v, s, empty_v, np.full_like(s, -INF))
    if impl == "oracle":
        out, lse = merge2(*args, sinks=sinks)
    elif impl == "reference":
        out, lse = reference.merge_state(*args, sinks=sinks)
    else:
        t = [torch.from_numpy(x).float() for x in args]
        out, lse = (f64(x) for x in zerokv.merge_state(*t, sinks=torch.from_numpy(sinks).float()))
    r = np.arange(1.0, 4)
    tol = EXACT if impl != "cpu" else {"rtol": 1e-7, "atol": 1e-7}
    for h, (want_v, want_s) in enumerate([(r / 2, LN2), (r, 0.0), (0 * r, INF), (r / 4, 2 * LN2)]):
        np.testing.assert_allclose(out[0, h], want_v, **tol, err_msg=f"head {h}")
        assert np.isclose(lse[0, h], want_s, **tol) or lse[0, h] == want_s, f"lse head {h}"
    assert (out[1] == 0).all()
    _close(lse[1], sinks, "no keys: the sink", impl)


@pytest.mark.parametrize("impl", ["oracle", "reference", "cpu"])
def test_prefix_rows_closed_forms(impl):
    """Rows < 2 merge; rows >= 2 are b alone: finite b as it is, b of +-inf (0, -inf), NaN b
    NaN; verbatim (vLLM's suffix) copies b even when +inf with NaN V."""
    v_a = np.tile(VA, (4, 1, 1))
    v_b = np.tile(VB, (4, 1, 1))
    s_a = np.array([[0.0], [NAN], [NAN], [5.0]])  # a's NaN past the cutoff is not used
    s_b = np.array([[0.0], [1.0], [INF], [-INF]])
    v_b[2] = NAN
    want_out = np.stack([(VA + VB) / 2, ROW, np.zeros(4), np.zeros(4)])[:, None]
    want_lse = np.array([[LN2], [NAN], [-INF], [-INF]])
    want_verbatim_out = np.stack([(VA + VB) / 2, ROW, ROW, VB])[:, None]
    want_verbatim_lse = np.array([[LN2], [NAN], [INF], [-INF]])
    args = (v_a, s_a, v_b, s_b)
    if impl == "oracle":
        got = merge2(*args, prefix_rows=2)
        verb = merge2(*args, prefix_rows=2, verbatim=True)
    elif impl == "reference":
        got = reference.merge_state(*args, prefix_rows=2)
        verb = reference.merge_state(*args, prefix_rows=2, suffix_verbatim=True)
    else:
        t = [torch.from_numpy(x).float() for x in args]
        got = [f64(x) for x in zerokv.merge_state(*t, prefix_rows=2)]
        out, lse = torch.full_like(t[0], NAN), torch.full_like(t[1], NAN)
        vllm.merge_attn_states(out, t[0], t[1].T, t[2], t[3].T, lse.T, 2)
        verb = f64(out), f64(lse)
    for (o, s), (wo, ws) in ((got, (want_out, want_lse)), (verb, (want_verbatim_out, want_verbatim_lse))):
        _close(o[2:], wo[2:], "suffix out", impl)
        _close(s[2:], ws[2:], "suffix lse", impl)
        _close(o[:2], wo[:2], "prefix out", impl)
        _close(s[:2], ws[:2], "prefix lse", impl)


@pytest.mark.parametrize("impl", ["oracle", "reference", "cpu"])
def test_a_empty_closed_form(impl):
    """Requests [0, 2) kv 0, [2, 3) kv 4, [3, 5) kv 0: rows 0, 1, 3, 4 take b as it is (a's
    finite LSE and NaN V are garbage), row 2 merges equal weights."""
    T = 5
    v_a = np.tile(VA, (T, 1, 1))
    v_a[[0, 1, 3, 4]] = NAN
    s_a = np.array([[7.0], [7.0], [0.0], [7.0], [7.0]])
    v_b = np.tile(VB, (T, 1, 1))
    s_b = np.array([[0.5], [-1.0], [0.0], [2.0], [3.0]])
    cu, kv = np.array([0, 2, 3, 5]), np.array([0, 4, 0])
    rows = np.array([True, True, False, True, True])
    if impl == "oracle":
        assert (a_empty_rows(cu, kv, T) == rows).all()
        out, lse = merge2(v_a, s_a, v_b, s_b, a_empty=rows)
    elif impl == "reference":
        assert (reference.rows_with_empty_a(cu, kv, T) == rows).all()
        out, lse = reference.merge_state(v_a, s_a, v_b, s_b, a_empty_rows=rows)
    else:
        t = [torch.from_numpy(x).float() for x in (v_a, s_a, v_b, s_b)]
        out, lse = (f64(x) for x in zerokv.merge_state(*t, a_empty=(torch.tensor(cu), torch.tensor(kv))))
    want_out = np.tile(VB, (T, 1, 1))
    want_out[2] = (VA + VB) / 2
    _close(out, want_out, "out", impl)
    _close(lse, np.array([[0.5], [-1.0], [LN2], [2.0], [3.0]]), "lse", impl)


@pytest.mark.parametrize("impl", ["oracle", "reference", "cpu_torch", "cpu_numpy"])
@pytest.mark.parametrize("op", ["fixup", "mask"])
def test_empty_rows_closed_form(op, impl):
    """cu = [0, 2, 2, 5, 6] over T = 7: requests 0 (rows 0-1), 1 (none), 2 (rows 2-4), 3 (row 5);
    row 6 belongs to no request. Empty: kv_lens 0 for requests 0 and 2 (fixup); context spans
    [3, 3) and [5, 4) for requests 0 and 2 (mask). Rows 0-4 become (0, -inf); 5 and 6 stay."""
    T, H, D = 7, 2, 3
    rng = np.random.default_rng(5)
    out = rng.standard_normal((T, H, D))
    out[:5] = NAN  # garbage that must be overwritten
    lse = rng.standard_normal((T, H))
    cu, kv, cu_kv = np.array([0, 2, 2, 5, 6]), np.array([0, 3, 0, 1]), np.array([3, 3, 5, 4, 9])
    want_out, want_lse = out.copy(), lse.copy()
    want_out[:5], want_lse[:5] = 0.0, -INF
    if impl == "oracle":
        rows = fixup_rows(cu, kv, T) if op == "fixup" else mask_rows(cu, cu_kv, T)
        got = with_empty_rows(out, lse, rows)
    elif impl == "reference":
        if op == "fixup":
            got = reference.fixup_zero_kv_rows(out, lse, kv, cu)
        else:
            got = reference.mask_empty_context(out, lse, cu, cu_kv)
    else:
        o, s = torch.from_numpy(out).float(), torch.from_numpy(lse).float()
        c, k, ck = (torch.from_numpy(x).int() for x in (cu, kv, cu_kv))
        if impl == "cpu_numpy":
            o, s, c, k, ck = (x.numpy() for x in (o, s, c, k, ck))
        if op == "fixup":
            zerokv.fixup_zero_kv_rows(o, s, k, c)
        else:
            zerokv.mask_empty_context(o, s, c, ck)
        got = f64(torch.as_tensor(o)), f64(torch.as_tensor(s))
        want_out, want_lse = f64(torch.from_numpy(want_out).float()), f64(torch.from_numpy(want_lse).float())
    assert np.array_equal(got[0], want_out) and np.array_equal(got[1], want_lse)


@pytest.mark.parametrize("scale", [0.5, 0.125])
@pytest.mark.parametrize("op", ["merge_state", "merge_states"])
def test_fp8_out_scale_closed_form(op, scale):
    """fp8 e4m3 output = fp8(clamp(merged / scale, +-448)): values chosen to be exact in e4m3
    (3/4 * 4 + 1/4 * 8 = 5, / 0.5 = 10), clamps at +-448, an empty row 0, a NaN row NaN."""
    v_a = np.array([[[4.0, -2.0, 0.5, 1000.0]], [[1.0, 1.0, 1.0, 1.0]], [[NAN] * 4], [[1.0] * 4]])
    v_b = np.array([[[8.0, -2.0, 0.5, -1000.0]], [[3.0, -3.0, 9.0, 0.0]], [[NAN] * 4], [[1.0] * 4]])
    s_a = np.array([[LN3], [-INF], [-INF], [NAN]])
    s_b = np.array([[0.0], [2.0], [INF], [0.0]])
    merged = np.array([[5.0, -2.0, 0.5, 500.0], [3.0, -3.0, 9.0, 0.0], [0.0] * 4, [NAN] * 4])
    want = np.clip(merged / scale, -448, 448)  # 10, -4, 1, 448 | 6, -6, 18, 0 at 0.5: all exact
    t = [torch.from_numpy(x).float() for x in (v_a, s_a, v_b, s_b)]
    out = torch.full((4, 1, 4), NAN).to(torch.float8_e4m3fn)
    s = torch.tensor([scale])
    if op == "merge_state":
        zerokv.merge_state(*t, out=out, out_scale=s)
    else:
        zerokv.merge_states(torch.stack(t[::2]), torch.stack(t[1::2]), out=out, out_scale=s)
    np.testing.assert_array_equal(f64(out.float())[:, 0], want)


# --- the laws: the empty state is the identity, a chain is the N-way merge, order is free -----


@pytest.mark.parametrize("empty_lse", [-INF, INF])
@pytest.mark.parametrize("side", ["a", "b"])
def test_merging_with_the_empty_state_is_the_identity(empty_lse, side):
    """Exactly (bit for bit) on the CPU path, in the oracle and in the reference: weight 1 and 0."""
    v, s, _, _ = make_states(40, 3, 8, torch.float32, seed=2)  # with edges: NaN rows, empty rows
    garbage = torch.full_like(v, NAN)
    empty = torch.full_like(s, empty_lse)
    args = (garbage, empty, v, s) if side == "a" else (v, s, garbage, empty)
    out, lse = zerokv.merge_state(*args)
    want_out = torch.where(torch.isinf(s)[..., None], 0.0, v)
    want_lse = torch.where(torch.isinf(s), -INF, s)
    for got in ((out, lse), merge2(*args), reference.merge_state(*(f64(x) for x in args))):
        _close(f64(torch.as_tensor(got[0])), f64(want_out), "out")
        assert np.array_equal(f64(torch.as_tensor(got[1])), f64(want_lse), equal_nan=True)
    assert torch.equal(out.isnan(), want_out.isnan()) and torch.equal(out.nan_to_num(), want_out.nan_to_num())


def _states(N, T=30, H=3, D=8, seed=0):
    parts = [make_states(T, H, D, torch.float32, seed=seed + i) for i in range(N)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


@pytest.mark.parametrize("N", [1, 2, 3, 5])
@pytest.mark.parametrize("base", ["e", 2])
def test_a_two_way_chain_equals_the_n_way_merge(N, base):
    """((s0 + s1) + s2) + ... by merge_state equals merge_states in one pass, on the CPU path,
    and both equal the oracle."""
    v, s = _states(N, seed=10 * N)
    want = merge(f64(v), f64(s), base)
    acc_v, acc_s = v[0], s[0]
    empty = torch.full_like(s[0], -INF)
    if N == 1:  # a chain of one: merged with the empty state
        acc_v, acc_s = zerokv.merge_state(acc_v, acc_s, torch.full_like(v[0], NAN), empty, lse_base=base)
    for i in range(1, N):
        acc_v, acc_s = zerokv.merge_state(acc_v, acc_s, v[i], s[i], lse_base=base)
    # float32 between the steps: a rounded LSE moves the next step's weights (the float32 bound)
    assert_close(acc_v, want[0], torch.float32, "chain out", roundings=N, arithmetic="float32")
    assert_close(acc_s, want[1], torch.float32, "chain lse", roundings=N, arithmetic="float32")
    out, lse = zerokv.merge_states(v, s, lse_base=base)
    assert_close(out, want[0], torch.float32, "merge_states out")
    assert_close(lse, want[1], torch.float32, "merge_states lse")
    ref = reference.merge_states(f64(v), f64(s), base)
    _close(ref[0], want[0], "reference out")
    _close(ref[1], want[1], "reference lse")


@pytest.mark.parametrize("N", [2, 4])
def test_order_does_not_matter(N):
    v, s = _states(N, seed=5)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(N)).flip(0)
    sinks = torch.randn(3) * 2
    out, lse = zerokv.merge_states(v, s, sinks=sinks)
    out_p, lse_p = zerokv.merge_states(v[perm], s[perm], sinks=sinks)
    want = merge(f64(v[perm]), f64(s[perm]), sinks=f64(sinks))
    for o, l_ in ((out, lse), (out_p, lse_p)):
        assert_close(o, want[0], torch.float32, "out")
        assert_close(l_, want[1], torch.float32, "lse")
    ab = zerokv.merge_state(v[0], s[0], v[1], s[1])
    ba = zerokv.merge_state(v[1], s[1], v[0], s[0])
    two = merge(f64(v[:2]), f64(s[:2]))
    for o, l_ in (ab, ba):
        assert_close(o, two[0], torch.float32, "a+b out")
        assert_close(l_, two[1], torch.float32, "a+b lse")


# --- the reference against the oracles on random states with every edge -----------------------


@pytest.mark.parametrize("base", ["e", 2])
@pytest.mark.parametrize("options", ["plain", "sinks", "prefix", "verbatim", "a_empty", "all"])
def test_reference_equals_the_oracle_on_random_edges(base, options):
    T, H, D = 64, 5, 6
    v_a, s_a, v_b, s_b = (f64(x) for x in make_states(T, H, D, torch.float64, seed=17))
    rng = np.random.default_rng(9)
    kw: dict = {}
    ref_kw: dict = {}
    if options in ("sinks", "all"):
        kw["sinks"] = ref_kw["sinks"] = np.array([0.5, -INF, INF, -3.0, 2.0])
    if options in ("prefix", "verbatim", "all"):
        kw["prefix_rows"] = ref_kw["prefix_rows"] = 23
    if options == "verbatim":
        kw["verbatim"] = ref_kw["suffix_verbatim"] = True
    if options in ("a_empty", "all"):
        kw["a_empty"] = ref_kw["a_empty_rows"] = rng.random(T) < 0.3
    want = merge2(v_a, s_a, v_b, s_b, base=base, **kw)
    got = reference.merge_state(v_a, s_a, v_b, s_b, lse_base=base, **ref_kw)
    _close(got[0], want[0], "out")
    _close(got[1], want[1], "lse")


@pytest.mark.parametrize("seed", range(4))
def test_reference_empty_rows_equal_the_loops(seed):
    rng = np.random.default_rng(seed)
    T, B = 50, 12
    cu = np.concatenate([[0], np.sort(rng.integers(-5, T + 5, B))])  # may step down at its start
    kv = rng.integers(0, 3, B)
    cu_kv = np.concatenate([[0], np.cumsum(rng.integers(-1, 3, B))])
    out, lse = rng.standard_normal((T, 2, 3)), rng.standard_normal((T, 2))
    assert (reference.rows_with_empty_a(cu, kv, T) == a_empty_rows_searched(cu, kv, T)).all()
    rising = np.sort(cu)  # non-decreasing: the plain loop over the requests
    assert (reference.rows_with_empty_a(rising, kv, T) == a_empty_rows(rising, kv, T)).all()
    for got, rows in (
        (reference.fixup_zero_kv_rows(out, lse, kv, cu), fixup_rows(cu, kv, T)),
        (reference.mask_empty_context(out, lse, cu, cu_kv), mask_rows(cu, cu_kv, T)),
    ):
        want = with_empty_rows(out, lse, rows)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flashinfer_in_place_row_mask_closed_form(kind, dtype):
    """merge_state_in_place(mask=): rows 0 and 2 (mask True) merge, base 2 with equal LSEs (V
    halves, LSE + 1); rows 1 and 3 stay bit for bit, V and LSE, NaN garbage included."""
    T = 4
    v = np.tile(np.array([2.0, 4.0, -8.0]), (T, 2, 1))
    v[1, 0] = NAN
    s = np.array([[1.0, 3.0], [NAN, 0.5], [-1.0, 2.0], [4.0, 4.0]])
    v_o = np.tile(np.array([6.0, 0.0, 8.0]), (T, 2, 1))
    s_o = s.copy()
    s_o[1] = 9.0
    mask = np.array([True, False, True, False])
    want_v, want_s = v.copy(), s.copy()
    want_v[mask] = (v[mask] + v_o[mask]) / 2
    want_s[mask] = s[mask] + 1.0
    tv, ts, to, tso = (
        torch.from_numpy(x).to(d)
        for x, d in ((v, dtype), (s, torch.float32), (v_o, dtype), (s_o, torch.float32))
    )
    m = torch.from_numpy(mask)
    if kind == "numpy":
        tv, ts, to, tso, m = (
            x.numpy() if x.dtype != torch.bfloat16 else _np_bf16(x) for x in (tv, ts, to, tso, m)
        )
    flashinfer.merge_state_in_place(tv, ts, to, tso, mask=m)
    got_v = f64(torch.as_tensor(np.asarray(tv, dtype=np.float64)) if kind == "numpy" else tv)
    got_s = f64(torch.as_tensor(np.asarray(ts, dtype=np.float64)) if kind == "numpy" else ts)
    assert np.array_equal(got_v, want_v, equal_nan=True), got_v
    assert np.array_equal(got_s, want_s, equal_nan=True), got_s


def _np_bf16(x):
    import ml_dtypes

    return x.float().numpy().astype(ml_dtypes.bfloat16)
