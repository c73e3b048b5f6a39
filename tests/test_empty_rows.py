"""The empty-row family: ``fixup_zero_kv_rows`` (empty when ``kv_lens[i] == 0``) and
``mask_empty_context`` (empty when the context span is empty). Rows of empty requests become
exactly (0, -inf); every other row is left bitwise untouched. Each test runs for both ops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import oracles
import pytest
import torch
from batches import KERNEL_CASES, bits, check_empty_rows, empty_rows, garbage_state, make_batch
from conftest import DTYPES

import zerokv


@dataclass(frozen=True)
class Op:
    """One op of the family: its function, the name of its emptiness argument, how to build that
    argument from ``kv_lens`` (0 for an empty request), and its rule as a loop over requests
    (``oracles.py``, independent of the library)."""

    name: str
    fn: Callable[..., None]
    lens_name: str
    emptiness: Callable[[torch.Tensor], torch.Tensor]
    rows: Callable[..., np.ndarray]  # (cu_seqlens_q, lens, T) -> the rows that become empty
    kernel_kw: dict[str, Any] = field(default_factory=dict)  # extra keywords for the kernel tests

    def __call__(self, out, lse, cu_seqlens_q, lens, **kw) -> None:
        self.fn(out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, **{self.lens_name: lens}, **kw)


def _context_offsets(kv: torch.Tensor) -> torch.Tensor:
    """Context offsets with equal neighbours exactly where ``kv == 0``."""
    return torch.cat([torch.zeros(1, dtype=kv.dtype), kv.cumsum(0).to(kv.dtype)])


OPS = [
    Op(
        "fixup",
        zerokv.fixup_zero_kv_rows,
        "kv_lens",
        lambda kv: kv,
        oracles.fixup_rows,
        {"max_seqlen_q": 1},  # a too-small hint: it must not cause rows to be skipped
    ),
    Op(
        "mask",
        zerokv.mask_empty_context,
        "cu_seqlens_kv",
        _context_offsets,
        oracles.mask_rows,
    ),
]
by_op = pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# --- the CPU path: the rule, numpy, validation -------------------------------------------


@by_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("empty", ["none", "one", "all", "random"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cpu_path_follows_the_rule(op, dtype, empty, index_dtype):
    cu, kv = make_batch(9 + OPS.index(op) * 2, 6, empty, seed=1 + OPS.index(op), index_dtype=index_dtype)
    lens = op.emptiness(kv)
    rows = empty_rows(cu, kv)
    out, lse = garbage_state(int(cu[-1]), 3, 8, dtype, rows, "cpu", 2, lse_ht=True)
    ref_out, ref_lse = oracles.with_empty_rows(out, lse, op.rows(cu, lens, int(cu[-1])))
    before = out.clone(), lse.clone()
    op(out, lse, cu, lens)
    check_empty_rows(out, lse, *before, rows)
    np.testing.assert_array_equal(out.double().numpy(), ref_out)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)


@by_op
def test_numpy_inputs(op):
    cu, kv = make_batch(5, 4, "random", seed=3)
    rows = empty_rows(cu, kv)
    assert rows.any() and not rows.all()
    out, lse = garbage_state(int(cu[-1]), 2, 4, torch.float32, rows, "cpu", 4, lse_ht=False)
    o, s = out.numpy().copy(), lse.numpy().copy()
    op(o, s, cu.numpy(), op.emptiness(kv).numpy())
    check_empty_rows(torch.from_numpy(o), torch.from_numpy(s), out, lse, rows)


def _lens_of_length(n: int):
    return lambda args, op: args.update({op.lens_name: torch.zeros(n, dtype=torch.int32)})


CU = "cu_seqlens_q"
REJECTED = [
    # (id, mutate(args, op), exception, the argument the message must name (None: op.lens_name))
    ("lens_wrong_length", _lens_of_length(3), ValueError, None),
    ("lens_float", lambda a, op: a.update({op.lens_name: a[op.lens_name].float()}), TypeError, None),
    ("cu_2d", lambda a, op: a.update(cu_seqlens_q=torch.zeros(5, 1, dtype=torch.int32)), ValueError, CU),
    ("cu_list", lambda a, op: a.update(cu_seqlens_q=[0, 1]), TypeError, CU),
    ("lse_shape", lambda a, op: a.update(lse=torch.zeros(1000, 2)), ValueError, "lse"),
    ("out_float64", lambda a, op: a.update(out=torch.zeros(10, 2, 8, dtype=torch.float64)), TypeError, "out"),
    ("out_2d", lambda a, op: a.update(out=torch.zeros(5, 2)), ValueError, "out"),
]


@by_op
@pytest.mark.parametrize("mutate, exc, needle", [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED])
def test_rejected_calls_name_the_argument_and_write_nothing(op, mutate, exc, needle):
    cu, kv = make_batch(4, 4, "all", seed=5)
    T = int(cu[-1])
    out, lse = torch.randn(T, 2, 8), torch.randn(T, 2)
    before = out.clone(), lse.clone()
    args = {"out": out, "lse": lse, "cu_seqlens_q": cu, op.lens_name: op.emptiness(kv)}
    mutate(args, op)
    with pytest.raises(exc, match=needle or op.lens_name):
        op.fn(**args)
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])


def test_fixup_rejects_a_max_seqlen_q_that_is_not_an_int():
    cu, kv = make_batch(4, 4, "all", seed=5)
    T = int(cu[-1])
    out, lse = torch.randn(T, 2, 8), torch.randn(T, 2)
    before = out.clone(), lse.clone()
    with pytest.raises(TypeError, match="max_seqlen_q"):
        zerokv.fixup_zero_kv_rows(out, lse, kv, cu, max_seqlen_q="7")
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])


# --- both paths: nothing to do means nothing written -----------------------------------------


@by_op
@pytest.mark.parametrize("device", DEVICES)
def test_no_empty_request_writes_nothing_and_zero_tokens_is_a_no_op(op, device):
    cu, kv = make_batch(16, 8, "none", seed=11)
    out = torch.randn(int(cu[-1]), 4, 8, device=device)
    lse = torch.randn(int(cu[-1]), 4, device=device)
    before = out.clone(), lse.clone()
    op(out, lse, cu.to(device), op.emptiness(kv).to(device))
    assert torch.equal(bits(out), bits(before[0])) and torch.equal(bits(lse), bits(before[1]))

    # zero tokens, as views inside poisoned buffers, with offsets that claim rows and every
    # request empty: the buffers stay bitwise as they were
    out_buf = torch.full((4, 4, 8), float("nan"), device=device)
    lse_buf = torch.full((4, 4), float("nan"), device=device)
    out_before, lse_before = out_buf.clone(), lse_buf.clone()
    cu0 = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    op(out_buf[2:2], lse_buf[2:2], cu0, op.emptiness(torch.zeros(2, dtype=torch.int32)).to(device))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(bits(out_buf), bits(out_before)) and torch.equal(bits(lse_buf), bits(lse_before))


# --- GPU: the kernels ---------------------------------------------------------------------------


@pytest.mark.gpu
@by_op
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("empty", ["none", "one", "all", "random"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("B, max_q, H, D", KERNEL_CASES)
def test_kernel(op, dtype, empty, index_dtype, B, max_q, H, D):
    k = OPS.index(op)
    cu, kv = make_batch(B, max_q, empty, seed=B * (2 * k + 1) + max_q, index_dtype=index_dtype)
    rows = empty_rows(cu, kv)
    out, lse = garbage_state(int(cu[-1]), H, D, dtype, rows, "cuda", B, lse_ht=(B + k) % 2 == 0)
    before = out.clone(), lse.clone()
    op(out, lse, cu.cuda(), op.emptiness(kv).cuda(), **op.kernel_kw)
    check_empty_rows(out, lse, *before, rows)


@by_op
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["none", "first step", "last step", "every step"])
@pytest.mark.parametrize("B", [1025, 2500])
def test_batches_of_several_scan_steps(op, device, where, B):
    """More requests than the kernel tests in one step (1024): empty requests only in the first
    step, only in the last, in every step, or none at all."""
    g = torch.Generator().manual_seed(B + len(where))
    q = torch.randint(0, 4, (B,), generator=g)
    kv = torch.randint(1, 9, (B,), generator=g)
    picks = {"none": [], "first step": [3, 1000], "last step": [B - 1], "every step": list(range(5, B, 97))}
    kv[picks[where]] = 0
    q[picks[where]] = 2  # rows to write
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)]).to(torch.int32)
    kv = kv.to(torch.int32)
    rows = empty_rows(cu, kv)
    assert int(rows.sum()) == 2 * len(picks[where])
    out, lse = garbage_state(int(cu[-1]), 4, 64, torch.bfloat16, rows, device, B, lse_ht=B % 2 == 0)
    before = out.clone(), lse.clone()
    op(out, lse, cu.to(device), op.emptiness(kv).to(device))
    check_empty_rows(out, lse, *before, rows)


@pytest.mark.gpu
@by_op
@pytest.mark.parametrize("layout", ["contiguous", "padded"])
@pytest.mark.parametrize("lse_ht", [False, True])
def test_kernel_65536_rows_int64(op, layout, lse_ht):
    g = torch.Generator().manual_seed(7 + OPS.index(op))
    q = torch.randint(0, 200, (512,), generator=g)
    q[-1] += 65536 - q.sum()
    assert q.min() >= 0
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)])
    kv = torch.randint(0, 3, (512,), generator=g)
    rows = empty_rows(cu, kv)
    T, H, D = 65536, 8 * (1 + OPS.index(op)), 128
    out, lse = garbage_state(T, H, D, torch.bfloat16, rows, "cuda", 9, lse_ht=lse_ht)
    if layout == "padded":
        buf = torch.randn(T, H + 1, D + 8, dtype=torch.bfloat16, device="cuda")
        buf[:, :H, :D] = out
        out = buf[:, :H, :D]
    before = out.clone(), lse.clone()
    op(out, lse, cu.cuda(), op.emptiness(kv).cuda())
    check_empty_rows(out, lse, *before, rows)


@pytest.mark.gpu
@by_op
def test_cuda_graph_capture_and_replay(op):
    cu, kv = make_batch(32, 50, "random", seed=13)
    lens = op.emptiness(kv).cuda()
    cu = cu.cuda()
    rows = empty_rows(cu.cpu(), kv)
    out, lse = garbage_state(int(cu[-1]), 8, 64, torch.float16, rows, "cuda", 1, lse_ht=False)
    op(out, lse, cu, lens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):  # a stream of the current device
        op(out, lse, cu, lens)
    fresh = garbage_state(int(cu[-1]), 8, 64, torch.float16, rows, "cuda", 2, lse_ht=False)
    out.copy_(fresh[0])
    lse.copy_(fresh[1])
    graph.replay()
    torch.cuda.synchronize()
    check_empty_rows(out, lse, *fresh, rows)
