"""The goals a run is judged against, each with its measured value and verdict: merge_state
against the best baseline and the copy bandwidth, the N-way merge, the empty-row ops, the host
cost per call over ``torch.mul(out=)``, the context-parallel merge, the first-use times; and the
table of them that ends the report. A goal whose op is not among the rows is left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .common import Row
from .compare import OURS, host_ref, merge_lines
from .tables import shape_label, table, us


@dataclass
class Target:
    """``ratio`` = measured / goal: at least 1 is good for a ">=" goal, at most 1 for "<="."""

    name: str
    goal: str
    measured: str = "not measured"
    ratio: float | None = None
    reached: bool | None = None

    def judge(self, value: float, goal: float, text: str, at_least: bool) -> Target:
        self.measured, self.ratio = text, value / goal
        self.reached = value >= goal if at_least else value <= goal
        return self


def _find(rows: list[Row], op: str, impl: str = OURS, **want: Any) -> Row | None:
    for r in rows:
        same = r.op == op and r.impl == impl and r.us is not None
        if same and all(getattr(r, k, None) == v or r.params.get(k) == v for k, v in want.items()):
            return r
    return None


def _worst(t: Target, found: list[tuple[float, str]], goal: float, at_least: bool, unit: str = "") -> Target:
    """Judge the worst of several (value, where) against one goal."""
    if not found:
        return t
    value, where = (min if at_least else max)(found)
    missed = sum((v < goal) if at_least else (v > goal) for v, _ in found)
    return t.judge(value, goal, f"worst {value:.2f}{unit} ({where}); {missed} of {len(found)} miss", at_least)


def evaluate(rows: list[Row], big_bytes: float = 256e6) -> list[Target]:
    """Every goal whose op is among the rows (a part not run adds no "not measured" lines)."""
    ran = {r.op for r in rows}
    big_mb = f"{big_bytes / 1e6:.0f} MB"
    out: list[Target] = []

    if "merge_state" in ran:
        lines = merge_lines(rows)
        for layout in ("TH", "HT"):
            t = Target(f"merge_state zerokv / best baseline, layout {layout}, every shape", "<= 1.00")
            found = [
                (x["ratio"], f"{x['key'][0]} {shape_label(x['zerokv'])}")
                for x in lines
                if x["layout"] == layout
            ]
            out.append(_worst(t, [f for f in found if f[0] is not None], 1.0, at_least=False))
        t = Target(f"merge_state zerokv, every shape >= {big_mb} moved", ">= 90 % of copy")
        big = [
            r
            for r in rows
            if r.op == "merge_state" and r.impl == OURS and r.bytes >= big_bytes and r.pct_copy
        ]
        found = [(r.pct_copy, f"{r.dtype} {shape_label(r)} {r.params.get('layout')}") for r in big]
        out.append(_worst(t, found, 90, True, " %"))

    if "merge_states" in ran:
        for N in (2, 4, 8):
            t = Target(f"merge_states N={N}, >= {big_mb} moved", ">= 90 % of copy")
            sel = [
                r for r in rows
                if r.op == "merge_states" and r.impl == OURS and r.params.get("N") == N and r.bytes >= big_bytes
            ]  # fmt: skip
            out.append(_worst(t, [(r.pct_copy, shape_label(r)) for r in sel if r.pct_copy], 90, True, " %"))

    for op in ("fixup_zero_kv_rows", "mask_empty_context"):
        if op not in ran:
            continue
        for E, goal in ((4096, 85.0), (32768, 88.0)):
            t = Target(f"{op}, {E} empty rows", f">= {goal:.0f} % of copy (bytes written)")
            r = _find(rows, op, empty_rows=E)
            if r and r.pct_copy:
                t.judge(
                    r.pct_copy, goal, f"{r.pct_copy:.1f} % ({us(r.us)} µs, {shape_label(r)})", at_least=True
                )
            out.append(t)
        t = Target(f"{op}, no empty row", "<= 1.5 µs (GPU, graph)")
        r = _find(rows, op, empty_rows=0)
        if r:
            t.judge(r.us, 1.5, f"{us(r.us)} µs", at_least=False)
        out.append(t)

    if "host" in ran:
        out += host_targets(rows)
    out += cp_targets(rows)

    if "compile" in ran:
        for kind, goal, name in (
            ("cold", 3.0, "cold compile, engine set (bf16 vector path of each op)"),
            ("warm", 0.5, "warm first call of each op in a new process, after import"),
        ):
            t = Target(name, f"<= {goal} s")
            r = _find(rows, "compile", kind, set="engine", item="total")
            if r:
                t.judge(r.us / 1e6, goal, f"{r.us / 1e6:.3f} s", at_least=False)
            out.append(t)
    return out


def host_targets(rows: list[Row]) -> list[Target]:
    """Host-cost goals, over torch.mul(out=) of the same process: merge_state <= 1.3 x on the
    same T (repeated, or 60 layers' buffers) and <= 1.5 x on a new T; every option, LSE layout
    and adapter of the two-way merge <= merge_state's figure + 0.2 in the same mode; the other
    ops <= 1.5 x on a new T; allocated outputs and torch.ops.zerokv.* <= 2 x; the first call of
    a new signature <= 200 µs."""
    ours = [r for r in rows if r.op == "host" and r.params.get("kind") == OURS and r.us is not None]

    def ratios(mode: str, keep: Callable[[Row], bool]) -> list[tuple[float, str]]:
        ref = host_ref(rows, mode)
        if ref is None:
            return []
        return [(r.us / ref.us, r.impl) for r in ours if r.params.get("mode") == mode and keep(r)]

    def plain(r: Row) -> bool:
        return r.impl == "merge_state" or "layers' buffers" in r.impl

    def two_way(r: Row) -> bool:  # an option, LSE layout or adapter of the two-way merge
        other = ("merge_states", "fixup", "mask_empty", "cp_merge", "torch.ops")
        return not plain(r) and not any(k in r.impl for k in other) and not r.params.get("allocates")

    out = []
    t = Target("host (b) the same T: merge_state (repeated, 60 layers)", "<= 1.3 x torch.mul(out=)")
    out.append(_worst(t, ratios("b", plain), 1.3, False, " x"))
    t = Target("host (a) new T every call: merge_state", "<= 1.5 x torch.mul(out=)")
    out.append(_worst(t, ratios("a", lambda r: r.impl == "merge_state"), 1.5, False, " x"))
    for mode, name in (("a", "new T"), ("b", "the same T")):
        base = {w: v for v, w in ratios(mode, plain)}.get("merge_state")
        if base is not None:
            t = Target(
                f"host ({mode}) {name}: options, LSE layouts, adapters",
                f"<= merge_state + 0.2 ({base + 0.2:.2f} x)",
            )
            out.append(_worst(t, ratios(mode, two_way), base + 0.2, False, " x"))
    t = Target("host (a) new T every call: the other ops", "<= 1.5 x torch.mul(out=)")
    other = ("merge_states", "fixup", "mask_empty", "cp_merge")
    out.append(
        _worst(
            t,
            ratios("a", lambda r: any(k in r.impl for k in other) and "torch.ops" not in r.impl),
            1.5,
            False,
            " x",
        )
    )
    t = Target("host: outputs allocated by zerokv (c), torch.ops.zerokv.* (a, b)", "<= 2 x torch.mul(out=)")
    found = ratios("c", lambda r: True) + [
        x for m in "ab" for x in ratios(m, lambda r: r.impl.startswith("torch.ops"))
    ]
    out.append(_worst(t, found, 2.0, False, " x"))
    first = [
        r for r in rows if r.op == "host_first" and r.impl == "merge_state, first call of a new signature"
    ]
    if first and first[0].us is not None:
        t = Target("host: first call of a new signature (kernel loaded)", "<= 200 µs")
        out.append(t.judge(first[0].us, 200.0, f"{first[0].us:.0f} µs", at_least=False))
    return out


CP = "cp_merge"  # the context-parallel rows: their labels as the cp part writes them
CP_PAIRS = (("zerokv", "collectives fp32"), ("zerokv bf16 wire", "collectives bf16"))
CP_BASELINE = "vLLM design"


def cp_targets(rows: list[Row]) -> list[Target]:
    """Context-parallel goals, when the cp part ran: cp_merge (each wire) no slower than the
    combine in vLLM's design at every T, and within 1.2 x the collectives of its wire alone at
    T >= 1024."""
    if not any(r.op == CP for r in rows):
        return []
    cp = {(r.impl, r.T): r for r in rows if r.op == CP and r.us}
    Ts = sorted({T for _, T in cp if T})
    out = []
    for ours, coll in CP_PAIRS:
        pairs = [(cp.get((ours, T)), cp.get((CP_BASELINE, T)), T) for T in Ts]
        t = Target(f"{CP} {ours} / {CP_BASELINE}, every T", "<= 1.00")
        out.append(_worst(t, [(z.us / b.us, f"T={T}") for z, b, T in pairs if z and b], 1.0, False, " x"))
        pairs = [(cp.get((ours, T)), cp.get((coll, T)), T) for T in Ts if T >= 1024]
        t = Target(f"{CP} {ours} / {coll} alone, T >= 1024", "<= 1.20")
        out.append(_worst(t, [(z.us / c.us, f"T={T}") for z, c, T in pairs if z and c], 1.2, False, " x"))
    return out + _cp_a2a_targets(cp, Ts)


# the all-to-all rows: (zerokv a2a, the same without the pack, the vLLM-design a2a,
# zerokv's AG + RS of that wire, the AG + RS collectives alone of that wire)
CP_A2A = (
    ("zerokv a2a", "zerokv a2a, no pack", "vLLM design a2a", "zerokv bf16 wire", "collectives bf16"),
    ("zerokv a2a fp32 wire", "zerokv a2a fp32 wire, no pack", "vLLM design a2a fp32 wire", "zerokv",
     "collectives fp32"),
)  # fmt: skip


def _cp_a2a_targets(cp: dict, Ts: list[int]) -> list[Target]:
    """zerokv's a2a <= 1.00 x the AG + RS collectives alone at T >= 1024 (<= 0.90 without the
    pack), ahead of the vLLM-design a2a and of zerokv's own AG + RS at every T."""
    out = []
    for ours, no_pack, vllm_a2a, ag_rs, coll in CP_A2A:
        if not any((ours, T) in cp for T in Ts):
            continue
        for impl, other, big, goal in ((ours, coll, True, 1.0), (no_pack, coll, True, 0.9),
                                       (ours, vllm_a2a, False, 1.0), (ours, ag_rs, False, 1.0)):  # fmt: skip
            pairs = [(cp.get((impl, T)), cp.get((other, T)), T) for T in Ts if T >= 1024 or not big]
            where = "T >= 1024" if big else "every T"
            t = Target(f"{CP} {impl} / {other}, {where}", f"<= {goal:.2f}")
            out.append(
                _worst(t, [(z.us / c.us, f"T={T}") for z, c, T in pairs if z and c], goal, False, " x")
            )
    return out


def targets_table(targets: list[Target]) -> str:
    def verdict(t: Target) -> str:
        return "-" if t.reached is None else ("reached" if t.reached else "NOT reached")

    return table(
        ["target", "goal", "measured", "measured/goal", "verdict"],
        [
            [t.name, t.goal, t.measured, "-" if t.ratio is None else f"{t.ratio:.2f}", verdict(t)]
            for t in targets
        ],
    )
