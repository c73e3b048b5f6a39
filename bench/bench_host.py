"""Host cost of a call from Python, on tiny tensors (T=4, H=2, D=64 bf16) so the GPU is never
the bottleneck: N calls timed by ``time.perf_counter``, synchronised before and after, and the
ratio to ``torch.mul(a, b, out=c)`` in the same process. The engine adapters are timed when
importable. Then merge_state inside a captured CUDA graph: GPU µs per call in the replay
against the eager call.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

from .common import Bench, Row, Sets, Task, host_us

T, H, D = 4, 2, 64
CALLS = 20000
GRAPH_CALLS = 100
MUL = "torch.mul(a, b, out=c)"
MERGE6 = "merge_state (all 6 tensors)"
MERGE6_NEW = "merge_state (all 6 tensors, new tensors every call)"
GRAPH = "merge_state in a CUDA graph"


def _tensors(b: Bench) -> SimpleNamespace:
    """One set of tiny tensors for every call, made once per run."""
    t = b.shared.get("host_tensors")
    if t is not None:
        return t
    torch, dev, bf = b.torch, b.device, b.torch.bfloat16

    def v(*shape):
        return torch.randn(*shape, device=dev, dtype=bf)

    def s(*shape):
        return torch.randn(*shape, device=dev)

    t = SimpleNamespace(
        a=v(T, H, D), b=v(T, H, D), c=v(T, H, D),
        va=v(T, H, D), vb=v(T, H, D), out=v(T, H, D), sa=s(T, H), sb=s(T, H), ol=s(T, H),
        v=v(2, T, H, D), s=s(2, T, H), v_tn=v(T, 2, H, D), s_tn=s(T, 2, H),
        fo=v(T, H, D), fl=s(T, H), lse_ht=s(H, T), pl_ht=s(H, T), sl_ht=s(H, T), ol_ht=s(H, T),
        ip_v=v(T, H, D), ip_s=s(T, H), n_calls=calls(b) + warmup(b) + 1,
        cu=torch.tensor([0, 2, 4], dtype=torch.int32, device=dev),
        kv=torch.tensor([0, 3], dtype=torch.int32, device=dev),
        cukv=torch.tensor([0, 0, 3], dtype=torch.int32, device=dev),
    )  # fmt: skip
    b.shared["host_tensors"] = t
    return t


def _zk(name: str) -> Any:
    return importlib.import_module(name)


def _new_tensors_each_call(torch: Any, t: SimpleNamespace) -> Callable[[], Any]:
    """merge_state on a different set of six tensors (views at other addresses) every call, so
    that nothing the library remembers about a previous call applies."""
    merge = _zk("zerokv").merge_state
    n = t.n_calls
    v = torch.randn(3, n, T, H, D, device=t.va.device, dtype=t.va.dtype)
    s = torch.randn(3, n, T, H, device=t.va.device)
    sets = [(v[0, i], s[0, i], v[1, i], s[1, i], v[2, i], s[2, i]) for i in range(n)]
    it = itertools.cycle(sets)

    def call() -> Any:
        va, sa, vb, sb, out, out_lse = next(it)
        return merge(va, sa, vb, sb, out=out, out_lse=out_lse)

    return call


# name -> builder(torch, tensors) -> zero-argument call; a builder that raises is skipped
BUILDERS: list[tuple[str, Callable[[Any, SimpleNamespace], Callable[[], Any]]]] = [
    (MUL, lambda torch, t: partial(torch.mul, t.a, t.b, out=t.c)),
    (MERGE6, lambda torch, t: partial(_zk("zerokv").merge_state, t.va, t.sa, t.vb, t.sb, out=t.out, out_lse=t.ol)),
    (MERGE6_NEW, _new_tensors_each_call),
    ("merge_state (out=None)", lambda torch, t: partial(_zk("zerokv").merge_state, t.va, t.sa, t.vb, t.sb)),
    ("merge_states (N=2, out given)", lambda torch, t: partial(_zk("zerokv").merge_states, t.v, t.s, out=t.out, out_lse=t.ol)),
    ("fixup_zero_kv_rows", lambda torch, t: partial(_zk("zerokv").fixup_zero_kv_rows, t.fo, t.fl, t.kv, t.cu)),
    ("mask_empty_context", lambda torch, t: partial(_zk("zerokv").mask_empty_context, t.fo, t.fl, t.cu, t.cukv)),
    ("compat.vllm.merge_attn_states", lambda torch, t: partial(
        _zk("zerokv.compat.vllm").merge_attn_states, t.out, t.va, t.pl_ht, t.vb, t.sl_ht, t.ol_ht)),
    ("compat.vllm.mask_empty_context", lambda torch, t: partial(
        _zk("zerokv.compat.vllm").mask_empty_context, t.lse_ht, t.fo, t.cu, t.cukv)),
    ("compat.sglang.merge_state_v2", lambda torch, t: partial(
        _zk("zerokv.compat.sglang").merge_state_v2, t.va, t.sa, t.vb, t.sb, t.out, t.ol)),
    ("compat.sglang.fixup_zero_kv_rows", lambda torch, t: partial(
        _zk("zerokv.compat.sglang").fixup_zero_kv_rows, t.fo, t.fl, t.kv, t.cu, 2)),
    ("compat.flashinfer.merge_state", lambda torch, t: partial(
        _zk("zerokv.compat.flashinfer").merge_state, t.va, t.sa, t.vb, t.sb)),
    ("compat.flashinfer.merge_state_in_place", lambda torch, t: partial(
        _zk("zerokv.compat.flashinfer").merge_state_in_place, t.ip_v, t.ip_s, t.vb, t.sb)),
    ("compat.flashinfer.merge_states", lambda torch, t: partial(
        _zk("zerokv.compat.flashinfer").merge_states, t.v_tn, t.s_tn)),
]  # fmt: skip


def calls(b: Bench) -> int:
    return 50 if b.dry else CALLS


def warmup(b: Bench) -> int:
    return 5 if b.dry else 200


def run_call(name: str, build: Callable[[Any, SimpleNamespace], Callable[[], Any]], b: Bench) -> list[Row]:
    row = Row(op="host", impl=name, dtype="bf16", T=T, H=H, D=D)
    try:
        call = build(b.torch, _tensors(b))
    except Exception as e:  # an adapter not written yet, or a signature that differs
        row.note = f"skipped: {type(e).__name__}: {e}"[:300]
        return [row]
    try:
        call()
        b.sync()
        n = calls(b)
        row.us = host_us(b, call, n, warmup=warmup(b) - 1)
    except Exception as e:
        row.note = f"failed: {type(e).__name__}: {e}"[:300]
        return [row]
    row.params["calls"] = n
    if name == MUL:
        b.shared["torch_mul_us"] = row.us
    mul = b.shared.get("torch_mul_us")
    if mul:
        row.params["ratio_to_torch_mul"] = row.us / mul
    b.shared[f"host:{name}"] = row.us
    return [row]


def run_graph(b: Bench) -> list[Row]:
    """``GRAPH_CALLS`` merge_state calls captured in one CUDA graph: GPU µs per call in the
    replay, against the same call made eagerly (GPU µs by events, host µs per call)."""
    row = Row(op="host", impl=GRAPH, dtype="bf16", T=T, H=H, D=D, params={"calls_per_graph": GRAPH_CALLS})
    if b.dry:
        row.note = "skipped: no GPU (dry run)"
        return [row]
    import zerokv

    torch, t = b.torch, _tensors(b)

    def call() -> Any:
        return zerokv.merge_state(t.va, t.sa, t.vb, t.sb, out=t.out, out_lse=t.ol)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    want = t.out.clone(), t.ol.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            call()
    t.out.fill_(float("nan"))
    t.ol.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    matches = bool(torch.equal(t.out, want[0]) and torch.equal(t.ol, want[1]))
    one = Sets(1, lambda k: ())
    row.us = b.time_us(lambda s: graph.replay(), one) / GRAPH_CALLS
    eager_gpu = b.time_us(lambda s: call(), one)
    eager_host = b.shared.get(f"host:{MERGE6}") or host_us(b, call, calls(b))
    row.params.update(replay_matches_eager=matches, eager_gpu_us=eager_gpu, eager_host_us=eager_host)
    if not matches:
        row.note = "the replay did not reproduce the eager output"
    return [row]


def tasks(mode: str) -> list[Task]:
    out = [Task("host", f"host µs: {name}", partial(run_call, name, build)) for name, build in BUILDERS]
    out.append(Task("host", "host: merge_state in a CUDA graph", run_graph))
    return out
