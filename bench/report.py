"""What a run leaves behind: the environment, the JSON of every row, the summary tables."""

from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .bench_compile import TOTAL
from .bench_host import GRAPH
from .common import Bench, Row
from .targets import Target

ROOT = Path(__file__).resolve().parent.parent
SUSPICIOUS_ERR = 0.1  # bf16 outputs of unit-scale data are off by ~1e-2 at most


def _try(fn: Any) -> Any:
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
    text = Path("/proc/driver/nvidia/version").read_text()  # "... Kernel Module  580.82.07  ..."
    words = text.split()
    return next(w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit())


def environment(b: Bench, args: dict[str, Any]) -> dict[str, Any]:
    """GPU, driver and library versions, date, and the options of the run."""
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
        "empty_launch_us": b.empty_launch_us,
    }
    import numpy

    env["numpy"] = numpy.__version__
    env["zerokv"] = _try(lambda: __import__("zerokv").__version__)
    env["git_commit"] = _try(
        lambda: (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    )
    env["triton"] = _try(lambda: __import__("triton").__version__)
    if b.dry:
        env["gpu"] = "none (dry run: CPU, synthetic times)"
        return env
    props = torch.cuda.get_device_properties(b.device)
    env["gpu"] = props.name
    env["compute_capability"] = f"{props.major}.{props.minor}"
    env["sm_count"] = props.multi_processor_count
    env["gpu_memory_bytes"] = props.total_memory
    env["driver"] = _try(_driver_version)
    import cupy

    env["cupy"] = cupy.__version__
    env["cuda_driver_api"] = _try(cupy.cuda.runtime.driverGetVersion)
    env["cuda_runtime"] = _try(cupy.cuda.runtime.runtimeGetVersion)
    env["nvrtc"] = _try(lambda: ".".join(map(str, cupy.cuda.nvrtc.getVersion())))
    return env


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


# --- tables ---------------------------------------------------------------------------------


def table(headers: list[str], body: Iterable[list[str]]) -> str:
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


def cell(r: Row | None) -> str:
    if r is None:
        return ""
    if r.us is None:
        return r.note.split(":")[0] or "-"
    return f"{us(r.us)} µs {r.pct_copy:.0f}%" if r.pct_copy is not None else f"{us(r.us)} µs"


def err(r: Row | None) -> str:
    return "-" if r is None or r.max_err is None else f"{r.max_err:.1e}"


def _pivot(rows: list[Row], key: Any) -> tuple[list[str], dict[Any, dict[str, Row]]]:
    impls: list[str] = []
    groups: dict[Any, dict[str, Row]] = {}
    for r in rows:
        if r.impl not in impls:
            impls.append(r.impl)
        groups.setdefault(key(r), {})[r.impl] = r
    return impls, groups


def _bandwidth_table(rows: list[Row], first: list[str], key: Any, lead: Any) -> str:
    impls, groups = _pivot(rows, key)
    body = []
    for cells in groups.values():
        any_row = next(iter(cells.values()))
        body.append(lead(any_row) + [cell(cells.get(i)) for i in impls] + [err(cells.get("zerokv"))])
    return table(first + impls + ["max err zerokv"], body)


def summary(b: Bench, rows: list[Row], targets: list[Target]) -> str:
    copy = next((r for r in rows if r.op == "copy" and r.gbps), None)
    parts = [
        f"GB/s = 1e9 bytes read + written per second; % = of the copy bandwidth, {copy.gbps:.0f} GB/s "
        f"(torch copy_ of {copy.bytes / 2 / 2**20:.0f} MiB, {copy.us:.0f} µs); cells: GPU µs and % of copy"
        if copy
        else "no copy bandwidth measured"
    ]

    def sel(op: str) -> list[Row]:
        return [r for r in rows if r.op == op]

    if ms := sel("merge_state"):
        parts.append("## merge_state (MB moved: 2 V + 2 LSE read, 1 V + 1 LSE written)")
        parts.append(
            _bandwidth_table(
                ms,
                ["dtype", "T", "H", "D", "MB"],
                lambda r: (r.dtype, r.T, r.H, r.D),
                lambda r: [r.dtype, r.T, r.H, r.D, mb(r.bytes)],
            )  # fmt: skip
        )
    if ms := sel("merge_states"):
        parts.append("## merge_states bf16 (MB moved: N+1 V and N+1 LSE)")
        parts.append(
            _bandwidth_table(
                ms,
                ["N", "T", "H", "D", "MB"],
                lambda r: (r.params.get("N"), r.T, r.H, r.D),
                lambda r: [r.params.get("N"), r.T, r.H, r.D, mb(r.bytes)],
            )  # fmt: skip
        )
    for op in ("fixup_zero_kv_rows", "mask_empty_context"):
        if er := sel(op):
            r0 = er[0]
            parts.append(f"## {op}, T={r0.T} H={r0.H} D={r0.D} bf16 (MB written; % of copy on bytes written)")
            parts.append(
                _bandwidth_table(
                    er,
                    ["empty rows", "MB written"],
                    lambda r: r.params.get("empty_rows"),
                    lambda r: [r.params.get("empty_rows"), mb(r.bytes)],
                )  # fmt: skip
            )
            if b.empty_launch_us is not None:
                parts.append(f"(empty kernel launch: {us(b.empty_launch_us)} µs GPU time)")
    if hr := [r for r in sel("host") if r.impl != GRAPH]:
        parts.append("## host µs per call (T=4 H=2 D=64 bf16)")
        parts.append(
            table(
                ["call", "µs", "x torch.mul", "note"],
                [
                    [
                        r.impl,
                        us(r.us),
                        f"{r.params['ratio_to_torch_mul']:.2f}" if "ratio_to_torch_mul" in r.params else "-",
                        r.note,
                    ]
                    for r in hr
                ],
            )
        )
    for r in sel("host"):
        if r.impl == GRAPH:
            p = r.params
            text = (
                f"CUDA graph of {p.get('calls_per_graph')} merge_state calls: {us(r.us)} µs per call in the replay "
                f"(GPU); eager: {us(p.get('eager_gpu_us'))} µs GPU, {us(p.get('eager_host_us'))} µs host per call; "
                f"replay matches eager: {p.get('replay_matches_eager')}"
                if r.us is not None
                else f"CUDA graph: {r.note}"
            )
            parts.append(text)
    if cr := sel("compile"):
        parts.append("## first use (s): cold = empty CUPY_CACHE_DIR, warm = new process on that cache")
        grid: dict[tuple[str, str], dict[str, Row]] = {}
        for r in cr:
            if r.impl not in ("cold", "warm"):
                continue
            grid.setdefault((r.params.get("set"), r.params.get("item")), {})[r.impl] = r
        body = [
            [which, item, _seconds(cells.get("cold")), _seconds(cells.get("warm"))]
            for (which, item), cells in grid.items()
        ]
        parts.append(table(["set", "item", "cold s", "warm s"], body))
        tot = [r for r in cr if r.params.get("item") == TOTAL]
        if tot:
            p = tot[0].params
            parts.append(
                f"(import zerokv: {p.get('import_s', 0):.3f} s, not counted; cupy imported by it: {p.get('cupy_imported_by_import')})"
            )
    odd = [r for r in rows if r.max_err is not None and not r.max_err <= SUSPICIOUS_ERR]
    if odd:
        parts.append(f"## max err over {SUSPICIOUS_ERR} against the float64 reference")
        parts.append("\n".join(f"- {_where(r)}: {r.max_err:.3g}" for r in odd))
    failed = [r for r in rows if r.note.startswith("failed")]
    if failed:
        parts.append("## failures")
        parts.append("\n".join(f"- {_where(r)}: {r.note}" for r in failed))
    parts.append("## targets")
    parts.append(targets_table(targets))
    return "\n\n".join(parts)


def _where(r: Row) -> str:
    shape = " ".join(f"{k}={v}" for k, v in (("T", r.T), ("H", r.H), ("D", r.D)) if v is not None)
    extra = " ".join(f"{k}={v}" for k, v in r.params.items() if k in ("N", "empty_rows", "item"))
    return " ".join(x for x in (r.op, r.impl, r.dtype, shape, extra) if x)


def _seconds(r: Row | None) -> str:
    return "-" if r is None else f"{r.us / 1e6:.3f}"


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
