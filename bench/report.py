"""The Markdown report of a run: the copy bandwidth, one section per op (merge_state per shape
and layout against the best baseline, the N-way merge, the empty-row ops, the host cost per
call, the first-use times), a generic table for an op this file does not know, the rows off the
reference or failed, and the targets table at the end.

Everything here reads the rows only (their ``op``, ``impl`` and ``params`` labels), never the
bench modules: an op this file does not know still gets a table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .common import Row
from .compare import OURS, host_ref, merge_lines
from .tables import cell, err, impls_in_order, mb, row_label, shape_label, table, us
from .targets import Target, targets_table

SUSPICIOUS_ERR = 0.1  # unit-scale bf16 data is off by ~1e-2 at most
KNOWN = ("copy", "empty_launch", "merge_state", "merge_states", "fixup_zero_kv_rows", "mask_empty_context")
KNOWN += ("host", "compile")


def merge_section(rows: list[Row]) -> list[str]:
    lines = merge_lines(rows)
    if not lines:
        return []
    bases = [i for i in impls_in_order([r for r in rows if r.op == "merge_state"]) if i != OURS]
    out = [
        "## merge_state\n\nMB: 2 V + 2 LSE read, 1 V + 1 LSE written. Cells: GPU µs per call from CUDA-graph "
        "replays, the implementations of a shape in interleaved rounds (% of copy); `1 call`: CUDA-event time of one eager call. Layout TH: LSE `[T, H]`; HT: an "
        "`[H, T]` buffer passed as `.T`. `*`: measured in the other layout (the vLLM-design CUDA merge reads "
        "`[H, T]` natively). best: the fastest baseline of the shape in any layout."
    ]
    summary = []
    for dtype in dict.fromkeys(x["key"][0] for x in lines):
        for layout in dict.fromkeys(x["layout"] for x in lines):
            sel = [
                x for x in lines if x["key"][0] == dtype and x["layout"] == layout and x["ratio"] is not None
            ]
            if sel:
                worst = max(sel, key=lambda x: x["ratio"])
                over = sum(x["ratio"] > 1.0 for x in sel)
                z = worst["zerokv"]
                summary.append([dtype, layout, len(sel), over, f"{worst['ratio']:.2f} ({shape_label(z)})"])
    if summary:
        out.append(table(["dtype", "layout", "shapes", "zerokv/best > 1.00", "worst zerokv/best"], summary))
    body = []
    for x in lines:
        z: Row = x["zerokv"]
        base = [cell(*x["cells"][i]) if i in x["cells"] else "" for i in bases]
        ratio = "-" if x["ratio"] is None else f"{x['ratio']:.2f}"
        best = "-" if x["best"] is None else x["best"].impl
        body.append(
            [z.dtype, z.T, z.H, z.D, x["layout"], mb(z.bytes), cell(z), us(z.event_us)]
            + base
            + [best, ratio, err(z)]
        )
    heads = (
        ["dtype", "T", "H", "D", "layout", "MB", "zerokv", "1 call"] + bases + ["best", "zerokv/best", "err"]
    )
    out.append(table(heads, body))
    return out


def pivot_section(title: str, rows: list[Row], lead: list[str], key: Callable[[Row], list[Any]]) -> list[str]:
    """One line per configuration (``key``), one column per implementation."""
    if not rows:
        return []
    impls = impls_in_order(rows)
    groups: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        groups.setdefault(tuple(key(r)), {})[r.impl] = r
    body = []
    for k, cells in groups.items():
        z = cells.get(OURS) or next(iter(cells.values()))
        body.append(
            list(k)
            + [mb(z.bytes) if z.bytes else "-"]
            + [cell(cells.get(i)) for i in impls]
            + [us(z.event_us), err(z)]
        )
    return [title, table(lead + ["MB"] + impls + ["1 call", "err"], body)]


def host_section(rows: list[Row]) -> list[str]:
    hr = [r for r in rows if r.op == "host"]
    if not hr:
        return []
    ref = {m: host_ref(rows, m) for m in ("a", "b", "c")}
    calls: dict[str, dict[str, Row]] = {}
    for r in hr:
        calls.setdefault(r.impl, {})[r.params.get("mode", "?")] = r
    body = []
    for label, modes in calls.items():
        line = [label]
        for m in ("a", "b", "c"):
            r = modes.get(m)
            line.append("-" if r is None else (us(r.us) if r.us is not None else r.note.split(":")[0]))
            line.append(f"{r.us / ref[m].us:.2f}" if r is not None and r.us and ref[m] and ref[m].us else "-")
        body.append(line + ["; ".join(r.note for r in modes.values() if r.note)])
    mul = ref["a"]
    first = hr[0]
    text = (
        f"## host µs per call (H={first.H} D={first.D} {first.dtype})\n\n(a) a new T every call (slices of "
        "preallocated buffers, the slicing subtracted); (b) the same call repeated; (c) outputs allocated by "
        "the op, new T every call. `x`: over `torch.mul(a, b, out=c)` measured the same way ((a) for (c))."
    )
    if mul is None:
        text += " (torch.mul not measured)"
    heads = ["call", "(a) µs", "x", "(b) µs", "x", "(c) µs", "x", "note"]
    return [text, table(heads, body)]


def compile_section(rows: list[Row]) -> list[str]:
    cr = [r for r in rows if r.op == "compile" and r.impl in ("cold", "warm")]
    if not cr:
        return []
    grid: dict[tuple[str, str], dict[str, Row]] = {}
    for r in cr:
        grid.setdefault((r.params.get("set"), r.params.get("item")), {})[r.impl] = r

    def sec(r: Row | None) -> str:
        return "-" if r is None or r.us is None else f"{r.us / 1e6:.3f}"

    body = [[w, item, sec(c.get("cold")), sec(c.get("warm"))] for (w, item), c in grid.items()]
    out = ["## first use (s): cold = empty CUPY_CACHE_DIR, warm = a new process on that cache"]
    out.append(table(["set", "item", "cold s", "warm s"], body))
    for r in cr:
        for op, why in r.stats.get("errors", {}).items():
            out.append(f"- {r.impl} {r.params.get('set')}: {op} failed: {why}")
    total = next((r for r in cr if r.params.get("item") == "total"), None)
    if total is not None:
        p = total.stats
        out.append(
            f"(import zerokv: {p.get('import_s', 0):.3f} s, not counted; CuPy imported by it: {p.get('cupy_imported_by_import')})"
        )
    return out


def summary(rows: list[Row], targets: list[Target], copy_note: str = "") -> str:
    copy = next((r for r in rows if r.op == "copy" and r.gbps), None)
    parts = [
        f"GB/s = 1e9 bytes read + written per second; % = of the copy bandwidth, {copy.gbps:.0f} GB/s "
        f"({copy.impl} of {copy.bytes / 2 / 2**20:.0f} MiB, {us(copy.us)} µs GPU time)"
        if copy
        else "no copy bandwidth measured"
    ]
    parts += merge_section(rows)
    parts += pivot_section(
        "## merge_states, N-way (MB: N + 1 V and N + 1 LSE)",
        [r for r in rows if r.op == "merge_states"],
        ["N", "dtype", "T", "H", "D"],
        lambda r: [r.params.get("N"), r.dtype, r.T, r.H, r.D],
    )
    launch = next((r for r in rows if r.op == "empty_launch" and r.us is not None), None)
    for op in ("fixup_zero_kv_rows", "mask_empty_context"):
        er = [r for r in rows if r.op == op]
        if er:
            title = f"## {op}, T={er[0].T} H={er[0].H} D={er[0].D} {er[0].dtype} (MB written; % of copy on bytes written)"
            if launch:
                title += f"\n\nAn empty kernel launched as zerokv launches: {us(launch.us)} µs (graph), {us(launch.event_us)} µs (1 call)."
            parts += pivot_section(title, er, ["empty rows"], lambda r: [r.params.get("empty_rows")])
    parts += host_section(rows)
    parts += compile_section(rows)
    for op in dict.fromkeys(r.op for r in rows if r.op not in KNOWN):
        extra = sorted({k for r in rows if r.op == op for k in r.params})
        parts += pivot_section(
            f"## {op}", [r for r in rows if r.op == op], ["dtype", "T", "H", "D"] + extra,
            lambda r, extra=extra: [r.dtype, r.T, r.H, r.D] + [r.params.get(k, "") for k in extra],
        )  # fmt: skip
    odd = [r for r in rows if r.max_err is not None and not r.max_err <= SUSPICIOUS_ERR]
    if odd:
        parts.append(f"## max error over {SUSPICIOUS_ERR} against the float64 reference")
        parts.append("\n".join(f"- {row_label(r)}: {r.max_err:.3g}" for r in odd))
    for word in ("failed", "skipped"):
        bad = [r for r in rows if r.note.startswith(word)]
        if bad:
            parts.append(f"## {word}")
            parts.append("\n".join(f"- {row_label(r)}: {r.note}" for r in bad))
    parts.append("## targets")
    parts.append(targets_table(targets))
    return "\n\n".join(parts)
