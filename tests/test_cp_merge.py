"""cp_merge (all-gather and all-to-all) and vLLM's DCP combine adapters across a process group.

* CPU: gloo groups of 1, 2, 3 and 4 processes (one spawn of four processes, sub-groups for the
  smaller sizes), every case of ``tests/cp_cases.py`` inside that one spawn; a deliberately
  wrong value fails with its message, every rank still in step.
* One GPU: the kernels alone, with N ranks simulated in one process (the collectives replaced
  by copies of what the other simulated ranks produced in earlier passes), a CUDA graph of the
  all-to-all's pack and merge, and a real NCCL group of one.
* Two GPUs: NCCL, in ``tests/test_multigpu.py``.
* No GPU needed: host tensors down the GPU path (launches and collectives recorded): a plan per
  signature, its cheap check, and the full validation's errors for the calls it sends back.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import random
import time
import types

import numpy as np
import pytest
import torch
from cp_cases import (
    DTYPES,
    NAN,
    REFERENCE,
    Ctx,
    case_bad_input,
    case_empty_rows,
    case_every_empty_pattern,
    case_grid,
    case_layouts,
    case_modes_agree,
    case_nan,
    case_pipelined,
    case_send_buffer,
    case_sinks,
    case_split_keys,
    case_vllm,
    case_wrong_value,
    cases,
    check,
    cp_cpu,
    cpm,
    expected,
    heads,
    nccl_run,
    run_cases,
    states,
    vllm_mask_reference,
)

import zerokv
from zerokv import reference
from zerokv.compat import vllm
from zerokv.core import executor

dist = torch.distributed

# --- CPU: gloo, one spawn of four processes ------------------------------------------------------

WORLD = 4
TIMEOUT = datetime.timedelta(seconds=60)  # a hang (a bug, never a wrong value) ends within it


def cpu_cases(ctx):
    grid = lambda: case_grid(ctx, DTYPES, (0, 1, 7, 33), (1, 8, 13), (None,))  # noqa: E731
    return cases(ctx, grid)


def _gloo_worker(rank: int, init: str, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    results: dict = {}
    try:
        for n in range(1, WORLD + 1):
            group = dist.new_group(list(range(n)), timeout=TIMEOUT)
            if rank < n:
                ctx = Ctx(rank, n, group, torch.device("cpu"))
                results[n] = run_cases(ctx, cpu_cases(ctx))
            dist.barrier()
        # the failure-surfacing check: a wrong value on the last rank of a group of 3, then a
        # case that needs every rank in step; timed from the first rank's start to the end
        group = dist.new_group([0, 1, 2], timeout=TIMEOUT)
        if rank < 3:
            ctx = Ctx(rank, 3, group, torch.device("cpu"))
            start = time.monotonic()
            wrong = run_cases(ctx, [("wrong value", lambda: case_wrong_value(ctx))])
            after = run_cases(Ctx(rank, 3, group, torch.device("cpu")), [("after", lambda: case_nan(ctx))])
            results["wrong"] = {"failures": wrong, "after": after, "seconds": time.monotonic() - start}
        dist.barrier()
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("gloo")
    torch.multiprocessing.start_processes(
        _gloo_worker, args=(f"file://{d / 'store'}", str(d)), nprocs=WORLD, join=True, start_method="spawn"
    )
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("n", range(1, WORLD + 1))
def test_gloo_group(gloo_results, n):
    fails = [x for r in range(n) for x in gloo_results[r].get(str(n), ["group did not run"])]
    assert not fails, "\n".join(fails)


def test_a_wrong_value_fails_with_its_message_in_seconds(gloo_results):
    """A wrong value on one rank: that rank reports the case, the value and the bound; the other
    ranks report nothing; every rank stays in step (the next case passes) and it takes seconds."""
    wrong = [gloo_results[r]["wrong"] for r in range(3)]
    assert not wrong[0]["failures"] and not wrong[1]["failures"]
    (first, *_) = wrong[2]["failures"]
    assert "rank 2 of 3, wrong value:" in first and "values off, worst" in first and "bound" in first
    assert all(not w["after"] for w in wrong), [w["after"] for w in wrong]
    assert max(w["seconds"] for w in wrong) < 10


# --- host-side behaviour without a group ---------------------------------------------------------


def test_needs_an_initialised_group():
    assert not (dist.is_available() and dist.is_initialized()), "a default group exists in this process"
    with pytest.raises(ValueError, match="not initialised"):
        zerokv.cp_merge(torch.zeros(2, 2, 4), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="not initialised"):
        zerokv.cp_merge(torch.zeros(2, 2, 4), torch.zeros(2, 2), exchange="a2a")
    with pytest.raises(ValueError, match="not initialised"):
        zerokv.cp_send_buffer(2, 2, 4, torch.float32)


def test_empty_shard_rows_matches_searchsorted():
    rng = np.random.default_rng(3)
    for B in (1, 2, 5, 33):
        for _ in range(20):
            qsl = np.concatenate([[0], np.cumsum(rng.integers(0, 4, size=B))])
            lens = rng.integers(0, 2, size=B)
            T = int(qsl[-1]) + int(rng.integers(0, 3))
            assert (cp_cpu.empty_shard_rows(lens, qsl, T) == vllm_mask_reference(lens, qsl, T)).all()
    assert cp_cpu.empty_shard_rows(np.zeros(0), np.array([2]), 4).tolist() == [False, False, True, True]


def test_shares_sum_to_the_reference():
    """Summing every rank's share of V gives the N-way merge (float64 host math)."""
    rng = np.random.default_rng(9)
    N, T, H, D = 3, 6, 4, 5
    v = rng.standard_normal((N, T, H, D))
    s = rng.standard_normal((N, T, H)) * 3
    s[0, 1, 2] = -np.inf
    s[:, 2, 0] = np.inf
    sinks = rng.standard_normal(H)
    want, lse = reference.merge_states(v, s, "e", sinks)
    total = 0.0
    for r in range(N):
        f, g = cp_cpu.shares(s, r, "e", sinks)
        total = total + np.where(f[..., None] > 0, f[..., None] * v[r], 0.0)
        np.testing.assert_allclose(g, lse, rtol=1e-12)
    np.testing.assert_allclose(total, want, rtol=1e-12, atol=1e-12)


