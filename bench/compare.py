"""Rows read against each other: each ``merge_state`` shape's zerokv row beside its baselines'
(from the same LSE layout, else the other) and the best of them, and the ``torch.mul(out=)``
row that a host row is compared with. The Markdown tables, the targets, the PNG and the H200
script's comparison with the last runs all read these pairings, so they are made in one place.
"""

from __future__ import annotations

from typing import Any

from .common import Row

OURS = "zerokv"


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


def host_ref(rows: list[Row], mode: str) -> Row | None:
    """torch.mul(out=) in the mode that a zerokv row of ``mode`` is compared with."""
    want = "a" if mode == "c" else mode
    return next(
        (
            r for r in rows
            if r.op == "host" and r.params.get("kind") == "reference" and r.params.get("mode") == want and r.us
        ),
        None,
    )  # fmt: skip
