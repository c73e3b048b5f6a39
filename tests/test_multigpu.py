"""Every op with its tensors on a device other than the current one (needs two GPUs).

Inputs on cuda:1 while cuda:0 is current (and the reverse): the kernel runs on that device's
current torch stream, results equal the reference, the other device is left alone, and the
current device is unchanged. Also: mixed devices are rejected, two threads drive two GPUs from
a cold cache, and a CUDA graph captured on cuda:1 replays.
"""

from __future__ import annotations

import threading

import pytest
import torch
from batches import check_empty_rows, empty_rows, garbage_state, make_batch
from conftest import assert_close, f64
from states import NAN, make_states

import zerokv
from zerokv import reference
from zerokv.compat import flashinfer, sglang, vllm
from zerokv.core import compiler as _compiler
from zerokv.core import plans as _plans

pytestmark = pytest.mark.multigpu


@pytest.fixture(autouse=True)
def _restore_current_device():
    """These tests switch devices; the tests after them find the device they started on."""
    before = torch.cuda.current_device() if torch.cuda.is_available() else None
    yield
    if before is not None:
        torch.cuda.set_device(before)


def _merge_calls(dev):
    """(name, call, check) for every merge op and adapter on ``dev``."""
    v_a, s_a, v_b, s_b = make_states(300, 8, 64, torch.bfloat16, dev, seed=1)
    ref = reference.merge_state(*(f64(x) for x in (v_a, s_a, v_b, s_b)))
    ref2 = reference.merge_state(*(f64(x) for x in (v_a, s_a, v_b, s_b)), lse_base=2)
    out = torch.full_like(v_a, NAN)

    def native():
        o, lse = zerokv.merge_state(v_a, s_a, v_b, s_b)
        return (o, lse), ref

    def native_out():
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out)
        return (out, None), ref

    def states():
        o, lse = zerokv.merge_states(torch.stack([v_a, v_b]), torch.stack([s_a, s_b]))
        return (o, lse), ref

    def vllm_merge():
        o = torch.full_like(v_a, NAN)
        o_lse = torch.full_like(s_a.T.contiguous(), NAN)
        vllm.merge_attn_states(o, v_a, s_a.T, v_b, s_b.T, o_lse)
        return (o, o_lse.T), ref

    def sglang_merge():
        return sglang.merge_state_v2(v_a, s_a, v_b, s_b), ref

    def fi_merge():
        return flashinfer.merge_state(v_a, s_a, v_b, s_b), ref2

    def fi_in_place():
        v, s = v_a.clone(), s_a.clone()
        flashinfer.merge_state_in_place(v, s, v_b, s_b)
        return (v, s), ref2

    def fi_states():
        return flashinfer.merge_states(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1)), ref2

    return [native, native_out, states, vllm_merge, sglang_merge, fi_merge, fi_in_place, fi_states]


def _empty_row_calls(dev):
    cu, kv = make_batch(40, 30, "random", seed=3)
    rows = empty_rows(cu, kv)
    cu_kv = torch.cat([torch.zeros(1, dtype=kv.dtype), kv.cumsum(0).to(kv.dtype)])
    cu, kv, cu_kv = cu.to(dev), kv.to(dev), cu_kv.to(dev)

    def case(fn):
        def run():
            out, lse = garbage_state(int(cu[-1]), 4, 64, torch.float16, rows, dev, 4, lse_ht=False)
            before = out.clone(), lse.clone()
            fn(out, lse)
            return out, lse, before

        return run

    return rows, [
        case(lambda o, s: zerokv.fixup_zero_kv_rows(o, s, kv, cu)),
        case(lambda o, s: zerokv.mask_empty_context(o, s, cu, cu_kv)),
        case(lambda o, s: sglang.fixup_zero_kv_rows(o, s, kv, cu, 1)),
        case(lambda o, s: vllm.mask_empty_context(s.T, o, cu, cu_kv)),
    ]


@pytest.mark.parametrize("tensor_dev, current", [(1, 0), (0, 1)])
def test_every_op_runs_on_its_tensors_device_and_stream(tensor_dev, current):
    dev = torch.device("cuda", tensor_dev)
    torch.cuda.set_device(current)
    other_before = torch.cuda.memory_allocated(current)
    side = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(side):  # the tensors' device's current stream is a busy side stream
        torch.cuda._sleep(20_000_000)
        for call in _merge_calls(dev):
            (o, lse), (ref_out, ref_lse) = call()
            side.synchronize()
            assert o.device == dev
            assert_close(o, ref_out, torch.bfloat16)
            if lse is not None:
                assert_close(lse, ref_lse, torch.float32)
        rows, calls = _empty_row_calls(dev)
        for call in calls:
            out, lse, before = call()
            side.synchronize()
            check_empty_rows(out, lse, *before, rows)
    assert torch.cuda.current_device() == current
    assert torch.cuda.memory_allocated(current) == other_before  # nothing landed on the other GPU


def test_tensors_on_two_devices_are_rejected_before_anything_is_written():
    v_a, s_a, v_b, s_b = make_states(16, 2, 8, torch.float32, "cuda:0", seed=5)
    out = torch.full_like(v_a, NAN)
    with pytest.raises(ValueError, match=r"v_b is on cuda:1 but v_a is on cuda:0"):
        zerokv.merge_state(v_a, s_a, v_b.to("cuda:1"), s_b, out=out)
    with pytest.raises(ValueError, match=r"out is on cuda:1"):
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out.to("cuda:1"))
    assert out.isnan().all()


def test_two_threads_two_gpus_from_a_cold_cache():
    _plans.clear_cache()
    built_before = _compiler._modules_built
    errors = []

    def drive(i):
        try:
            torch.cuda.set_device(i)
            for call in _merge_calls(torch.device("cuda", i)):
                (o, lse), (ref_out, ref_lse) = call()
                torch.cuda.synchronize(i)
                assert_close(o, ref_out, torch.bfloat16)
            rows, calls = _empty_row_calls(torch.device("cuda", i))
            for call in calls:
                out, lse, before = call()
                torch.cuda.synchronize(i)
                check_empty_rows(out, lse, *before, rows)
        except Exception as e:  # reported below, with the thread's device
            errors.append((i, e))

    threads = [threading.Thread(target=drive, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    keys = list(_compiler._functions)
    assert len(keys) == len(set(keys))
    per_device = {d: sorted(k[:2] for k in keys if k[2] == d) for d in (0, 1)}
    assert per_device[0] == per_device[1]  # the same kernels, loaded once on each device
    assert _compiler._modules_built - built_before == len(keys)


def test_cuda_graph_captured_on_the_second_gpu_replays():
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    v_a, s_a, v_b, s_b = make_states(512, 8, 128, torch.bfloat16, dev, seed=7)
    out, lse = torch.full_like(v_a, NAN), torch.full_like(s_a, NAN)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
    graph = torch.cuda.CUDAGraph()
    # an explicit capture stream: torch.cuda.graph's default one is made once per process, on
    # the device current at its first use, and would capture later graphs of cuda:0 on cuda:1
    with torch.cuda.device(dev), torch.cuda.graph(graph, stream=torch.cuda.Stream(dev)):
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
    fresh = make_states(512, 8, 128, torch.bfloat16, dev, seed=8)
    for dst, src in zip((v_a, s_a, v_b, s_b), fresh, strict=True):
        dst.copy_(src)
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize(dev)
    ref_out, ref_lse = reference.merge_state(*(f64(x) for x in fresh))
    assert_close(out, ref_out, torch.bfloat16)
    assert_close(lse, ref_lse, torch.float32)