def test_a2a_layout_keeps_blocks_on_16_bytes():
    """Each peer's chunk: V, then the LSE, each block on 16 bytes, nothing in between but padding."""
    a2a = cpm.a2a
    for N, T, Hn, D, wire in ((1, 1, 1, 1, "bfloat16"), (3, 7, 2, 13, "float16"), (4, 5, 3, 512, "float32")):
        lay = a2a.layout(N, T, Hn, D, wire)
        size = 4 if wire == "float32" else 2
        assert lay.lse_off % 16 == 0 and lay.chunk % 16 == 0
        assert 0 <= lay.lse_off - T * Hn * D * size < 16 and 0 <= lay.chunk - lay.lse_off - 4 * T * Hn < 16
        v, lse = a2a.views(torch, torch.zeros(lay.nbytes, dtype=torch.uint8), lay)
        assert v.shape == (N, T, Hn, D) and lse.shape == (N, T, Hn)
        v.fill_(1.0)  # V and LSE views do not overlap
        lse.fill_(-2.0)
        assert (v == 1).all() and (lse == -2).all()


# --- one GPU: the kernels alone, ranks simulated ------------------------------------------------


class SimulatedWorld:
    """N ranks in one process on one GPU. Each case runs three passes over the ranks; the k-th
    collective of a rank records its input, and returns what all ranks recorded for their k-th
    call once every rank has (the LSEs from pass 1 on, the sums in pass 2)."""

    def __init__(self, N):
        self.N, self.rank, self.k = N, 0, 0
        self.seen: dict = {}

    def start(self, rank):
        self.rank, self.k = rank, 0

    def _record(self, x):
        self.k += 1
        got = self.seen.setdefault(self.k, {})
        got[self.rank] = x.clone()
        return got if len(got) == self.N else None

    def all_gather(self, out, src, group=None, async_op=False):
        got = self._record(src)
        if got:
            out.copy_(torch.cat([got[r].reshape(-1) for r in range(self.N)]))
        return _Done() if async_op else None

    def reduce_scatter(self, out, src, group=None, async_op=False):
        got = self._record(src)
        if got:
            total = sum(got[r].float() for r in range(self.N)).view(self.N, -1)[self.rank]
            out.copy_(total.to(out.dtype))
        return _Done() if async_op else None

    def all_reduce(self, t, group=None, async_op=False):
        got = self._record(t)
        if got:
            t.copy_(sum(got[r].float() for r in range(self.N)).to(t.dtype))
        return _Done() if async_op else None

    def all_to_all(self, out, src, group=None, async_op=False):
        got = self._record(src)
        if got:
            out.copy_(torch.cat([got[r].view(self.N, -1)[self.rank] for r in range(self.N)]))
        return _Done() if async_op else None


class _Done:
    def wait(self):
        return True


