"""merge_state's options on the tuned forms: each option alone takes the flat family with its
feature compiled in (kernels_cu/merge_rows.cuh, FEAT), on every size class (heads, small, flat,
gathered, tiled, unaligned, 64-bit), against the float64 reference. Empty inputs hold NaN/Inf
garbage that must never reach the output; outputs start as NaN. Per-group fp8: bit for bit
against the reference's rule where the merge is exact. The form table's choices are checked
without a GPU; on the CPU path, each option against the oracles (``oracles.py``)."""

from __future__ import annotations

import numpy as np
import oracles
import pytest
import torch
from batches import LYING_CASES
from conftest import assert_close, f64
from states import make_states

import zerokv
from zerokv import merge, reference
from zerokv.core import forms
from zerokv.core import kernels as _kernels
from zerokv.core import plans as _plans

NAN, INF = float("nan"), float("inf")
FP8 = torch.float8_e4m3fn
DEV = forms.Device(sms=132, l2=50 << 20)

# --- the form table (no GPU) --------------------------------------------------------------------


def _call(T, H=8, D=128, vec=8, dtype="bfloat16", out="bfloat16", features=(), **kw):
    facts = {"inplace_lse": False, "fits32": True, "strides32": True, "lse_tiles": False} | kw
    return forms.MergeCall(T, H, D, vec, dtype, out, frozenset(features), **facts)


def _pick(c, ctypes=("zk_bfloat16", "zk_bfloat16")):
    f = forms.merge_two(c, DEV, ctypes)
    return f.kernel.name, f.targs, f


# T at H = 8, D = 128 bf16 (16 packs of 16 bytes a row) for each size class of the flat family
SIZE_CLASSES = {
    "heads": (4, "merge_state_heads_kernel"),
    "small": (300, "merge_state_flat_kernel"),
    "flat": (2500, "merge_state_flat_kernel"),
    "gathered": (4200, "merge_state_flat_gathered_kernel"),
}
ONE_OPTION = {
    "a_empty": _kernels.F_A_EMPTY,
    "sinks": _kernels.F_SINKS,
    "row_mask": _kernels.F_ROW_MASK,
}


@pytest.mark.parametrize("size", SIZE_CLASSES)
@pytest.mark.parametrize("feature", ONE_OPTION)
def test_one_option_takes_the_flat_family_with_its_feature(size, feature):
    T, kernel = SIZE_CLASSES[size]
    name, targs, _ = _pick(_call(T, features=(feature,)))
    assert name == kernel and targs[-1] == ONE_OPTION[feature]
    assert targs in _kernels.KERNELS[[k.name for k in _kernels.KERNELS].index(name)].instances
    if name == "merge_state_flat_kernel":
        assert targs[3] == 1  # with options, no thread returns early: SMALL = 1 stands for both


def test_a_empty_offsets_width_and_the_tiled_and_64_bit_forms():
    name, targs, _ = _pick(_call(4200, features=("a_empty",), a64=True, lse_tiles=True))
    assert name == "merge_state_flat_gathered_kernel"
    assert targs == (
        "zk_bfloat16",
        "zk_bfloat16",
        8,
        1,
        _kernels.F_A_EMPTY | _kernels.F_A64 | _kernels.F_A_RUN,
    )
    name, targs, _ = _pick(_call(4200, features=("a_empty",), a64=True))  # int64: runs on every grid
    assert targs == (
        "zk_bfloat16",
        "zk_bfloat16",
        8,
        0,
        _kernels.F_A_EMPTY | _kernels.F_A64 | _kernels.F_A_RUN,
    )
    name, targs, _ = _pick(_call(4200, features=("a_empty",)))  # int32 [T, H] below the runs' threshold
    assert targs == ("zk_bfloat16", "zk_bfloat16", 8, 0, _kernels.F_A_EMPTY)
    name, targs, _ = _pick(_call(64, features=("sinks",), fits32=False))
    assert (name, targs[-1]) == ("merge_state_flat64_gathered_kernel", _kernels.F_SINKS)
    name, targs, _ = _pick(_call(64, vec=1, features=("row_mask",)))
    assert (name, targs) == (
        "merge_state_flat_kernel",
        ("zk_bfloat16", "zk_bfloat16", 1, 1, _kernels.F_ROW_MASK),
    )


@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_fp8_outputs_take_the_flat_family_and_groups_in_packs(group):
    fp8 = ("zk_bfloat16", "zk_fp8_e4m3")
    name, targs, _ = _pick(_call(4200, out="float8_e4m3fn", features=("out_scale",)), fp8)
    assert name == "merge_state_flat_gathered_kernel" and targs[-1] == _kernels.F_OUT_SCALE
    for T, vec in ((4, 4), (300, 8), (4200, 8)):  # heads: bf16 in packs of 4
        c = _call(T, out="float8_e4m3fn", features=("group_fp8",), quant_group=group)
        name, targs, f = _pick(c, fp8)
        assert targs[-1] == _kernels.group_feature(group, vec) and targs[2] == vec
        assert targs[-1] & _kernels.F_GROUP_FP8 and 1 << (targs[-1] >> _kernels.F_GROUP_SHIFT) == group // vec
        assert 1 << f.g_shr == group // vec
        assert targs in _kernels.KERNELS[[k.name for k in _kernels.KERNELS].index(name)].instances


def test_several_options_and_an_in_place_lse_leave_the_flat_family():
    assert _pick(_call(300, features=("a_empty", "sinks")))[0] == "merge_state_kernel"
    assert _pick(_call(300, features=("sinks",), inplace_lse=True))[0] == "merge_state_kernel"
    with pytest.raises(ValueError, match="out_block_scale"):
        _pick(_call(300, out="float8_e4m3fn", features=("group_fp8", "sinks"), quant_group=128))


# --- the arguments each option packs, by parameter name (no GPU) ---------------------------------


