"""Context-parallel combine on two GPUs: ``cp_merge`` beside a combine in vLLM's design and the
collectives alone (``python -m bench --only cp``).

Two processes are spawned, one per GPU, joined in an NCCL group; rank 0 reports. Per T in
(1, 64, 1024, 8192), H = 128, D = 512, bf16 partial outputs, heads scattered over the two ranks:

* ``zerokv``: ``cp_merge`` with the float32 wire (the default); ``zerokv bf16 wire``: the same
  summing in bf16, as vLLM does.
* ``zerokv a2a`` / ``zerokv a2a fp32 wire``: ``cp_merge(exchange="a2a")``: the pack kernel, one
  all-to-all of V with its LSE beside it (bf16 as it is, or sent as float32), the merge kernel;
  ``..., no pack``: the same from a ``cp_send_buffer`` the partial was written into.
* ``vLLM design a2a`` / ``... fp32 wire``: the all-to-all design in torch, written from its
  description: a ``[N, T, H/N, D + 32/bits]`` buffer packed by copies (the float32 LSE bitcast into
  the last columns), one ``all_to_all_single``, the LSE unpacked and the partials weighed and
  summed in float32 by eager torch ops.
* ``vLLM design``: vLLM's ``cp_lse_ag_out_rs`` steps in torch: an all-gather of the LSE, the
  rescale by ``exp(lse_r - lse)`` in eager torch ops (in place, as vLLM's kernel does), the
  transpose copy to head-major, a bf16 reduce-scatter, the transpose copy back.
* ``collectives fp32`` / ``collectives bf16``: the all-gather of the LSE and the reduce-scatter of
  the ``[N, T, H/N, D]`` buffer in that dtype, nothing else: the floor of each wire;
  ``a2a collective bf16`` / ``... fp32``: the all-to-all of the packed buffer alone.
* ``..., no overlap``: where ``cp_merge`` pipelines (chunks of tokens, each chunk's collective
  beside the next chunk's kernels), the same call run in one piece, to show what the overlap buys.

µs: GPU time per call from replaying a CUDA graph of several calls (the collectives inside),
both ranks in step; "1 call" is the CUDA-event time of one eager call. Inputs rotate over sets
that exceed twice the L2 where a shape allows. The error is against the float64 merge of both
ranks' inputs on a sample of rows. ``--dry-run``: two gloo processes on the CPU, tiny shapes,
synthetic times. Without two GPUs the part reports itself skipped; the all-to-all's kernels
alone are measured on one GPU beside it (``bench/bench_cp_kernels.py``).
"""

from __future__ import annotations

import datetime
import importlib
import json
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import bench_cp_kernels
from .bench_cp_kernels import grid, vllm_a2a_combine, vllm_a2a_pack
from .common import Bench, Row, Task, max_error

OP = "cp_merge"
ZEROKV, ZEROKV_BF16, VLLM = "zerokv", "zerokv bf16 wire", "vLLM design"
A2A, A2A_FP32, NO_PACK = "zerokv a2a", "zerokv a2a fp32 wire", ", no pack"
VLLM_A2A, VLLM_A2A_FP32 = "vLLM design a2a", "vLLM design a2a fp32 wire"
NO_OVERLAP = ", no overlap"
COLL_FP32, COLL_BF16 = "collectives fp32", "collectives bf16"
COLL_A2A_BF16, COLL_A2A_FP32 = "a2a collective bf16", "a2a collective fp32"
WORLD = 2
SAMPLE = 128  # (token, head) rows checked against the float64 reference


def tasks(b: Bench, part: str) -> list[Task]:
    local = bench_cp_kernels.tasks(b, part)  # the all-to-all's kernels alone, on one GPU
    return [Task(part, f"{OP} on {WORLD} GPUs (T = {', '.join(map(str, grid(b.mode)[0]))})", run), *local]


def run(b: Bench) -> list[Row]:
    torch = b.torch
    Ts, H, D = grid(b.mode)
    if not b.dry and torch.cuda.device_count() < WORLD:
        note = f"skipped: needs {WORLD} GPUs, {torch.cuda.device_count()} found"
        return [Row(op=OP, impl=ZEROKV, dtype="bf16", H=H, D=D, note=note)]
    with tempfile.TemporaryDirectory() as d:
        torch.multiprocessing.start_processes(
            _worker, args=(f"file://{d}/store", d, b.mode, b.l2_bytes), nprocs=WORLD, join=True,
            start_method="spawn",
        )  # fmt: skip
        return [Row(**r) for r in json.loads(Path(d, "rows.json").read_text())]


