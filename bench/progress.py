"""The progress display of a bench run: a tqdm bar on a terminal, else one plain line per task
with a few words on its rows. Kept apart from the records and the timing because it only
reads finished rows and writes to stderr; nothing it shows reaches the results.
"""

from __future__ import annotations

import shutil
import sys
from typing import Any

from .common import Row


def brief(rows: list[Row]) -> str:
    """A few words per row: implementation, µs, % of copy (or what went wrong)."""
    parts = []
    for r in rows[:6]:
        if r.us is None:
            parts.append(f"{r.impl}: {r.note.split(':')[0] or '-'}")
        elif r.op == "compile":
            parts.append(f"{r.impl} {r.params.get('item')} {r.us / 1e6:.2f} s")
        elif r.pct_copy is not None:
            parts.append(f"{r.impl} {r.us:.1f} µs {r.pct_copy:.0f}%")
        else:
            parts.append(f"{r.impl} {r.us:.2f} µs")
    return "; ".join(parts)


class Progress:
    """A tqdm bar on a terminal when tqdm is installed, one plain line per task otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.count = 0
        self.bar: Any = None
        if sys.stderr.isatty() and shutil.get_terminal_size((0, 0)).columns >= 40:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="task", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(label[:48])

    def done(self, label: str, rows: list[Row], seconds: float) -> None:
        self.count += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            print(
                f"[{self.count}/{self.total}] {label}: {brief(rows)} ({seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