def _cpu_states(T=300, H=8, D=128, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(T)
    return (torch.randn(T, H, D, generator=g).to(dtype), torch.randn(T, H, generator=g),
            torch.randn(T, H, D, generator=g).to(dtype), torch.randn(T, H, generator=g))  # fmt: skip


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_a_empty_packs_its_offsets(recorded, index_dtype):
    va, sa, vb, sb = _cpu_states()
    cu = torch.tensor([0, 100, 200, 300], dtype=index_dtype)
    lens = torch.tensor([5, 0, 7], dtype=index_dtype)
    zerokv.merge_state(va, sa, vb, sb, out=torch.empty_like(va), a_empty=(cu, lens))
    name, targs, _, args = recorded[-1]
    assert name == "merge_state_flat_kernel" and targs[-1] & _kernels.F_A_EMPTY
    assert bool(targs[-1] & _kernels.F_A64) == (index_dtype == torch.int64)
    assert (args["a_cu"], args["a_lens"], args["a_batch"]) == (cu.data_ptr(), lens.data_ptr(), 3)
    assert args["sinks"] == args["row_mask"] == args["out_scale"] == args["bscale"] == 0


def test_sinks_row_mask_and_fp8_scale_pack_their_pointers(recorded):
    va, sa, vb, sb = _cpu_states()
    sinks, mask, scale = torch.randn(8), torch.ones(300, dtype=torch.bool), torch.ones(1)
    zerokv.merge_state(va, sa, vb, sb, out=torch.empty_like(va), sinks=sinks)
    assert recorded[-1][3]["sinks"] == sinks.data_ptr() and recorded[-1][1][-1] == _kernels.F_SINKS
    merge.merge_two(va, sa, vb, sb, torch.empty_like(va), torch.empty_like(sa), row_mask=mask)
    assert recorded[-1][3]["row_mask"] == mask.data_ptr() and recorded[-1][1][-1] == _kernels.F_ROW_MASK
    out8 = torch.empty(va.shape, dtype=FP8)
    zerokv.merge_state(va, sa, vb, sb, out=out8, out_scale=scale)
    assert recorded[-1][3]["out_scale"] == scale.data_ptr() and recorded[-1][1][-1] == _kernels.F_OUT_SCALE


@pytest.mark.parametrize(("T", "vec"), [(4, 4), (300, 8), (4200, 8)])
@pytest.mark.parametrize("fmt", ["float32", "ue8m0"])
def test_group_fp8_packs_its_scales_and_group(recorded, T, vec, fmt):
    va, sa, vb, sb = _cpu_states(T)
    out8 = torch.empty(va.shape, dtype=FP8)
    bs = torch.empty(8 * 128 // 32, T).T  # column-major
    zerokv.merge_state(va, sa, vb, sb, out=out8, out_block_scale=bs, quant_group=32, scale_format=fmt)
    name, targs, _, args = recorded[-1]
    assert targs[-1] == _kernels.group_feature(32, vec) and targs[1] == "zk_fp8_e4m3" and targs[2] == vec
    assert (args["bscale"], args["bs_st"], args["bs_sg"]) == (bs.data_ptr(), 1, T)
    assert 1 << args["g_shr"] == 32 // vec and args["ue8m0"] == (fmt == "ue8m0")
    v = torch.stack([va, vb])
    zerokv.merge_states(
        v, torch.stack([sa, sb]), out=out8, out_block_scale=bs, quant_group=32, scale_format=fmt
    )
    name2, targs2, _, args2 = recorded[-1]
    assert (name2, targs2) == (name, targs) and args2["vb"] == v.data_ptr() + v.stride(0) * 2
    assert (args2["bscale"], args2["g_shr"], args2["ue8m0"]) == (bs.data_ptr(), args["g_shr"], args["ue8m0"])


@pytest.mark.parametrize(("D", "vec", "group"), [(128, 8, 128), (64, 8, 16), (48, 1, 16)])
def test_group_fp8_of_n_states_packs_its_scales_and_whole_groups_a_row_group(recorded, D, vec, group):
    T, H = 9000, 8  # large enough that the lanes of a row would halve without groups
    v = _n_states(3, T, H, D, aligned=vec > 1)
    out8 = torch.empty(T, H, D, dtype=FP8)
    bs = torch.empty(T, H * D // group)
    zerokv.merge_states(
        v, torch.randn(3, T, H), out=out8, out_block_scale=bs, quant_group=group, scale_format="ue8m0"
    )
    name, targs, _, args = recorded[-1]
    assert name == "merge_states_kernel" and targs == ("zk_bfloat16", "zk_fp8_e4m3", vec)
    assert (args["bscale"], args["bs_st"], args["bs_sg"], args["ue8m0"]) == (
        bs.data_ptr(),
        H * D // group,
        1,
        1,
    )
    assert 1 << args["g_shr"] == group // vec and args["lanes"] >= group // vec


def test_group_fp8_of_unaligned_n_states_takes_groups_of_at_most_32_values(recorded):
    T, H, D = 5, 2, 128
    v = _n_states(3, T, H, D, aligned=False)
    out8 = torch.zeros(T, H, D, dtype=FP8)
    bs = torch.zeros(T, H * D // 64)
    with pytest.raises(ValueError, match="at most 32 values"):
        zerokv.merge_states(v, torch.randn(3, T, H), out=out8, out_block_scale=bs, quant_group=64)
    assert not recorded and bs.eq(0).all()


def _n_states(N, T, H, D, aligned=True):
    v = torch.randn(N, T, H, D).bfloat16()
    if aligned:
        return v
    u = torch.empty(v.numel() + 1, dtype=torch.bfloat16)[1:].view(v.shape)  # one element in: no vector path
    u.copy_(v)
    return u


def test_plain_calls_pack_no_option(recorded):
    va, sa, vb, sb = _cpu_states()
    zerokv.merge_state(va, sa, vb, sb, out=torch.empty_like(va))
    name, targs, _, args = recorded[-1]
    assert len(targs) == 4 and all(
        args[n] == 0 for n in ("a_cu", "a_lens", "a_batch", "sinks", "bscale", "g_shr")
    )


# --- on a GPU: every option on every size class -------------------------------------------------

CLASSES = {  # name: (T, H, D, LSE layout, kernel expected)
    "heads": (4, 8, 128, "TH", "merge_state_heads_kernel"),
    "small": (300, 8, 128, "TH", "merge_state_flat_kernel"),
    "flat": (2500, 8, 128, "TH", "merge_state_flat_kernel"),
    "gathered": (4200, 8, 128, "TH", "merge_state_flat_gathered_kernel"),
    "tiled": (4200, 8, 128, "HT", "merge_state_flat_gathered_kernel"),
    "unaligned": (300, 8, 128, "odd", "merge_state_flat_kernel"),
    "wide": (2, 8, 128, "wide", "merge_state_flat64_gathered_kernel"),
}


@pytest.fixture
def launched(monkeypatch):
    """The (kernel name, template arguments) of each launcher the calls load."""
    log: list[tuple[str, tuple]] = []
    real = _plans.launcher

    def spy(kernel, targs, device):
        log.append((kernel.name, tuple(targs)))
        return real(kernel, targs, device)

    _plans.clear_cache()
    monkeypatch.setattr(_plans, "launcher", spy)
    yield log
    monkeypatch.undo()
    _plans.clear_cache()


_WIDE: dict = {}


def _v(T, H, D, dtype, layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, D, device="cuda", generator=g).to(dtype)
    if layout == "odd":  # one element into a buffer: no vector path
        buf = torch.empty(T * H * D + 1, device="cuda", dtype=dtype)
        y = buf[1:].view(T, H, D)
        y.copy_(x)
        return y
    if layout == "wide":  # token stride 2^31: 64-bit offsets (one buffer, two rows written)
        key = (dtype, seed % 2)
        if key not in _WIDE:
            _WIDE[key] = torch.empty(2**31 + 2**20, device="cuda", dtype=dtype)
        y = _WIDE[key].as_strided((T, H, D), (2**31, D, 1))
        y.copy_(x)
        return y
    return x


def _lse(T, H, layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g) * 2
    return x.T.contiguous().T if layout == "HT" else x


def _states(cls, dtype, seed=0, garbage=True):
    """v_a, s_a, v_b, s_b of a size class: some LSEs -inf or +inf, their V NaN or Inf."""
    T, H, D, layout, _ = CLASSES[cls]
    va, vb = _v(T, H, D, dtype, layout, seed), _v(T, H, D, dtype, layout, seed + 1)
    sa, sb = _lse(T, H, layout, seed + 2), _lse(T, H, layout, seed + 3)
    if garbage:
        g = torch.Generator(device="cuda").manual_seed(seed + 4)
        for s, v, bad in ((sa, va, NAN), (sb, vb, INF)):
            empty = torch.rand(T, H, device="cuda", generator=g) < 0.15
            s[empty] = torch.where(torch.rand(T, H, device="cuda", generator=g) < 0.5, -INF, INF)[empty]
            v[empty] = bad
    return va, sa, vb, sb


def _outputs(cls, dtype):
    T, H, D, layout, _ = CLASSES[cls]
    out = torch.full((T, H, D), NAN, device="cuda").to(dtype)
    lse = torch.full((T, H), NAN, device="cuda")
    return out, (lse.T.contiguous().T if layout == "HT" else lse)


def _requests(T, index_dtype, seed, batch=9):
    g = np.random.default_rng(seed)
    B = max(1, min(batch, T))
    cuts = np.sort(g.choice(np.arange(1, T), B - 1, replace=False)) if B > 1 and T > B else np.arange(1, B)
    cu = np.concatenate([[0], cuts, [T]])
    lens = g.integers(1, 50, B)
    lens[g.choice(B, max(1, B // 3), replace=False)] = 0
    return torch.tensor(cu, dtype=index_dtype, device="cuda"), torch.tensor(
        lens, dtype=index_dtype, device="cuda"
    )


def _expect_kernel(launched, cls, feature_bit, dtype=None, group=0):
    name = CLASSES[cls][4]
    if cls == "flat" and dtype == torch.float32:  # rows of twice the packs reach the gathered form's threads
        name = "merge_state_flat_gathered_kernel"

    def feat(t):  # per-group fp8: the group's size in packs of the form's width is part of FEAT
        return _kernels.group_feature(group, t[2]) if group else feature_bit

    assert any(n == name and t[-1] == feat(t) for n, t in launched), launched


@pytest.mark.gpu
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_a_empty_on_every_size_class(launched, cls, index_dtype):
    dtype = torch.bfloat16
    va, sa, vb, sb = _states(cls, dtype, seed=1)
    T = va.shape[0]
    cu, lens = _requests(T, index_dtype, seed=T)
    rows = reference.rows_with_empty_a(f64(cu).astype(np.int64), f64(lens).astype(np.int64), T)
    va[torch.from_numpy(rows).cuda()] = NAN  # the attention wrote nothing there: garbage, finite LSE
    out, lse = _outputs(cls, dtype)
    zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse, a_empty=(cu, lens))
    ro, rl = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb), a_empty_rows=rows)
    assert_close(out, ro, dtype, "out")
    assert_close(lse, rl, torch.float32, "lse")
    bit = _kernels.F_A_EMPTY | (_kernels.F_A64 if index_dtype == torch.int64 else 0)
    runs = cls == "tiled" or (cls == "gathered" and index_dtype == torch.int64)  # [H, T] or int64: the runs
    _expect_kernel(launched, cls, bit | (_kernels.F_A_RUN if runs else 0))


BIG_T = 33000  # x 8 heads x 16 packs of bf16: past 2^22 threads, the gathered form in runs of spans


def _one_pass_t():
    """T (8 heads x 16 packs of bf16) below the runs' threshold on this GPU, past 2^19 threads:
    the gathered a_empty form in one span a block, its search shared by the block."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    T = forms.THRESHOLDS["a_empty_runs_spans_per_sm"] * sms * 512 // 128 - 8
    assert 4096 < T < BIG_T
    return T


_LIES = {c.id: c for c in LYING_CASES}
LYING_AT_SCALE = ("past_T", "negative_first", "decreasing", "decreasing_overlap", "uncovered_rows",
                  "above_2^31", "huge_negative")  # fmt: skip


def _scaled(case, T=BIG_T):
    """A lying case's offsets at T (small values scaled by T / case.T, extreme ones kept), as
    tensors of its narrowest index dtype."""
    k = T // case.T
    cu = [c * k if abs(c) <= 2**20 else c for c in case.cu]
    dtype = case.index_dtypes[0]
    return torch.tensor(cu, dtype=dtype, device="cuda"), torch.tensor(case.kv, dtype=dtype, device="cuda")


# batches of a_empty's search (merge_flat_rows.cuh): (batch, index dtype). Up to 64 requests: the warp's
# window (masks of two entries a lane); past 64: the binary search, in the runs' blocks over a
# shared copy of the offsets where it fits (65 to 250 requests with int32 offsets, to 125 with
# int64), else over global memory.
_BATCHES = {
    "9 requests": (9, torch.int32),
    "32 requests": (32, torch.int64),
    "33 requests": (33, torch.int32),
    "64 requests": (64, torch.int32),
    "65 requests": (65, torch.int64),
    "120 requests": (120, torch.int64),
    "250 requests": (250, torch.int32),
    "400 requests": (400, torch.int64),
    "700 requests": (700, torch.int32),
}


def _scrambled(T, batch, index_dtype, seed):
    """Offsets that lie at every depth of the search: not monotone, some past T or negative."""
    g = np.random.default_rng(seed)
    cu = g.integers(-T // 4, T + T // 4, batch + 1)
    lens = g.integers(0, 3, batch)
    return torch.tensor(cu, dtype=index_dtype, device="cuda"), torch.tensor(
        lens, dtype=index_dtype, device="cuda"
    )


def _short_requests(T, index_dtype, seed):
    """63 requests of 1-3 tokens (every other one empty), then one request of the rest: many
    requests inside one warp's run of tokens, within the window's 64."""
    g = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(g.integers(1, 4, 63)), [T]])
    lens = np.array([0, 7] * 32)
    return torch.tensor(cu, dtype=index_dtype, device="cuda"), torch.tensor(
        lens, dtype=index_dtype, device="cuda"
    )


def _search_offsets(name, T, seed):
    """``"<n> requests"`` (valid, a third of them empty), ``"scrambled <n> requests"`` or
    ``"short requests"`` / ``"short requests int64"``."""
    if name.startswith("short requests"):
        return _short_requests(T, torch.int64 if name.endswith("int64") else torch.int32, seed)
    if name.startswith("scrambled "):
        batch, index_dtype = _BATCHES[name.removeprefix("scrambled ")]
        return _scrambled(T, batch, index_dtype, seed + 1)
    return _requests(T, _BATCHES[name][1], seed, _BATCHES[name][0])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["TH", "HT"])
@pytest.mark.parametrize("offsets", ["9 requests", "400 requests", "scrambled 700 requests"])
def test_a_empty_runs_one_row_a_thread(launched, layout, offsets):
    """Rows of one pack (H = 1, D = 8 bf16) past the runs' threshold: a long block's rows are
    2048 tokens, the most its shared search holds (tiles of 8 round the range out with an [H, T]
    LSE); the window (9 requests) and the plain search, valid and scrambled offsets."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    T = forms.THRESHOLDS["a_empty_runs_spans_per_sm"] * sms * 512 + 1003
    cu, lens = _search_offsets(offsets, T, 21)
    _check_a_empty(T, 1, 8, torch.bfloat16, layout, cu, lens, 23, not offsets.startswith("scrambled"))
    bit = _kernels.F_A_EMPTY | _kernels.F_A_RUN | (_kernels.F_A64 if cu.dtype == torch.int64 else 0)
    assert any(n == "merge_state_flat_gathered_kernel" and t[-1] == bit for n, t in launched), launched


def _check_a_empty(T, H, D, dtype, layout, cu, lens, seed, some_empty):
    """merge_state(a_empty=(cu, lens)) into NaN outputs, state a NaN on the rows the binary
    search makes empty, against the float64 reference with those rows."""
    va, vb = _v(T, H, D, dtype, layout, seed), _v(T, H, D, dtype, layout, seed + 1)
    sa, sb = _lse(T, H, layout, seed + 2), _lse(T, H, layout, seed + 3)
    rows = reference.rows_with_empty_a(f64(cu).astype(np.int64), f64(lens).astype(np.int64), T)
    assert not some_empty or 0 < rows.sum() < T
    va[torch.from_numpy(rows).cuda()] = NAN  # garbage where state a is empty
    out, lse = torch.full((T, H, D), NAN, device="cuda").to(dtype), torch.full((T, H), NAN, device="cuda")
    lse = lse.T.contiguous().T if layout == "HT" else lse
    zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse, a_empty=(cu, lens))
    ro, rl = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb), a_empty_rows=rows)
    assert_close(out, ro, dtype, "out")
    assert_close(lse, rl, torch.float32, "lse")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("layout", "offsets"),
    [
        *(("TH", c) for c in _BATCHES),
        ("HT", "9 requests"),
        ("HT", "64 requests"),
        ("HT", "250 requests"),
        ("HT", "400 requests"),
        ("TH", "short requests"),
        ("TH", "short requests int64"),
        ("HT", "short requests"),
        *(("TH", c) for c in LYING_AT_SCALE),
        *(("TH", f"scrambled {c}") for c in _BATCHES),
    ],
)
@pytest.mark.parametrize("form", ["runs", "one pass"])
def test_a_empty_search_on_many_rows(launched, layout, offsets, form):
    """The gathered form's a_empty in runs of spans (the block's tokens searched once into shared
    memory before the loads, v_a of rows known empty not loaded) and, below the runs' threshold
    with an LSE laid [T, H], int32 offsets and at most 64 requests, in one span a block (the
    search shared by the block), each by the window or the plain search, against the binary
    search's rows, valid offsets and offsets that lie (out of order: the
    window gives way to the plain search)."""
    T = BIG_T if form == "runs" else _one_pass_t()
    if offsets in _BATCHES or offsets.startswith(("scrambled ", "short ")):
        cu, lens = _search_offsets(offsets, T, 15)
    else:
        cu, lens = _scaled(_LIES[offsets], T)
    valid = offsets in _BATCHES or offsets.startswith("short ")
    _check_a_empty(T, 8, 128, torch.bfloat16, layout, cu, lens, 11, valid)
    bit = _kernels.F_A_EMPTY | (_kernels.F_A64 if cu.dtype == torch.int64 else 0)
    # [H, T], int64 offsets or more requests than the window: runs on every grid
    runs = form == "runs" or layout == "HT" or cu.dtype == torch.int64 or lens.numel() > _kernels.A_WINDOW
    bit |= _kernels.F_A_RUN if runs else 0
    assert any(n == "merge_state_flat_gathered_kernel" and t[-1] == bit for n, t in launched), launched


