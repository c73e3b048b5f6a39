"""Form selection as a pure function: each threshold of ``forms.THRESHOLDS`` on both sides of
its edge, and the facts that rule forms out (options, an in-place LSE, 64-bit spans, strides)."""

from __future__ import annotations

import pytest

from zerokv.core import forms
from zerokv.core.layout import INT32

DEV = forms.Device(sms=132, l2=50 << 20)
BF16 = ("zk_bfloat16", "zk_bfloat16")
TH = forms.THRESHOLDS


def _call(T, H=8, D=128, vec=8, dtype="bfloat16", out="bfloat16", features=(), **kw):
    facts = {"inplace_lse": False, "fits32": True, "strides32": True, "lse_tiles": False} | kw
    return forms.MergeCall(T, H, D, vec, dtype, out, frozenset(features), **facts)


def _pick(c, dev=DEV):
    f = forms.merge_two(c, dev, BF16)
    return f.kernel.name, f.targs


def _tokens_for(threads, H=8, D=128, vec=8):
    """T giving exactly ``threads`` (one per pack) at H heads of D elements."""
    per_token = H * D // vec
    assert threads % per_token == 0
    return threads // per_token


def test_gathered_form_from_its_threshold_on():
    edge = TH["gathered_threads"]
    below = _pick(_call(_tokens_for(edge - 128)))
    at = _pick(_call(_tokens_for(edge)))
    assert below[0] == "merge_state_flat_kernel" and at[0] == "merge_state_flat_gathered_kernel"
    assert _pick(_call(_tokens_for(edge), lse_tiles=True))[1] == (*BF16, 8, 1)


def test_heads_form_up_to_its_packs():
    edge = TH["heads_packs"]  # counted in packs of 16 bytes
    H, D = 2, 64  # 8 packs of 16 bytes per row: 16 per token
    T = edge // 16
    assert _pick(_call(T, H, D))[0] == "merge_state_heads_kernel"
    assert _pick(_call(T + 1, H, D))[0] == "merge_state_flat_kernel"
    assert _pick(_call(1, 3, 96))[0] == "merge_state_flat_kernel"  # 12 packs: not a power of two
    assert _pick(_call(1, 8, 64, dtype="float16"))[1] == (*BF16, 8)  # fp16: 16-byte packs
    assert _pick(_call(1, 8, 64))[1] == (*BF16, 4)  # bf16: 8-byte packs
    assert _pick(_call(1, 8, 1024))[1] == (*BF16, 8)  # ... unless a row would pass a block of them


def test_small_form_for_one_wave():
    edge = TH["small_blocks_per_sm"] * DEV.sms * 128  # threads of one wave of 128-thread blocks
    assert _pick(_call(_tokens_for(edge)))[1] == (*BF16, 8, 1)
    assert _pick(_call(_tokens_for(edge) + 1))[1] == (*BF16, 8, 0)
    small_dev = forms.Device(sms=66, l2=DEV.l2)
    assert _pick(_call(_tokens_for(edge)), small_dev)[1] == (*BF16, 8, 0)


