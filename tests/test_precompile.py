"""zerokv.precompile: which instantiations it builds (CPU, a fake device), and on a GPU that a
CUDA graph captured after it compiles nothing."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from conftest import assert_close, f64
from states import make_states

import zerokv
from zerokv import reference
from zerokv.core import compiler as _compiler
from zerokv.core import device as _device
from zerokv.core import disk_cache as _cache
from zerokv.core import kernels as _kernels

pc = importlib.import_module("zerokv.precompile")  # the module (zerokv.precompile is the function)


@pytest.fixture
def fake_device(monkeypatch):
    """Every (kernel name, expression, device) that precompile would compile and load."""
    calls: list[tuple[str, str, int]] = []
    monkeypatch.setattr(_compiler, "function", lambda k, expr, dev: calls.append((k.name, expr, dev)))
    monkeypatch.setattr(_device, "check_device", lambda dev: None)
    monkeypatch.setattr(pc, "_check_exists", lambda dev: None)
    monkeypatch.setattr(_cache, "guard_cupy_cache", lambda: None)
    return calls


def _where(kernel, keep) -> list[str]:
    return [kernel.expr(*t) for t in kernel.instances if keep(t)]


def test_bf16_merge_state_builds_bf16_in_and_out_only(fake_device):
    n = zerokv.precompile(dtypes=("bfloat16",), ops=("merge_state",), device=3)
    bf16 = lambda t: t[:2] == ("zk_bfloat16", "zk_bfloat16")  # noqa: E731
    expected = [("merge_state_kernel", e, 3) for e in _where(_kernels.MERGE_STATE, bf16)]
    expected += [("merge_state_flat_kernel", e, 3) for e in _where(_kernels.MERGE_STATE_FLAT, bf16)]
    expected += [("merge_state_heads_kernel", e, 3) for e in _where(_kernels.MERGE_STATE_HEADS, bf16)]
    gathered = _where(_kernels.MERGE_STATE_FLAT_GATHERED, bf16)
    expected += [("merge_state_flat_gathered_kernel", e, 3) for e in gathered]
    wide_gathered = _where(_kernels.MERGE_STATE_FLAT64_GATHERED, bf16)
    expected += [("merge_state_flat64_gathered_kernel", e, 3) for e in wide_gathered]
    assert fake_device == expected
    assert n == len(expected) >= 2  # a vector and a scalar path at least
    assert {t[2] for t in _kernels.MERGE_STATE.instances if t[:2] == ("zk_bfloat16", "zk_bfloat16")} == {1, 8}


def test_dtypes_select_every_combination_among_them(fake_device):
    zerokv.precompile(dtypes=[torch.bfloat16, torch.float8_e4m3fn], ops=["merge_states"], device="cuda:1")
    pairs = {("zk_bfloat16", "zk_bfloat16"), ("zk_bfloat16", "zk_fp8_e4m3")}
    expected = _where(_kernels.MERGE_STATE_FLAT, lambda t: t[:2] in pairs)  # two states: the flat kernels
    expected += _where(_kernels.MERGE_STATE_HEADS, lambda t: t[:2] in pairs)
    expected += _where(_kernels.MERGE_STATE_FLAT_GATHERED, lambda t: t[:2] in pairs)
    expected += _where(_kernels.MERGE_STATE_FLAT64_GATHERED, lambda t: t[:2] in pairs)
    expected += _where(_kernels.MERGE_STATES, lambda t: t[:2] in pairs)
    assert [e for _, e, _ in fake_device] == expected
    assert {t[:2] for t in _kernels.MERGE_STATES.instances if t[:2] in pairs} == pairs
    assert {d for *_, d in fake_device} == {1}


def test_fixup_and_mask_take_their_own_emptiness_rule(fake_device):
    zerokv.precompile(dtypes="float16", ops="fixup_zero_kv_rows", device=0)
    fixup = [e for _, e, _ in fake_device]
    fake_device.clear()
    zerokv.precompile(dtypes=np.float16, ops="mask_empty_context", device=0)
    mask = [e for _, e, _ in fake_device]
    rows = _kernels.EMPTY_ROWS
    assert fixup == _where(rows, lambda t: t[0] == "zk_half" and t[2] == _kernels.RULE_KV_LENS_ZERO)
    assert mask == _where(rows, lambda t: t[0] == "zk_half" and t[2] == _kernels.RULE_CONTEXT_SPAN_EMPTY)
    assert fixup and mask and not set(fixup) & set(mask)


def test_everything_by_default_is_every_instantiation_once(fake_device):
    n = zerokv.precompile(device=0)
    every = [e for exprs in _kernels.instantiations().values() for e in exprs]
    assert sorted(e for _, e, _ in fake_device) == sorted(every)
    assert n == len(every) == len(set(every))


def test_selection_only_names_instantiations_the_offline_compile_knows():
    every = {e for exprs in _kernels.instantiations().values() for e in exprs}
    for dtypes in (("float32",), ("float16", "float8_e4m3fn"), pc.DTYPES):
        for op in pc.OPS:
            chosen = [k.expr(*t) for k, t in pc.selection(dtypes, (op,))]
            assert set(chosen) <= every, op
    for op in pc.OPS:  # every op launches something
        assert pc.selection(pc.DTYPES, (op,)), op


def test_current_device_is_the_default(fake_device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    zerokv.precompile(dtypes=("float32",), ops=("merge_state",))
    assert {d for *_, d in fake_device} == {2}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtypes": ("int32",)}, TypeError, "dtypes: 'int32'"),
        ({"dtypes": (torch.float64,)}, TypeError, "dtypes: torch.float64"),
        ({"ops": ("merge",)}, ValueError, "ops: 'merge'"),
        ({"device": "cpu"}, ValueError, "device: 'cpu'"),
        ({"device": -1}, ValueError, "device: -1"),
        ({"device": 1.5}, TypeError, "device: expected"),
        ({"device": True}, TypeError, "device: True"),
    ],
)
def test_bad_arguments_are_rejected_before_anything_compiles(fake_device, kwargs, error, match):
    with pytest.raises(error, match=match):
        zerokv.precompile(**kwargs)
    assert fake_device == []


# --- on a GPU: precompile, then a CUDA graph that compiles nothing ----------------------------


def _fill(bufs, fresh) -> None:
    for b, f in zip(bufs, fresh, strict=True):
        b.copy_(f)


@pytest.mark.gpu
def test_precompile_then_cuda_graph_capture_compiles_nothing(monkeypatch):
    from zerokv.core import plans as _plans

    _plans.clear_cache()  # nothing loaded in this process: precompile has to load it all
    dtypes = ("bfloat16", "float8_e4m3fn")
    n = zerokv.precompile(
        dtypes=dtypes, ops=("merge_state", "merge_states", "fixup_zero_kv_rows", "mask_empty_context")
    )
    assert n == len(
        pc.selection(dtypes, ("merge_state", "merge_states", "fixup_zero_kv_rows", "mask_empty_context"))
    )
    built, loaded = _compiler._modules_built, _compiler.loaded_count()

    def no_compile(*args, **kwargs):
        raise AssertionError("a kernel was compiled after precompile")

    monkeypatch.setattr(_compiler, "_build", no_compile)

    dev = "cuda"
    T, H = 300, 8
    v_a, s_a, v_b, s_b = make_states(T, H, 128, torch.bfloat16, dev, seed=1)  # vector path
    w_a, t_a, w_b, t_b = make_states(T, H, 7, torch.bfloat16, dev, seed=2)  # scalar path
    v = torch.stack([w_a, w_b])
    s = torch.stack([t_a, t_b])
    g = torch.Generator(device="cpu").manual_seed(3)
    B = 20
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.randint(0, 30, (B,), generator=g).cumsum(0)])
    cu = (cu * T // cu[-1]).to(torch.int32).to(dev)
    kv = torch.randint(0, 3, (B,), generator=g).to(torch.int32).to(dev)
    cukv = torch.cat([kv.new_zeros(1), kv.cumsum(0)]).to(torch.int32)
    scale = torch.tensor([1 / 64], device=dev)

    out = torch.empty(T, H, 128, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, H, device=dev)
    out_n = torch.empty(T, H, 7, dtype=torch.bfloat16, device=dev)
    lse_n = torch.empty(T, H, device=dev)
    out8 = torch.empty(T, H, 128, dtype=torch.float8_e4m3fn, device=dev)
    o1, l1 = v_b.clone(), s_b.clone()  # fixed up in place
    o2, l2 = v_b.clone(), s_b.clone()  # masked in place

    def calls():
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
        zerokv.merge_states(v, s, out=out_n, out_lse=lse_n)
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out8, out_scale=scale)
        zerokv.fixup_zero_kv_rows(o1, l1, kv, cu)
        zerokv.mask_empty_context(o2, l2, cu, cukv)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as before any capture: the first calls of each op
        calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):  # a stream of the current device
        calls()
    torch.cuda.synchronize()
    assert (_compiler._modules_built, _compiler.loaded_count()) == (built, loaded)

    # Replay on fresh inputs, outputs poisoned: the graph computes the ops, right.
    fresh = make_states(T, H, 128, torch.bfloat16, dev, seed=4)
    _fill((v_a, s_a, v_b, s_b), fresh)
    fresh_n = make_states(T, H, 7, torch.bfloat16, dev, seed=5)
    _fill((v[0], s[0], v[1], s[1]), fresh_n)
    for buf in (out, lse, out_n, lse_n):
        buf.fill_(float("nan"))
    out8.fill_(float("nan"))
    for dst, src in ((o1, v_b), (l1, s_b), (o2, v_b), (l2, s_b)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()

    ref_out, ref_lse = reference.merge_state(*(f64(x) for x in (v_a, s_a, v_b, s_b)))
    assert_close(out, ref_out, torch.bfloat16, "merge_state out")
    assert_close(lse, ref_lse, torch.float32, "merge_state lse")
    ref_out, ref_lse = reference.merge_states(f64(v), f64(s))
    assert_close(out_n, ref_out, torch.bfloat16, "merge_states out")
    assert_close(lse_n, ref_lse, torch.float32, "merge_states lse")
    expected8 = torch.from_numpy(
        np.clip(reference.merge_state(*(f64(x) for x in (v_a, s_a, v_b, s_b)))[0] * 64, -448, 448)
    )
    torch.testing.assert_close(out8.float().cpu(), expected8.float(), rtol=1 / 16, atol=2**-9, equal_nan=True)
    cu_np, kv_np, cukv_np = (x.cpu().numpy() for x in (cu, kv, cukv))
    ref_o, ref_l = reference.fixup_zero_kv_rows(f64(v_b), f64(s_b), kv_np, cu_np)
    assert_close(o1, ref_o, torch.bfloat16, "fixup out")
    assert_close(l1, ref_l, torch.float32, "fixup lse")
    ref_o, ref_l = reference.mask_empty_context(f64(v_b), f64(s_b), cu_np, cukv_np)
    assert_close(o2, ref_o, torch.bfloat16, "mask out")
    assert_close(l2, ref_l, torch.float32, "mask lse")