@pytest.mark.gpu
@pytest.mark.parametrize(
    "offsets", ["9 requests", "64 requests", "400 requests", "short requests", "scrambled 33 requests"]
)
@pytest.mark.parametrize("T", [4097, 4200])  # 8 heads x 16 packs: 1025 and 1050 spans
def test_a_empty_runs_of_one_span_with_tiles(launched, offsets, T):
    """An LSE laid [H, T] takes the runs on the smallest gathered grids too, where every block
    holds one span (fewer spans than the tail's blocks on this GPU): empty rows' NaN v_a never
    reaches the output, lying offsets included."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    assert forms.THRESHOLDS["a_empty_run_tail_per_sm"] * sms > -(-T * 128 // 512)
    cu, lens = _search_offsets(offsets, T, 21)
    _check_a_empty(T, 8, 128, torch.bfloat16, "HT", cu, lens, 23, not offsets.startswith("scrambled"))
    bit = _kernels.F_A_EMPTY | _kernels.F_A_RUN | (_kernels.F_A64 if cu.dtype == torch.int64 else 0)
    assert any(n == "merge_state_flat_gathered_kernel" and t[-1] == bit for n, t in launched), launched


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["TH", "HT"])
@pytest.mark.parametrize("prefix", [0, 1, 20000, BIG_T - 3])
def test_a_empty_in_runs_with_prefix_rows(launched, layout, prefix):
    """Runs of spans skip v_a past prefix_rows too (state b alone there, by the empty rule): NaN
    in v_a on those rows and on the empty requests' never reaches the output."""
    T, H, D = BIG_T, 8, 128
    cu, lens = _search_offsets("64 requests", T, 31)
    va, vb = _v(T, H, D, torch.bfloat16, layout, 32), _v(T, H, D, torch.bfloat16, layout, 33)
    sa, sb = _lse(T, H, layout, 34), _lse(T, H, layout, 35)
    rows = reference.rows_with_empty_a(f64(cu).astype(np.int64), f64(lens).astype(np.int64), T)
    unused = rows | (np.arange(T) >= prefix)
    va[torch.from_numpy(unused).cuda()] = NAN
    out, lse = (
        torch.full((T, H, D), NAN, device="cuda").to(torch.bfloat16),
        torch.full((T, H), NAN, device="cuda"),
    )
    lse = lse.T.contiguous().T if layout == "HT" else lse
    zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse, a_empty=(cu, lens), prefix_rows=prefix)
    ro, rl = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb), prefix_rows=prefix, a_empty_rows=rows)
    assert_close(out, ro, torch.bfloat16, "out")
    assert_close(lse, rl, torch.float32, "lse")
    assert any(t[-1] == _kernels.F_A_EMPTY | _kernels.F_A_RUN for _, t in launched), launched


