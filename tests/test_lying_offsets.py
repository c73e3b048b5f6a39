"""Offsets are trusted for meaning, never for memory (DESIGN.md).

Request i's rows ``[cu[i], cu[i + 1])`` are clipped to ``[0, T)``; a span with ``end <= start``
covers no row; a row that no request covers is left alone by the fixup and the mask and is
merged normally by ``merge_state(a_empty=...)``; ``kv_lens[i] == 0`` means empty and any other
value (negative too) does not; a context span with ``end <= start`` is empty; offsets are read
at their own width. For ``a_empty`` a row's request is the one a binary search over ``cu``
finds. The expected rows are written here as plain loops over Python ints, independent of the
library. Every output lies inside a larger NaN-poisoned buffer whose other bytes must not change.
The CPU tests pin the CPU path's rules; the GPU tests check the kernels against the same rules
and against the CPU path for the same inputs.
"""

from __future__ import annotations

import oracles
import pytest
import torch
from batches import LYING_CASES, NAN, Lying, bits, check_empty_rows, garbage_state, poisoned_lse, poisoned_v
from conftest import assert_close, f64
from states import make_states

import zerokv
from zerokv import reference

D = 8  # a multiple of every vector width: the "rows" layout takes the vector path

# --- the rules, as plain loops ------------------------------------------------------------------


def _span(cu: tuple[int, ...], i: int, T: int) -> range:
    """Request i's rows, clipped to [0, T); empty when end <= start."""
    return range(min(max(cu[i], 0), T), min(max(cu[i + 1], 0), T))


def fixup_rows(case: Lying) -> list[bool]:
    rows = [False] * case.T
    for i in range(len(case.cu) - 1):
        if case.kv[i] == 0:
            for t in _span(case.cu, i, case.T):
                rows[t] = True
    return rows


def mask_rows(case: Lying) -> list[bool]:
    rows = [False] * case.T
    for i in range(len(case.cu) - 1):
        if case.cu_kv[i + 1] <= case.cu_kv[i]:  # an empty context span
            for t in _span(case.cu, i, case.T):
                rows[t] = True
    return rows


def a_empty_rows(case: Lying) -> list[bool]:
    B = len(case.cu) - 1
    rows = [False] * case.T
    if B == 0:
        return rows
    for t in range(case.T):
        lo, hi = 0, B
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if case.cu[mid] <= t:
                lo = mid
            else:
                hi = mid
        rows[t] = t in _span(case.cu, lo, case.T) and case.kv[lo] == 0
    return rows


def _params(cases=LYING_CASES):
    return [
        pytest.param(case, index_dtype, id=f"{case.id}-{str(index_dtype).removeprefix('torch.')}")
        for case in cases
        for index_dtype in case.index_dtypes
    ]


def test_the_cases_mean_what_they_say():
    """The expected rows of a few cases, by hand: the loops above are the rule."""
    cases = {c.id: c for c in LYING_CASES}

    def where(rows):
        return [t for t, r in enumerate(rows) if r]

    assert where(fixup_rows(cases["past_T"])) == [0, 1, 2, 3, 9]
    assert where(fixup_rows(cases["negative_first"])) == [0, 1, 6, 7, 8, 9]
    assert where(fixup_rows(cases["decreasing_overlap"])) == list(range(1, 10))
    assert where(a_empty_rows(cases["decreasing_overlap"])) == list(range(2, 10))
    assert where(fixup_rows(cases["above_2^32"])) == list(range(2, 10))
    assert where(fixup_rows(cases["lens_zero_in_low_32_bits"])) == []
    assert where(mask_rows(cases["lens_zero_in_low_32_bits"])) == [3, 4, 5]
    assert where(mask_rows(cases["int32_extreme_lens"])) == [0, 1, 2, 3]
    assert where(a_empty_rows(cases["uncovered_rows"])) == [2, 3, 4, 5, 6]
    assert where(fixup_rows(cases["B0"])) == where(a_empty_rows(cases["B0"])) == []


# --- fixup_zero_kv_rows and mask_empty_context ------------------------------------------------

EMPTY_ROW_OPS = {
    "fixup": (lambda out, lse, cu, kv, cu_kv: zerokv.fixup_zero_kv_rows(out, lse, kv, cu), fixup_rows),
    "mask": (lambda out, lse, cu, kv, cu_kv: zerokv.mask_empty_context(out, lse, cu, cu_kv), mask_rows),
}


def _empty_rows_call(op, case, index_dtype, dtype, device, padded):
    """Run ``op`` on garbage-filled outputs inside poisoned buffers; check the rule's rows are
    (0, -inf), every other row and every surrounding byte unchanged. Returns the buffers."""
    call, rule = EMPTY_ROW_OPS[op]
    rows = torch.tensor(rule(case), dtype=torch.bool)
    out, lse = garbage_state(case.T, case.H, D, dtype, rows, "cpu", seed=case.T + len(case.cu), lse_ht=False)
    o = poisoned_v(out.to(device), padded)
    s = poisoned_lse(lse.to(device), ht=padded)
    o_before, s_before = o.buf.clone(), s.buf.clone()
    cu, kv, cu_kv = case.tensors(index_dtype, device)
    call(o.view, s.view, cu, kv, cu_kv)
    check_empty_rows(o.view, s.view, out.to(device), lse.to(device), rows)
    assert o.surroundings_unchanged(o_before), "out: a byte outside the view changed"
    assert s.surroundings_unchanged(s_before), "lse: a byte outside the view changed"
    return o.buf, s.buf


