"""What a run leaves behind: the environment, the JSON of every row, the Markdown tables, the PNG
and the targets table.

Everything here reads the rows only (their ``op``, ``impl`` and ``params`` labels), never the
bench modules: an op this file does not know still gets a table and a PNG panel.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zerokv import versions

from .common import Row

ROOT = Path(__file__).resolve().parent.parent
SUSPICIOUS_ERR = 0.1  # unit-scale bf16 data is off by ~1e-2 at most
OURS = "zerokv"
KNOWN = ("copy", "empty_launch", "merge_state", "merge_states", "fixup_zero_kv_rows", "mask_empty_context")
KNOWN += ("host", "compile")

# --- environment and JSON -----------------------------------------------------------------------


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()  # fmt: skip
        if out:
            return out.splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    words = Path("/proc/driver/nvidia/version").read_text().split()  # "... Kernel Module  580.82.07 ..."
    return next(w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit())


def _nvrtc_version() -> str | None:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def environment(b: Any, args: dict[str, Any]) -> dict[str, Any]:
    """GPU, driver and library versions, date, commit and the options of the run."""
    torch = b.torch
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": b.mode,
        "args": args,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "l2_bytes": b.l2_bytes,
        "copy_gbps": b.copy_gbps,
    }
    env["numpy"] = _try(lambda: __import__("numpy").__version__)
    env["zerokv"] = _try(lambda: __import__("zerokv").__version__)
    env["git_commit"] = _try(
        lambda: (
            subprocess.run(
                # "-dirty": the measured tree is not the commit named
                ["git", "describe", "--always", "--dirty", "--abbrev=7"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    )
    env["triton"] = _try(lambda: __import__("triton").__version__)
    env["flashinfer"] = _try(lambda: __import__("flashinfer").__version__)
    # from metadata: importing CuPy creates its kernel cache directory, which a dry run must not
    env["cupy"] = _try(lambda: next(v for d in versions.CUPY if (v := versions.installed(d))))
    env["nvrtc"] = _try(_nvrtc_version)
    if b.dry:
        env["gpu"] = "none (dry run: CPU, synthetic times)"
        return env
    import cupy

    props = torch.cuda.get_device_properties(b.device)
    env["gpu"] = props.name
    env["compute_capability"] = f"{props.major}.{props.minor}"
    env["sm_count"] = props.multi_processor_count
    env["gpu_memory_bytes"] = props.total_memory
    env["driver"] = _try(_driver_version)
    env["cuda_driver_api"] = _try(cupy.cuda.runtime.driverGetVersion)
    env["cuda_runtime"] = _try(cupy.cuda.runtime.runtimeGetVersion)
    env["nvrtc"] = env["nvrtc"] or _try(lambda: ".".join(map(str, cupy.cuda.nvrtc.getVersion())))
    return env


def header(env: dict[str, Any]) -> str:
    keys = ("driver", "torch", "cupy", "nvrtc", "cuda_runtime", "triton", "flashinfer")
    names = ("driver", "torch", "CuPy", "NVRTC", "CUDA runtime", "Triton", "FlashInfer")
    versions = ", ".join(f"{n} {env.get(k)}" for n, k in zip(names, keys, strict=True) if env.get(k))
    return f"zerokv bench ({env['mode']}): {env.get('gpu')}, {versions}, {env['date']}, commit {env.get('git_commit')}"


def _clean(x: Any) -> Any:
    """JSON without NaN/Infinity literals: non-finite floats become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: Path, env: dict[str, Any], rows: list[Row], targets: list[Target]) -> None:
    doc = {"environment": env, "rows": [asdict(r) for r in rows], "targets": [asdict(t) for t in targets]}
    path.write_text(json.dumps(_clean(doc), indent=1) + "\n")


# --- formatting ---------------------------------------------------------------------------------


def table(headers: list[str], body: Iterable[list[Any]]) -> str:
    body = [[str(c) for c in r] for r in body]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join(
        [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in body]
    )