@pytest.mark.gpu
@pytest.mark.parametrize(
    "H, D, dtype", [(1, 32, torch.bfloat16), (3, 16, torch.float32), (2, 8, torch.float16)]
)
@pytest.mark.parametrize("offsets", ["33 requests", "64 requests", "scrambled 64 requests", "400 requests"])
def test_a_empty_search_with_several_tokens_a_warp(H, D, dtype, offsets):
    """A warp's lanes on up to 32 tokens (few heads, short rows) in each warp's own search: the
    window's lanes count the requests that start between the warp's tokens one by one."""
    T = 20000
    cu, lens = _search_offsets(offsets, T, 25)
    _check_a_empty(T, H, D, dtype, "TH", cu, lens, 21, True)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sinks_on_every_size_class(launched, cls, dtype):
    if cls == "wide" and dtype == torch.float32:
        pytest.skip("one 64-bit case per dtype family is enough memory")
    va, sa, vb, sb = _states(cls, dtype, seed=2)
    H = va.shape[1]
    sinks = torch.randn(H, device="cuda")
    sinks[0] = -INF
    out, lse = _outputs(cls, dtype)
    zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse, sinks=sinks)
    ro, rl = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb), sinks=f64(sinks))
    assert_close(out, ro, dtype, "out")
    assert_close(lse, rl, torch.float32, "lse")
    _expect_kernel(launched, cls, _kernels.F_SINKS, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", CLASSES)
def test_row_mask_on_every_size_class(launched, cls):
    dtype = torch.bfloat16
    va, sa, vb, sb = _states(cls, dtype, seed=3)
    T = va.shape[0]
    mask = torch.rand(T, device="cuda") < 0.6
    mask[0] = True
    out, lse = _outputs(cls, dtype)
    merge.merge_two(va, sa, vb, sb, out, lse, row_mask=mask)
    ro, rl = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb))
    m = mask.cpu().numpy()
    assert_close(out[mask], ro[m], dtype, "out")
    assert_close(lse[mask], rl[m], torch.float32, "lse")
    assert out[~mask].float().isnan().all() and lse[~mask].isnan().all()  # rows left alone
    _expect_kernel(launched, cls, _kernels.F_ROW_MASK)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", CLASSES)
