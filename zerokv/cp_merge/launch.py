"""cp_merge's kernel launches on the ops' one path: the launcher of an instantiation (kernel,
template arguments, device) found by one lookup, the arguments by name put in the order of the
kernel's description, one ``cuLaunchKernel`` on the caller's stream.

The call's facts are its ``args.Args``: from the signature's plan and its bound call
(:mod:`.plan`), or from the full validation; each launch names every parameter of its
kernel, checked against the description when its instantiation is first met.
"""

from __future__ import annotations

from typing import Any

from ..core import plans as _plans
from ..core.kernels import Kernel


def launch(kernel: Kernel, targs: tuple, device: int, grid: int, stream: int, **values: Any) -> None:
    """Launch ``kernel<targs>`` with ``grid`` blocks on ``stream``, every parameter by name."""
    key = ("cp_merge", kernel.name, targs, device)
    launcher = _plans.get(key)
    if launcher is None:
        kernel.check_names(values)
        launcher = _plans.lookup(key, lambda: _plans.launcher(kernel, targs, device))
    launcher.launch_values(grid, 1, stream, [values[n] for n in kernel.names])
