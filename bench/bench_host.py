"""Host cost of a call from Python, and the compile time of the kernels.

**Host µs per call** of every op and adapter, beside ``torch.mul(a, b, out=c)`` and the Triton
merge measured in the same process, three ways:

* (a) a new token count on every call: slices ``x[:T]`` of preallocated buffers, T running over
  4096 distinct values per round (rounds use other values again); the loop that only slices is
  timed too and subtracted;
* (b) the same call repeated (same tensors, T = 256);
* (c) outputs allocated by the op (where it allocates): as (a), without ``out``. Adapters that
  always allocate (FlashInfer's ``merge_state``, ``merge_states``) have (b) and (c) only.

Rows are ``H = 2``, ``D = 64``, bf16, T up to ~12k: the GPU work of a call stays a few µs, below
its host time, so the host is what is measured. Loops run with the garbage collector off,
synchronised before and after; the median of the rounds is reported.

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

H, D = 2, 64
T_REPEATED = 256
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


def cases(b: Bench) -> list[Case]:
    import zerokv
    from zerokv.compat import flashinfer as fi
    from zerokv.compat import sglang, vllm

    from . import baselines

    torch = b.torch
    ops = getattr(torch.ops, "zerokv", None)

    def merge6(t, T):
        return (t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T]), {"out": t.out[:T], "out_lse": t.ol[:T]}

    def merge4(t, T):
        return (t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T]), {}

    def a_empty(args_at):
        def at(t, T):
            a, kw = args_at(t, T)
            return a, {**kw, "a_empty": (t.cu, t.kv)}

        return at

    out = [
        Case("torch.mul(a, b, out=c)", "reference",
             (torch.mul, lambda t, T: ((t.a[:T], t.b[:T]), {"out": t.c[:T]})),
             (torch.mul, lambda t, T: ((t.a[:T], t.b[:T]), {}))),
        Case("Triton merge (vLLM design)", "baseline",
             (baselines.triton_merge_state,
              lambda t, T: ((t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T], t.out[:T], t.ol[:T]), {})),
             skip="" if baselines.triton is not None and not b.dry else "skipped: needs Triton on a GPU"),
        Case("merge_state", "zerokv", (zerokv.merge_state, merge6), (zerokv.merge_state, merge4)),
        Case("merge_state a_empty", "zerokv",
             (zerokv.merge_state, a_empty(merge6)), (zerokv.merge_state, a_empty(merge4))),
        Case("merge_states", "zerokv",
             (zerokv.merge_states, lambda t, T: ((t.v[:, :T], t.s[:, :T]), {"out": t.out[:T], "out_lse": t.ol[:T]})),
             (zerokv.merge_states, lambda t, T: ((t.v[:, :T], t.s[:, :T]), {}))),
        Case("fixup_zero_kv_rows", "zerokv",
             (zerokv.fixup_zero_kv_rows, lambda t, T: ((t.fo[:T], t.fl[:T], t.kv, t.cu), {}))),
        Case("mask_empty_context", "zerokv",
             (zerokv.mask_empty_context, lambda t, T: ((t.fo[:T], t.fl[:T], t.cu, t.cukv), {}))),
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
    ]  # fmt: skip
    if ops is not None and hasattr(ops, "merge_state_out"):
        out.append(
            Case(
                "torch.ops.zerokv.merge_state_out",
                "zerokv",
                (
                    ops.merge_state_out,
                    lambda t, T: ((t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T], t.out[:T], t.ol[:T]), {}),
                ),
                (ops.merge_state, merge4),
            )  # fmt: skip
        )
    return out


def buffers(b: Bench) -> SimpleNamespace:
    """Round sizes and the buffers every case slices (made once per run)."""
    p = b.shared.get("host_plan")
    if p is not None:
        return p
    per_round, rounds = (32, 1) if b.dry else (4096, 1 if b.quick else 3)
    t_max = per_round * rounds + WARMUP
    torch, dev, bf = b.torch, b.device, b.torch.bfloat16
    g = torch.Generator().manual_seed(7)
    order = torch.randperm(per_round * rounds, generator=g) + 1  # distinct T values 1..per_round*rounds

    def v(*shape):
        return torch.randn(*shape, dtype=bf).to(dev)

    def s(*shape):
        return torch.randn(*shape).to(dev)

    t = SimpleNamespace(
        a=v(t_max, H, D), b=v(t_max, H, D), c=v(t_max, H, D),
        va=v(t_max, H, D), vb=v(t_max, H, D), out=v(t_max, H, D), sa=s(t_max, H), sb=s(t_max, H), ol=s(t_max, H),
        sa_ht=s(H, t_max), sb_ht=s(H, t_max), ol_ht=s(H, t_max),
        v=v(2, t_max, H, D), s=s(2, t_max, H), v_tn=v(t_max, 2, H, D), s_tn=s(t_max, 2, H),
        fo=v(t_max, H, D), fl=s(t_max, H), fl_ht=s(H, t_max), ip_v=v(t_max, H, D), ip_s=s(t_max, H),
        cu=torch.tensor([0, 2, 4], dtype=torch.int32, device=dev),
        kv=torch.tensor([0, 3], dtype=torch.int32, device=dev),
        cukv=torch.tensor([0, 0, 3], dtype=torch.int32, device=dev),
    )  # fmt: skip
    p = SimpleNamespace(
        bufs=t,
        rounds=[order[r * per_round : (r + 1) * per_round].tolist() for r in range(rounds)],
        warmup=list(range(t_max - WARMUP + 1, t_max + 1)),  # T values no round uses
    )
    b.shared["host_plan"] = p
    return p


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


def new_t_us(b: Bench, fn: Callable[..., Any], at: ArgsAt) -> tuple[float, dict[str, Any]]:
    """Mode (a) / (c): µs per call with a new T every call, the slicing subtracted."""
    p = buffers(b)
    t = p.bufs
    for T in p.warmup:
        a, kw = at(t, T)
        fn(*a, **kw)

    def calls(Ts: list[int]) -> None:
        for T in Ts:
            a, kw = at(t, T)
            fn(*a, **kw)

    def slices(Ts: list[int]) -> None:
        for T in Ts:
            at(t, T)

    per_round, slicing = [], []
    for Ts in p.rounds:
        whole = _timed(b, partial(calls, Ts), len(Ts))
        cut = _timed(b, partial(slices, Ts), len(Ts))
        per_round.append(whole - cut)
        slicing.append(cut)
    stats = {
        "rounds_us": per_round,
        "slicing_us": statistics.median(slicing),
        "calls": sum(map(len, p.rounds)),
    }
    return statistics.median(per_round), stats


def repeated_us(b: Bench, fn: Callable[..., Any], at: ArgsAt) -> tuple[float, dict[str, Any]]:
    """Mode (b): µs per call of the same call repeated."""
    p = buffers(b)
    a, kw = at(p.bufs, T_REPEATED)
    for _ in range(WARMUP):
        fn(*a, **kw)
    n = len(p.rounds[0])

    def calls() -> None:
        for _ in range(n):
            fn(*a, **kw)

    per_round = [_timed(b, calls, n) for _ in p.rounds]
    return statistics.median(per_round), {"rounds_us": per_round, "calls": n * len(p.rounds)}


def run_case(case: Case, b: Bench) -> list[Row]:
    if case.skip:
        return [
            Row(
                op="host", impl=case.label, dtype="bf16", H=H, D=D, params={"kind": case.kind}, note=case.skip
            )
        ]
    modes = [
        ("a", case.given, new_t_us),
        ("b", case.given or case.alloc, repeated_us),
        ("c", case.alloc, new_t_us),
    ]
    rows = []
    for mode, what, measure in modes:
        if what is None:
            continue
        row = Row(op="host", impl=case.label, dtype="bf16", H=H, D=D)
        row.params = {"mode": mode, "kind": case.kind, "allocates": case.given is None or mode == "c"}
        try:
            row.us, row.stats = measure(b, *what)
        except Exception as e:
            row.note = f"failed: {type(e).__name__}: {e}"[:300]
        rows.append(row)
    return rows


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
    try:
        found = cases(b)
    except Exception as e:  # an adapter missing or renamed: the table says so
        note = f"failed: {type(e).__name__}: {e}"[:300]
        return [Task(part, "host µs", lambda b: [Row(op="host", impl="(cases)", note=note)])]
    return [Task(part, f"host µs: {c.label}", partial(run_case, c)) for c in found]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_host")
    parser.add_argument("--compile-child", choices=("engine", "all"), required=True)
    parser.add_argument("--cpu", action="store_true", help="the CPU path (checks the pipeline only)")
    args = parser.parse_args(argv)
    print(json.dumps(compile_child(args.compile_child, args.cpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
