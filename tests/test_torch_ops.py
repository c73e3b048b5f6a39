"""torch.ops.zerokv.*: schemas, fake implementations, and torch.compile with mutation."""

from __future__ import annotations

import oracles
import pytest
import torch
from batches import empty_rows, garbage_state, make_batch
from conftest import assert_close
from states import make_states

import zerokv  # noqa: F401  (registers torch.ops.zerokv)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    v_a, s_a, v_b, s_b = make_states(33, 4, 16, torch.float32, device, seed=1, edges=False)
    cu, kv = make_batch(5, 8, "random", seed=2)
    cu, kv = cu.to(device), kv.to(device)
    T = int(cu[-1])
    out, lse = torch.randn(T, 4, 16, device=device), torch.randn(T, 4, device=device)
    ops = torch.ops.zerokv
    torch.library.opcheck(ops.merge_state.default, (v_a, s_a, v_b, s_b))
    torch.library.opcheck(ops.merge_state_out.default, (v_a, s_a, v_b, s_b, v_a.clone(), s_a.clone()))
    torch.library.opcheck(ops.merge_states.default, (torch.stack([v_a, v_b]), torch.stack([s_a, s_b])))
    torch.library.opcheck(ops.fixup_zero_kv_rows.default, (out, lse, kv, cu))
    cu_kv = torch.cat([torch.zeros(1, dtype=kv.dtype, device=device), kv.cumsum(0).to(kv.dtype)])
    torch.library.opcheck(ops.mask_empty_context.default, (out, lse, cu, cu_kv))


def _step(out, lse, kv, cu, v_b, s_b):
    torch.ops.zerokv.fixup_zero_kv_rows(out, lse, kv, cu)
    return torch.ops.zerokv.merge_state(out, lse, v_b, s_b)


@pytest.mark.parametrize(
    "device, backend", [("cpu", "aot_eager"), pytest.param("cuda", "inductor", marks=pytest.mark.gpu)]
)
def test_compile_with_in_place_fixup_then_merge(device, backend):
    cu, kv = make_batch(12, 9, "random", seed=3)
    rows = empty_rows(cu, kv)
    T = int(cu[-1])
    out, lse = garbage_state(T, 4, 64, torch.float32, rows, device, 4, lse_ht=False)
    _, _, v_b, s_b = make_states(T, 4, 64, torch.float32, device, seed=5, edges=False)
    compiled = torch.compile(_step, backend=backend, fullgraph=True)
    got = compiled(out.clone(), lse.clone(), kv.to(device), cu.to(device), v_b, s_b)
    fixed_out, fixed_lse = oracles.with_empty_rows(out, lse, oracles.fixup_rows(cu, kv, T))
    ref_out, ref_lse = oracles.merge2(fixed_out, fixed_lse, v_b, s_b)
    assert_close(got[0], ref_out, torch.float32)
    assert_close(got[1], ref_lse, torch.float32)