def simulate(monkeypatch, N, case):
    """Run ``case`` on N simulated ranks; the failures of the checked pass, asserted."""
    world = SimulatedWorld(N)
    monkeypatch.setattr(cpm, "_group", lambda torch_, group, arg: (None, N, world.rank))
    monkeypatch.setattr(
        cpm,
        "_collectives",
        lambda torch_: (world.all_gather, world.reduce_scatter, world.all_reduce, world.all_to_all),
    )
    failures: list = []
    try:
        for p in range(3):
            REFERENCE[0] = p == 2
            for r in range(N):
                world.start(r)
                ctx = Ctx(r, N, None, torch.device("cuda", 0), checking=p == 2, real=False, failures=failures)
                run_cases(ctx, [(getattr(case, "__name__", "case"), lambda: case(ctx))])
    finally:
        REFERENCE[0] = True
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_kernels_with_simulated_ranks(monkeypatch, N):
    torch.manual_seed(N)
    simulate(monkeypatch, N, lambda c: case_grid(c, DTYPES, (0, 1, 7, 300), (13, 128), (None, "input")))
    for case in (case_empty_rows, case_every_empty_pattern, case_nan, case_sinks, case_split_keys, case_modes_agree,
                 case_send_buffer, case_layouts, case_vllm, case_bad_input, case_pipelined):  # fmt: skip
        simulate(monkeypatch, N, case)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 3])
def test_a2a_kernels_in_a_cuda_graph(N):
    """The all-to-all's pack and merge on simulated ranks, each rank's calls captured in a CUDA
    graph (the collective replaced by a copy between the ranks' buffers outside the graph) and
    replayed on new inputs; against the float64 reference."""
    T, H, D, dev = 96, 4 * N, 512, torch.device("cuda", 0)
    Hn = H // N
    a2a = cpm.a2a
    lay = a2a.layout(N, T, Hn, D, "bfloat16")
    sends = [torch.empty(lay.nbytes, dtype=torch.uint8, device=dev) for _ in range(N)]
    recvs = [torch.empty_like(x) for x in sends]
    ins = [
        (torch.empty((T, H, D), dtype=torch.bfloat16, device=dev), torch.empty((T, H), device=dev))
        for _ in range(N)
    ]
    outs = [
        (torch.empty((T, Hn, D), dtype=torch.bfloat16, device=dev), torch.empty((T, Hn), device=dev))
        for _ in range(N)
    ]
    graphs = []
    for r in range(N):  # each rank: its pack in one graph, its merge in another
        v, s = ins[r]
        v.normal_()
        s.normal_()
        out, out_lse = outs[r]
        g_pack, g_merge = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(dev)
        args = cpm.validate(torch, v, s, N, "heads", "a2a", "e", None, None, out, out_lse, None, None, None,
                            cpm.Names(None))  # fmt: skip
        for g, step in ((g_pack, 0), (g_merge, 1)):
            for capture in (False, True):  # warm-up (compile), then capture
                if capture:
                    torch.cuda.synchronize()
                    ctxm = torch.cuda.graph(g, stream=stream)
                else:
                    ctxm = torch.cuda.stream(stream)
                with ctxm:
                    if step == 0:
                        a2a._pack(
                            args, lay, sends[r].data_ptr(), False, torch.cuda.current_stream().cuda_stream
                        )
                    else:
                        v_in, s_in = a2a.views(torch, recvs[r], lay)
                        zerokv.merge_states(v_in, s_in, out=out, out_lse=out_lse)
        graphs.append((g_pack, g_merge))
    for seed in (81, 83):
        V, S = states(seed, N, T, H, D, torch.bfloat16, dev)
        for r in range(N):
            ins[r][0].copy_(V[r])
            ins[r][1].copy_(S[r])
            outs[r][0].fill_(NAN)
            outs[r][1].fill_(NAN)
            graphs[r][0].replay()
        torch.cuda.synchronize()
        for r in range(N):  # the all-to-all: chunk r of every rank's send buffer to rank r
            recvs[r].copy_(torch.cat([sends[j].view(N, -1)[r] for j in range(N)]))
        for r in range(N):
            graphs[r][1].replay()
        torch.cuda.synchronize()
        want, lse, mag = expected(V, S)
        failures: list = []
        for r in range(N):
            ctx = Ctx(r, N, None, dev, failures=failures)
            check(
                ctx,
                outs[r][0],
                heads(want, ctx, "heads"),
                heads(mag, ctx, "heads"),
                torch.bfloat16,
                f"graph {seed}",
            )
            check(ctx, outs[r][1], heads(lse, ctx, "heads"), None, "lse", f"graph {seed} lse")
        assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_nccl_one_gpu(tmp_path):
    """A real NCCL group of one: the default-group path, no collectives, the same cases."""
    nccl_run(tmp_path, 1)