def test_suffix_verbatim_on_every_size_class(launched, cls):
    dtype = torch.bfloat16
    va, sa, vb, sb = _states(cls, dtype, seed=4)
    T = va.shape[0]
    prefix = T // 2
    out, lse = _outputs(cls, dtype)
    merge.merge_two(va, sa, vb, sb, out, lse, prefix_rows=prefix, suffix_verbatim=True)
    ro, rl = reference.merge_state(
        f64(va), f64(sa), f64(vb), f64(sb), prefix_rows=prefix, suffix_verbatim=True
    )
    assert_close(out, ro, dtype, "out")
    assert_close(lse, rl, torch.float32, "lse")
    assert any(n == CLASSES[cls][4] for n, _ in launched), launched


@pytest.mark.gpu
@pytest.mark.parametrize("cls", CLASSES)
def test_out_scale_fp8_on_every_size_class(launched, cls):
    dtype = torch.bfloat16
    va, sa, vb, sb = _states(cls, dtype, seed=5)
    out, lse = _outputs(cls, FP8)
    scale = torch.tensor([1 / 64], device="cuda")
    zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse, out_scale=scale)
    ro, rl = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb))
    want = reference.e4m3_values(ro * 64)
    got = f64(out)
    assert (np.isnan(got) == np.isnan(want)).all()
    fin = np.isfinite(want)
    step = np.maximum(np.abs(want[fin]) / 8, 2.0**-9)  # one e4m3 step at that magnitude
    assert (np.abs(got[fin] - want[fin]) <= step).all()
    assert_close(lse, rl, torch.float32, "lse")
    _expect_kernel(launched, cls, _kernels.F_OUT_SCALE)


