"""cp_merge's kernel launches on the ops' one path: a plan per signature (kernel, template
arguments, device) found by one lookup, the arguments by name put in the order of the kernel's
description, one ``cuLaunchKernel`` on the caller's stream.

The call's facts are its ``args.Args``: from the signature's plan and its bound call
(:mod:`.plan`), or from the full validation; each launch names every parameter of its
kernel, checked against the description when the plan is built.
"""

from __future__ import annotations

from typing import Any

from ..core import plans as _plans
from ..core.kernels import Kernel


class _Plan:
    """One instantiation: its launcher and its parameters' names in the kernel's order."""

    __slots__ = ("launcher", "params", "names")

    def __init__(self, kernel: Kernel, targs: tuple, device: int, names: frozenset[str]) -> None:
        params = tuple(n for n, _ in kernel.params)
        if names != frozenset(params):
            raise TypeError(
                f"{kernel.name}: missing {sorted(set(params) - names)}, unknown {sorted(names - set(params))}"
            )
        self.params = params
        self.launcher = _plans.launcher(kernel, targs, device)
        self.names = names


def launch(kernel: Kernel, targs: tuple, device: int, grid: int, stream: int, **values: Any) -> None:
    """Launch ``kernel<targs>`` with ``grid`` blocks on ``stream``, every parameter by name."""
    key = ("cp_merge", kernel.name, targs, device)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans.lookup(key, lambda: _Plan(kernel, targs, device, frozenset(values)))
    plan.launcher.launch_values(grid, 1, stream, [values[n] for n in plan.params])