def test_row_group_kernel_takes_two_packs_per_thread_for_batches_in_l2():
    a, b, x, y = TH["rows_mid_l2"]
    elem = 2 * 2 + 2  # bytes moved per element: two bf16 inputs, one bf16 output
    H, D = 1, 128  # 16 packs per row
    lo, hi = DEV.l2 * a // b, DEV.l2 * x // y

    def ppt(nbytes):
        T = -(-nbytes // (H * D * elem))
        return _pick(_call(T, H, D, inplace_lse=True))[1][3], T * H * D * elem

    assert ppt(lo)[0] == 2 and ppt(hi - H * D * elem)[0] == 2
    below, n = ppt(lo - H * D * elem)
    assert n < lo and below == 1
    above, n = ppt(hi + H * D * elem)
    assert n > hi and above == 1


def test_several_options_or_two_dtypes_take_the_row_group_kernel_with_their_code():
    # one option alone takes the flat family (tests/test_merge_options.py)
    name, targs = _pick(_call(64, features=("a_empty", "sinks")))
    assert name == "merge_state_kernel" and targs[4:] == (1, "long long")
    name, targs = _pick(_call(64, out="float32", features=("sinks",)))
    assert name == "merge_state_kernel" and targs[4] == 1


def test_facts_that_rule_out_the_flat_forms():
    assert _pick(_call(64, inplace_lse=True))[1] == (*BF16, 8, 1, 0, "int")
    assert _pick(_call(64, strides32=False))[1] == (*BF16, 8, 1, 0, "int")
    assert _pick(_call(64, D=0))[0] == "merge_state_kernel"
    assert _pick(_call(64, fits32=False))[0] == "merge_state_flat64_gathered_kernel"
    assert _pick(_call(64, vec=1, fits32=False))[1] == (*BF16, 1, 1, 0, "long long")
    huge = _tokens_for(INT32, H=8, D=128)
    assert _pick(_call(huge, fits32=False))[0] == "merge_state_kernel"


def test_merge_states_two_packs_per_lane_from_its_threshold():
    edge = TH["n_two_packs_per_sm"] * DEV.sms
    packs = 16
    rows = edge // packs
    assert forms.merge_states_lanes(packs, rows - 1, DEV) == 16
    assert forms.merge_states_lanes(packs, rows, DEV) == 8


@pytest.mark.parametrize("vec", [1, 8])
def test_empty_rows_grid_is_persistent_but_never_past_one_store_per_thread(vec):
    per_sm = TH["empty_rows_blocks_per_sm"]
    H, D = 4, 64
    per_token = H * max(1, D // vec)
    full = per_sm * DEV.sms * 256 // per_token  # tokens that fill the persistent grid
    form = forms.empty_rows_form(H, D, vec, DEV, ())
    assert forms.launch_grid(form, full) == (per_sm * DEV.sms, 1)
    assert forms.launch_grid(form, full * 4) == (per_sm * DEV.sms, 1)
    assert forms.launch_grid(form, 1) == (1, 1)


def _same_form(a, b):
    """Two forms that launch the same instantiation with the same T-free parameters."""
    skip = {"grid", "grid_y"}
    return all(getattr(a, n) == getattr(b, n) for n in forms.Form._fields if n not in skip)


_SHAPES = [
    # (H, D, vec, in dtype, out dtype, features, extra facts): every rule and option family
    (8, 128, 8, "bfloat16", "bfloat16", (), {}),
    (2, 64, 8, "bfloat16", "bfloat16", (), {}),
    (128, 128, 8, "float16", "float16", ("a_empty",), {}),
    (16, 512, 8, "bfloat16", "bfloat16", ("sinks",), {"lse_tiles": True}),
    (3, 96, 1, "bfloat16", "bfloat16", (), {}),
    (32, 128, 4, "float32", "float32", (), {"inplace_lse": True}),
    (64, 128, 8, "bfloat16", "float32", (), {}),
    (8, 128, 8, "bfloat16", "bfloat16", ("a_empty", "sinks"), {}),
    (40, 128, 8, "bfloat16", "float8_e4m3fn", ("group_fp8",), {"quant_group": 128}),
    (8, 256, 8, "bfloat16", "bfloat16", (), {"strides32": False}),
    (128, 512, 8, "bfloat16", "bfloat16", (), {"fits32": False}),
]


@pytest.mark.parametrize("H, D, vec, dtype, out, features, extra", _SHAPES)
def test_one_form_serves_every_token_count_of_its_interval(H, D, vec, dtype, out, features, extra):
    """The plans cache a form per interval of ``t_breaks``: every T of an interval gets the form
    the rules give its first T, and ``launch_grid`` scales its grid as the rules would."""
    size = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
    breaks = forms.t_breaks(H, D, vec, size[dtype], size[out], DEV)
    ctypes = (dtype, out)
    edges = sorted({1, 2, *(b + d for b in breaks for d in (-1, 0, 1) if 0 < b + d < INT32 // (H * D))})
    checked = 0
    for lo, hi in zip(edges, edges[1:], strict=False):
        first = forms.merge_two(_call(lo, H, D, vec, dtype, out, features, **extra), DEV, ctypes)
        for T in {lo, hi - 1, (lo + hi) // 2}:
            if forms.t_class(breaks, T) != forms.t_class(breaks, lo):
                continue
            got = forms.merge_two(_call(T, H, D, vec, dtype, out, features, **extra), DEV, ctypes)
            assert _same_form(got, first), (T, lo, got, first)
            assert forms.launch_grid(first, T) == (got.grid, got.grid_y), (T, got)
            checked += 1
    assert checked > 20


def _first_of_interval(breaks, T):
    i = forms.t_class(breaks, T)
    return breaks[i - 1] if i else 1


@pytest.mark.parametrize("N", [2, 3, 8])
def test_merge_states_form_serves_every_token_count_of_its_interval(N):
    breaks = forms.t_breaks(16, 128, 8, 2, 2, DEV)
    for T in [*range(1, 70000, 997), *breaks]:
        first = forms.merge_states(N, _first_of_interval(breaks, T), 16, 128, 8, DEV, BF16)
        got = forms.merge_states(N, T, 16, 128, 8, DEV, BF16)
        assert _same_form(got, first) and forms.launch_grid(first, T) == (got.grid, got.grid_y), T


@pytest.mark.parametrize("extra", [{}, {"lse_tiles": True}, {"a64": True}, {"a_many": True}])
def test_a_empty_in_runs_of_spans_from_their_threshold_on(extra):
    """The gathered a_empty form takes runs of spans (F_A_RUN) from its threshold on, and on every
    grid with an LSE laid [H, T] (tiles), int64 offsets or more requests than the window; its grid
    gives the first blocks A_RUN_SPANS spans and the tail one, as merge_flat_run reads it back."""
    from zerokv.core import kernels

    edge = TH["a_empty_runs_spans_per_sm"] * DEV.sms * 512
    base = kernels.F_A_EMPTY | (kernels.F_A64 if extra.get("a64") else 0)
    K, tail = kernels.A_RUN_SPANS, TH["a_empty_run_tail_per_sm"] * DEV.sms
    low = [_tokens_for(edge - 128), _tokens_for(TH["gathered_threads"]) + 1]  # below the edge
    above = [_tokens_for(edge), _tokens_for(edge) + 1, 33000, 123457]
    every_grid = bool(extra)  # [H, T], int64 offsets, more requests than the window: runs on every grid
    if not every_grid:
        for T in low:
            below = forms.merge_two(_call(T, features=("a_empty",), **extra), DEV, BF16)
            assert below.kernel.name == "merge_state_flat_gathered_kernel" and below.targs[-1] == base
            assert below.run_tail == 0
    for T in above + low * every_grid:
        form = forms.merge_two(_call(T, features=("a_empty",), **extra), DEV, BF16)
        assert (
            form.kernel.name == "merge_state_flat_gathered_kernel"
            and form.targs[-1] == base | kernels.F_A_RUN
        )
        assert form.targs in form.kernel.instances and form.run_tail == tail
        spans = -(-T * 8 * 16 // 512)
        G = form.grid
        assert forms.launch_grid(form, T) == (G, 1)
        L = min(G, -(-(spans - G) // (K - 1))) if spans > G else 0  # merge_flat_run's reading
        assert L * K + (G - L) >= spans > L * K + (G - L) - 1  # every span once, none past the last block
        assert G - L == spans - L * K >= min(tail, spans)  # the tail: `tail` blocks of one span (or all)
    # another option at the same size keeps one span a block
    assert forms.merge_two(_call(33000, features=("sinks",), **extra), DEV, BF16).run_tail == 0


def test_every_option_of_merge_state_has_a_row_and_the_last_row_takes_the_generic_ones():
    """A feature no row names fails at the call; the last row takes every option its generic
    kernel takes, so a new option runs with no edit of the form table."""
    from zerokv.core import spec

    named = frozenset().union(*(row.features for row in forms.MERGE_FORMS))
    for o in spec.MERGE_STATE.options:
        assert o.feature in named, o.name
        assert (o.feature in forms.MERGE_FORMS[-1].features) == o.generic, o.name
    T = 64
    for o in spec.MERGE_STATE.options:
        if o.generic:
            name, _ = _pick(_call(T, features=(o.feature, "sinks" if o.feature != "sinks" else "row_mask")))
            assert name == "merge_state_kernel", o.name