@pytest.mark.parametrize("op", sorted(EMPTY_ROW_OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case, index_dtype", _params())
def test_empty_rows_cpu(op, dtype, case, index_dtype):
    _empty_rows_call(op, case, index_dtype, dtype, "cpu", padded=dtype == torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(EMPTY_ROW_OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["rows", "padded"])
@pytest.mark.parametrize("case, index_dtype", _params())
def test_empty_rows_gpu_equals_cpu(op, dtype, padded, case, index_dtype):
    gpu = _empty_rows_call(op, case, index_dtype, dtype, "cuda", padded)
    cpu = _empty_rows_call(op, case, index_dtype, dtype, "cpu", padded)
    for g, c in zip(gpu, cpu, strict=True):
        assert torch.equal(bits(g.cpu()), bits(c))


@pytest.mark.parametrize("op", sorted(EMPTY_ROW_OPS))
@pytest.mark.parametrize("case", LYING_CASES, ids=lambda c: c.id)
def test_reference_follows_the_rule(op, case):
    """The float64 reference is the specification: it applies the same rule."""
    rows = EMPTY_ROW_OPS[op][1](case)
    out = torch.randn(case.T, case.H, 2, dtype=torch.float64).numpy()
    lse = torch.randn(case.T, case.H, dtype=torch.float64).numpy()
    cu, kv, cu_kv = (t.numpy() for t in case.tensors(torch.int64))
    if op == "fixup":
        ref_out, ref_lse = reference.fixup_zero_kv_rows(out, lse, kv, cu)
    else:
        ref_out, ref_lse = reference.mask_empty_context(out, lse, cu, cu_kv)
    for t in range(case.T):
        if rows[t]:
            assert (ref_out[t] == 0).all() and (ref_lse[t] == float("-inf")).all(), f"row {t}"
        else:
            assert (ref_out[t] == out[t]).all() and (ref_lse[t] == lse[t]).all(), f"row {t}"


# --- merge_state(a_empty=(cu_seqlens_q, kv_lens)) ---------------------------------------------


def _merge_call(case, index_dtype, dtype, device, padded):
    """Merge with ``a_empty`` into outputs inside poisoned buffers; state a holds NaN/Inf garbage
    in its empty rows (it must never reach the output). Checks the float64 reference, the
    surroundings and that the inputs are unchanged; returns ``(out, out_lse)`` views."""
    rows = a_empty_rows(case)
    v_a, s_a, v_b, s_b = make_states(case.T, case.H, D, dtype, seed=len(case.cu) + case.T)
    r = torch.tensor(rows, dtype=torch.bool)
    v_a[r] = NAN
    v_a[r, :, ::3] = float("inf")
    s_a[r] = torch.randn(int(r.sum()), case.H, generator=torch.Generator().manual_seed(0)) + 2.0
    inputs = [x.to(device) for x in (v_a, s_a, v_b, s_b)]
    kept = [x.clone() for x in inputs]
    o = poisoned_v(torch.full((case.T, case.H, D), NAN, dtype=dtype, device=device), padded)
    s = poisoned_lse(torch.full((case.T, case.H), NAN, device=device), ht=padded)
    o_before, s_before = o.buf.clone(), s.buf.clone()
    cu, kv, _ = case.tensors(index_dtype, device)
    res = zerokv.merge_state(*inputs, out=o.view, out_lse=s.view, a_empty=(cu, kv))
    assert res[0].data_ptr() == o.view.data_ptr() and res[0].shape == o.view.shape
    ref_out, ref_lse = oracles.merge2(v_a, s_a, v_b, s_b, a_empty=rows)  # not the reference: the CPU path
    assert_close(o.view, ref_out, dtype, "out")
    assert_close(s.view, ref_lse, torch.float32, "out_lse")
    assert o.surroundings_unchanged(o_before), "out: a byte outside the view changed"
    assert s.surroundings_unchanged(s_before), "out_lse: a byte outside the view changed"
    for x, k in zip(inputs, kept, strict=True):
        assert torch.equal(bits(x), bits(k)), "an input changed"
    return o.view, s.view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case, index_dtype", _params())
def test_merge_a_empty_cpu(dtype, case, index_dtype):
    _merge_call(case, index_dtype, dtype, "cpu", padded=dtype == torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["rows", "padded"])
@pytest.mark.parametrize("case, index_dtype", _params())
def test_merge_a_empty_gpu_equals_cpu(dtype, padded, case, index_dtype):
    gpu = _merge_call(case, index_dtype, dtype, "cuda", padded)
    cpu = _merge_call(case, index_dtype, dtype, "cpu", padded)
    assert_close(gpu[0], f64(cpu[0]), dtype, "out: GPU vs CPU", roundings=2)
    assert_close(gpu[1], f64(cpu[1]), torch.float32, "out_lse: GPU vs CPU", roundings=2)