def _block_scale(T, G, layout):
    if layout == "rows":
        return torch.full((T, G), NAN, device="cuda")
    if layout == "cols":
        return torch.full((G, T), NAN, device="cuda").T
    return torch.full((T, G + 3), NAN, device="cuda")[:, :G]  # padded rows (TMA-aligned)


def _exact_states(cls, dtype, seed):
    """States whose merge is exact in float32 (equal LSEs: weights 1/2 each; or one side empty:
    weight 1), so that the per-group quantisation is compared bit for bit. One row all empty."""
    T, H, D, layout, _ = CLASSES[cls]
    va, vb = _v(T, H, D, dtype, layout, seed), _v(T, H, D, dtype, layout, seed + 1)
    sa = _lse(T, H, layout, seed + 2)
    sb = sa.clone()  # the same strides
    sa[::3] = -INF
    va[::3] = NAN
    sa[T - 1, 0], sb[T - 1, 0] = -INF, INF  # an empty row: zeros and the smallest scale
    vb[T - 1, 0] = INF
    return va, sa, vb, sb


@pytest.mark.gpu
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("group", "fmt"), [(16, "float32"), (32, "ue8m0"), (64, "float32"), (128, "float32"), (128, "ue8m0")]
)
def test_group_fp8_bit_for_bit_on_every_size_class(launched, cls, group, fmt):
    dtype = torch.bfloat16
    va, sa, vb, sb = _exact_states(cls, dtype, seed=6)
    T, H, D = va.shape
    ro, rl = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb))
    values, scales = reference.fp8_group_scales(ro, group, fmt == "ue8m0")
    want = torch.from_numpy(values).float().to(FP8).view(torch.uint8)
    want_s = torch.from_numpy(scales).float().view(torch.int32)
    smallest = reference.fp8_group_scales(np.zeros((1, 1, group)), group, fmt == "ue8m0")[1][0, 0]
    assert scales[T - 1, 0] == smallest and not values[T - 1, 0].any()  # the empty row
    for layout in ("rows", "cols", "padded"):
        out, lse = _outputs(cls, FP8)
        bs = _block_scale(T, H * D // group, layout)
        zerokv.merge_state(
            va, sa, vb, sb, out=out, out_lse=lse, out_block_scale=bs, quant_group=group, scale_format=fmt
        )
        assert torch.equal(out.cpu().view(torch.uint8), want), layout
        assert torch.equal(bs.cpu().contiguous().view(torch.int32), want_s), layout
        assert_close(lse, rl, torch.float32, "lse")
    _expect_kernel(launched, cls, _kernels.F_GROUP_FP8, group=group)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("cls", ["heads", "small", "gathered", "unaligned"])
def test_group_fp8_bit_for_bit_for_other_input_dtypes(cls, dtype):
    va, sa, vb, sb = _exact_states(cls, dtype, seed=7)
    T, H, D = va.shape
    for group, fmt in ((16, "float32"), (128, "ue8m0"), (64, "float32")):
        out, lse = _outputs(cls, FP8)
        bs = _block_scale(T, H * D // group, "rows")
        zerokv.merge_state(
            va, sa, vb, sb, out=out, out_lse=lse, out_block_scale=bs, quant_group=group, scale_format=fmt
        )
        ro, _ = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb))
        values, scales = reference.fp8_group_scales(ro, group, fmt == "ue8m0")
        assert torch.equal(
            out.cpu().view(torch.uint8), torch.from_numpy(values).float().to(FP8).view(torch.uint8)
        )
        assert torch.equal(bs.cpu(), torch.from_numpy(scales).float())


