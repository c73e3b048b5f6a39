"""The performance targets, judged on the rows of a run. ``ratio`` is measured / goal: at least 1
is good for a ">=" goal, at most 1 for a "<=" goal."""

from __future__ import annotations

from dataclasses import dataclass

from .bench_compile import TOTAL
from .bench_host import MERGE6, MERGE6_NEW, MUL
from .common import Row

BIG = 256e6  # bytes moved from which merge_state must reach the bandwidth target


@dataclass
class Target:
    name: str
    goal: str
    measured: str = "not measured"
    ratio: float | None = None
    reached: bool | None = None


def _shape(r: Row) -> str:
    return f"T={r.T} H={r.H} D={r.D}"


def _find(rows: list[Row], op: str, impl: str = "zerokv", **want) -> Row | None:
    for r in rows:
        if r.op != op or r.impl != impl or r.us is None:
            continue
        if all(getattr(r, k, None) == v or r.params.get(k) == v for k, v in want.items()):
            return r
    return None


def _at_least(t: Target, value: float, goal: float, text: str) -> Target:
    t.measured, t.ratio, t.reached = text, value / goal, value >= goal
    return t


def _at_most(t: Target, value: float, goal: float, text: str) -> Target:
    t.measured, t.ratio, t.reached = text, value / goal, value <= goal
    return t


def evaluate(rows: list[Row], empty_launch_us: float | None) -> list[Target]:
    out: list[Target] = []

    t = Target("merge_state bf16 T=16384 H=128 D=128", ">= 90 % of copy")
    r = _find(rows, "merge_state", dtype="bf16", T=16384, H=128, D=128)
    if r and r.pct_copy:
        t = _at_least(t, r.pct_copy, 90, f"{r.pct_copy:.1f} % ({r.us:.0f} µs)")
    out.append(t)

    t = Target("merge_state bf16, every row >= 256 MB moved", ">= 90 % of copy")
    big = [
        r for r in rows
        if r.op == "merge_state" and r.impl == "zerokv" and r.dtype == "bf16" and r.bytes >= BIG and r.pct_copy
    ]  # fmt: skip
    if big:
        lo = min(big, key=lambda r: r.pct_copy)
        hi = max(big, key=lambda r: r.pct_copy)
        text = f"worst {lo.pct_copy:.1f} % ({_shape(lo)}), best {hi.pct_copy:.1f} % ({_shape(hi)}), {len(big)} rows"
        t = _at_least(t, lo.pct_copy, 90, text)
    out.append(t)

    for op in ("fixup_zero_kv_rows", "mask_empty_context"):
        t = Target(f"{op}, 4096 empty rows, H=128 D=128 bf16", ">= 85 % of copy (bytes written)")
        r = _find(rows, op, empty_rows=4096, H=128, D=128, dtype="bf16")
        if r and r.pct_copy:
            t = _at_least(t, r.pct_copy, 85, f"{r.pct_copy:.1f} % ({r.us:.1f} µs)")
        out.append(t)
        t = Target(f"{op}, 0 empty rows", "<= an empty kernel launch")
        r = _find(rows, op, empty_rows=0, H=128, D=128, dtype="bf16")
        if r and empty_launch_us:
            t = _at_most(t, r.us, empty_launch_us, f"{r.us:.2f} µs vs empty launch {empty_launch_us:.2f} µs")
        out.append(t)

    mul = _find(rows, "host", MUL)
    for name, impl in (("", MERGE6), (" (info: new tensors every call)", MERGE6_NEW)):
        t = Target(f"host: merge_state with all 6 tensors{name}", "<= 1.3 x torch.mul")
        r = _find(rows, "host", impl)
        if r and mul:
            x = r.us / mul.us
            t = _at_most(t, x, 1.3, f"{r.us:.1f} µs = {x:.2f} x torch.mul ({mul.us:.1f} µs)")
        out.append(t)

    t = Target("cold compile, engine set (bf16 vector path of each op)", "<= 3 s")
    r = _find(rows, "compile", "cold", set="engine", item=TOTAL)
    if r:
        t = _at_most(t, r.us / 1e6, 3.0, f"{r.us / 1e6:.2f} s")
    out.append(t)

    t = Target("warm first call of each op in a new process, after import", "<= 0.5 s")
    r = _find(rows, "compile", "warm", set="engine", item=TOTAL)
    if r:
        t = _at_most(t, r.us / 1e6, 0.5, f"{r.us / 1e6:.3f} s")
    out.append(t)
    return out
