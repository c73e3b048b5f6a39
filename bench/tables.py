"""Markdown text of rows: the table layout, the formats of a run's figures (µs, MB, a cell of
GPU µs with its % of copy, an error) and how a row is named (its shape, where it was measured,
the implementations in a table's columns, zerokv first). The report's sections and the targets
table are written with these, so that every table of a run reads alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .common import Row
from .compare import OURS


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


def shape_label(r: Row) -> str:
    return " ".join(f"{k}={v}" for k, v in (("T", r.T), ("H", r.H), ("D", r.D)) if v is not None)


def row_label(r: Row) -> str:
    extra = " ".join(f"{k}={v}" for k, v in r.params.items())
    return " ".join(x for x in (r.op, r.impl, r.dtype, shape_label(r), extra) if x)


def impls_in_order(rows: list[Row]) -> list[str]:
    """Implementations in order of appearance, zerokv first."""
    seen: list[str] = []
    for r in rows:
        if r.impl not in seen:
            seen.append(r.impl)
    return sorted(seen, key=lambda i: i != OURS)
