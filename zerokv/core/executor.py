"""Which executor runs the bound calls: the compiled one (:mod:`zerokv.core.cexec`) where it can be
built and loaded, else the Python one (:func:`zerokv.core.pyexec.run`).

``ZEROKV_LAUNCHER``: ``auto`` (default: compiled when it builds, else Python, one warning at
most), ``c`` (compiled, or an error saying why not), ``python``. The compiled executor reads
torch tensors through DLPack's C exchange API; a signature of another producer (CuPy, numpy)
runs on the Python executor whatever the choice.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from . import bound as _bound
from . import pyexec as _pyexec

ENV = "ZEROKV_LAUNCHER"
CHOICES = ("auto", "c", "python")

_lock = threading.Lock()
_state: dict[str, Any] = {}  # the process's choice: "name", "why", "module"
_on_compiled: list[Any] = []


def _load(want: str) -> tuple[Any, str]:
    if want == "python":
        return None, f"{ENV}=python"
    from . import cexec

    return cexec.load(strict=want == "c")


def choose() -> tuple[str, str]:
    """``(name, why)`` of the process's executor (``ZEROKV_LAUNCHER``), chosen on first use;
    ``c`` raises RuntimeError when the compiled one cannot load."""
    with _lock:
        if not _state:
            want = (os.environ.get(ENV) or "auto").strip().lower()
            if want not in CHOICES:
                raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {want!r}")
            module, why = _load(want)
            _state.update(name="python" if module is None else "c", why=why, module=module)
            # the runner the ops call from now on (plans read ``executor.run`` on each call)
            globals()["run"] = _runner(module)
        return _state["name"], _state["why"]


def module_of(name: str) -> Any:
    """The compiled module for ``"c"`` (loaded, or RuntimeError), None for ``"python"``."""
    if name == "python":
        return None
    choose()
    if _state["module"] is not None:
        return _state["module"]
    module, _ = _load("c")
    return module


def module_of_safe(name: str) -> Any:
    """:func:`module_of`, None where it cannot load."""
    try:
        return module_of(name)
    except RuntimeError:
        return None


def runner(name: str) -> Any:
    """The run function of executor ``name`` (``"c"`` or ``"python"``)."""
    return _runner(module_of(name))


def _runner(module: Any) -> Any:
    if module is None:
        return _pyexec.run
    for hook in _on_compiled:
        hook(module)
    return module.run_either  # the compiled executor for torch signatures, the Python one for others


def on_compiled(hook: Any) -> None:
    """``hook(module)`` runs whenever the compiled module becomes a runner
    (:mod:`zerokv.core.entries` puts the ops' compiled entries in place)."""
    if hook not in _on_compiled:
        _on_compiled.append(hook)


def run(bc: _bound.BoundCall, objs: tuple, scalars: tuple) -> Any:
    """The first call chooses (:func:`choose`), then runs."""
    choose()
    return globals()["run"](bc, objs, scalars)
