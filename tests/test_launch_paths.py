"""The torch fast paths launch exactly what the validating path launches (no GPU needed).

Each op has two ways to a launch: the validating path (``Call`` facts, full checks on a
signature's first call) and, for the engine's call with torch tensors, a plan's straight-line
``torch_call``. Here both run on CPU tensors with the launchers replaced by recorders (a plan
built from CPU tensors has device -1, which is all the fast path compares against), and must
record the same instantiation, grid and packed arguments, byte for byte, over many layouts.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from zerokv import empty_rows, merge
from zerokv.core import facts as _call
from zerokv.core import kernels as _kernels
from zerokv.core import plans as _plans
from zerokv.core import runtime as _runtime


class _Recorder:
    """Stands for a Launcher: records (kernel, instantiation, grid, packed arguments)."""

    def __init__(self, kernel, targs, device):
        self.kernel, self.targs = kernel, targs
        self.calls: list[tuple] = []

    def __call__(self, grid, stream, *args, grid_y=1):
        grid = grid if grid_y == 1 else (grid, grid_y)
        self.calls.append((self.kernel.name, self.targs, grid, self.kernel.packer.pack(*args)))


@pytest.fixture
def recorded(monkeypatch):
    log: list[tuple] = []

    def launcher(kernel, targs, device):
        rec = _Recorder(kernel, targs, device)
        rec.calls = log
        return rec

    monkeypatch.setattr(_plans, "launcher", launcher)
    monkeypatch.setattr(_runtime, "sm_count", lambda device: 132)
    monkeypatch.setattr(_runtime, "l2_bytes", lambda device: 50 << 20)
    monkeypatch.setattr(_runtime, "torch_stream", lambda device: 0)
    monkeypatch.setattr(_call.Call, "stream", lambda self: 0)
    return log


def _both(log, fast, slow) -> None:
    """Run the fast path, then the validating path; both must launch, identically."""
    log.clear()
    done = fast()
    assert done is not None and done is not False, "the fast path declined the call"
    first = log[-1]
    log.clear()
    slow()
    assert log, "the validating path launched nothing"
    assert log[-1] == first


def _both_two(log, objs) -> None:
    """``_both`` for merge_state: a plan built from ``objs``, its fast path, then its validating
    path on a fresh call."""
    plan = merge._MergeTwoPlan(_fresh(objs), None, None)
    _both(log, lambda: plan.torch_call(*objs, None), lambda: plan(_fresh(objs), None, None))


def _both_n(log, objs) -> None:
    """``_both`` for merge_states: a plan built from ``objs``, its fast path, then its
    validating path on a fresh call."""
    plan = merge._MergeNPlan(_first_n(objs))
    _both(log, lambda: plan.torch_call(*objs[:4]), lambda: plan(_first_n(objs)))


def _both_plans(log, T, H, D, dtype=torch.bfloat16, out_dtype=None, out_lse_ht=False) -> tuple[tuple, tuple]:
    """``(kernel, instantiation, grid)`` that merge_state and a two-state merge_states launch
    for the same aligned call (an ``[H, T]`` LSE, outputs given: out_lse ``[T, H]``, or an
    ``[H, T]`` buffer as ``.T``), each the same on both paths."""
    v_a, s_a, v_b, s_b = _states(T, H, D, dtype, True, 0)
    out = torch.empty(T, H, D, dtype=out_dtype or dtype)
    out_lse = torch.empty(H, T).T if out_lse_ht else torch.empty(T, H)
    _both_two(log, (v_a, s_a, v_b, s_b, out, out_lse))
    two = log[-1][:3]
    _both_n(log, (torch.stack([v_a, v_b]), torch.stack([s_a, s_b]), out, out_lse, None, None))
    return two, log[-1][:3]


def _unaligned_two(log, T, H, D) -> tuple:
    """``(kernel, instantiation, grid)`` of a bf16 merge_state whose v_a starts one element into
    its buffer (no vector packs), the same on both paths."""
    v_a, s_a, v_b, s_b = _states(T, H, D, torch.bfloat16, True, 0)
    odd = torch.empty(T * H * D + 1, dtype=torch.bfloat16)[1:].view(T, H, D)
    _both_two(log, (odd, s_a, v_b, s_b, torch.empty(T, H, D, dtype=torch.bfloat16), torch.empty(T, H)))
    return log[-1][:3]


def _states(T, H, D, dtype, lse_ht, pad_h):
    """Inputs in engine layouts: padded heads (``pad_h``), an [H, T] LSE buffer as ``.T``."""
    g = torch.Generator().manual_seed(T * 131 + H * 7 + D)
    v = [torch.randn(T, H + pad_h, D, generator=g).to(dtype)[:, :H] for _ in range(2)]
    if lse_ht:
        s = [torch.randn(H, T, generator=g).T for _ in range(2)]
    else:
        s = [torch.randn(T, H, generator=g) for _ in range(2)]
    return v[0], s[0], v[1], s[1]


LAYOUTS = list(
    itertools.product(
        [(1, 16, 512), (7, 8, 64), (64, 32, 128), (300, 4, 72), (2048, 2, 128)],
        [torch.bfloat16, torch.float16, torch.float32],
        [False, True],  # LSE [H, T] as .T
        [0, 3],  # padded heads
    )
)


@pytest.mark.parametrize("shape, dtype, lse_ht, pad_h", LAYOUTS)
@pytest.mark.parametrize("inplace", [False, True])
def test_merge_state_fast_path_packs_what_the_validating_path_packs(
    recorded, shape, dtype, lse_ht, pad_h, inplace
):
    T, H, D = shape
    v_a, s_a, v_b, s_b = _states(T, H, D, dtype, lse_ht, pad_h)
    out, out_lse = (v_a, s_a) if inplace else (torch.empty(T, H, D, dtype=dtype), torch.empty(T, H))
    objs = (v_a, s_a, v_b, s_b, out, out_lse)
    plan = merge._MergeTwoPlan(_fresh(objs), None, None)
    for prefix in (None, T // 2):
        _both(
            recorded,
            lambda p=prefix: plan.torch_call(*objs, p),
            lambda p=prefix: plan(_fresh(objs), p, None),
        )


def _fresh(objs):
    """The validating path's view of a merge_state call (its signature's layout facts set)."""
    call = _call.Call("merge_state", objs, ("e", True, False, False))
    call.key(merge._aligned_two(call))
    return call


@pytest.mark.parametrize("shape, dtype, lse_ht, pad_h", LAYOUTS[::3])
@pytest.mark.parametrize("N", [2, 3])  # 2: merge_state's flat kernel
def test_merge_states_fast_path_packs_what_the_validating_path_packs(
    recorded, shape, dtype, lse_ht, pad_h, N
):
    T, H, D = shape
    g = torch.Generator().manual_seed(5)
    v = torch.randn(T, N, H + pad_h, D, generator=g).to(dtype)[:, :, :H].permute(1, 0, 2, 3)
    s = torch.randn(T, N, H, generator=g).permute(1, 0, 2)
    out, out_lse = torch.empty(T, H, D, dtype=dtype), torch.empty(H, T).T if lse_ht else torch.empty(T, H)
    _both_n(recorded, (v, s, out, out_lse, None, None))
    flat = ("merge_state_heads_kernel", "merge_state_flat_kernel", "merge_state_flat_gathered_kernel")
    assert recorded[-1][0] in (flat if N == 2 else ("merge_states_kernel",))


@pytest.mark.parametrize("given_lse", [False, True])
def test_merge_states_fast_path_allocates_what_the_validating_path_allocates(recorded, given_lse):
    """Outputs allocated by the op: both paths launch the same arguments but the output
    pointers (each allocates its own), and return outputs of the same shapes and dtypes."""
    T, H, D = 37, 4, 64
    g = torch.Generator().manual_seed(9)
    v = torch.randn(3, T, H, D, generator=g).to(torch.bfloat16)
    s = torch.randn(3, T, H, generator=g)
    lse = torch.empty(T, H) if given_lse else None
    objs = (v, s, None, lse, None, None)

    def call_of():
        c = _call.Call("merge_states", objs, ("e", True))
        c.key(merge._aligned_n(c))
        return c

    plan = merge._MergeNPlan(call_of())
    recorded.clear()
    fast = plan.torch_call(v, s, None, lse)
    slow = plan(call_of())
    assert len(recorded) == 2 and recorded[0][:3] == recorded[1][:3]
    for got in (fast, slow):
        assert got[0].shape == (T, H, D) and got[0].dtype == torch.bfloat16 and got[0].is_contiguous()
        assert got[1].shape == (T, H) and got[1].dtype == torch.float32
        assert (got[1] is lse) == given_lse


@pytest.mark.parametrize("rule", [_kernels.RULE_KV_LENS_ZERO, _kernels.RULE_CONTEXT_SPAN_EMPTY])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape, pad_h", [((40, 4, 64), 0), ((40, 4, 64), 2), ((9, 3, 7), 0)])
def test_empty_rows_fast_path_packs_what_the_validating_path_packs(recorded, rule, index, shape, pad_h):
    T, H, D = shape
    out = torch.randn(T, H + pad_h, D, dtype=torch.bfloat16)[:, :H]
    lse = torch.randn(H, T).T
    cu = torch.tensor([0, 5, 5, 17, T], dtype=index)
    lens = (
        torch.tensor([0, 3, 0, 2], dtype=index) if rule == 0 else torch.tensor([0, 4, 4, 9, 9], dtype=index)
    )
    objs = (out, lse, cu, lens)
    names = ("out", "lse", "cu_seqlens_q", "kv_lens")

    def call_of():
        c = _call.Call("empty_rows", objs, (rule,))
        c.key(empty_rows._aligned(c))
        return c

    plan = empty_rows._EmptyRowsPlan(call_of(), rule, names)
    _both(recorded, lambda: plan.torch_call(*objs), lambda: plan(call_of(), rule, names))
    assert recorded[-1][1][-1] == int(index is torch.int64)  # the offsets' width, at compile time


def test_merge_state_common_call_takes_the_flat_kernel_unless_it_cannot(recorded):
    """The flat kernel (32-bit parameters) for the common call; the row-group kernel for an LSE
    written in place, or a stride past 32 bits on a size-1 dimension, on both paths."""
    T, H, D = 64, 8, 128
    v_a, s_a, v_b, s_b = _states(T, H, D, torch.bfloat16, True, 0)
    flat = ("zk_bfloat16", "zk_bfloat16", 8)
    small = (*flat, 1)  # 64 blocks: a small grid
    for out, out_lse, targs in [  # the flat kernel's template arguments have four entries
        (torch.empty(T, H, D, dtype=torch.bfloat16), torch.empty(T, H), small),
        (v_a, torch.empty(T, H), small),  # V in place: one thread reads and writes each pack
        (torch.empty(T, H, D, dtype=torch.bfloat16), s_a, (*flat, 1, 0, "int")),  # LSE in place
    ]:
        objs = (v_a, s_a, v_b, s_b, out, out_lse)
        _both_two(recorded, objs)
        assert recorded[-1][1] == targs
    # T = 1: the token stride is never used and may be anything, here past 32 bits
    base = torch.randn(H * D, dtype=torch.bfloat16)
    v1 = [base.as_strided((1, H, D), (2**40, D, 1)), torch.randn(1, H, D, dtype=torch.bfloat16)]
    objs = (
        v1[0],
        torch.randn(1, H),
        v1[1],
        torch.randn(1, H),
        torch.empty(1, H, D, dtype=torch.bfloat16),
        None,
    )
    _both_two(recorded, objs)
    assert recorded[-1][:2] == ("merge_state_kernel", (*flat, 1, 0, "int"))


def test_tensors_past_two_gigabytes_keep_32_bit_math_below_2_31_elements(recorded):
    """bf16 V of 2^30 + 8192 elements (2^31 + 16384 bytes): every element offset fits 32 bits,
    so a 32-bit flat kernel runs (its offsets are elements, not bytes; the form that gathers
    the output LSE), on both paths of merge_state and of a two-state
    merge_states. The tensors are never written, so their pages are never touched."""
    T, H, D = 2**20 + 8, 8, 128
    v_a, v_b, out = (torch.empty(T, H, D, dtype=torch.bfloat16) for _ in range(3))
    s_a, s_b, out_lse = torch.randn(T, H), torch.randn(T, H), torch.empty(T, H)
    objs = (v_a, s_a, v_b, s_b, out, out_lse)
    _both_two(recorded, objs)
    assert recorded[-1][:2] == ("merge_state_flat_gathered_kernel", ("zk_bfloat16", "zk_bfloat16", 8, 0))
    del v_a, v_b
    # merge_states, N = 2: the states as one [2, T, H, D] tensor of 2^31 + 16384 elements
    v, s = torch.empty(2, T // 2, H, D, dtype=torch.bfloat16), torch.randn(2, T // 2, H)
    _both_n(recorded, (v, s, out[: T // 2], out_lse[: T // 2], None, None))
    assert recorded[-1][:2] == ("merge_state_flat_gathered_kernel", ("zk_bfloat16", "zk_bfloat16", 8, 0))


def test_tensors_past_2_31_elements_take_the_64_bit_flat_kernel(recorded):
    """A V whose token stride spans 2^31 elements: the flat kernel's 64-bit form in blocks of
    512 (its strides are 64-bit parameters), on both paths of merge_state and of a two-state
    merge_states, its rows in the natural order for an out_lse laid [H, T] too (also at 2^22
    threads); an unaligned call of that size takes the row-group kernel's 64-bit form. One
    4.3 GB buffer, never written, so its pages are never touched."""
    T, H, D = 2, 8, 128
    base = torch.empty(2**31 + 2**20, dtype=torch.bfloat16)
    wide = base.as_strided((T, H, D), (2**31, D, 1))
    v_b, s_a, s_b = torch.randn(T, H, D, dtype=torch.bfloat16), torch.randn(T, H), torch.randn(T, H)
    objs = (wide, s_a, v_b, s_b, torch.empty(T, H, D, dtype=torch.bfloat16), torch.empty(H, T).T)
    _both_two(recorded, objs)
    name, targs, grid, packed = recorded[-1]
    assert (name, targs, grid) == ("merge_state_flat64_gathered_kernel", ("zk_bfloat16", "zk_bfloat16", 8), 1)
    assert _kernels.MERGE_STATE_FLAT64_GATHERED.packer.unpack(packed)[17] == 2**31  # va_st, 64-bit

    # two states 2^31 elements apart in one buffer
    v = base.as_strided((2, T, H, D), (2**31, H * D, D, 1))
    out_n = torch.empty(T, H, D, dtype=torch.bfloat16)
    _both_n(recorded, (v, torch.randn(2, T, H), out_n, torch.empty(T, H), None, None))
    assert recorded[-1][:3] == ("merge_state_flat64_gathered_kernel", ("zk_bfloat16", "zk_bfloat16", 8), 1)

    # many heads of short rows, 2^22 threads: a token stride of 2^18 + 40 elements spans
    # 2^31 + 2^16 in 2^13 tokens
    Tw, Hw = 2**13, 32
    wide = base.as_strided((Tw, Hw, D), (2**18 + 40, D, 1))
    v_b, s_a, s_b = torch.empty(Tw, Hw, D, dtype=torch.bfloat16), torch.randn(Tw, Hw), torch.randn(Tw, Hw)
    for out_lse in (torch.empty(Hw, Tw).T, torch.empty(Tw, Hw)):
        _both_two(recorded, (wide, s_a, v_b, s_b, torch.empty(Tw, Hw, D, dtype=torch.bfloat16), out_lse))
        expected = ("merge_state_flat64_gathered_kernel", ("zk_bfloat16", "zk_bfloat16", 8), 2**13)
        assert recorded[-1][:3] == expected
    v_b, s_a, s_b = torch.randn(T, H, D, dtype=torch.bfloat16), torch.randn(T, H), torch.randn(T, H)

    # unaligned (V starts one element into the buffer): no vector path, the row-group kernel
    odd = base[1:].as_strided((T, H, D), (2**31, D, 1))
    objs = (odd, s_a, v_b, s_b, torch.empty(T, H, D, dtype=torch.bfloat16), torch.empty(T, H))
    _both_two(recorded, objs)
    assert recorded[-1][:2] == ("merge_state_kernel", ("zk_bfloat16", "zk_bfloat16", 1, 1, 0, "long long"))


def test_the_flat_kernel_takes_its_small_form_for_grids_of_one_wave(recorded):
    """SMALL = 1 up to 16 x 132 blocks of 128 threads (packs of 8 bf16: one wave on 132 SMs),
    SMALL = 0 past it, on both paths and both plans."""
    H, D = 8, 128  # 16 packs per row, 8 rows per block: T blocks
    for T, small in [(129, 1), (528, 1), (2112, 1), (2113, 0), (4095, 0)]:
        expected = ("merge_state_flat_kernel", ("zk_bfloat16", "zk_bfloat16", 8, small), T)
        assert _both_plans(recorded, T, H, D) == (expected, expected)


def test_the_smallest_calls_take_blocks_of_heads_of_one_token(recorded):
    """Up to 2048 packs of 16 bytes, aligned calls whose rows are a power of two of at most 128
    packs take merge_state_heads_kernel: grid (head groups, T) of 128-thread blocks (T = 1: a
    one-dimensional grid); bf16 inputs
    in packs of 8 bytes (16 when a row would pass 128 of them), fp16 and float in 16 bytes; any
    output type; on both paths and both plans. Rows of 18 or 12 packs, rows of 256 packs, 2049
    packs and unaligned calls take the flat kernel's SMALL form."""
    heads, flat = "merge_state_heads_kernel", "merge_state_flat_kernel"
    for dtype, out_dtype, T, H, D, expected in [
        (torch.bfloat16, torch.bfloat16, 1, 8, 64, (heads, ("zk_bfloat16", "zk_bfloat16", 4), 1)),
        (torch.bfloat16, torch.bfloat16, 1, 37, 128, (heads, ("zk_bfloat16", "zk_bfloat16", 4), 10)),
        (torch.bfloat16, torch.bfloat16, 1, 16, 1024, (heads, ("zk_bfloat16", "zk_bfloat16", 8), 16)),
        (torch.float16, torch.float16, 8, 8, 64, (heads, ("zk_half", "zk_half", 8), (1, 8))),
        (torch.float16, torch.float32, 1, 128, 128, (heads, ("zk_half", "float", 8), 16)),
        (torch.float32, torch.float32, 4, 8, 64, (heads, ("float", "float", 4), (1, 4))),
        (torch.bfloat16, torch.bfloat16, 32, 8, 64, (heads, ("zk_bfloat16", "zk_bfloat16", 4), (1, 32))),
        (torch.bfloat16, torch.float32, 3, 7, 72, (flat, ("zk_bfloat16", "float", 8, 1), 2)),  # 18 packs
        (torch.float16, torch.float16, 1, 3, 96, (flat, ("zk_half", "zk_half", 8, 1), 1)),  # 12 packs
        (torch.bfloat16, torch.bfloat16, 1, 4, 2048, (flat, ("zk_bfloat16", "zk_bfloat16", 8, 1), 8)),
        (torch.bfloat16, torch.bfloat16, 33, 8, 64, (flat, ("zk_bfloat16", "zk_bfloat16", 8, 1), 17)),  # 2112
    ]:  # fmt: skip
        assert _both_plans(recorded, T, H, D, dtype, out_dtype) == (expected, expected), (dtype, T, H, D)
    # unaligned: packs of one element
    assert _unaligned_two(recorded, 1, 8, 64) == (flat, ("zk_bfloat16", "zk_bfloat16", 1, 1), 4)


