"""Host-side checks: byte ranges, overlap by pointers/shapes/strides, outputs that cannot be written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zerokv import merge
from zerokv.core import checks as _checks
from zerokv.core import spec, validation
from zerokv.core.tensors import Tensor, view

GPU_PTR = 0x7F00_0000_0000  # a device-like address: nothing at it is ever read


def _t(x) -> Tensor:
    return view(x, "x")


def _fake(ptr, shape, strides, dtype="float32", device=0) -> Tensor:
    """A record of a tensor that does not exist: the checks must never read memory."""
    return Tensor(None, ptr, tuple(shape), tuple(strides), dtype, device, False)


# --- extent -------------------------------------------------------------------------------------


def test_extent_of_contiguous_strided_negative_and_empty():
    assert _checks.extent(1000, (3, 4), (4, 1), 2) == (1000, 1024)
    assert _checks.extent(1000, (3, 4), (8, 1), 4) == (1000, 1000 + (2 * 8 + 3 + 1) * 4)
    # a reversed view: element 0 is the last in memory
    assert _checks.extent(1000, (5,), (-1,), 4) == (1000 - 16, 1004)
    assert _checks.extent(1000, (2, 3), (-3, 1), 8) == (1000 - 24, 1000 + 24)
    assert _checks.extent(1000, (4, 0, 7), (7, 7, 1), 4) == (1000, 1000)
    assert _checks.extent(1000, (), (), 4) == (1000, 1004)  # a 0-d tensor holds one element
    assert _checks.extent(1000, (6, 3), (0, 1), 2) == (1000, 1006)  # an expanded view


def test_extent_matches_numpy_on_real_views():
    buf = np.zeros((7, 5, 6), np.float32)
    for v in (buf, buf[::-1], buf[:, ::-2, 1:], buf.transpose(2, 0, 1), buf[3:4, :, ::-1]):
        lo, hi = _checks.extent(*_t(v)[1:4], 4)
        lo_np, hi_np = np.byte_bounds(v) if hasattr(np, "byte_bounds") else np.lib.array_utils.byte_bounds(v)
        assert (lo, hi) == (lo_np, hi_np)


# --- overlap ------------------------------------------------------------------------------------


def test_the_same_view_is_an_alias_and_a_copy_is_not():
    a = torch.randn(6, 2, 8)
    assert _checks.overlap(_t(a), _t(a)) == "alias"
    assert _checks.overlap(_t(a), _t(a[:])) == "alias"
    assert _checks.overlap(_t(a), _t(a.clone())) == "none"


@pytest.mark.parametrize("device", [-1, 0])
def test_shift_by_a_row_or_a_head_is_partial(device):
    T, H, D = 16, 4, 8
    whole = _fake(GPU_PTR, (T + 1, H, D), (H * D, D, 1), device=device)
    v = _fake(whole.ptr, (T, H, D), whole.strides, device=device)
    row = _fake(whole.ptr + H * D * 4, (T, H, D), whole.strides, device=device)
    head = _fake(whole.ptr + D * 4, (T, H, D), whole.strides, device=device)
    elem = _fake(whole.ptr + 4, (T, H, D), whole.strides, device=device)
    for shifted in (row, head, elem):
        assert _checks.overlap(v, shifted) == "partial"
        assert _checks.overlap(shifted, v) == "partial"


def test_shifted_views_of_real_tensors_are_partial():
    buf = torch.randn(9, 4, 8)
    assert _checks.overlap(_t(buf[:8]), _t(buf[1:])) == "partial"
    heads = torch.randn(8, 5, 8)
    assert _checks.overlap(_t(heads[:, :4]), _t(heads[:, 1:])) == "partial"
    arr = np.zeros((9, 4, 8), np.float16)
    assert _checks.overlap(_t(arr[:8]), _t(arr[1:])) == "partial"


def test_interleaved_halves_of_one_buffer_do_not_overlap():
    T, H, D = 33, 4, 16
    kv = torch.randn(T, 2, H, D)  # K and V of each token side by side
    k, v = _t(kv[:, 0]), _t(kv[:, 1])
    assert _checks.extent(k.ptr, k.shape, k.strides, 4)[1] > v.ptr  # their byte ranges do intersect
    assert _checks.overlap(k, v) == "none"
    # the same on device-like addresses, and for even/odd heads and interleaved LSE columns
    a = _fake(GPU_PTR, (T, H, D), (2 * H * D, D, 1), "bfloat16")
    b = _fake(GPU_PTR + H * D * 2, (T, H, D), (2 * H * D, D, 1), "bfloat16")
    assert _checks.overlap(a, b) == "none"
    even, odd = _fake(GPU_PTR, (T, H), (2 * H, 2)), _fake(GPU_PTR + 4, (T, H), (2 * H, 2))
    assert _checks.overlap(even, odd) == "none"
    lse = torch.randn(T, 2 * H)
    assert _checks.overlap(_t(lse[:, :H]), _t(lse[:, H:])) == "none"
    assert _checks.overlap(_t(lse[:, : H + 1]), _t(lse[:, H:])) == "partial"


def test_transposed_lse_views_overlap():
    T, H = 12, 4
    ht = torch.randn(H, T)  # vLLM's [H, T] buffer
    th = torch.randn(T, H)
    assert _checks.overlap(_t(ht.T), _t(ht.T)) == "alias"
    # the same buffer read [T, H] one way and [H, T]-transposed the other: same bytes, other order
    same_bytes = _t(ht.view(T, H))
    assert same_bytes.ptr == _t(ht.T).ptr
    assert _checks.overlap(same_bytes, _t(ht.T)) == "partial"
    assert _checks.overlap(_t(th), _t(th.T.contiguous().T)) == "none"
    square = torch.randn(H, H)
    assert _checks.overlap(_t(square), _t(square.T)) == "partial"  # same pointer, shape; other strides


def test_out_and_out_lse_sharing_bytes():
    T, H, D = 8, 2, 4
    buf = torch.empty(T * H * D + T * H)
    out = buf[: T * H * D].view(T, H, D)
    disjoint_lse = buf[T * H * D :].view(T, H)
    inside_lse = buf[5 : 5 + T * H].view(T, H)
    assert _checks.overlap(_t(out), _t(disjoint_lse)) == "none"
    assert _checks.overlap(_t(out), _t(inside_lse)) == "partial"
    # another dtype over the same bytes is never an alias
    as_int = buf[: T * H].view(torch.int32).view(T, H)
    assert _checks.overlap(_t(buf[: T * H].view(T, H)), _t(as_int)) == "partial"


def test_negative_strides():
    a = np.arange(20, dtype=np.float32)
    assert _checks.overlap(_t(a[::-1]), _t(a)) == "partial"
    assert _checks.overlap(_t(a[9::-1]), _t(a[10:])) == "none"  # the reversed first half
    assert _checks.overlap(_t(a[::-2]), _t(a[::2])) == "none"  # odd positions vs even ones
    assert _checks.overlap(_t(a[::-2]), _t(a[1::2])) == "partial"
    rows = np.zeros((6, 3), np.float32)
    assert _checks.overlap(_t(rows[::-1][:3]), _t(rows[:3])) == "none"
    assert _checks.overlap(_t(rows[::-1][:4]), _t(rows[:3])) == "partial"


def test_zero_size_overlaps_nothing():
    a = torch.randn(4, 3)
    assert _checks.overlap(_t(a[:0]), _t(a)) == "none"
    assert _checks.overlap(_t(a), _t(a[:, :0])) == "none"
    assert _checks.overlap(_t(a[:0]), _t(a[:0])) == "none"


def test_other_devices_and_host_do_not_overlap():
    a = _fake(GPU_PTR, (4, 4), (4, 1), device=0)
    assert _checks.overlap(a, a._replace(device=1)) == "none"
    assert _checks.overlap(a, a._replace(device=-1)) == "none"


def test_an_undecidable_overlap_counts_as_overlap(monkeypatch):
    monkeypatch.setattr(_checks, "_OVERLAP_WORK", 0)
    a = _fake(GPU_PTR, (64, 64), (130, 2))
    b = _fake(GPU_PTR + 4, (64, 64), (130, 2))
    assert _checks.overlap(a, b) == "partial"


@pytest.mark.parametrize("seed", range(40))
def test_overlap_agrees_with_an_exhaustive_count(seed):
    """Random strided views of one small buffer: partial exactly when some byte is shared."""
    rng = np.random.default_rng(seed)
    buf = np.zeros(256, np.uint8)

    def random_view():
        size = int(rng.choice([1, 2, 4]))
        n = [int(x) for x in rng.integers(1, 5, 2)]
        s = [int(x) * int(rng.choice([-1, 1])) for x in rng.integers(1, 9, 2)]
        lo = sum(min(0, (k - 1) * st) for k, st in zip(n, s, strict=True)) * size
        hi = (sum(max(0, (k - 1) * st) for k, st in zip(n, s, strict=True)) + 1) * size
        start = int(rng.integers(-lo, 256 - hi + 1))
        return _fake(buf.ctypes.data + start, n, s, {1: "uint8", 2: "float16", 4: "float32"}[size], -1)

    def bytes_of(t):
        size = _checks.itemsize(t.dtype)
        i, j = np.meshgrid(range(t.shape[0]), range(t.shape[1]), indexing="ij")
        first = t.ptr + (i * t.strides[0] + j * t.strides[1]) * size
        return set((first[..., None] + np.arange(size)).ravel().tolist())

    a, b = random_view(), random_view()
    shared = bool(bytes_of(a) & bytes_of(b))
    kind = _checks.overlap(a, b)
    assert (kind != "none") == shared, (kind, shared)
    if shared:  # "alias" only for the same view (pointer, shape, strides, dtype)
        same = (a.ptr, a.shape, a.strides, a.dtype) == (b.ptr, b.shape, b.strides, b.dtype)
        assert kind == ("alias" if same else "partial"), (kind, a, b)


# --- check_outputs ------------------------------------------------------------------------------


def _merge_tensors(T=8, H=2, D=4):
    v_a, v_b = torch.randn(T, H, D), torch.randn(T, H, D)
    s_a, s_b = torch.randn(T, H), torch.randn(T, H)
    return v_a, s_a, v_b, s_b


_MAY = {("out", "v_a"), ("out", "v_b"), ("out_lse", "s_a"), ("out_lse", "s_b")}


def _check(out, out_lse, v_a, s_a, v_b, s_b, may_alias=_MAY, names=None):
    ins = {"v_a": _t(v_a), "s_a": _t(s_a), "v_b": _t(v_b), "s_b": _t(s_b)}
    outs = {"out": _t(out), "out_lse": None if out_lse is None else _t(out_lse)}
    _checks.check_outputs(outs, ins, may_alias=may_alias, names=names)


def test_in_place_exact_aliases_are_allowed():
    v_a, s_a, v_b, s_b = _merge_tensors()
    _check(v_a, s_a, v_a, s_a, v_b, s_b)
    _check(v_b, s_b, v_a, s_a, v_b, s_b)
    _check(v_a, s_b, v_a, s_a, v_b, s_b)
    _check(torch.empty_like(v_a), None, v_a, s_a, v_b, s_b)


def test_an_alias_outside_may_alias_is_refused():
    v_a, s_a, v_b, s_b = _merge_tensors()
    with pytest.raises(ValueError, match="out is the same memory as the input v_a"):
        _check(v_a, None, v_a, s_a, v_b, s_b, may_alias=())


@pytest.mark.parametrize("shift", ["row", "head"])
def test_out_shifted_against_an_input_names_both(shift):
    T, H, D = 8, 2, 4
    big = torch.randn(T + 1, H + 1, D)
    v_a = big[:T, :H]
    out = big[1:, :H] if shift == "row" else big[:T, 1:]
    _, s_a, v_b, s_b = _merge_tensors(T, H, D)
    with pytest.raises(ValueError, match=r"out overlaps the input v_a"):
        _check(out, None, v_a, s_a, v_b, s_b)


def test_out_lse_overlapping_s_a_and_out_over_an_lse():
    T, H, D = 8, 2, 4
    v_a, _, v_b, s_b = _merge_tensors(T, H, D)
    lse_buf = torch.randn(T + 1, H)
    s_a, out_lse = lse_buf[:T], lse_buf[1:]
    with pytest.raises(ValueError, match="out_lse overlaps the input s_a"):
        _check(torch.empty_like(v_a), out_lse, v_a, s_a, v_b, s_b)
    # an fp32 out laid over the s_b buffer
    buf = torch.randn(T * H * D)
    s_b = buf[: T * H].view(T, H)
    with pytest.raises(ValueError, match="out overlaps the input s_b"):
        _check(buf.view(T, H, D), None, v_a, torch.randn(T, H), v_b, s_b)


def test_transposed_out_lse_over_s_a_is_not_an_alias():
    T, H, D = 6, 6, 4
    v_a, s_a, v_b, s_b = _merge_tensors(T, H, D)
    with pytest.raises(ValueError, match="out_lse overlaps the input s_a"):
        _check(torch.empty_like(v_a), s_a.T, v_a, s_a, v_b, s_b)


def test_out_and_out_lse_sharing_bytes_are_refused():
    T, H, D = 8, 2, 4
    v_a, s_a, v_b, s_b = _merge_tensors(T, H, D)
    buf = torch.empty(T * H * D)
    with pytest.raises(ValueError, match="out and out_lse share memory"):
        _check(buf.view(T, H, D), buf[-T * H :].view(T, H), v_a, s_a, v_b, s_b)
    # even when both alias inputs that are allowed: v_a and s_a must not share bytes either
    with pytest.raises(ValueError, match="share memory"):
        _checks.check_outputs({"out": _t(buf.view(T, H, D)), "out_lse": _t(buf[: T * H].view(T, H))}, {})


def test_merge_states_outputs_may_not_touch_the_inputs_at_all():
    v = torch.randn(3, 8, 2, 4)
    s = torch.randn(3, 8, 2)
    ins = {"v": _t(v), "s": _t(s)}
    with pytest.raises(ValueError, match=r"out is the same memory as the input v"):
        _checks.check_outputs({"out": _t(v[0])}, {"v": _t(v[0])})
    with pytest.raises(ValueError, match=r"out overlaps the input v"):
        _checks.check_outputs({"out": _t(v[0])}, ins)
    with pytest.raises(ValueError, match=r"out_lse overlaps the input s"):
        _checks.check_outputs({"out_lse": _t(s[1])}, ins)
    _checks.check_outputs({"out": _t(torch.empty(8, 2, 4)), "out_lse": _t(torch.empty(8, 2))}, ins)


def test_messages_use_the_callers_names():
    v_a, s_a, v_b, s_b = _merge_tensors()
    names = {"out": "output", "v_a": "prefix_output"}
    with pytest.raises(ValueError, match="output is the same memory as the input prefix_output"):
        _check(v_a, None, v_a, s_a, v_b, s_b, may_alias=(), names=names)


def test_zero_size_outputs_overlap_nothing():
    v_a, s_a, v_b, s_b = _merge_tensors()
    _check(v_a[:0], s_a[:0], v_a[:0], s_a[:0], v_b[:0], s_b[:0], may_alias=())


# --- writable -----------------------------------------------------------------------------------


def test_writable_accepts_ordinary_outputs():
    for x in (torch.empty(4, 3), np.empty((4, 3)), torch.empty(4, 3)[:, :2], np.empty((4, 3))[::-1]):
        _checks.writable(_t(x), "out")
    _checks.writable(_t(torch.empty(1, 3).expand(1, 3)), "out")  # stride 0 over one element
    _checks.writable(_t(torch.empty(0, 3).expand(0, 3)), "out")


def test_read_only_numpy_is_refused():
    a = np.zeros((4, 3), np.float32)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="out_lse: the numpy array is read-only"):
        _checks.writable(_t(a), "out_lse")
    with pytest.raises(ValueError, match="out: the numpy array is read-only"):
        _checks.writable(_t(np.broadcast_to(np.zeros(3, np.float32), (4, 3))), "out")


def test_requires_grad_is_refused():
    x = torch.zeros(4, 3, requires_grad=True)
    with pytest.raises(ValueError, match="lse: requires grad"):
        _checks.writable(_t(x), "lse")
    with pytest.raises(ValueError, match="out: requires grad"):
        _checks.writable(_t(x[1:]), "out")  # a view of a leaf that requires grad


def test_inference_tensors_only_inside_inference_mode():
    with torch.inference_mode():
        x = torch.zeros(4, 3)
        _checks.writable(_t(x), "out")
    with pytest.raises(ValueError, match="out: is an inference tensor"):
        _checks.writable(_t(x), "out")


def test_expanded_outputs_are_refused():
    with pytest.raises(ValueError, match="out_lse: dimension 0 has stride 0 over 5 elements"):
        _checks.writable(_t(torch.zeros(1, 3).expand(5, 3)), "out_lse")
    with pytest.raises(ValueError, match="out: dimension 1 has stride 0"):
        _checks.writable(_t(torch.zeros(4, 1, 8).expand(4, 2, 8)), "out")
    overlapping_rows = torch.zeros(16).as_strided((4, 4), (2, 1))
    with pytest.raises(ValueError, match="share addresses"):
        _checks.writable(_t(overlapping_rows), "out")
    _checks.writable(_t(torch.zeros(16).as_strided((4, 2), (1, 4))), "out")  # column-major: fine


# --- small checks kept from before -------------------------------------------------------------


_LSE_BASE = next(x for x in spec.MERGE_STATE.scalars if x.name == "lse_base")


@pytest.mark.parametrize("value, expected", [("e", "e"), (2, "2"), (2.0, "2"), (np.float32(2), "2")])
def test_lse_base_accepts(value, expected):
    assert validation.scalar(_LSE_BASE, value, "lse_base", {}) == expected


@pytest.mark.parametrize("value", [10, "ten", None, True, 2.5, "log2", "E", "2"])
def test_lse_base_refuses(value):
    with pytest.raises(ValueError, match="lse_base"):
        validation.scalar(_LSE_BASE, value, "lse_base", {})


def test_out_scale_names_the_callers_argument():
    g = torch.Generator().manual_seed(5)
    v_a, v_b, s_a, s_b = (torch.randn(shape, generator=g) for shape in ((3, 2, 8), (3, 2, 8), (3, 2), (3, 2)))
    names = {"out_scale": "output_scale"}
    out = torch.full((3, 2, 8), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="output_scale: only meaningful with a float8_e4m3fn output"):
        merge.merge_two(v_a, s_a, v_b, s_b, out, out_scale=torch.ones(1), names=names)
    assert out.isnan().all()
    with pytest.raises(ValueError, match="output_scale: required"):
        merge.merge_two(v_a, s_a, v_b, s_b, torch.zeros(3, 2, 8).to(torch.float8_e4m3fn), names=names)