@pytest.mark.gpu
@pytest.mark.parametrize("cls", ["small", "gathered"])
def test_group_fp8_with_random_weights_within_one_step(cls):
    dtype = torch.bfloat16
    va, sa, vb, sb = _states(cls, dtype, seed=8)
    T, H, D = va.shape
    out, lse = _outputs(cls, FP8)
    bs = _block_scale(T, H * D // 128, "rows")
    zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse, out_block_scale=bs, quant_group=128)
    ro, _ = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb))
    values, scales = reference.fp8_group_scales(ro, 128)
    np.testing.assert_allclose(f64(bs), scales, rtol=1e-5)
    got = f64(out)
    assert not np.isnan(got).any()  # the garbage of empty inputs never reached the output
    assert (np.abs(got - values) <= np.maximum(np.abs(values) / 8, 2.0**-9)).all()


@pytest.mark.gpu
def test_group_fp8_through_merge_states_and_vllm():
    from zerokv.compat import vllm

    va, sa, vb, sb = _exact_states("small", torch.bfloat16, seed=9)
    T, H, D = va.shape
    ro, rl = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb))
    values, scales = reference.fp8_group_scales(ro, 64, True)
    out, _ = _outputs("small", FP8)
    bs = _block_scale(T, H * D // 64, "cols")
    zerokv.merge_states(
        torch.stack([va, vb]),
        torch.stack([sa, sb]),
        out=out,
        out_block_scale=bs,
        quant_group=64,
        scale_format="ue8m0",
    )
    assert torch.equal(
        out.cpu().view(torch.uint8), torch.from_numpy(values).float().to(FP8).view(torch.uint8)
    )
    assert torch.equal(bs.cpu(), torch.from_numpy(scales).float())
    out2, _ = _outputs("small", FP8)
    bs2 = _block_scale(T, H * D // 64, "padded")
    lse_ht = torch.full((H, T), NAN, device="cuda")
    vllm.merge_attn_states(
        out2, va, sa.T.contiguous(), vb, sb.T.contiguous(), lse_ht,
        output_block_scale=bs2, quant_group_size=64, quant_scale_ue8m0=True,
    )  # fmt: skip
    assert torch.equal(out2.view(torch.uint8), out.view(torch.uint8)) and torch.equal(bs2.cpu(), bs.cpu())
    assert_close(lse_ht.T, rl, torch.float32, "lse")


def test_vllm_rules_for_the_per_group_output():
    from zerokv.compat import vllm

    T, H, D = 3, 2, 64
    va, vb = torch.randn(T, H, D), torch.randn(T, H, D)
    sa, sb = torch.randn(H, T), torch.randn(H, T)
    out = torch.zeros(T, H, D).to(FP8)
    bs = torch.zeros(T, H * D // 32)
    with pytest.raises(ValueError, match="quant_group_size"):
        vllm.merge_attn_states(out, va, sa, vb, sb, output_block_scale=bs)
    with pytest.raises(ValueError, match="output_scale"):
        vllm.merge_attn_states(
            out, va, sa, vb, sb, output_scale=torch.ones(1), output_block_scale=bs, quant_group_size=32
        )
    with pytest.raises(ValueError, match="quant_group_size"):
        vllm.merge_attn_states(out, va, sa, vb, sb, output_block_scale=torch.zeros(T, 5), quant_group_size=48)
    assert out.view(torch.uint8).eq(0).all() and bs.eq(0).all()  # a rejected call wrote nothing
    lse = torch.full((H, T), NAN)
    vllm.merge_attn_states(out, va, sa, vb, sb, lse, output_block_scale=bs, quant_group_size=32)
    ro, rl = oracles.merge2(va, sa.T, vb, sb.T)
    values, scales = oracles.group_fp8(ro, 32)
    assert np.array_equal(f64(out), values) and np.array_equal(f64(bs), scales)
    assert_close(lse.T, rl, torch.float32, "output_lse")


# --- each option on the CPU path, against the oracles --------------------------------------------

CPU_OPTIONS = [
    "a_empty_int32", "a_empty_int64", "sinks", "sinks_base2", "prefix_rows", "vllm_verbatim",
    "vllm_lse_ht", "row_mask", "out_scale", "group_fp8", "group_fp8_ue8m0", "n_states_sinks",
]  # fmt: skip


def _cpu_option(option):
    """``(run, want)``: one CPU call with ``option`` on states with every edge (empty inputs
    of NaN garbage, +inf markers, a NaN LSE, huge gaps) into NaN-poisoned outputs, and the
    oracles' ``(out, lse)`` (``lse`` None where the call writes none)."""
    T, H, D = 40, 4, 32
    va, sa, vb, sb = make_states(T, H, D, torch.float32, seed=21)
    out, lse = torch.full((T, H, D), NAN), torch.full((T, H), NAN)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(22)) * 2
    if option.startswith("a_empty"):
        cu = torch.tensor([0, 5, 5, 17, 30, T], dtype=torch.int32 if option.endswith("32") else torch.int64)
        lens = torch.tensor([0, 3, 0, 9, 0], dtype=cu.dtype)
        want = oracles.merge2(va, sa, vb, sb, a_empty=oracles.a_empty_rows(cu, lens, T))
        return lambda: zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse, a_empty=(cu, lens)), want
    if option.startswith("sinks"):
        base = 2 if option.endswith("base2") else "e"
        want = oracles.merge2(va, sa, vb, sb, base=base, sinks=sinks)
        return lambda: zerokv.merge_state(
            va, sa, vb, sb, out=out, out_lse=lse, lse_base=base, sinks=sinks
        ), want
    if option == "prefix_rows":
        want = oracles.merge2(va, sa, vb, sb, prefix_rows=27)
        return lambda: zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse, prefix_rows=27), want
    if option.startswith("vllm"):
        from zerokv.compat import vllm

        k = 27 if option == "vllm_verbatim" else None
        want = oracles.merge2(va, sa, vb, sb, prefix_rows=k, verbatim=k is not None)
        lse_ht = torch.full((H, T), NAN)
        run = lambda: vllm.merge_attn_states(out, va, sa.T, vb, sb.T, lse_ht, k) or (out, lse_ht.T)  # noqa: E731
        return run, want
    if option == "row_mask":
        from zerokv.compat import flashinfer

        mask = torch.rand(T, generator=torch.Generator().manual_seed(23)) < 0.5
        merged = oracles.merge2(va, sa, vb, sb, base=2)
        kept = f64(va), f64(sa)
        want = tuple(
            np.where(mask.numpy().reshape(-1, *[1] * (m.ndim - 1)), m, k)
            for m, k in zip(merged, kept, strict=True)
        )
        v, s = va.clone(), sa.clone()
        return lambda: flashinfer.merge_state_in_place(v, s, vb, sb, mask=mask) or (v, s), want
    if option == "out_scale":
        scale = torch.tensor([0.05])
        merged, want_lse = oracles.merge2(va, sa, vb, sb)
        values = oracles.e4m3(np.clip(merged / 0.05, -448.0, 448.0))
        out8 = torch.full((T, H, D), NAN).to(FP8)
        run = lambda: zerokv.merge_state(va, sa, vb, sb, out=out8, out_lse=lse, out_scale=scale)  # noqa: E731
        return run, (values, want_lse)
    if option.startswith("group_fp8"):
        ue8m0 = option.endswith("ue8m0")
        merged, want_lse = oracles.merge2(va, sa, vb, sb)
        values, scales = oracles.group_fp8(merged, 16, ue8m0)
        out8, bs = torch.full((T, H, D), NAN).to(FP8), torch.full((H * D // 16, T), NAN).T
        kw = {"out_block_scale": bs, "quant_group": 16, "scale_format": "ue8m0" if ue8m0 else "float32"}

        def run():
            zerokv.merge_state(va, sa, vb, sb, out=out8, out_lse=lse, **kw)
            np.testing.assert_array_equal(f64(bs), scales, err_msg="scales")
            return out8, lse

        return run, (values, want_lse)
    v, s = torch.stack([va, vb, va.flip(0)]), torch.stack([sa, sb, sb.flip(0)])  # n_states_sinks
    return lambda: zerokv.merge_states(v, s, out=out, out_lse=lse, sinks=sinks), oracles.merge(
        v, s, sinks=sinks
    )


@pytest.mark.parametrize("option", CPU_OPTIONS)
def test_each_option_on_the_cpu_path_equals_the_oracles(option):
    run, (want_out, want_lse) = _cpu_option(option)
    got = run()
    out, lse = got if got is not None else (None, None)
    if out.dtype == FP8:  # fp8 values exactly, NaN where the merge is NaN
        assert np.array_equal(f64(out), want_out, equal_nan=True), option
    else:
        assert_close(out, want_out, torch.float32, f"{option} out")
    assert_close(lse, want_lse, torch.float32, f"{option} lse")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("D", "aligned", "group"), [(128, True, 128), (128, True, 16), (64, False, 32), (48, False, 16)]
)
@pytest.mark.parametrize("fmt", ["float32", "ue8m0"])
def test_group_fp8_of_n_states_bit_for_bit(D, aligned, group, fmt):
    """Four states, two empty (garbage V) and two of one LSE: weights 0, 0, 1/2, 1/2, an exact
    merge in float32; per-group fp8 bit for bit against the reference."""
    N, T, H = 4, 300, 6
    g = torch.Generator(device="cuda").manual_seed(D + group)
    v = torch.randn(N, T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    if not aligned:
        u = torch.empty(v.numel() + 1, device="cuda", dtype=torch.bfloat16)[1:].view(v.shape)
        u.copy_(v)
        v = u
    s = torch.randn(T, H, device="cuda", generator=g).expand(N, T, H).clone()
    s[0], s[2] = -INF, INF
    v[0], v[2] = NAN, INF
    out = torch.full((T, H, D), NAN, device="cuda").to(FP8)
    lse = torch.full((T, H), NAN, device="cuda")
    bs = _block_scale(T, H * D // group, "cols")
    zerokv.merge_states(v, s, out=out, out_lse=lse, out_block_scale=bs, quant_group=group, scale_format=fmt)
    ro, rl = reference.merge_states(f64(v), f64(s))
    values, scales = reference.fp8_group_scales(ro, group, fmt == "ue8m0")
    assert torch.equal(
        out.cpu().view(torch.uint8), torch.from_numpy(values).float().to(FP8).view(torch.uint8)
    )
    assert torch.equal(bs.cpu(), torch.from_numpy(scales).float())
    assert_close(lse, rl, torch.float32, "lse")


@pytest.mark.gpu
def test_group_fp8_of_n_states_with_sinks_within_one_step():
    N, T, H, D = 3, 500, 8, 128
    v = torch.randn(N, T, H, D, device="cuda").to(torch.bfloat16)
    s = torch.randn(N, T, H, device="cuda") * 2
    s[1, ::4] = -INF
    v[1, ::4] = NAN
    sinks = torch.randn(H, device="cuda")
    out = torch.full((T, H, D), NAN, device="cuda").to(FP8)
    bs = _block_scale(T, H * D // 128, "rows")
    zerokv.merge_states(v, s, out=out, sinks=sinks, out_block_scale=bs, quant_group=128)
    ro, _ = reference.merge_states(f64(v), f64(s), sinks=f64(sinks))
    values, scales = reference.fp8_group_scales(ro, 128)
    np.testing.assert_allclose(f64(bs), scales, rtol=1e-5)
    got = f64(out)
    assert not np.isnan(got).any()
    assert (np.abs(got - values) <= np.maximum(np.abs(values) / 8, 2.0**-9)).all()