# --- the implementations -------------------------------------------------------------------------


def _collectives(torch: Any) -> tuple[Any, Any]:
    dist = torch.distributed
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return ag, rs


def vllm_design_a2a(torch: Any, v: Any, s: Any, N: int, wire: Any) -> Any:
    """The all-to-all combine in the design vLLM describes, in torch: ``[N, T, H/N, D + P]``
    (``P = 32 / bits``) packed by copies with the float32 LSE bitcast into the last ``P``
    columns, one ``all_to_all_single``, then the LSE unpacked and the N partials weighed by
    ``exp(lse_n - lse)`` (NaN / +inf as -inf; a weight of NaN as 0) and summed in float32.
    Returns ``out [T, H/N, D]`` in ``v``'s dtype."""
    T, H, D = v.shape
    P = 32 // torch.finfo(wire).bits
    send = torch.empty((N, T, H // N, D + P), dtype=wire, device=v.device)
    vllm_a2a_pack(v, s, N, send)
    recv = torch.empty_like(send)
    torch.distributed.all_to_all_single(recv.view(torch.uint8).view(-1), send.view(torch.uint8).view(-1))
    return vllm_a2a_combine(torch, recv, D, v.dtype)


def vllm_design(torch: Any, v: Any, s: Any, N: int, rank: int) -> tuple[Any, Any]:
    """vLLM's AG + RS combine, step for step, in torch: returns ``(out [T, H/N, D], lse [T, H])``;
    rescales ``v`` in place."""
    all_gather, reduce_scatter = _collectives(torch)
    T, H, D = v.shape
    lse = s.contiguous()
    lses = torch.empty((N * T, H), dtype=torch.float32, device=v.device)
    all_gather(lses.view(-1), lse.view(-1))
    lses = lses.view(N, T, H)
    inf = float("inf")
    clean = torch.where(torch.isnan(lses) | (lses == inf), -inf, lses)
    m = clean.amax(0)
    m = torch.where(m == -inf, 0.0, m)
    g = torch.log(torch.exp(clean - m).sum(0)) + m
    f = lses[rank] - g
    f = torch.exp(torch.where(torch.isnan(f) | (f == inf), -inf, f))
    v.mul_(f.unsqueeze(-1))
    v.masked_fill_((f == 0).unsqueeze(-1), 0.0)
    x = v.movedim(0, 1).contiguous()  # [H, T, D]: vLLM's reduce_scatter(dim=1)
    y = torch.empty((H // N, T, D), dtype=v.dtype, device=v.device)
    reduce_scatter(y.view(-1), x.view(-1))
    return y.movedim(0, 1).contiguous(), g


# --- one process per GPU --------------------------------------------------------------------------


def _worker(rank: int, init: str, outdir: str, mode: str, l2_bytes: int) -> None:
    import torch

    dry = mode == "dry"
    if not dry:
        torch.cuda.set_device(rank)
    dist = torch.distributed
    dist.init_process_group("gloo" if dry else "nccl", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip
    try:
        rows = _measure_all(torch, rank, mode, l2_bytes)
        if rank == 0:
            Path(outdir, "rows.json").write_text(json.dumps([asdict(r) for r in rows]))
    finally:
        dist.destroy_process_group()


def _measure_all(torch: Any, rank: int, mode: str, l2_bytes: int) -> list[Row]:
    dry = mode == "dry"
    dev = torch.device("cpu") if dry else torch.device("cuda", rank)
    timer = _FakeTimer() if dry else _PairTimer(torch)
    Ts, H, D = grid(mode)
    rows: list[Row] = []
    for T in Ts:
        rows += _measure(torch, timer, rank, dev, T, H, D, l2_bytes)
        if not dry:
            torch.cuda.empty_cache()
    return rows


def _measure(torch: Any, timer: Any, rank: int, dev: Any, T: int, H: int, D: int, l2_bytes: int) -> list[Row]:
    import zerokv

    cpm_a2a = importlib.import_module("zerokv.cp_merge.a2a")

    all_gather, reduce_scatter = _collectives(torch)
    N, Hn = WORLD, H // WORLD
    set_bytes = T * H * (D * 2 + 4)
    count = 1 if set_bytes > 2 * l2_bytes else max(3, int(2 * l2_bytes // set_bytes) + 1)
    gen = torch.Generator(device=dev).manual_seed(1000 * T + rank)
    pool_v = torch.randn((count, T, H, D), generator=gen, device=dev).to(torch.bfloat16)
    pool_s = torch.randn((count, T, H), generator=gen, device=dev) * 3
    sets = [(pool_v[k], pool_s[k]) for k in range(count)]
    wires = {t: torch.empty((N * T * Hn * D,), dtype=t, device=dev) for t in (torch.float32, torch.bfloat16)}
    reduced = {t: torch.empty((T * Hn * D,), dtype=t, device=dev) for t in wires}
    lses = torch.empty((N * T * H,), dtype=torch.float32, device=dev)

    def coll(wire_t: Any, v: Any, s: Any) -> None:
        all_gather(lses, s.view(-1))
        reduce_scatter(reduced[wire_t], wires[wire_t])

    a2a_bufs = {t: torch.empty((cpm_a2a.layout(N, T, Hn, D, str(t)[6:]).nbytes,), dtype=torch.uint8, device=dev)
                for t in wires}  # fmt: skip
    a2a_recv = {t: torch.empty_like(b) for t, b in a2a_bufs.items()}

    def coll_a2a(wire_t: Any, v: Any, s: Any) -> None:
        torch.distributed.all_to_all_single(a2a_recv[wire_t], a2a_bufs[wire_t])

    # the send buffers the partials were written into (no pack): one per set, filled once
    def send_sets(wire_t: Any) -> list:
        out = []
        for v0, s0 in sets:
            bv, bl, send = zerokv.cp_send_buffer(T, H, D, wire_t, device=dev)
            for j in range(N):
                bv[j].copy_(v0[:, j * Hn : (j + 1) * Hn])
                bl[j].copy_(s0[:, j * Hn : (j + 1) * Hn])
            out.append((bv, bl, send))
        return out

    impls = [
        (ZEROKV, lambda v, s: zerokv.cp_merge(v, s)),
        (ZEROKV_BF16, lambda v, s: zerokv.cp_merge(v, s, wire_dtype=torch.bfloat16)),
        (A2A, lambda v, s: zerokv.cp_merge(v, s, exchange="a2a")),
        (A2A_FP32, lambda v, s: zerokv.cp_merge(v, s, exchange="a2a", wire_dtype=torch.float32)),
        (VLLM, lambda v, s: vllm_design(torch, v, s, N, rank)[0]),
        (VLLM_A2A, lambda v, s: vllm_design_a2a(torch, v, s, N, torch.bfloat16)),
        (VLLM_A2A_FP32, lambda v, s: vllm_design_a2a(torch, v, s, N, torch.float32)),
        (COLL_FP32, lambda v, s: coll(torch.float32, v, s)),
        (COLL_BF16, lambda v, s: coll(torch.bfloat16, v, s)),
        (COLL_A2A_BF16, lambda v, s: coll_a2a(torch.bfloat16, v, s)),
        (COLL_A2A_FP32, lambda v, s: coll_a2a(torch.float32, v, s)),
    ]
    no_pack = {
        A2A + NO_PACK: (torch.bfloat16, lambda v, s, send: zerokv.cp_merge(v, s, exchange="a2a", send=send)),
        A2A_FP32 + NO_PACK: (
            torch.float32,
            lambda v, s, send: zerokv.cp_merge(v, s, exchange="a2a", send=send),
        ),
    }
    cpm = importlib.import_module("zerokv.cp_merge.allgather")
    # the float32 wire is pipelined here (the bf16 one is summed straight into the output, in one
    # piece): the same call without the overlap beside it
    if len(cpm._chunks(T, H * D * 4, N, False)) > 1:

        def serial(call: Any) -> Any:
            def run(v: Any, s: Any) -> Any:
                saved, cpm._OVERLAP_MIN_BYTES = cpm._OVERLAP_MIN_BYTES, 1 << 62
                try:
                    return call(v, s)
                finally:
                    cpm._OVERLAP_MIN_BYTES = saved

            return run

        impls.append((ZEROKV + NO_OVERLAP, serial(impls[0][1])))
    rows = []
    for impl, call in impls:
        err = None
        if "collective" not in impl:
            v0, s0 = sets[0]
            err = _check(torch, call(v0.clone(), s0), v0, s0, rank, T, H, D)
        us, event_us, stats = timer.time(call, sets, T)
        rows.append(Row(op=OP, impl=impl, dtype="bf16", T=T, H=H, D=D, us=us, event_us=event_us,
                        max_err=err, params={"N": N}, stats=stats))  # fmt: skip
    for impl, (wire_t, call) in no_pack.items():
        ss = send_sets(wire_t)
        err = _check(torch, call(*ss[0]), *sets[0], rank, T, H, D)
        us, event_us, stats = timer.time(call, ss, T)
        rows.append(Row(op=OP, impl=impl, dtype="bf16", T=T, H=H, D=D, us=us, event_us=event_us,
                        max_err=err, params={"N": N}, stats=stats))  # fmt: skip
        del ss
    return rows


def _check(torch: Any, out: Any, v: Any, s: Any, rank: int, T: int, H: int, D: int) -> float | None:
    """Max error of rank 0's heads on a sample of rows against the float64 merge of both
    ranks' inputs (the sampled rows gathered from every rank)."""
    from zerokv import reference

    all_gather, _ = _collectives(torch)
    Hn = H // WORLD
    g = torch.Generator().manual_seed(7)
    n = min(SAMPLE, T * Hn)
    flat = torch.randperm(T * Hn, generator=g)[:n].to(v.device)
    t, h = flat // Hn, flat % Hn
    mine_v = v[t, h].float().contiguous()
    mine_s = s[t, h].contiguous()
    all_v = torch.empty((WORLD * n * D,), dtype=torch.float32, device=v.device)
    all_s = torch.empty((WORLD * n,), dtype=torch.float32, device=v.device)
    all_gather(all_v, mine_v.view(-1))
    all_gather(all_s, mine_s)
    if rank != 0:
        return None
    V = all_v.view(WORLD, n, 1, D).double().cpu().numpy()
    S = all_s.view(WORLD, n, 1).double().cpu().numpy()
    want, _ = reference.merge_states(V, S)
    got = out[t, h].double().cpu().numpy()
    return max_error(got, want[:, 0])


class _PairTimer:
    """GPU µs per call with both ranks in step: the counts depend on T only (never on a local
    measurement), so both ranks capture and replay the same collectives."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.side = torch.cuda.Stream()

    def time(self, call: Any, sets: list, T: int) -> tuple[float, float, dict]:
        torch = self.torch
        n, replays, reps = (50, 10, 20) if T <= 64 else ((10, 10, 10) if T <= 1024 else (3, 5, 5))
        K = len(sets)
        k = 0

        def take(m: int) -> list:
            nonlocal k
            out = [sets[(k + j) % K] for j in range(m)]
            k += m
            return out

        for s in take(min(K, 3) + 1):  # compile, NCCL set-up, first touch
            call(*s)
        torch.cuda.synchronize()
        torch.distributed.barrier()
        todo = take(reps)
        starts = [torch.cuda.Event(enable_timing=True) for _ in todo]
        ends = [torch.cuda.Event(enable_timing=True) for _ in todo]
        torch.cuda._sleep(50_000_000)  # covers the host's enqueue of the batch (~25 ms at 2 GHz)
        for a, e, s in zip(starts, ends, todo, strict=True):
            a.record()
            call(*s)
            e.record()
        torch.cuda.synchronize()
        event_us = statistics.median(a.elapsed_time(e) * 1e3 for a, e in zip(starts, ends, strict=True))

        graph = torch.cuda.CUDAGraph()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            graph.capture_begin(capture_error_mode="thread_local")
            for s in take(n):
                call(*s)
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.side)
        graph.replay()  # uploads the graph
        torch.cuda.synchronize()
        torch.distributed.barrier()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
        marks[0].record()
        for m in marks[1:]:
            graph.replay()
            m.record()
        torch.cuda.synchronize()
        per_call = [a.elapsed_time(b) * 1e3 / n for a, b in zip(marks, marks[1:], strict=False)]
        del graph
        stats = {"sets": K, "graph_calls": n, "replays": replays, "event_reps": reps,
                 "replay_spread_us": [min(per_call), max(per_call)]}  # fmt: skip
        return statistics.median(per_call), event_us, stats


class _FakeTimer:
    """--dry-run: each call runs twice, the time is synthetic."""

    def time(self, call: Any, sets: list, T: int) -> tuple[float, float, dict]:
        for s in sets[:2]:
            call(*s)
        us = 20.0 + T * 0.5
        return us, us + 5.0, {"sets": len(sets), "timed_by": "fake"}
