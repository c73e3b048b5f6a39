"""Which executor runs the bound calls: the compiled one (:mod:`zerokv.core.cexec`) where it can be
built and loaded, else the Python one (:func:`zerokv.core.bound.run`).

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

ENV = "ZEROKV_LAUNCHER"
CHOICES = ("auto", "c", "python")

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "name", "why", "module"


def choose(choice: str | None = None) -> tuple[str, str]:
    """``(name, why)`` of the executor for ``choice`` (default: the environment's), chosen once
    per process unless ``choice`` is given; ``"c"`` raises RuntimeError when it cannot load."""
    want = (choice or os.environ.get(ENV) or "auto").strip().lower()
    if want not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {want!r}")
    with _lock:
        if choice is None and _state:
            return _state["name"], _state["why"]
        if want == "python":
            module, why = None, f"{ENV}=python"
        else:
            from . import cexec

            module, why = cexec.load(strict=want == "c")
        name = "python" if module is None else "c"
        # the runner the ops call from now on (plans read ``executor.run`` on each call)
        globals()["run"] = _bound.run if module is None else _compiled(module)
        if choice is None:
            _state.update(name=name, why=why, module=module)
        return name, why


def _compiled(module: Any) -> Any:
    """The compiled executor for torch signatures, the Python one for the others."""
    c_run, py_run = module.run, _bound.run

    def run_either(bc: _bound.BoundCall, objs: tuple, scalars: tuple) -> Any:
        if bc.c_ok:
            return c_run(bc, objs, scalars)
        return py_run(bc, objs, scalars)

    return run_either


def run(bc: _bound.BoundCall, objs: tuple, scalars: tuple) -> Any:
    """The first call chooses (:func:`choose`), then runs."""
    choose()
    return run(bc, objs, scalars)


def current() -> tuple[str, str]:
    """``(name, why)`` of the executor this process uses (chosen now if not yet)."""
    return choose()
