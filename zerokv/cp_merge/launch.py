"""cp_merge's kernel launches on the ops' one path: a plan per signature (kernel, template
arguments, device) found by one lookup, the arguments packed by name from the kernel's
description (``Kernel.binder``), one ``cuLaunchKernel`` on the caller's stream.

The call's facts are its ``args.Args``: from the signature's plan and its bound call
(:mod:`.plan`), or from the full validation; each launch names every parameter of its
kernel, checked against the description when the plan is built.
"""

from __future__ import annotations

from typing import Any

from ..core import plans as _plans
from ..core.kernels import Kernel


class _Plan:
    """One instantiation: its launcher, its record class (a slot per parameter) and binder."""

    __slots__ = ("launcher", "record", "bind", "names")

    def __init__(self, kernel: Kernel, targs: tuple, device: int, names: frozenset[str]) -> None:
        params = tuple(n for n, _ in kernel.params)
        if names != frozenset(params):
            raise TypeError(
                f"{kernel.name}: missing {sorted(set(params) - names)}, unknown {sorted(names - set(params))}"
            )
        self.record = type(f"{kernel.name}_args", (), {"__slots__": params})
        self.bind = kernel.binder(("a", self.record))
        self.launcher = _plans.launcher(kernel, targs, device)
        self.names = names


def launch(kernel: Kernel, targs: tuple, device: int, grid: int, stream: int, **values: Any) -> None:
    """Launch ``kernel<targs>`` with ``grid`` blocks on ``stream``, every parameter by name."""
    key = ("cp_merge", kernel.name, targs, device)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans.lookup(key, lambda: _Plan(kernel, targs, device, frozenset(values)))
    rec = plan.record()
    for name, value in values.items():
        setattr(rec, name, value)
    plan.launcher.launch(grid, 1, stream, plan.bind, rec)