def us(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 10 else (f"{x:.1f}" if x < 1000 else f"{x:.0f}")


def mb(nbytes: int) -> str:
    x = nbytes / 1e6
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def cell(r: Row | None, mark: str = "") -> str:
    """GPU µs (and % of copy) of a row, or why there is none."""
    if r is None:
        return ""
    if r.us is None:
        return r.note.split(":")[0] or "-"
    text = f"{us(r.us)}{mark}"
    if r.stats.get("timed_by") == "events":
        text += " (ev)"
    return f"{text} ({r.pct_copy:.0f}%)" if r.pct_copy is not None else text


def err(r: Row | None) -> str:
    return "-" if r is None or r.max_err is None else f"{r.max_err:.1e}"


def _shape(r: Row) -> str:
    return " ".join(f"{k}={v}" for k, v in (("T", r.T), ("H", r.H), ("D", r.D)) if v is not None)


def _where(r: Row) -> str:
    extra = " ".join(f"{k}={v}" for k, v in r.params.items())
    return " ".join(x for x in (r.op, r.impl, r.dtype, _shape(r), extra) if x)


def _impls(rows: list[Row]) -> list[str]:
    """Implementations in order of appearance, zerokv first."""
    seen: list[str] = []
    for r in rows:
        if r.impl not in seen:
            seen.append(r.impl)
    return sorted(seen, key=lambda i: i != OURS)


# --- merge_state: per shape and layout, zerokv against the best baseline ------------------------


def _shape_key(r: Row) -> tuple:
    return (r.dtype, r.T, r.H, r.D)


def merge_lines(rows: list[Row]) -> list[dict[str, Any]]:
    """One entry per (shape, layout) zerokv ran: its row, the baselines' rows (from the same
    layout, else from the other one), the best baseline of the shape in any layout, the ratio."""
    ms = [r for r in rows if r.op == "merge_state"]
    by_shape: dict[tuple, list[Row]] = {}
    for r in ms:
        by_shape.setdefault(_shape_key(r), []).append(r)
    lines = []
    for key, rs in by_shape.items():
        bases = [r for r in rs if r.impl != OURS and r.us is not None]
        best = min(bases, key=lambda r: r.us, default=None)
        for z in (r for r in rs if r.impl == OURS):
            layout = z.params.get("layout")
            cells = {}
            for r in rs:
                if r.impl == OURS:
                    continue
                same = r.params.get("layout") == layout
                if same or r.impl not in cells:
                    cells[r.impl] = (r, "" if same else "*")
            ratio = z.us / best.us if z.us is not None and best is not None else None
            lines.append(
                {"key": key, "layout": layout, "zerokv": z, "cells": cells, "best": best, "ratio": ratio}
            )
    return lines


def merge_section(rows: list[Row]) -> list[str]:
    lines = merge_lines(rows)
    if not lines:
        return []
    bases = [i for i in _impls([r for r in rows if r.op == "merge_state"]) if i != OURS]
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
                summary.append([dtype, layout, len(sel), over, f"{worst['ratio']:.2f} ({_shape(z)})"])
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


# --- the other sections -------------------------------------------------------------------------


def pivot_section(title: str, rows: list[Row], lead: list[str], key: Callable[[Row], list[Any]]) -> list[str]:
    """One line per configuration (``key``), one column per implementation."""
    if not rows:
        return []
    impls = _impls(rows)
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
    ref = {m: _host_ref(rows, m) for m in ("a", "b", "c")}
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


def _host_ref(rows: list[Row], mode: str) -> Row | None:
    """torch.mul(out=) in the mode that a zerokv row of ``mode`` is compared with."""
    want = "a" if mode == "c" else mode
    return next(
        (
            r for r in rows
            if r.op == "host" and r.params.get("kind") == "reference" and r.params.get("mode") == want and r.us
        ),
        None,
    )  # fmt: skip


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
        parts.append("\n".join(f"- {_where(r)}: {r.max_err:.3g}" for r in odd))
    for word in ("failed", "skipped"):
        bad = [r for r in rows if r.note.startswith(word)]
        if bad:
            parts.append(f"## {word}")
            parts.append("\n".join(f"- {_where(r)}: {r.note}" for r in bad))
    parts.append("## targets")
    parts.append(targets_table(targets))
    return "\n\n".join(parts)


# --- targets --------------------------------------------------------------------------------------


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
                (x["ratio"], f"{x['key'][0]} {_shape(x['zerokv'])}") for x in lines if x["layout"] == layout
            ]
            out.append(_worst(t, [f for f in found if f[0] is not None], 1.0, at_least=False))
        t = Target(f"merge_state zerokv, every shape >= {big_mb} moved", ">= 90 % of copy")
        big = [
            r
            for r in rows
            if r.op == "merge_state" and r.impl == OURS and r.bytes >= big_bytes and r.pct_copy
        ]
        found = [(r.pct_copy, f"{r.dtype} {_shape(r)} {r.params.get('layout')}") for r in big]
        out.append(_worst(t, found, 90, True, " %"))

    if "merge_states" in ran:
        for N in (2, 4, 8):
            t = Target(f"merge_states N={N}, >= {big_mb} moved", ">= 90 % of copy")
            sel = [
                r for r in rows
                if r.op == "merge_states" and r.impl == OURS and r.params.get("N") == N and r.bytes >= big_bytes
            ]  # fmt: skip
            out.append(_worst(t, [(r.pct_copy, _shape(r)) for r in sel if r.pct_copy], 90, True, " %"))

    for op in ("fixup_zero_kv_rows", "mask_empty_context"):
        if op not in ran:
            continue
        for E, goal in ((4096, 85.0), (32768, 88.0)):
            t = Target(f"{op}, {E} empty rows", f">= {goal:.0f} % of copy (bytes written)")
            r = _find(rows, op, empty_rows=E)
            if r and r.pct_copy:
                t.judge(r.pct_copy, goal, f"{r.pct_copy:.1f} % ({us(r.us)} µs, {_shape(r)})", at_least=True)
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
        ref = _host_ref(rows, mode)
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


