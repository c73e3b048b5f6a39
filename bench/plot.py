"""The PNG: bandwidth as % of copy against bytes moved (log x), one subplot per op, one line per
implementation (and dtype, or N). Needs matplotlib; without it the plot is skipped."""

from __future__ import annotations

import textwrap
from pathlib import Path

from .common import Row

OPS = {
    "merge_state": "bytes moved (read + written)",
    "merge_states": "bytes moved (read + written)",
    "fixup_zero_kv_rows": "bytes written",
    "mask_empty_context": "bytes written",
}
COLORS = {"zerokv": "tab:blue", "torch": "tab:orange", "triton": "tab:green", "flashinfer": "tab:red"}
STYLES = ["-", "--", ":", "-."]


def _series(rows: list[Row], op: str) -> dict[tuple[str, str], list[Row]]:
    out: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if r.op == op and r.pct_copy is not None and r.bytes > 0:
            variant = f"N={r.params['N']}" if "N" in r.params else r.dtype
            out.setdefault((r.impl, variant), []).append(r)
    return out


def write_png(rows: list[Row], path: Path, title: str) -> str | None:
    """Write the plot; returns a note when it could not be written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    ops = [op for op in OPS if _series(rows, op)]
    if not ops:
        return "no bandwidth rows: no PNG"
    ncols = min(2, len(ops))
    nrows = (len(ops) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, 4.8 * nrows), squeeze=False)
    for ax in axes.flat[len(ops) :]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, ops, strict=False):
        series = _series(rows, op)
        variants = sorted({v for _, v in series})
        for (impl, variant), rs in series.items():
            rs = sorted(rs, key=lambda r: r.bytes)
            ax.plot(
                [r.bytes for r in rs],
                [r.pct_copy for r in rs],
                marker="o",
                markersize=3,
                linestyle=STYLES[variants.index(variant) % len(STYLES)],
                color=COLORS.get(impl),
                label=f"{impl} {variant}",
            )
        ax.axhline(100, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_title(op)
        ax.set_xlabel(OPS[op])
        ax.set_ylabel("% of copy bandwidth")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 140), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
