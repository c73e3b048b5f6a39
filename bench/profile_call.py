"""Host cost of one call, per executor, beside ``torch.mul(a, b, out=c)`` in the same process.

    PYTHONPATH=. python3 -m bench.profile_call [--cpu] [--against DIR] [--json FILE]

Rows (µs, median of interleaved rounds, and × ``torch.mul(out=)``): the public ``merge_state``
through the C and the Python executor (the same tensors, and a new T every call as an engine
calls; a call no recent bound call takes, 12 signatures in turn, an empty call), each executor
alone on a bound call, every option (sinks also as a module's parameter), the ``[H, T]`` LSE, allocated
outputs, each adapter, ``torch.ops.zerokv``, the empty-row ops and ``merge_states``; the new-T
rows' loop around a no-op (its cost is in each of them). ``--cpu``:
CPU tensors down the GPU path with launches counted, not made (``zerokv.testing``), and
``torch.mul`` of 64 floats on one thread. ``--against DIR``: also the same public call of
another zerokv package directory (e.g. an older release unpacked there), loaded in this process
beside this one, for an A/B of the Python paths.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import timeit
from typing import Any

H, D = 16, 128
ROUNDS, NUMBER = 7, 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_call")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors, launches counted (no GPU)")
    parser.add_argument("-T", type=int, default=256)
    parser.add_argument("--against", help="another zerokv package directory, timed beside this one")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    import torch

    import zerokv
    from zerokv.core import executor

    dev = "cpu" if args.cpu else "cuda"
    if args.cpu:
        torch.set_num_threads(1)  # a small multiply without a thread pool's wake-up
    shape = (64,) if args.cpu else (args.T, H, D)
    a, b, c = torch.randn(shape, device=dev), torch.randn(shape, device=dev), torch.empty(shape, device=dev)
    steps: dict[str, Any] = {"torch.mul(out=)": lambda: torch.mul(a, b, out=c)}
    # the new-T rows' own loop around a callee that does nothing: part of each of those rows
    steps["new-T loop, no-op callee"] = _new_t(lambda *a, out=None, out_lse=None: None, torch, dev)
    names = ["c", "python"] if executor.module_of_safe("c") is not None else ["python"]
    for name in names:
        for label, fn in _calls(zerokv, torch, dev, args.T).items():
            steps[f"{label}, {'C' if name == 'c' else 'Python'} executor"] = (name, fn)
    if args.against:
        old, route = _load_other(args.against, args.cpu)
        for label, fn in _calls(old, torch, dev, args.T, only_plain=True).items():
            steps[f"{label}, {args.against}"] = (route, fn)
    got = _time(steps, args.cpu, args.rounds)
    mul = statistics.median(got["torch.mul(out=)"])
    rows = []
    for k, v in got.items():
        us = statistics.median(v)
        rows.append({"step": k, "us": us, "x_mul": us / mul, "rounds": v})
        print(f"{k:58s} {us:7.2f} µs  {us / mul:5.2f} x torch.mul")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": args.cpu, "T": args.T, "H": H, "D": D, "rows": rows}, f, indent=1)
    return 0


def _time(steps: dict, cpu: bool, rounds: int) -> dict[str, list[float]]:
    """µs per call of each step, ``rounds`` interleaved rounds; zerokv's steps inside a recording
    block of their executor on the CPU."""
    import zerokv.testing as zt

    got: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, step in steps.items():
            if callable(step):
                got[k].append(timeit.timeit(step, number=NUMBER) / NUMBER * 1e6)
                continue
            name, fn = step
            if callable(name):  # another package's own routing
                block = name()
            else:
                block = zt.record_launches(executor=name, keep=False) if cpu else _executor_block(name)
            with block:
                fn = getattr(fn, "make", lambda f=fn: f)()  # a step made inside its block
                fn()  # its signature's first call (full validation, plan, form) before timing
                got[k].append(timeit.timeit(fn, number=NUMBER) / NUMBER * 1e6)
    return got


@contextlib.contextmanager
def _executor_block(name: str):
    """On a GPU: the ops run on executor ``name`` inside the block."""
    from zerokv.core import executor

    saved = executor.run
    executor.run = executor.runner(name)
    try:
        yield
    finally:
        executor.run = saved


def _calls(zk: Any, torch: Any, dev: str, T: int, only_plain: bool = False) -> dict[str, Any]:
    """The timed calls of package ``zk`` (zerokv, or another directory's), by label."""
    bf = torch.bfloat16
    va, vb, out = (torch.randn(T, H, D, device=dev).to(bf) for _ in range(3))
    sa, sb, ol = (torch.randn(T, H, device=dev) for _ in range(3))
    ms = zk.merge_state
    calls = {"public call": lambda: ms(va, sa, vb, sb, out=out, out_lse=ol)}
    calls["public call, new T"] = _new_t(ms, torch, dev)
    # the calls no recent bound call takes: the full validation, the plan of the signature by
    # its facts, then its bound call (none among the recent: cleared), or the launch from the
    # facts (T = 0: no bound call takes an empty call, nothing is launched)
    plans = importlib.import_module(f"{zk.__name__}.core.plans")
    calls["no recent bound call"] = lambda: (plans.recent.clear(), ms(va, sa, vb, sb, out=out, out_lse=ol))
    va0, sa0, vb0, sb0, out0, ol0 = (x[:0] for x in (va, sa, vb, sb, out, ol))
    calls["T = 0"] = lambda: ms(va0, sa0, vb0, sb0, out=out0, out_lse=ol0)
    calls["12 signatures in turn"] = _signatures(ms, torch, dev, T)
    if only_plain:
        return calls
    from zerokv.compat import flashinfer, sglang, vllm

    sa_ht, sb_ht, ol_ht = (torch.randn(H, T, device=dev) for _ in range(3))
    sa_t, sb_t, ol_t = sa_ht.T, sb_ht.T, ol_ht.T  # [H, T] buffers as [T, H] views, made once
    idx = torch.tensor([0, T // 3, T // 2, T], dtype=torch.int32, device=dev)
    kv = torch.tensor([0, 5, 9], dtype=torch.int32, device=dev)
    sinks, scale = torch.randn(H, device=dev), torch.tensor([0.5], device=dev)
    psinks = torch.nn.Parameter(sinks.clone(), requires_grad=False)  # gpt-oss's sinks are weights
    out8 = torch.empty(T, H, D, device=dev).to(torch.float8_e4m3fn)
    bscale = torch.empty(T, H * D // 128, device=dev)
    v3, s3 = torch.randn(3, T, H, D, device=dev).to(bf), torch.randn(3, T, H, device=dev)
    objs = (va, sa, vb, sb, out, ol, None, None, None, None, None)

    def executor_alone() -> Any:
        """The bound call of the plain call, run by the block's executor."""
        from zerokv.core import executor

        plans.recent.clear()  # a cache: the plain call's bound call is then the only one kept
        ms(va, sa, vb, sb, out=out, out_lse=ol)
        bc = next(iter(plans.recent.values()))[0]
        run = executor.run
        return lambda: run(bc, objs, (None,))

    alone = _Made()
    alone.make = executor_alone
    calls.update(
        {
            "executor alone": alone,
            "a_empty": lambda: ms(va, sa, vb, sb, out=out, out_lse=ol, a_empty=(idx, kv)),
            "sinks": lambda: ms(va, sa, vb, sb, out=out, out_lse=ol, sinks=sinks),
            "sinks, a module's parameter": lambda: ms(va, sa, vb, sb, out=out, out_lse=ol, sinks=psinks),
            "out_scale (fp8)": lambda: ms(va, sa, vb, sb, out=out8, out_scale=scale),
            "per-group fp8": lambda: ms(va, sa, vb, sb, out=out8, out_block_scale=bscale, quant_group=128),
            "prefix_rows": lambda: ms(va, sa, vb, sb, out=out, out_lse=ol, prefix_rows=T // 2),
            "[H, T] LSE": lambda: ms(va, sa_t, vb, sb_t, out=out, out_lse=ol_t),
            "allocated outputs": lambda: ms(va, sa, vb, sb),
            "vllm.merge_attn_states": lambda: vllm.merge_attn_states(out, va, sa_ht, vb, sb_ht, ol_ht),
            "sglang.merge_state_v2": lambda: sglang.merge_state_v2(va, sa, vb, sb, out, ol),
            "flashinfer.merge_state_in_place": lambda: flashinfer.merge_state_in_place(out, ol, vb, sb),
            "torch.ops.zerokv.merge_state_out": lambda: torch.ops.zerokv.merge_state_out(
                va, sa, vb, sb, out, ol
            ),
            "merge_states (N = 3)": lambda: zk.merge_states(v3, s3, out=out, out_lse=ol),
            "fixup_zero_kv_rows": lambda: zk.fixup_zero_kv_rows(out, ol, kv, idx),
            "mask_empty_context": lambda: zk.mask_empty_context(out, ol, idx, idx),
        }
    )
    return calls


class _Made:
    """A step whose callable is made inside its executor's block (``make()``)."""

    make: Any = None


def _signatures(ms: Any, torch: Any, dev: str, T: int) -> Any:
    """Calls of 12 signatures with the same scalar arguments, in turn (3 dtypes, each with and
    without out_lse, an unaligned out, sinks): a process that meets several."""
    calls = []
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        va, vb, out = (torch.randn(T, H, D, device=dev).to(dt) for _ in range(3))
        sa, sb, ol = (torch.randn(T, H, device=dev) for _ in range(3))
        odd = torch.empty(T * H * D + 1, dtype=dt, device=dev)[1:].view(T, H, D)
        sinks = torch.randn(H, device=dev)
        calls += [
            lambda a=(va, sa, vb, sb), o=out, ol=ol: ms(*a, out=o, out_lse=ol),
            lambda a=(va, sa, vb, sb), o=out: ms(*a, out=o),
            lambda a=(va, sa, vb, sb), o=odd, ol=ol: ms(*a, out=o, out_lse=ol),
            lambda a=(va, sa, vb, sb), o=out, ol=ol, s=sinks: ms(*a, out=o, out_lse=ol, sinks=s),
        ]
    state = [0]

    def call() -> None:
        i = state[0] = (state[0] + 1) % 12
        calls[i]()

    def warm() -> Any:  # each signature's first call made before the timing
        for c in calls:
            c()
        return call

    made = _Made()
    made.make = warm
    return made


def _new_t(fn: Any, torch: Any, dev: str) -> Any:
    """Calls over 64 token counts, cycled (views of preallocated buffers made beforehand: the
    slicing is not timed), as an engine calls with a new T each step."""
    n, bf = 512, torch.bfloat16
    vs = [torch.randn(n, H, D, device=dev).to(bf) for _ in range(3)]
    ss = [torch.randn(n, H, device=dev) for _ in range(3)]
    args = [(vs[0][:t], ss[0][:t], vs[1][:t], ss[1][:t], vs[2][:t], ss[2][:t]) for t in range(n - 63, n + 1)]
    state = [0]

    def call() -> None:
        i = state[0] = (state[0] + 1) & 63
        a = args[i]
        fn(a[0], a[1], a[2], a[3], out=a[4], out_lse=a[5])

    return call


def _load_other(directory: str, cpu: bool) -> tuple[Any, Any]:
    """Another zerokv package directory as a package of its own name in this process (its
    ``__init__`` not run, so it registers no torch ops beside this one's), and the block that
    routes its calls as ``record_launches`` routes this one's (on a GPU: nothing)."""
    import os
    import types

    path = os.path.abspath(directory)
    name = "zerokv_" + os.path.basename(path.rstrip("/")).replace("-", "_").replace(".", "_")
    pkg = types.ModuleType(name)
    pkg.__path__ = [path]
    sys.modules[name] = pkg
    merge = importlib.import_module(f"{name}.merge")
    mods = {m: importlib.import_module(f"{name}.core.{m}") for m in ("device", "facts", "plans")}

    @contextlib.contextmanager
    def route():
        if not cpu:
            yield
            return
        saved = []

        def patch(obj: Any, attr: str, value: Any) -> None:
            saved.append((obj, attr, getattr(obj, attr)))
            setattr(obj, attr, value)

        patch(mods["plans"], "launcher", _Counted)
        for attr, value in (("sm_count", 132), ("l2_bytes", 50 << 20), ("torch_stream", 0)):
            patch(mods["device"], attr, lambda d, v=value: v)
        for attr in ("of", "read", "read_two", "read_n", "read_rows"):  # the readers of either version
            if hasattr(mods["facts"], attr):
                patch(mods["facts"], attr, _on_device(getattr(mods["facts"], attr)))
        try:
            yield
        finally:
            for obj, attr, value in reversed(saved):
                setattr(obj, attr, value)
            mods["plans"].clear_plans()

    return types.SimpleNamespace(merge_state=merge.merge_state, __name__=name), route


class _Counted:
    """Another package's launcher stand-in: packs as a launch would, launches nothing (each of
    the launch entries that releases have had)."""

    def __init__(self, kernel: Any, targs: tuple, device: int) -> None:
        self.buf = bytearray(kernel.packer.size)
        self.pack_into = kernel.packer.pack_into
        self.count = 0

    def launch_values(self, grid: int, grid_y: int, stream: int, values: Any) -> None:
        self.pack_into(self.buf, 0, *values)
        self.count += 1

    def fire(self, grid: int, grid_y: int, stream: int) -> None:
        self.count += 1


def _on_device(facts_of: Any) -> Any:
    def on_device(*a: Any) -> Any:
        f = facts_of(*a)
        if f is not None:  # (an older version's readers return None for what they cannot read)
            f.device = 0
        return f

    return on_device


if __name__ == "__main__":
    sys.exit(main())
