"""The compiled executor: ``launcher.c`` built at first use with the host C compiler."""

from __future__ import annotations

from typing import Any


def load(strict: bool = False) -> tuple[Any, str]:
    """``(module, why)``: the compiled executor, or None and the reason it cannot run."""
    why = "the compiled executor is not built in this version"
    if strict:
        raise RuntimeError(f"zerokv: ZEROKV_LAUNCHER=c: {why}")
    return None, why
