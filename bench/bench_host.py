"""Host cost of a call from Python, and the compile time of the kernels.

**Host µs per call** of every op, option and adapter, in one process beside
``torch.mul(a, b, out=c)`` measured the same way (bf16, ``H = 16``, ``D = 128``):

* (a) a new token count on every call: slices ``x[:T]`` of preallocated buffers, T running over
  4000 distinct values per round; the loop that only slices is timed too and subtracted;
* (b) the same call repeated (same tensors, T = 256); one row cycles over 60 layers' buffers
  at one T (an engine step), its indexing subtracted;
* (c) outputs allocated by the op (where it allocates): as (a), without ``out``.

Every measurement is one item of a round; the rounds (3, 1 with ``--quick``) run every item in
a new order and each item keeps the median of its rounds, after a warm-up that meets every
kernel form of the rounds' T (a compile inside a round is the cold start's cost, measured
below, not a call's). Loops run with the garbage collector off, synchronised before and after. ``host_first``: the first call of each of 24 new
merge_state signatures after ``zerokv.precompile`` loaded every kernel (µs, synchronised).

**Compile**: the first call of each op in a fresh process with its own ``CUPY_CACHE_DIR``:
cold (empty cache: NVRTC compile, load, first launch) and warm (a new process on the cache
the cold one filled); "engine" = the bf16 vector path of each op, "all" = every instantiation
through ``zerokv.precompile`` (full runs only). The child process is this module::

    python -m bench.bench_host --compile-child engine|all [--cpu]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .common import Bench, Row, Task  # nothing that imports zerokv: the compile child times that

H, D = 16, 128  # (2, 8) in a dry run: the CPU path computes in float64
T_REPEATED = 256
T_VALUES = 4000  # distinct token counts per round of mode (a)
LAYERS = 60
WARMUP = 64
ROOT = Path(__file__).resolve().parent.parent  # holds the bench package
COMPILE_TIMEOUT_S = 300

Args = tuple[tuple, dict]
ArgsAt = Callable[[SimpleNamespace, int], Args]  # (buffers, T) -> (args, kwargs) of one call


@dataclass
class Case:
    label: str
    kind: str  # "reference" (torch.mul), "baseline" or "zerokv"
    given: tuple[Callable[..., Any], ArgsAt] | None  # outputs given: modes (a) and (b)
    alloc: tuple[Callable[..., Any], ArgsAt] | None = None  # outputs allocated by the op: mode (c)
    skip: str = ""  # why it cannot run here
    modes: str = "abc"  # the modes measured
    inference: bool = False  # rounds run under torch.inference_mode(), outputs inference tensors (engines)


def cases(b: Bench) -> list[Case]:
    import zerokv
    from zerokv.compat import flashinfer as fi
    from zerokv.compat import sglang, vllm

    from . import baselines

    torch = b.torch
    ops = torch.ops.zerokv

    def merge6(t, T):
        return (t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T]), {"out": t.out[:T], "out_lse": t.ol[:T]}

    def merge4(t, T):
        return (t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T]), {}

    def option(args_at, **extra):
        def at(t, T):
            a, kw = args_at(t, T)
            return a, {**kw, **{k: (f(t, T) if callable(f) else f) for k, f in extra.items()}}

        return at

    def ht(t, T):  # vLLM's [H, T] LSE buffers, as the [T, H] views merge_state takes
        return (t.va[:T], t.sa_ht[:, :T].T, t.vb[:T], t.sb_ht[:, :T].T), {
            "out": t.out[:T],
            "out_lse": t.ol_ht[:, :T].T,
        }

    def fp8(t, T):
        return (t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T]), {"out": t.o8[:T], "out_scale": t.scale}

    ms = zerokv.merge_state
    out = [
        Case("torch.mul(a, b, out=c)", "reference",
             (torch.mul, lambda t, T: ((t.a[:T], t.b[:T]), {"out": t.c[:T]})),
             (torch.mul, lambda t, T: ((t.a[:T], t.b[:T]), {}))),
        Case("Triton merge (vLLM design)", "baseline",
             (baselines.triton_merge_state,
              lambda t, T: ((t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T], t.out[:T], t.ol[:T]), {})),
             skip="" if baselines.triton is not None and not b.dry else "skipped: needs Triton on a GPU"),
        Case("merge_state", "zerokv", (ms, merge6), (ms, merge4)),
        Case("floor: read six tensors, pack, cuLaunchKernel (no check)", "floor",
             (launch_floor(b), merge6), modes="ab",
             skip="" if not b.dry else "skipped: needs a GPU"),
        Case("merge_state under inference_mode()", "zerokv",
             (ms, lambda t, T: ((t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T]), {"out": t.i_out[:T], "out_lse": t.i_ol[:T]})),
             modes="ab", inference=True),
        Case("merge_state, [H, T] LSE (three .T views)", "zerokv", (ms, ht), modes="a"),
        Case("merge_state a_empty=", "zerokv", (ms, option(merge6, a_empty=lambda t, T: (t.cu, t.kv))), modes="ab"),
        Case("merge_state sinks=", "zerokv", (ms, option(merge6, sinks=lambda t, T: t.sinks)), modes="ab"),
        Case("merge_state prefix_rows=", "zerokv", (ms, option(merge6, prefix_rows=lambda t, T: T // 2)), modes="ab"),
        Case("merge_state fp8 out, out_scale=", "zerokv", (ms, fp8), modes="ab"),
        Case("merge_states N = 2", "zerokv",
             (zerokv.merge_states, lambda t, T: ((t.v[:, :T], t.s[:, :T]), {"out": t.out[:T], "out_lse": t.ol[:T]})),
             (zerokv.merge_states, lambda t, T: ((t.v[:, :T], t.s[:, :T]), {}))),
        Case("fixup_zero_kv_rows", "zerokv",
             (zerokv.fixup_zero_kv_rows, lambda t, T: ((t.fo[:T], t.fl[:T], t.kv, t.cu), {}))),
        Case("mask_empty_context", "zerokv",
             (zerokv.mask_empty_context, lambda t, T: ((t.fo[:T], t.fl[:T], t.cu, t.cukv), {}))),
        Case("torch.ops.zerokv.merge_state_out", "zerokv",
             (ops.merge_state_out, lambda t, T: ((t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T], t.out[:T], t.ol[:T]), {})),
             (ops.merge_state, merge4)),
        Case("torch.ops.zerokv.fixup_zero_kv_rows", "zerokv",
             (ops.fixup_zero_kv_rows, lambda t, T: ((t.fo[:T], t.fl[:T], t.kv, t.cu), {})), modes="ab"),
        Case("compat.vllm.merge_attn_states", "zerokv",
             (vllm.merge_attn_states,
              lambda t, T: ((t.out[:T], t.va[:T], t.sa_ht[:, :T], t.vb[:T], t.sb_ht[:, :T], t.ol_ht[:, :T]), {}))),
        Case("compat.vllm.mask_empty_context", "zerokv",
             (vllm.mask_empty_context, lambda t, T: ((t.fl_ht[:, :T], t.fo[:T], t.cu, t.cukv), {}))),
        Case("compat.sglang.merge_state_v2", "zerokv",
             (sglang.merge_state_v2, lambda t, T: ((t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T], t.out[:T], t.ol[:T]), {})),
             (sglang.merge_state_v2, merge4)),
        Case("compat.sglang.fixup_zero_kv_rows", "zerokv",
             (sglang.fixup_zero_kv_rows, lambda t, T: ((t.fo[:T], t.fl[:T], t.kv, t.cu, 2), {}))),
        Case("compat.flashinfer.merge_state", "zerokv", None, (fi.merge_state, merge4)),
        Case("compat.flashinfer.merge_state_in_place", "zerokv",
             (fi.merge_state_in_place, lambda t, T: ((t.ip_v[:T], t.ip_s[:T], t.vb[:T], t.sb[:T]), {}))),
        Case("compat.flashinfer.merge_states", "zerokv",
             None, (fi.merge_states, lambda t, T: ((t.v_tn[:T], t.s_tn[:T]), {}))),
        Case("cp_merge, one rank (its local part: no collective at N = 1), bf16 wire", "zerokv",
             (one_rank_cp_merge(b), lambda t, T: ((t.va[:T], t.sa[:T]), {"out": t.out[:T]})),
             skip="" if not b.dry else "skipped: needs a GPU"),
    ]  # fmt: skip
    return out


def one_rank_cp_merge(b: Bench) -> Callable[..., Any]:
    """``cp_merge`` in a process group of one rank (gloo, made here when none is): its
    validation, kernels and launches without a collective (N = 1 calls none)."""
    if b.dry:
        return lambda *a, **k: None
    import socket

    import zerokv

    dist = b.torch.distributed
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    bf16 = b.torch.bfloat16
    return lambda v, s, out: zerokv.cp_merge(v, s, None, wire_dtype=bf16, out=out)


def launch_floor(b: Bench) -> Callable[..., None]:
    """The floor of a pure-Python launch of the plain merge: read each of the six tensors'
    pointer, shape, strides, dtype and device once, the stream, one ``pack_into`` of the flat
    kernel's arguments and one ``cuLaunchKernel``; no check, no plan, no form choice (one
    instantiation for every T). What any Python path pays before it checks anything."""
    if b.dry:
        return lambda *a, **k: None
    from zerokv.core import dtypes, kernels, launch, plans

    torch = b.torch
    k = kernels.MERGE_STATE_FLAT
    bf = dtypes.ctype("bfloat16")
    dev = torch.cuda.current_device()
    handle = plans.launcher(k, (bf, bf, 8, 0), dev).handle
    arena, cu_launch, stream_of = launch._arena, launch.driver().launch, torch._C._cuda_getCurrentRawStream
    pack_into, buf, extra, size, nbytes = (
        k.packer.pack_into,
        arena.buf,
        arena.extra_ptr,
        arena.size,
        k.packer.size,
    )
    H, D = _hd(b)
    (pm, ps), (hm, hs) = kernels.fast_divisor(D // 8), kernels.fast_divisor(H)

    # the flat kernel's parameters by name: the reads below, the form's divisors, the constants
    values = {
        "va": "pa", "vb": "pb", "sa": "psa", "sb": "psb", "out": "po", "olse": "pl", "rows": "rows",
        "H": "H", "packs": "packs", "packs_mul": "pm", "packs_shr": "ps", "H_mul": "hm", "H_shr": "hs",
        "sa_st": "sa0", "sa_sh": "sa1", "sb_st": "sb0", "sb_sh": "sb1", "va_st": "a0", "va_sh": "a1",
        "vb_st": "b0", "vb_sh": "b1", "out_st": "o0", "out_sh": "o1", "ol_st": "l0", "ol_sh": "l1",
        "prefix_rows": "T", "k": "1.4426950408889634", "inv_k": "0.6931471805599453",
    }  # fmt: skip
    args = ", ".join(values.get(n, "0") for n, _ in k.params)
    src = f"""def floor(v_a, s_a, v_b, s_b, out=None, out_lse=None):
    pa, (T, H, D), (a0, a1, _), _, da = v_a.data_ptr(), v_a.shape, v_a.stride(), v_a.dtype, v_a.get_device()
    pb, _, (b0, b1, _), _, _ = v_b.data_ptr(), v_b.shape, v_b.stride(), v_b.dtype, v_b.get_device()
    psa, _, (sa0, sa1), _, _ = s_a.data_ptr(), s_a.shape, s_a.stride(), s_a.dtype, s_a.get_device()
    psb, _, (sb0, sb1), _, _ = s_b.data_ptr(), s_b.shape, s_b.stride(), s_b.dtype, s_b.get_device()
    po, _, (o0, o1, _), _, _ = out.data_ptr(), out.shape, out.stride(), out.dtype, out.get_device()
    pl, _, (l0, l1), _, _ = out_lse.data_ptr(), out_lse.shape, out_lse.stride(), out_lse.dtype, out_lse.get_device()
    rows, packs = T * H, D >> 3
    pack_into(buf, 0, {args})
    size.value = nbytes  # the arena is shared with zerokv's launches of other sizes
    cu_launch(handle, -(-rows * packs // 128), 1, 1, 128, 1, 1, 0, stream_of(da), 0, extra)
"""
    scope = {
        "pack_into": pack_into, "buf": buf, "size": size, "nbytes": nbytes, "cu_launch": cu_launch,
        "handle": handle, "stream_of": stream_of, "extra": extra, "pm": pm, "ps": ps, "hm": hm, "hs": hs,
    }  # fmt: skip
    exec(compile(src, "<floor>", "exec"), scope)  # packed by name, as zerokv's bound calls
    floor = scope["floor"]
    return floor


def buffers(b: Bench) -> SimpleNamespace:
    """Round sizes and the buffers every case slices (made once per run)."""
    p = b.shared.get("host_plan")
    if p is not None:
        return p
    per_round, rounds = (16, 1) if b.dry else (T_VALUES, 1 if b.quick else 3)
    t_max = per_round + WARMUP
    torch, dev, bf = b.torch, b.device, b.torch.bfloat16
    H, D = _hd(b)
    g = torch.Generator().manual_seed(7)

    def v(*shape):
        return torch.randn(*shape, dtype=bf).to(dev)

    def s(*shape):
        return torch.randn(*shape).to(dev)

    t = SimpleNamespace(
        a=v(t_max, H, D), b=v(t_max, H, D), c=v(t_max, H, D),
        va=v(t_max, H, D), vb=v(t_max, H, D), out=v(t_max, H, D), sa=s(t_max, H), sb=s(t_max, H), ol=s(t_max, H),
        sa_ht=s(H, t_max), sb_ht=s(H, t_max), ol_ht=s(H, t_max), o8=v(t_max, H, D).to(torch.float8_e4m3fn),
        v=v(2, t_max, H, D), s=s(2, t_max, H), v_tn=v(t_max, 2, H, D), s_tn=s(t_max, 2, H),
        fo=v(t_max, H, D), fl=s(t_max, H), fl_ht=s(H, t_max), ip_v=v(t_max, H, D), ip_s=s(t_max, H),
        cu=torch.tensor([0, 2, 4], dtype=torch.int32, device=dev),
        kv=torch.tensor([0, 3], dtype=torch.int32, device=dev),
        cukv=torch.tensor([0, 0, 3], dtype=torch.int32, device=dev),
        sinks=s(H), scale=torch.tensor([0.5], device=dev),
    )  # fmt: skip
    with torch.inference_mode():  # outputs as an engine's model runner allocates them
        t.i_out, t.i_ol = v(t_max, H, D), s(t_max, H)
    n_layers = 4 if b.dry else LAYERS
    t_same = min(T_REPEATED, t_max)
    layers = [tuple(f(t_same, *shape) for f, shape in ((v, (H, D)), (s, (H,)), (v, (H, D)), (s, (H,)), (v, (H, D)), (s, (H,)))) for _ in range(n_layers)]  # fmt: skip
    p = SimpleNamespace(
        bufs=t,
        layers=layers,
        t_same=t_same,
        rounds=[(torch.randperm(per_round, generator=g) + 1).tolist() for _ in range(rounds)],
        warmup=_warmup_tokens(per_round, t_max),
    )
    b.shared["host_plan"] = p
    return p


def _warmup_tokens(per_round: int, t_max: int) -> list[int]:
    """T values of the warm-up: a geometric sweep over the rounds' range, so that every kernel
    form those T take is compiled and loaded before the timing (a form first met inside a
    round costs its NVRTC compile there), then T values no round uses."""
    sweep = sorted({int(1.15**k) for k in range(80) if 1 <= int(1.15**k) <= per_round})
    return sweep + list(range(t_max - WARMUP + 1, t_max + 1))


def _hd(b: Bench) -> tuple[int, int]:
    return (2, 8) if b.dry else (H, D)


def _timed(b: Bench, loop: Callable[[], None], n: int) -> float:
    """µs per iteration of ``loop`` (``n`` iterations), synchronised, the collector off."""
    b.sync()
    enabled = gc.isenabled()
    gc.disable()
    try:
        t = time.perf_counter()
        loop()
        b.sync()
        return (time.perf_counter() - t) / n * 1e6
    finally:
        if enabled:
            gc.enable()


def new_t_round(b: Bench, fn: Callable[..., Any], at: ArgsAt, r: int) -> tuple[float, float]:
    """Mode (a) / (c), round ``r``: µs per call with a new T every call, the slicing subtracted;
    and the slicing's µs."""
    p = buffers(b)
    t, Ts = p.bufs, p.rounds[r]

    def calls() -> None:
        for T in Ts:
            a, kw = at(t, T)
            fn(*a, **kw)

    def slices() -> None:
        for T in Ts:
            at(t, T)

    whole = _timed(b, calls, len(Ts))
    cut = _timed(b, slices, len(Ts))
    return whole - cut, cut


def repeated_round(b: Bench, fn: Callable[..., Any], at: ArgsAt, r: int) -> tuple[float, float]:
    """Mode (b): µs per call of the same call repeated."""
    p = buffers(b)
    a, kw = at(p.bufs, p.t_same)
    n = len(p.rounds[0])

    def calls() -> None:
        for _ in range(n):
            fn(*a, **kw)

    return _timed(b, calls, n), 0.0


def layers_round(b: Bench, fn: Callable[..., Any], r: int) -> tuple[float, float]:
    """Mode (b), 60 layers' buffers at one T: merge_state over each layer's tensors in turn."""
    layers = buffers(b).layers
    n = len(buffers(b).rounds[0]) // len(layers) * len(layers)

    def calls() -> None:
        for i in range(n):
            va, sa, vb, sb, o, ol = layers[i % len(layers)]
            fn(va, sa, vb, sb, out=o, out_lse=ol)

    def index() -> None:
        for i in range(n):
            va, sa, vb, sb, o, ol = layers[i % len(layers)]

    whole = _timed(b, calls, n)
    cut = _timed(b, index, n)
    return whole - cut, cut


def _items(b: Bench, found: list[Case]) -> list[tuple[Row, Callable[[int], tuple[float, float]], Callable]]:
    """Every measurement: its row, its round function and a warm-up call."""
    import zerokv

    p = buffers(b)
    items = []
    for case in found:
        if case.skip:
            continue
        for mode, what, measure in (("a", case.given, new_t_round), ("b", case.given or case.alloc, repeated_round),
                                    ("c", case.alloc, new_t_round)):  # fmt: skip
            if what is None or mode not in case.modes:
                continue
            row = Row(op="host", impl=case.label, dtype="bf16", H=_hd(b)[0], D=_hd(b)[1])
            row.params = {"mode": mode, "kind": case.kind, "allocates": case.given is None or mode == "c"}
            fn, at = what
            warm, timed = partial(_warm, fn, at, p, mode), partial(measure, b, fn, at)
            if case.inference:
                warm, timed = _in_inference(b, warm), _in_inference(b, timed)
            items.append((row, timed, warm))
    row = Row(
        op="host",
        impl=f"merge_state, {len(p.layers)} layers' buffers, one T",
        dtype="bf16",
        H=_hd(b)[0],
        D=_hd(b)[1],
    )
    row.params = {"mode": "b", "kind": "zerokv", "allocates": False}
    items.append((row, partial(layers_round, b, zerokv.merge_state), lambda: None))
    return items


def _in_inference(b: Bench, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*a: Any) -> Any:
        with b.torch.inference_mode():
            return fn(*a)

    return run


def _warm(fn: Callable[..., Any], at: ArgsAt, p: SimpleNamespace, mode: str) -> None:
    for T in p.warmup if mode != "b" else [p.t_same] * WARMUP:
        a, kw = at(p.bufs, T)
        fn(*a, **kw)


def run_interleaved(b: Bench) -> list[Row]:
    """Every host measurement in interleaved rounds (a new order each), the median of each."""
    try:
        found = cases(b)
    except Exception as e:  # an adapter missing or renamed: the table says so
        return [Row(op="host", impl="(cases)", note=f"failed: {type(e).__name__}: {e}"[:300])]
    rows = [Row(op="host", impl=c.label, params={"kind": c.kind}, note=c.skip) for c in found if c.skip]
    items, got = [], {}
    for row, measure, warm in _items(b, found):
        try:
            warm()
            items.append((row, measure))
        except Exception as e:
            row.note = f"failed: {type(e).__name__}: {e}"[:300]
            rows.append(row)
    order = random.Random(11)
    for r in range(len(buffers(b).rounds)):
        order.shuffle(items)
        for row, measure in items:
            got.setdefault(id(row), []).append(measure(r))
    for row, _ in items:
        us = [x for x, _ in got[id(row)]]
        row.us = statistics.median(us)
        row.stats = {"rounds_us": us, "subtracted_us": statistics.median(c for _, c in got[id(row)])}
        rows.append(row)
    ref = {r.params["mode"]: r.us for r in rows if r.params.get("kind") == "reference" and r.us}
    for row in rows:
        mul = ref.get("a" if row.params.get("mode") == "c" else row.params.get("mode"))
        if row.us and mul:
            row.stats["x_torch_mul"] = row.us / mul
    return rows + first_calls(b)


def first_calls(b: Bench) -> list[Row]:
    """µs of the first call of each of 24 new merge_state signatures, every kernel already
    loaded (``zerokv.precompile``): validation, plan and form building, one launch."""
    import zerokv

    torch, dev = b.torch, b.device
    H, D = _hd(b)
    if not b.dry:
        zerokv.precompile(ops=["merge_state"], dtypes=["bfloat16"])
    T = 64
    va, vb = (torch.randn(T, H, D, dtype=torch.bfloat16, device=dev) for _ in range(2))
    sa, sb = (torch.randn(T, H, device=dev) for _ in range(2))
    us = []
    for base in ("e", 2):
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            for prefix in (None, T // 2):
                for with_lse in (False, True):
                    out = torch.empty(T, H, D, dtype=out_dtype, device=dev)
                    lse = torch.empty(T, H, device=dev) if with_lse else None
                    b.sync()
                    t = time.perf_counter()
                    zerokv.merge_state(
                        va, sa, vb, sb, out=out, out_lse=lse, lse_base=base, prefix_rows=prefix
                    )
                    b.sync()
                    us.append((time.perf_counter() - t) * 1e6)
    row = Row(op="host_first", impl="merge_state, first call of a new signature", dtype="bf16", H=H, D=D, T=T)  # fmt: skip
    row.us, row.stats = statistics.median(us), {"calls_us": us, "max_us": max(us)}
    return [row]


# --- compile ----------------------------------------------------------------------------------


def child(which: str, cache_dir: str, dry: bool) -> dict[str, Any]:
    env = dict(os.environ)
    env["CUPY_CACHE_DIR"] = cache_dir
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([str(ROOT)] if str(ROOT) not in paths else []))
    cmd = [sys.executable, "-m", "bench.bench_host", "--compile-child", which] + (["--cpu"] if dry else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited with {proc.returncode}: {proc.stderr.strip()[-600:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    result["cache_files"] = sum(len(files) for _, _, files in os.walk(cache_dir))
    return result


def compile_rows(kind: str, which: str, result: dict[str, Any]) -> list[Row]:
    rows = [
        Row(op="compile", impl=kind, us=s * 1e6, params={"set": which, "item": item})
        for item, s in result["items"].items()
    ]
    extra = {k: v for k, v in result.items() if k not in ("items", "total_s", "set")}
    rows.append(
        Row(op="compile", impl=kind, us=result["total_s"] * 1e6, params={"set": which, "item": "total"})
    )
    rows[-1].stats = extra
    return rows


def run_compile(which: str, b: Bench) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="zerokv-bench-cache-") as cache:
        cold = child(which, cache, b.dry)
        warm = child(which, cache, b.dry)
    return compile_rows("cold", which, cold) + compile_rows("warm", which, warm)


def compile_child(which: str, cpu: bool) -> dict[str, Any]:
    """In a fresh process: tensors made and torch's CUDA context up before ``import zerokv``;
    the clock starts after that import, as an engine sees it."""
    import torch

    dev = torch.device("cpu" if cpu else "cuda")

    def sync() -> None:
        if not cpu:
            torch.cuda.synchronize()

    T, bf = 4, torch.bfloat16
    va, vb, out = (torch.randn(T, H, D, device=dev, dtype=bf) for _ in range(3))
    sa, sb, lse = (torch.randn(T, H, device=dev) for _ in range(3))
    v, s = torch.randn(2, T, H, D, device=dev, dtype=bf), torch.randn(2, T, H, device=dev)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=dev)
    kv = torch.tensor([0, 3], dtype=torch.int32, device=dev)
    cu_kv = torch.tensor([0, 0, 3], dtype=torch.int32, device=dev)
    sync()

    t = time.perf_counter()
    import zerokv

    result: dict[str, Any] = {"set": which, "import_s": time.perf_counter() - t, "items": {}}
    result["cupy_imported_by_import"] = "cupy" in sys.modules
    t0 = time.perf_counter()
    if which == "engine":
        ops = [
            ("merge_state bf16", lambda: zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse)),
            ("merge_states bf16", lambda: zerokv.merge_states(v, s, out=out, out_lse=lse)),
            ("fixup_zero_kv_rows bf16", lambda: zerokv.fixup_zero_kv_rows(out, lse, kv, cu)),
            ("mask_empty_context bf16", lambda: zerokv.mask_empty_context(out, lse, cu, cu_kv)),
        ]
        for name, fn in ops:
            t = time.perf_counter()
            fn()
            sync()
            result["items"][name] = time.perf_counter() - t
    elif not cpu:
        count = 0
        for op in ("merge_state", "merge_states", "fixup_zero_kv_rows", "mask_empty_context", "cp_merge"):
            t = time.perf_counter()
            try:
                n = zerokv.precompile(ops=[op])  # every dtype: compiles and loads each instantiation
            except Exception as e:  # an op this version does not have, or a failed compile
                result.setdefault("errors", {})[op] = f"{type(e).__name__}: {e}"[:300]
                continue
            result["items"][f"{op} ({n} instantiations)"] = time.perf_counter() - t
            count += n
        result["instantiations"] = count
    result["total_s"] = time.perf_counter() - t0
    return result


# --- tasks ------------------------------------------------------------------------------------


def tasks(b: Bench, part: str) -> list[Task]:
    if part == "compile":
        sets = ["engine"] if b.mode != "full" else ["engine", "all"]
        return [Task(part, f"compile: {w} set, cold + warm", partial(run_compile, w)) for w in sets]
    return [Task(part, "host µs: every op, option and adapter, interleaved rounds", run_interleaved)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_host")
    parser.add_argument("--compile-child", choices=("engine", "all"), required=True)
    parser.add_argument("--cpu", action="store_true", help="the CPU path (checks the pipeline only)")
    args = parser.parse_args(argv)
    print(json.dumps(compile_child(args.compile_child, args.cpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
