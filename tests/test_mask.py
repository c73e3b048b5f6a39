"""mask_empty_context: rows of requests with an empty context span become exactly (0, -inf)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batches import KERNEL_CASES, check_empty_rows, empty_rows, garbage_state, make_batch
from conftest import DTYPES

import zerokv
from zerokv import reference


def _context_offsets(kv: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=kv.dtype), kv.cumsum(0).to(kv.dtype)])


@pytest.mark.parametrize("empty", ["none", "one", "all", "random"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cpu_path_matches_reference(empty, index_dtype):
    cu, kv = make_batch(11, 5, empty, seed=2, index_dtype=index_dtype)
    cu_kv = _context_offsets(kv)
    rows = empty_rows(cu, kv)
    out, lse = garbage_state(int(cu[-1]), 3, 8, torch.bfloat16, rows, "cpu", 3, lse_ht=True)
    ref_out, ref_lse = reference.mask_empty_context(
        out.double().numpy(), lse.numpy(), cu.numpy(), cu_kv.numpy()
    )
    before = out.clone(), lse.clone()
    zerokv.mask_empty_context(out, lse, cu, cu_kv)
    check_empty_rows(out, lse, *before, rows)
    np.testing.assert_array_equal(out.double().numpy(), ref_out)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)


@pytest.mark.parametrize(
    "kw, exc, needle",
    [
        ({"cu_seqlens_kv": torch.zeros(3, dtype=torch.int32)}, ValueError, "cu_seqlens_kv"),
        ({"cu_seqlens_kv": torch.zeros(5)}, TypeError, "cu_seqlens_kv"),
        ({"cu_seqlens_q": [0, 1]}, TypeError, "cu_seqlens_q"),
        ({"lse": torch.zeros(1000, 2)}, ValueError, "lse"),
        ({"out": torch.zeros(5, 2)}, ValueError, "out"),
    ],
)
def test_rejected_calls_name_the_argument_and_write_nothing(kw, exc, needle):
    cu, kv = make_batch(4, 4, "all", seed=5)
    T = int(cu[-1])
    out, lse = torch.randn(T, 2, 8), torch.randn(T, 2)
    before = out.clone(), lse.clone()
    args = {"out": out, "lse": lse, "cu_seqlens_q": cu, "cu_seqlens_kv": _context_offsets(kv), **kw}
    with pytest.raises(exc, match=needle):
        zerokv.mask_empty_context(**args)
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("empty", ["none", "one", "all", "random"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("B, max_q, H, D", KERNEL_CASES)
def test_kernel(dtype, empty, index_dtype, B, max_q, H, D):
    cu, kv = make_batch(B, max_q, empty, seed=B * 3 + max_q, index_dtype=index_dtype)
    rows = empty_rows(cu, kv)
    out, lse = garbage_state(int(cu[-1]), H, D, dtype, rows, "cuda", B, lse_ht=B % 2 == 1)
    before = out.clone(), lse.clone()
    zerokv.mask_empty_context(out, lse, cu.cuda(), _context_offsets(kv).cuda())
    check_empty_rows(out, lse, *before, rows)


@pytest.mark.gpu
def test_kernel_65536_rows_int64():
    g = torch.Generator().manual_seed(17)
    q = torch.randint(0, 200, (512,), generator=g)
    q[-1] += 65536 - q.sum()
    assert q.min() >= 0
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)])
    kv = torch.randint(0, 2, (512,), generator=g)
    rows = empty_rows(cu, kv)
    out, lse = garbage_state(65536, 16, 128, torch.bfloat16, rows, "cuda", 5, lse_ht=True)
    before = out.clone(), lse.clone()
    zerokv.mask_empty_context(out, lse, cu.cuda(), _context_offsets(kv).cuda())
    check_empty_rows(out, lse, *before, rows)