def test_calls_of_2_19_threads_take_the_gathered_form(recorded):
    """One thread per pack: 2^19 - 128 threads stay on the 128-thread form (SMALL = 0); from
    2^19 on, the 512-thread form that gathers the output LSE, its rows in tiles of 8 tokens
    with out_lse [H, T], not [T, H], up to 2^24 threads and past it; on both paths and both
    plans. An unaligned call keeps the 128-thread form (the others are built for vector packs
    only)."""
    H, D = 8, 128  # 16 packs of 8 bf16 per row: 128 threads per token
    bf16 = ("zk_bfloat16", "zk_bfloat16", 8)
    for ht in (False, True):
        gathered = ("merge_state_flat_gathered_kernel", (*bf16, int(ht)))
        for T, expected in [
            (2**12 - 1, ("merge_state_flat_kernel", (*bf16, 0), 2**12 - 1)),
            (2**12, (*gathered, 2**10)),
            (2**12 + 1, (*gathered, 2**10 + 1)),
            (2**17, (*gathered, 2**15)),
        ]:
            assert _both_plans(recorded, T, H, D, out_lse_ht=ht) == (expected, expected)
    scalar = ("merge_state_flat_kernel", ("zk_bfloat16", "zk_bfloat16", 1, 0))
    assert _unaligned_two(recorded, 2**12, H, D) == (*scalar, 2**15)