# --- the launches: every parameter packed by name --------------------------------------------------


class _Recorder:
    """A launcher that packs the arguments as the real one does and keeps the bytes."""

    def __init__(self, kernel, targs, device, seen):
        self.kernel, self.targs, self.seen = kernel, targs, seen

    def launch_values(self, grid, grid_y, stream, values):
        buf = bytearray(self.kernel.packer.size)
        self.kernel.packer.pack_into(buf, 0, *values)
        self.seen.append((self.kernel.name, self.targs, grid, stream, bytes(buf)))


class _Ptr:
    def __init__(self, p):
        self.p = p

    def data_ptr(self):
        return self.p


def test_launches_pack_every_parameter_by_name(monkeypatch):
    """The pack kernels' and the finalize kernel's arguments, packed by name from a call's
    facts, are the bytes of the kernel's parameters in its C order (written out here by hand)."""
    launch_mod = importlib.import_module("zerokv.cp_merge.launch")
    from zerokv.core import kernels
    from zerokv.core.tensors import Tensor

    seen: list = []
    monkeypatch.setattr(launch_mod._plans, "launcher", lambda k, t, d: _Recorder(k, t, d, seen))
    monkeypatch.setattr(launch_mod._plans, "get", lambda key: None)  # build a plan every time,
    monkeypatch.setattr(launch_mod._plans, "lookup", lambda key, build: build())  # never kept

    def t(ptr, shape, strides, dtype):
        return Tensor(None, ptr, shape, strides, dtype, 0, True)

    a = cpm.a2a.Args(
        t(4096, (7, 6, 40), (320, 48, 1), "bfloat16"), t(8192, (7, 6), (1, 9), "float32"), None, None,
        t(1 << 21, (3,), (1,), "int64"), t(1 << 22, (4,), (1,), "int32"),
        7, 6, 40, 3, "float32", "bfloat16", "e", 0, "heads", "a2a", None,
    )  # fmt: skip
    lay = cpm.a2a.layout(2, 7, 3, 40, "float32")
    cpm.a2a._pack(a, lay, 1 << 30, True, 77)
    cp_ag = cpm.allgather
    cp_ag._pack_lse(a, _Ptr(1 << 31), 78)
    o = t(1 << 35, (7, 3, 40), (240, 80, 1), "bfloat16")
    cp_ag._finalize(a, _Ptr(1 << 34), o, 1, 6, None, 80)
    pack = kernels.CP_A2A_PACK.packer.pack
    want = [
        ("cp_a2a_pack_kernel", ("zk_bfloat16", "float", 8, 1), -(-7 * 6 * 8 // 256), 77,
         pack(4096, 320, 48, 8192, 1, 9, 1 << 30, lay.chunk, lay.lse_off, 7, 6, 3, 40, 3, 1, 1 << 21, 1, 1 << 22, 0, 3)),
        ("cp_pack_lse_kernel", (1,), 1, 78,
         kernels.CP_PACK_LSE.packer.pack(8192, 1, 9, 1 << 31, 7, 6, 1 << 21, 1, 1 << 22, 0, 3)),
        ("cp_finalize_kernel", ("float", "zk_bfloat16", 8), 1, 80,
         kernels.CP_FINALIZE.packer.pack(1 << 34, (1 << 35) + 240 * 2, 240, 80, 5, 3, 40, 8, 0)),
    ]  # fmt: skip
    assert seen == want
    with pytest.raises(TypeError, match=r"missing \['batch'\]"):
        launch_mod.launch(kernels.CP_PACK_LSE, (0,), 0, 1, 0, **dict.fromkeys(["s", "s_st", "s_sh", "dst", "T", "H",
                          "seq_lens", "sl_is64", "qsl", "q_is64"], 0))  # fmt: skip


# --- the GPU path's host side: a plan per signature, its cheap check, the full validation -------


@pytest.fixture
def gpu_path(monkeypatch):
    """Host tensors down the GPU path in a faked group of ``seen.N`` ranks: launches and
    collectives recorded, the Args each run got kept, and every call of ``validate`` (its Args
    or the exception it raised) in ``seen.validated``."""
    from zerokv.core import device as _device
    from zerokv.core import plans as _plans

    seen = types.SimpleNamespace(N=1, launches=[], collectives=[], validated=[], args=[])
    _plans.clear_cache()
    monkeypatch.setattr(_plans, "launcher", lambda k, t, d: _Recorder(k, t, d, seen.launches))
    monkeypatch.setattr(_device, "torch_stream", lambda device: 0)
    monkeypatch.setattr(cpm, "_group", lambda torch_, group, arg: (None, seen.N, 0))
    names = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    fake = tuple(lambda *a, _n=n, **k: seen.collectives.append(_n) for n in names)
    monkeypatch.setattr(cpm, "_collectives", lambda torch_: fake)
    read, validate = cpm._plan.read, cpm.validate

    def on_device(*a):  # the branch a CUDA tensor takes
        f = read(*a)
        if f is not None:
            f.device = 0
        return f

    def counted(*a):
        try:
            seen.validated.append(validate(*a))
        except (TypeError, ValueError) as e:
            seen.validated.append(e)
            raise
        return seen.validated[-1]

    monkeypatch.setattr(cpm._plan, "read", on_device)
    monkeypatch.setattr(cpm, "validate", counted)
    for mod in (cpm.allgather, cpm.a2a):
        monkeypatch.setattr(mod, "run", lambda *a, _run=mod.run: (seen.args.append(a[5]), _run(*a))[1])
    yield seen
    _plans.clear_cache()


BF = torch.bfloat16


def _nan(shape, dtype=torch.float32):
    return torch.full(shape, NAN, dtype=dtype)


def _vs(T, H, dtype):
    g = torch.Generator().manual_seed(T)
    return {"v": torch.randn(T, H, 16, generator=g).to(dtype), "s": torch.randn(T, H, generator=g)}


def _send(T):
    v, s, send = zerokv.cp_send_buffer(T, 4, 16, BF, None, device="cpu")
    return {"v": v, "s": s, "send": send, "exchange": "a2a", "out": _nan((T, 4, 16), BF)}


def _combine(k):
    k = dict(k)
    return cpm.combine(k.pop("v"), k.pop("s"), None, **k)


def _vllm(k):
    return vllm.cp_lse_ag_out_rs(k["v"], k["s"], None, return_lse=True)


# name: (N, the call's arguments for T tokens, the call); H = 4, D = 16
SIGNATURES = {
    "plain": (1, lambda T: dict(_vs(T, 4, BF), out=_nan((T, 4, 16), BF), wire_dtype=BF), _combine),
    "options": (1, lambda T: dict(v=torch.randn(T, 6, 16)[:, :4], s=torch.randn(4, T).T, out=_nan((T, 4, 16)),
                                  out_lse=_nan((T, 4)), sinks=torch.randn(4), lse_base=2, return_lse=True), _combine),
    "fp8": (1, lambda T: dict(_vs(T, 4, torch.float16), scatter="none", out_scale=torch.tensor([0.5]),
                              out=torch.zeros(T, 4, 16, dtype=torch.float8_e4m3fn)), _combine),
    "shards": (1, lambda T: dict(_vs(T, 4, torch.float16), nan_empty=True, out=_nan((T, 4, 16)),
                                 empty_shards=(torch.tensor([1, 0], dtype=torch.int32), torch.tensor([0, 2, T]))),
               _combine),
    "two ranks": (2, lambda T: dict(_vs(T, 4, BF), out=_nan((T, 2, 16), BF)), _combine),
    "a2a": (1, lambda T: dict(_vs(T, 4, torch.float32), exchange="a2a", out=_nan((T, 4, 16)),
                              out_lse=_nan((T, 4))), _combine),
    "send": (1, _send, _combine),
    "send, out allocated": (1, lambda T: {**_send(T), "out": None, "return_lse": True}, _combine),
    "vllm": (1, lambda T: dict(_vs(T, 4, BF)), _vllm),
    "sinks a module's parameter": (1, lambda T: dict(_vs(T, 4, BF), out=_nan((T, 4, 16), BF),
                                                     sinks=torch.nn.Parameter(torch.randn(4), requires_grad=False)),
                                   _combine),
}  # fmt: skip


@pytest.mark.parametrize("name", SIGNATURES)
def test_later_calls_of_a_signature_take_its_plan(gpu_path, name):
    """The first call of a signature is validated; later calls (another T, new tensors) are
    not, and hand the runs the Args and launches that the full validation gives (the arguments
    differ only by the buffers each call allocates)."""
    seen = gpu_path
    seen.N, make, call = SIGNATURES[name]
    call(make(5))
    assert len(seen.validated) == 1
    k = make(9)
    for rnd in range(2):  # 0: the plan; 1: the same call validated (the plans forgotten)
        seen.launches.clear()
        call(k)
        assert len(seen.validated) == 1 + rnd
        if rnd == 0:
            fast, launched = seen.args[-1], [x[:4] for x in seen.launches]  # (kernel, form, grid)
            cpm._plan._plans.clear_cache()
    assert _facts(fast) == _facts(seen.args[-1]) == _facts(seen.validated[-1])
    assert launched == [x[:4] for x in seen.launches] and len(seen.args) == 3


def _facts(a):
    """An Args record with each tensor as its memory, dtype and device (a parameter is read
    through a new plain tensor on each call: the same memory, another object)."""
    from zerokv.core.tensors import Tensor

    return tuple(x[1:] if isinstance(x, Tensor) else x for x in a)


def _alias_buffer(k):
    buf = torch.randn(k["v"].numel() + 1).to(BF)
    return {**k, "v": buf[:-1].view(k["v"].shape), "out": buf[1:].view(k["v"].shape)}


def _shared_outputs(k):
    buf = _nan((k["out"].numel(),))
    return {
        **k,
        "out": buf.view(k["out"].shape),
        "out_lse": buf[: k["out_lse"].numel()].view(k["out_lse"].shape),
    }


def _lse_over_sinks(k):
    buf = _nan((4 + k["out_lse"].numel(),))
    return {**k, "sinks": buf[:4], "out_lse": buf[3 : 3 + k["out_lse"].numel()].view(k["out_lse"].shape)}


def _inference_out(k):
    with torch.inference_mode():
        return {**k, "out": _nan(k["out"].shape, BF)}


def _buffer_of_two(k):
    b = cpm.CpSendBuffer(torch, cpm.a2a.layout(2, 9, 2, 16, "bfloat16"), "cpu")
    return {**k, "v": b.v, "s": b.lse, "send": b}


BROKEN = [  # (signature, rule broken on a later call, the arguments, the validation's message)
    ("plain", "s shape", lambda k: {**k, "s": k["s"][:, :3]}, r"s: expected shape \(9, 4\)"),
    ("plain", "v head_dim stride", lambda k: {**k, "v": torch.zeros(9, 4, 32, dtype=BF)[..., ::2]}, "v: the last"),
    ("two ranks", "heads over ranks", lambda k: {**k, "v": k["v"][:, :3], "s": k["s"][:, :3], "out": _nan((9, 1, 16), BF)},
     "3 heads cannot be"),
    ("plain", "out shape", lambda k: {**k, "out": _nan((9, 5, 16), BF)}, "out: expected shape"),
    ("plain", "v of rank 4", lambda k: {**k, "v": k["v"][None]}, "v: expected 3 dimensions"),
    ("plain", "s of rank 1", lambda k: {**k, "s": k["s"][0]}, "s: expected 2 dimensions"),
    ("plain", "out head_dim stride", lambda k: {**k, "out": _nan((9, 4, 32), BF)[..., ::2]}, "out: the last"),
    ("plain", "out requires grad", lambda k: {**k, "out": _nan((9, 4, 16), BF).requires_grad_()}, "out: requires grad"),
    ("plain", "out an inference tensor", _inference_out, "out: is an inference tensor"),
    ("plain", "out expanded", lambda k: {**k, "out": _nan((1, 4, 16), BF).expand(9, 4, 16)}, "out: dimension 0 has"),
    ("plain", "out is v", lambda k: {**k, "out": k["v"]}, "out is the same memory as the input v"),
    ("plain", "out overlaps v", _alias_buffer, "out overlaps the input v"),
    ("options", "out_lse is s", lambda k: {**k, "out_lse": k["s"]}, "out_lse is the same memory as the input s"),
    ("options", "outputs share", _shared_outputs, "out and out_lse share memory"),
    ("options", "out_lse shape", lambda k: {**k, "out_lse": _nan((9, 5))}, "out_lse: expected shape"),
    ("options", "sinks length", lambda k: {**k, "sinks": torch.zeros(5)}, r"sinks: expected shape \(4,\)"),
    ("options", "sinks stride", lambda k: {**k, "sinks": torch.zeros(8)[::2]}, "sinks: must be contiguous"),
    ("options", "out_lse over sinks", _lse_over_sinks, "out_lse overlaps the input sinks"),
    ("fp8", "out_scale size", lambda k: {**k, "out_scale": torch.ones(2)}, "out_scale: expected one element"),
    ("shards", "query_start_loc length", lambda k: {**k, "empty_shards": (k["empty_shards"][0], torch.tensor([0, 9]))},
     "query_start_loc: expected 3 entries"),
    ("shards", "query_start_loc stride", lambda k: {**k, "empty_shards": (k["empty_shards"][0],
     torch.tensor([0, 0, 2, 0, 9, 0])[::2])}, "query_start_loc: must be contiguous"),
    ("shards", "seq_lens stride", lambda k: {**k, "empty_shards": (torch.zeros(4, dtype=torch.int32)[::2],
     k["empty_shards"][1])}, "seq_lens: must be contiguous"),
    ("a2a", "out is v", lambda k: {**k, "out": k["v"]}, "out is the same memory as the input v"),
    ("send", "other views", lambda k: {**k, "v": k["v"].clone()}, "v: with send=, pass the views"),
    ("send", "a buffer of two ranks", _buffer_of_two, "send: made for a group of 2 ranks"),
    ("send", "out in the buffer", lambda k: {**k, "out": k["send"].send.view(BF)[: 9 * 64].view(9, 4, 16)},
     "out overlaps the input v"),
    ("vllm", "lse shape", lambda k: {**k, "s": k["s"][:, :3]}, r"cp_attn_lse: expected shape \(9, 4\)"),
]  # fmt: skip


@pytest.mark.parametrize("name, rule, broken, match", BROKEN, ids=[f"{b[0]}: {b[1]}" for b in BROKEN])
def test_a_later_call_that_breaks_a_rule_raises_the_validations_error(gpu_path, name, rule, broken, match):
    """A call of a known signature that breaks a rule of the cheap check goes to the full
    validation: its error, with the caller's names; nothing launched, sent or written."""
    seen = gpu_path
    seen.N, make, call = SIGNATURES[name]
    call(make(5))
    k = broken(make(9))
    before = {
        n: x.detach().clone() for n, x in k.items() if n.startswith("out") and isinstance(x, torch.Tensor)
    }
    seen.launches.clear()
    seen.collectives.clear()
    with pytest.raises((TypeError, ValueError), match=match) as e:
        call(k)
    assert e.value is seen.validated[-1] and len(seen.validated) == 2
    assert seen.launches == [] and seen.collectives == []
    for n, x in before.items():
        assert torch.equal(k[n].detach().float().nan_to_num(7.0), x.float().nan_to_num(7.0)), f"{n} written"


def test_calls_the_cheap_check_cannot_decide_are_let_through_by_the_full_validation(gpu_path):
    """out_lse interleaved with s (byte ranges that cross, no shared element): validated, and
    run; an output of a torch subclass is not read into facts (validated on every call), one
    of a module's parameter (``torch.nn.Parameter``, or a subclass of it) is."""
    seen = gpu_path
    make = SIGNATURES["options"][1]
    _combine(make(5))
    buf = _nan((9, 8))
    _combine({**make(9), "s": buf[:, ::2].normal_(), "out_lse": buf[:, 1::2]})
    assert len(seen.validated) == 2 and len(seen.args) == 2 and seen.args[1] == seen.validated[1]
    k = {**make(9), "out": _nan((9, 4, 16)).as_subclass(_Subclass)}
    assert cpm._plan.read(k["v"], k["s"], k["sinks"], k["out"], k["out_lse"], None, None) is None
    for weights in (torch.nn.Parameter, _Weight):
        out = weights(_nan((9, 4, 16)), requires_grad=False)
        f = cpm._plan.read(k["v"], k["s"], k["sinks"], out, k["out_lse"], None, None)
        assert f is not None and f.out.ptr == out.data_ptr()


class _Subclass(torch.Tensor):
    """A torch subclass of no parameter's kind."""


class _Weight(torch.nn.Parameter):
    """An engine's parameter class."""


CP_SEEN: list[tuple[bool, bool]] = []  # (taken, valid) of each random layout


@pytest.mark.parametrize("seed", range(400))
def test_the_bound_call_takes_only_calls_the_full_validation_accepts(seed):
    """A signature's bound call (spec.CP_MERGE's records), then a later call of that signature
    in random layouts placed one after another in shared buffers (padded or non-unit strides,
    transposed LSEs, one tensor over the last element of the one before, wrong lengths of the
    option tensors): whatever the bound call takes the full validation accepts, with the Args
    the plan hands the runs; the compiled and the Python executor take the same calls."""
    rng = random.Random(seed)
    N = rng.choice((1, 2))
    T, D = rng.randint(1, 12), rng.choice((8, 16))
    H = N * rng.randint(1, 3)
    Hn = H // N
    given = {o: rng.random() < 0.5 for o in ("out_lse", "sinks", "shards")}
    B = rng.randint(0, 3)

    def fresh():
        x = {"v": torch.randn(T, H, D).to(BF), "s": torch.randn(T, H), "out": _nan((T, Hn, D), BF)}
        x["out_lse"] = _nan((T, Hn)) if given["out_lse"] else None
        x["sinks"] = torch.randn(H) if given["sinks"] else None
        shards = (torch.zeros(B, dtype=torch.int32), torch.arange(B + 1, dtype=torch.int32))
        x["shards"] = shards if given["shards"] else None
        return x

    def call_args(x):
        return (x["v"], x["s"], N, "heads", "allgather", "e", None, x["sinks"], x["out"], x["out_lse"], None,
                x["shards"], None, cpm.Names(None))  # fmt: skip

    def objs(x):
        return cpm._plan.spec_objects(
            x["v"], x["s"], x["out"], x["out_lse"], x["sinks"], None, x["shards"], None
        )

    first = fresh()
    plan = cpm._plan.Plan(cpm.validate(torch, *call_args(first)), objs(first), N)

    vbuf, fbuf, ibuf = (
        torch.randn(8 * T * H * (D + 8) + 64).to(BF),
        torch.randn(64 * T * H + 64),
        torch.zeros(64, dtype=torch.int32),
    )
    ends = {"v": [0], "f": [0], "i": [0]}
    order = ["v", "out", "s", "out_lse", "sinks", "sl", "q"]
    rng.shuffle(order)
    short = rng.choice(order)

    def place(name, kind, shape, strides):
        buf = {"v": vbuf, "f": fbuf, "i": ibuf}[kind]
        span = 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True)) if all(shape) else 0
        gap = -1 if name == short and len(ends[kind]) > 1 else rng.choice((0, 0, 1, 8))
        start = max(0, max(ends[kind]) + gap)
        ends[kind].append(start + span)
        return buf.as_strided(shape, strides, start)

    def state(name, heads):
        pad, inner = rng.choice((0, 0, 8)), 1 if rng.random() < 0.9 else 2
        n_heads = heads + (rng.random() < 0.05)  # now and then a wrong head count
        return place(name, "v", (T, n_heads, D), (n_heads * (D * inner + pad), D * inner + pad, inner))

    def lse(name, heads):
        pad = rng.choice((0, 0, 4))
        st = (1, T + pad) if rng.random() < 0.3 else (heads + pad, 1)
        return place(name, "f", (T, heads), st)

    def vector(name, kind, n):  # now and then one entry too many, or a stride of 2
        return place(name, kind, (n + (rng.random() < 0.1),), (1 if rng.random() < 0.85 else 2,))

    later = {}
    for name in order:
        if name in ("v", "out"):
            later[name] = state(name, H if name == "v" else Hn)
        elif name in ("s", "out_lse"):
            later[name] = lse(name, H if name == "s" else Hn)
        elif name == "sinks":
            later[name] = vector(name, "f", H)
        else:
            later[name] = vector(name, "i", B if name == "sl" else B + 1)
    later["shards"] = (later.pop("sl"), later.pop("q"))
    for option, on in given.items():
        later[option] = later[option] if on else None
    f = cpm._plan.read(
        later["v"], later["s"], later["sinks"], later["out"], later["out_lse"], None, later["shards"]
    )
    fast = plan.args(f, None, N, objs(later))
    runners = [executor.runner("python")] + ([executor.runner("c")] if executor.module_of_safe("c") else [])
    assert {bool(run(plan.bound, objs(later), ())) for run in runners} == {fast is not None}
    try:
        full, valid = cpm.validate(torch, *call_args(later)), True
    except (TypeError, ValueError):
        valid = False
    CP_SEEN.append((fast is not None, valid))
    assert valid or fast is None, "the bound call took a call the full validation rejects"
    if fast is not None:
        assert fast == full


def test_the_random_layouts_cover_taken_and_refused_calls():
    """The layouts of the test above hold both calls the bound call takes and calls the full
    validation rejects, each in numbers, and the bound call takes every valid one (none of them
    has byte ranges that cross without a shared element, the one case it leaves to the full
    validation)."""
    if len(CP_SEEN) < 400:
        pytest.skip("runs after the random layouts")  # pragma: no cover
    taken = sum(t for t, _ in CP_SEEN)
    valid_not_taken = sum(v and not t for t, v in CP_SEEN)
    invalid = sum(not v for _, v in CP_SEEN)
    assert taken >= 100 and invalid >= 100 and valid_not_taken == 0, (taken, valid_not_taken, invalid)
