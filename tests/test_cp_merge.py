"""cp_merge (all-gather and all-to-all) and vLLM's DCP combine adapters across a process group.

* CPU: gloo groups of 1, 2, 3 and 4 processes (one spawn of four processes, sub-groups for the
  smaller sizes), every case of ``tests/cp_cases.py`` inside that one spawn; a deliberately
  wrong value fails with its message, every rank still in step.
* One GPU: the kernels alone, with N ranks simulated in one process (the collectives replaced
  by copies of what the other simulated ranks produced in earlier passes), a CUDA graph of the
  all-to-all's pack and merge, and a real NCCL group of one.
* Two GPUs: NCCL, in ``tests/test_multigpu.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import time

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
    a2a = cpm.cp_merge_a2a
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
    a2a = cpm.cp_merge_a2a
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

    def launch(self, grid, grid_y, stream, bind, *records):
        buf = bytearray(self.kernel.packer.size)
        bind(buf, *records)
        self.seen.append((self.kernel.name, self.targs, grid, stream, bytes(buf)))


class _Ptr:
    def __init__(self, p):
        self.p = p

    def data_ptr(self):
        return self.p


def test_launches_pack_every_parameter_by_name(monkeypatch):
    """The pack kernels' and the finalize kernel's arguments, packed by name from a call's
    facts, are the bytes of the kernel's parameters in its C order (written out here by hand)."""
    import zerokv.cp_merge_launch as launch_mod
    from zerokv.core import kernels
    from zerokv.core.tensors import Tensor

    seen: list = []
    monkeypatch.setattr(launch_mod._plans, "launcher", lambda k, t, d: _Recorder(k, t, d, seen))
    monkeypatch.setattr(launch_mod._plans, "get", lambda key: None)  # build a plan every time,
    monkeypatch.setattr(launch_mod._plans, "lookup", lambda key, build: build())  # never kept

    def t(ptr, shape, strides, dtype):
        return Tensor(None, ptr, shape, strides, dtype, 0, True)

    a = cpm.cp_merge_a2a.Args(
        t(4096, (7, 6, 40), (320, 48, 1), "bfloat16"), t(8192, (7, 6), (1, 9), "float32"), None, None,
        t(1 << 21, (3,), (1,), "int64"), t(1 << 22, (4,), (1,), "int32"),
        7, 6, 40, 3, "float32", "bfloat16", "e", 0, "heads", "a2a", None,
    )  # fmt: skip
    lay = cpm.cp_merge_a2a.layout(2, 7, 3, 40, "float32")
    cpm.cp_merge_a2a._pack(a, lay, 1 << 30, True, 77)
    cp_ag = cpm.cp_merge_allgather
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
