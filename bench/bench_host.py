"""Host cost of a call from Python (``--only host``).

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
by ``bench_compile``, not a call's). Loops run with the garbage collector off, synchronised before and after. ``host_first``: the first call of each of 24 new
merge_state signatures after ``zerokv.precompile`` loaded every kernel (µs, synchronised).

The calls and the buffers they slice are in ``host_cases``; this module times them.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

from .common import Bench, Row, Task
from .host_cases import WARMUP, ArgsAt, Case, buffers, cases, hd_of


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
            row = Row(op="host", impl=case.label, dtype="bf16", H=hd_of(b)[0], D=hd_of(b)[1])
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
        H=hd_of(b)[0],
        D=hd_of(b)[1],
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
    H, D = hd_of(b)
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


# --- tasks ------------------------------------------------------------------------------------


def tasks(b: Bench, part: str) -> list[Task]:
    return [Task(part, "host µs: every op, option and adapter, interleaved rounds", run_interleaved)]
