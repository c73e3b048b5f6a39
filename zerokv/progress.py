"""Progress of the command line's long compiles (the self-check without a GPU, ``compile``).

On a terminal, one line on stderr, redrawn every second and after each kernel source:
``sm_90: 104 / 500 instantiations, 23 s (compiling merge)``; it is erased when the arch is
done, and the caller prints the arch's result line. Not on a terminal (piped, a log file), this
draws nothing: the caller's one result line per arch, flushed at once, is the progress there.
``quiet`` draws nothing either. NVRTC releases the GIL while it compiles, so the clock runs.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def on_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class Progress:
    """``start(label, total)``, then ``stage(what)`` before and ``advance(n)`` after each part,
    then ``finish()``; :attr:`live` says whether anything is drawn."""

    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False, every: float = 1.0) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.live = not quiet and on_terminal(self.stream)
        self.every = every
        self.label, self.total, self.done, self.what = "", 0, 0, ""
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._width = 0

    def start(self, label: str, total: int) -> None:
        self.finish()
        self.label, self.total, self.done, self.what = label, total, 0, ""
        self.started = time.perf_counter()
        if not self.live:
            return
        self._stop.clear()
        self._ticker = threading.Thread(target=self._tick, name="zerokv-progress", daemon=True)
        self._ticker.start()
        self._draw()

    def stage(self, what: str) -> None:
        self.what = what
        self._draw()

    def advance(self, n: int) -> None:
        self.done, self.what = self.done + n, ""
        self._draw()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        what = f" (compiling {self.what})" if self.what else ""
        return f"{self.label}: {self.done} / {self.total} instantiations, {elapsed:.0f} s{what}"

    def finish(self) -> None:
        """Stop the clock and erase the line (the caller prints the result in its place)."""
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
            self._ticker = None
        if self.live and self._width:
            with self._lock:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
                self._width = 0

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            self._draw()

    def _draw(self) -> None:
        if not self.live or not self.label:
            return
        with self._lock:
            text = self.line()
            pad = max(self._width - len(text), 0)
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._width = len(text)