def test_the_gathered_form_tiles_rows_by_the_layout_of_out_lse_else_of_s_a(recorded):
    """Rows in tiles of 8 tokens (TILE = 1) exactly when the LSE the kernel writes, or without
    one the LSE it reads first, has unit stride along tokens: out_lse [H, T] whatever the
    inputs, not [T, H]; without out_lse, s_a [H, T] and not [T, H]; any head count and row
    length, T not a multiple of 8. Both paths of merge_state."""
    bf16 = ("zk_bfloat16", "zk_bfloat16", 8)
    for T, H, D, lse_ht, out_ht, tile in [
        (2**13, 32, 128, True, True, 1),
        (2**13 + 3, 32, 128, False, True, 1),
        (2**11 + 5, 128, 64, True, False, 0),
        (2**12, 16, 512, True, None, 1),
        (2**12, 16, 512, False, None, 0),
        (2**15, 1, 128, True, True, 1),  # one head: either layout is unit-stride along tokens
    ]:
        v_a, s_a, v_b, s_b = _states(T, H, D, torch.bfloat16, lse_ht, 0)
        out_lse = None if out_ht is None else torch.empty(H, T).T if out_ht else torch.empty(T, H)
        _both_two(recorded, (v_a, s_a, v_b, s_b, torch.empty(T, H, D, dtype=torch.bfloat16), out_lse))
        threads = T * H * D // 8
        expected = ("merge_state_flat_gathered_kernel", (*bf16, tile), -(-threads // 512))
        assert recorded[-1][:3] == expected, (T, H, D, lse_ht, out_ht)


def _first_n(objs):
    call = _call.Call("merge_states", objs, ("e", False))
    call.key(merge._aligned_n(call))
    return call


def test_merge_states_fast_path_declines_a_wrong_out_lse(recorded):
    """A check that fails on the fast path sends the call to the validating path: None, never a
    value merge_states would return, and nothing launched."""
    T, H, D = 16, 4, 64
    v = torch.randn(2, T, H, D).to(torch.bfloat16)
    s = torch.randn(2, T, H)
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    objs = (v, s, out, torch.empty(T, H), None, None)
    first = _call.Call("merge_states", objs, ("e", False))
    first.key(merge._aligned_n(first))
    plan = merge._MergeNPlan(first)
    recorded.clear()
    for bad in (
        torch.empty(T, H, dtype=torch.float64),
        torch.empty(T, H + 1),
        torch.empty(T, H).requires_grad_(),
    ):
        assert plan.torch_call(v, s, out, bad) is None
    assert recorded == []


def _shifted(t):
    """``t``'s values one element into a fresh buffer: the data pointer loses its 16-byte
    alignment."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def test_each_fast_path_takes_only_calls_of_its_plans_alignment(recorded):
    """The short keys of the fast paths do not hold the layout: a plan built for an unaligned
    call must not take aligned calls (they would lose their vector accesses for good), and a
    vectorised plan must not take unaligned ones. Declining sends the call to the validating
    path, which finds the plan of its own layout."""
    T, H, D = 16, 4, 64
    v_a, s_a, v_b, s_b = _states(T, H, D, torch.bfloat16, False, 0)
    aligned = (v_a, s_a, v_b, s_b, None, None)
    shifted = (_shifted(v_a), s_a, v_b, s_b, None, None)
    for objs, other in ((aligned, shifted), (shifted, aligned)):
        plan = merge._MergeTwoPlan(_fresh(objs), None, None)
        assert plan.vec == (8 if objs is aligned else 1)
        assert plan.torch_call(*objs, None) is not None
        assert plan.torch_call(*other, None) is None
        # a given output counts too: aligned inputs with an unaligned output are an unaligned call
        out = torch.empty(T, H, D, dtype=torch.bfloat16)
        done = plan.torch_call(*aligned[:4], _shifted(out), None, None)
        assert (done is None) == (objs is aligned)
        done = plan.torch_call(*aligned[:4], out, None, None)
        assert (done is None) == (objs is shifted)

    v = torch.stack([v_a, v_b])
    for state, other in ((v, _shifted(v)), (_shifted(v), v)):
        first = _call.Call(
            "merge_states", (state, torch.stack([s_a, s_b]), None, None, None, None), ("e", True)
        )
        first.key(merge._aligned_n(first))
        plan_n = merge._MergeNPlan(first)
        assert plan_n.torch_call(state, first.objs[1], None, None) is not None
        assert plan_n.torch_call(other, first.objs[1], None, None) is None

    names = ("out", "lse", "cu_seqlens_q", "kv_lens")
    cu = torch.tensor([0, 7, T], dtype=torch.int32)
    lens = torch.tensor([0, 3], dtype=torch.int32)
    lse = torch.randn(T, H)
    for out, other in ((v_a.clone(), _shifted(v_a)), (_shifted(v_a), v_a.clone())):
        call = _call.Call("fixup_zero_kv_rows", (out, lse, cu, lens), ())
        call.key(empty_rows._aligned(call))
        plan = empty_rows._EmptyRowsPlan(call, _kernels.RULE_KV_LENS_ZERO, names)
        assert plan.torch_call(out, lse, cu, lens) is True
        assert plan.torch_call(other, lse, cu, lens) is False
