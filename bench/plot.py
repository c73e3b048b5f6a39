"""The PNG of a run: % of copy against bytes moved (µs where an op has no bandwidth), one panel
per op and one line per implementation, plus zerokv over the best baseline for merge_state.
Reads the rows only, like the report: an op this file does not know still gets a panel.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from .common import Row
from .compare import merge_lines

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
