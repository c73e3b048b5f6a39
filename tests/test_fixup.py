"""fixup_zero_kv_rows: rows of requests with kv_lens == 0 become exactly (0, -inf); others untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batches import KERNEL_CASES, check_empty_rows, empty_rows, garbage_state, make_batch
from conftest import DTYPES

import zerokv
from zerokv import reference


@pytest.mark.parametrize("empty", ["none", "one", "all", "random"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cpu_path_matches_reference(empty, index_dtype):
    cu, kv = make_batch(9, 6, empty, seed=1, index_dtype=index_dtype)
    rows = empty_rows(cu, kv)
    out, lse = garbage_state(int(cu[-1]), 3, 8, torch.float32, rows, "cpu", 2, lse_ht=True)
    ref_out, ref_lse = reference.fixup_zero_kv_rows(out.numpy(), lse.numpy(), kv.numpy(), cu.numpy())
    before = out.clone(), lse.clone()
    zerokv.fixup_zero_kv_rows(out, lse, kv, cu)
    check_empty_rows(out, lse, *before, rows)
    np.testing.assert_array_equal(out.numpy(), ref_out)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)


def test_numpy_inputs():
    cu, kv = make_batch(5, 4, "random", seed=3)
    rows = empty_rows(cu, kv)
    out, lse = garbage_state(int(cu[-1]), 2, 4, torch.float32, rows, "cpu", 4, lse_ht=False)
    o, s = out.numpy().copy(), lse.numpy().copy()
    zerokv.fixup_zero_kv_rows(o, s, kv.numpy(), cu.numpy())
    check_empty_rows(torch.from_numpy(o), torch.from_numpy(s), out, lse, rows)


@pytest.mark.parametrize(
    "kw, exc, needle",
    [
        ({"kv_lens": torch.zeros(3, dtype=torch.int32)}, ValueError, "kv_lens"),
        ({"kv_lens": torch.zeros(4)}, TypeError, "kv_lens"),
        ({"cu_seqlens_q": torch.zeros(5, 1, dtype=torch.int32)}, ValueError, "cu_seqlens_q"),
        ({"lse": torch.zeros(1000, 2)}, ValueError, "lse"),
        ({"out": torch.zeros(10, 2, 8, dtype=torch.float64)}, TypeError, "out"),
        ({"max_seqlen_q": "7"}, TypeError, "max_seqlen_q"),
    ],
)
def test_rejected_calls_name_the_argument_and_write_nothing(kw, exc, needle):
    cu, kv = make_batch(4, 4, "all", seed=5)
    T = int(cu[-1])
    out, lse = torch.randn(T, 2, 8), torch.randn(T, 2)
    before = out.clone(), lse.clone()
    args = {"out": out, "lse": lse, "kv_lens": kv, "cu_seqlens_q": cu, **kw}
    with pytest.raises(exc, match=needle):
        zerokv.fixup_zero_kv_rows(**args)
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("empty", ["none", "one", "all", "random"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("B, max_q, H, D", KERNEL_CASES)
def test_kernel(dtype, empty, index_dtype, B, max_q, H, D):
    cu, kv = make_batch(B, max_q, empty, seed=B + max_q, index_dtype=index_dtype)
    rows = empty_rows(cu, kv)
    out, lse = garbage_state(int(cu[-1]), H, D, dtype, rows, "cuda", B, lse_ht=B % 2 == 0)
    before = out.clone(), lse.clone()
    zerokv.fixup_zero_kv_rows(out, lse, kv.cuda(), cu.cuda(), max_seqlen_q=1)  # a too-small hint
    check_empty_rows(out, lse, *before, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "padded"])
def test_kernel_large_batch_65536_rows(layout):
    g = torch.Generator().manual_seed(7)
    q = torch.randint(0, 200, (512,), generator=g)
    q[-1] += 65536 - q.sum()
    assert q.min() >= 0
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)]).to(torch.int64)
    kv = torch.randint(0, 3, (512,), generator=g)
    rows = empty_rows(cu, kv)
    T, H, D = 65536, 8, 128
    out, lse = garbage_state(T, H, D, torch.bfloat16, rows, "cuda", 9, lse_ht=False)
    if layout == "padded":
        buf = torch.randn(T, H + 1, D + 8, dtype=torch.bfloat16, device="cuda")
        buf[:, :H, :D] = out
        out = buf[:, :H, :D]
    before = out.clone(), lse.clone()
    zerokv.fixup_zero_kv_rows(out, lse, kv.cuda(), cu.cuda())
    check_empty_rows(out, lse, *before, rows)


@pytest.mark.gpu
def test_no_empty_request_writes_nothing_and_zero_tokens_is_a_no_op():
    cu, kv = make_batch(16, 8, "none", seed=11)
    out = torch.randn(int(cu[-1]), 4, 8, device="cuda")
    lse = torch.randn(int(cu[-1]), 4, device="cuda")
    before = out.clone(), lse.clone()
    zerokv.fixup_zero_kv_rows(out, lse, kv.cuda(), cu.cuda())
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])
    zerokv.fixup_zero_kv_rows(
        torch.empty(0, 4, 8, device="cuda"), torch.empty(0, 4, device="cuda"),
        torch.zeros(2, dtype=torch.int32, device="cuda"), torch.zeros(3, dtype=torch.int32, device="cuda"),
    )  # fmt: skip


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    cu, kv = make_batch(32, 50, "random", seed=13)
    cu, kv = cu.cuda(), kv.cuda()
    rows = empty_rows(cu.cpu(), kv.cpu())
    out, lse = garbage_state(int(cu[-1]), 8, 64, torch.float16, rows, "cuda", 1, lse_ht=False)
    zerokv.fixup_zero_kv_rows(out, lse, kv, cu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        zerokv.fixup_zero_kv_rows(out, lse, kv, cu)
    fresh = garbage_state(int(cu[-1]), 8, 64, torch.float16, rows, "cuda", 2, lse_ht=False)
    out.copy_(fresh[0])
    lse.copy_(fresh[1])
    graph.replay()
    torch.cuda.synchronize()
    check_empty_rows(out, lse, *fresh, rows)
