"""torch.ops.zerokv.*: schemas, fake implementations, torch.compile with mutation, fp8 outputs."""

from __future__ import annotations

import numpy as np
import oracles
import pytest
import torch
from batches import empty_rows, garbage_state, make_batch
from conftest import assert_close, f64
from states import make_states

import zerokv  # noqa: F401  (registers torch.ops.zerokv)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NAN = float("nan")


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


def _fp8_outputs(T, H, D, group, device):
    out = torch.full((T, H, D), float("nan"), device=device).to(torch.float8_e4m3fn)  # NaN poison: 0x7f
    return (
        out,
        torch.full((T, H), float("nan"), device=device),
        torch.full((T, H * D // group), float("nan"), device=device),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("group", "fmt"), [(32, "ue8m0"), (128, "float32")])
def test_the_out_ops_write_per_group_fp8_as_the_oracle(device, group, fmt):
    """merge_state_out / merge_states_out with out_block_scale: equal LSEs, so that the merged
    rows are exact in float32 and the fp8 values and scales compare bit for bit with the
    oracles' merge and per-group rule."""
    T, H, D = 37, 4, 128
    v_a, s_a, v_b, _ = make_states(T, H, D, torch.bfloat16, device, seed=6, edges=False)
    s_b = s_a.clone()
    ro, rl = oracles.merge2(v_a, s_a, v_b, s_b)
    values, scales = oracles.group_fp8(ro, group, fmt == "ue8m0")
    want = torch.from_numpy(values).float().to(torch.float8_e4m3fn).view(torch.uint8)
    ops = torch.ops.zerokv
    for call in ("two", "n"):
        out, lse, bs = _fp8_outputs(T, H, D, group, device)
        kw = {"out_block_scale": bs, "quant_group": group, "scale_format": fmt}
        if call == "two":
            ops.merge_state_out(v_a, s_a, v_b, s_b, out, lse, **kw)
        else:
            ops.merge_states_out(torch.stack([v_a, v_b]), torch.stack([s_a, s_b]), out, lse, **kw)
        assert torch.equal(out.cpu().view(torch.uint8), want), call
        assert np.array_equal(f64(bs), scales), call
        assert_close(lse, rl, torch.float32)


# torch's schema test multiplies the outputs, which fp8 tensors do not take (on either device); the
# bf16 call below runs it on the same schema
_FP8_CHECKS = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_of_the_per_group_fp8_outputs(device):
    T, H, D, group = 9, 2, 64, 32
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, device, seed=7, edges=False)
    ops = torch.ops.zerokv
    out, lse, bs = _fp8_outputs(T, H, D, group, device)
    kw = {"out_block_scale": bs, "quant_group": group, "scale_format": "float32"}
    torch.library.opcheck(
        ops.merge_state_out.default, (v_a, s_a, v_b, s_b, out, lse), kw, test_utils=_FP8_CHECKS
    )
    v, s = torch.stack([v_a, v_b, v_a]), torch.stack([s_a, s_b, s_b])
    torch.library.opcheck(ops.merge_states_out.default, (v, s, out, lse), kw, test_utils=_FP8_CHECKS)
    torch.library.opcheck(ops.merge_states_out.default, (v, s, torch.empty_like(v_a), None))


def test_the_out_ops_reject_a_bad_group_and_write_nothing():
    T, H, D = 5, 2, 64
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, "cpu", seed=8, edges=False)
    out, lse, bs = _fp8_outputs(T, H, D, 32, "cpu")
    before = out.view(torch.uint8).clone(), bs.view(torch.int32).clone(), lse.view(torch.int32).clone()
    with pytest.raises(ValueError, match="quant_group"):
        torch.ops.zerokv.merge_state_out(v_a, s_a, v_b, s_b, out, lse, out_block_scale=bs, quant_group=24)
    with pytest.raises(ValueError, match="scale_format"):
        torch.ops.zerokv.merge_states_out(
            torch.stack([v_a, v_b]), torch.stack([s_a, s_b]), out, lse, out_block_scale=bs, quant_group=32,
            scale_format="e8m0",
        )  # fmt: skip
    after = out.view(torch.uint8), bs.view(torch.int32), lse.view(torch.int32)
    assert all(torch.equal(x, y) for x, y in zip(after, before, strict=True))


def _op_call(op, device):
    """``(run, want)``: one call of ``torch.ops.zerokv.<op>`` on states with every edge, and
    what the oracles say it gives (float64)."""
    T, H, D = 29, 3, 16
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.float32, device, seed=11)
    cu, kv = make_batch(6, 8, "random", seed=12)
    T_b = int(cu[-1])
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(13)).to(device)
    ops = torch.ops.zerokv
    if op == "merge_state":  # base 2, a_empty, the suffix rule, sinks
        cu_a = torch.tensor([0, 3, 10, 10, T], dtype=torch.int32)
        kv_a = torch.tensor([0, 4, 0, 0], dtype=torch.int32)
        rows = oracles.a_empty_rows(cu_a, kv_a, T)
        want = oracles.merge2(v_a, s_a, v_b, s_b, base=2, sinks=sinks, a_empty=rows, prefix_rows=21)
        return lambda: ops.merge_state(
            v_a, s_a, v_b, s_b, "2", 21, cu_a.to(device), kv_a.to(device), sinks
        ), want
    if op == "merge_state_out":
        out, out_lse = torch.full_like(v_a, NAN), torch.full_like(s_a, NAN)
        ops_call = lambda: ops.merge_state_out(v_a, s_a, v_b, s_b, out, out_lse) or (out, out_lse)  # noqa: E731
        return ops_call, oracles.merge2(v_a, s_a, v_b, s_b)
    if op in ("merge_states", "merge_states_out"):
        v, s = torch.stack([v_a, v_b, v_a.flip(0)]), torch.stack([s_a, s_b, s_b.flip(0)])
        if op == "merge_states":
            return lambda: ops.merge_states(v, s, "2", sinks), oracles.merge(v, s, base=2, sinks=sinks)
        out, out_lse = torch.full_like(v_a, NAN), torch.full_like(s_a, NAN)
        return lambda: ops.merge_states_out(v, s, out, out_lse) or (out, out_lse), oracles.merge(v, s)
    out, lse = garbage_state(T_b, H, D, torch.float32, empty_rows(cu, kv), device, 14, lse_ht=True)
    if op == "fixup_zero_kv_rows":
        rows = oracles.fixup_rows(cu, kv, T_b)
        run = lambda: ops.fixup_zero_kv_rows(out, lse, kv.to(device), cu.to(device)) or (out, lse)  # noqa: E731
    else:
        cu_kv = torch.cat([torch.zeros(1, dtype=kv.dtype), kv.cumsum(0).to(kv.dtype)])
        rows = oracles.mask_rows(cu, cu_kv, T_b)
        run = lambda: ops.mask_empty_context(out, lse, cu.to(device), cu_kv.to(device)) or (out, lse)  # noqa: E731
    assert rows.any() and not rows.all()
    return run, oracles.with_empty_rows(out, lse, rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "op",
    [
        "merge_state",
        "merge_state_out",
        "merge_states",
        "merge_states_out",
        "fixup_zero_kv_rows",
        "mask_empty_context",
    ],
)
def test_each_op_computes_what_the_oracles_say(device, op):
    run, (want_out, want_lse) = _op_call(op, device)
    out, lse = run()
    assert_close(out, want_out, torch.float32, f"{op} out")
    assert_close(lse, want_lse, torch.float32, f"{op} lse")