# --- PNG ------------------------------------------------------------------------------------------

NOT_PLOTTED = ("copy", "empty_launch", "host", "compile")


def _variant(r: Row, ops_rows: list[Row]) -> str:
    """What tells the lines of one implementation apart: layout, N, dtype where they vary."""
    parts = []
    for k in ("layout", "N"):
        if k in r.params:
            parts.append(f"{k}={r.params[k]}" if k == "N" else str(r.params[k]))
    if len({x.dtype for x in ops_rows}) > 1:
        parts.append(r.dtype)
    return " ".join(parts)


def write_png(rows: list[Row], path: Path, title: str) -> str | None:
    """% of copy against bytes moved (µs where an op has no bandwidth), a panel per op, a line
    per implementation; plus zerokv / best baseline for merge_state. A note when not written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    ops = [op for op in dict.fromkeys(r.op for r in rows) if op not in NOT_PLOTTED]
    ops = [op for op in ops if any(r.op == op and r.us is not None for r in rows)]
    lines = merge_lines(rows)
    panels = ops + (["merge_state zerokv / best"] if any(x["ratio"] for x in lines) else [])
    if not panels:
        return "nothing to plot: no PNG"
    ncols = min(2, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.5 * ncols, 5 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "v", "D", "x"]
    for ax, panel in zip(axes.flat, panels, strict=False):
        if panel == "merge_state zerokv / best":
            for layout in dict.fromkeys(x["layout"] for x in lines):
                pts = sorted(
                    (x["zerokv"].bytes, x["ratio"]) for x in lines if x["layout"] == layout and x["ratio"]
                )
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    "o",
                    markersize=3,
                    alpha=0.7,
                    label=f"layout {layout}",
                )
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
            ax.set_xscale("log")
            ax.set_title(panel)
            ax.set_xlabel("bytes moved (read + written)")
            ax.set_ylabel("zerokv µs / best baseline µs (lower is better)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
            continue
        rs = [r for r in rows if r.op == panel and r.us is not None]
        bandwidth = any(r.pct_copy is not None for r in rs)
        series: dict[tuple[str, str], list[Row]] = {}
        for r in rs:
            if bandwidth and (r.pct_copy is None or r.bytes <= 0):
                continue
            series.setdefault((r.impl, _variant(r, rs)), []).append(r)
        variants = list(dict.fromkeys(v for _, v in series))
        impls = list(dict.fromkeys(i for i, _ in series))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for (impl, variant), pts in series.items():
            pts = sorted(pts, key=lambda r: (r.bytes, r.T or 0))
            xs = [r.bytes if r.bytes else (r.T or 0) for r in pts]
            ys = [r.pct_copy if bandwidth else r.us for r in pts]
            v = variants.index(variant)
            many = len(pts) > 12  # a grid of shapes: points, since shapes of equal bytes differ
            ax.plot(
                xs, ys, marker=markers[v % len(markers)], markersize=3, linewidth=0.8, alpha=0.7,
                linestyle="none" if many else styles[v % len(styles)],
                color=colors[impls.index(impl) % len(colors)], label=f"{impl} {variant}".strip(),
            )  # fmt: skip
        ax.set_xscale("log")
        if bandwidth:
            ax.axhline(100, color="grey", linewidth=0.8, linestyle=":")
            ax.set_ylim(bottom=0)
            ax.set_ylabel("% of copy bandwidth")
        else:
            ax.set_yscale("log")
            ax.set_ylabel("µs per call")
        written = panel in ("fixup_zero_kv_rows", "mask_empty_context")
        ax.set_xlabel(
            "bytes written"
            if written
            else ("bytes moved (read + written)" if any(r.bytes for r in rs) else "T")
        )
        ax.set_title(panel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
