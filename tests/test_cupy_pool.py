"""CuPy beside torch: a call with torch tensors allocates nothing through CuPy's memory pools
(outputs requested as None come from torch's allocator), for every op."""

from __future__ import annotations

import pytest
import torch

import zerokv

pytestmark = pytest.mark.gpu


def _pools():
    import cupy

    pool, pinned = cupy.get_default_memory_pool(), cupy.get_default_pinned_memory_pool()
    return pool.used_bytes(), pool.total_bytes(), pinned.n_free_blocks()


def test_torch_tensor_calls_allocate_nothing_through_cupy():
    g = torch.Generator(device="cuda").manual_seed(11)
    T, H, D = 300, 8, 128
    v_a, v_b = (torch.randn(T, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    s_a, s_b = (torch.randn(T, H, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(3, T, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    s = torch.randn(3, T, H, device="cuda", generator=g)
    cu = torch.tensor([0, 100, 250, T], dtype=torch.int32, device="cuda")
    lens = torch.tensor([0, 7, 0], dtype=torch.int32, device="cuda")
    cu_kv = torch.tensor([0, 0, 9, 9], dtype=torch.int32, device="cuda")

    def every_op():
        out, lse = zerokv.merge_state(v_a, s_a, v_b, s_b)  # outputs allocated (by torch)
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
        zerokv.merge_state(v_a, s_a, v_b, s_b, a_empty=(cu, lens))
        zerokv.merge_states(v, s)
        zerokv.fixup_zero_kv_rows(out, lse, lens, cu)
        zerokv.mask_empty_context(out, lse, cu, cu_kv)
        return out

    every_op()  # compiles and loads (CuPy may allocate while compiling: not a call's cost)
    torch.cuda.synchronize()
    before = _pools()
    for _ in range(3):
        out = every_op()
    torch.cuda.synchronize()
    assert _pools() == before
    assert isinstance(out, torch.Tensor) and out.is_cuda  # allocated by torch
