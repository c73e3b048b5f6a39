"""Launch plans: what a call of one signature needs, built once and looked up by the signature.

A signature is what the ops put in a key: the op, the tensors' dtypes and devices, which
optional arguments are given and the layout facts that choose an instantiation (vector width,
which LSE axis has unit stride). Never pointers or shapes: an engine that changes the token
count on every step finds its plan on every step.

``get(key)`` finds a plan; on a miss ``lookup(key, build)`` builds it: ``build()`` validates
the whole call and returns the plan, once per key (under a lock, so concurrent first calls
build once).
``clear_cache()`` forgets the plans and then the loaded functions they hold.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from . import compiler as _compiler
from . import executor as _executor
from . import launch as _launch

_plans: dict[Any, Any] = {}
_lock = threading.RLock()  # builders look up the launchers they use
LIMIT = 4096  # distinct signatures kept; past it the table starts again (a process rarely has 50)


def lookup(key: Any, build: Callable[[], Any]) -> Any:
    try:
        plan = _plans.get(key)
    except TypeError:  # an unhashable argument in the key (lse_base=np.array(2)): build() names it
        return build()
    if plan is None:
        with _lock:
            plan = _plans.get(key)
            if plan is None:
                plan = build()
                if len(_plans) >= LIMIT:  # past LIMIT entries the table starts again
                    _plans.clear()
                _plans[key] = plan
    return plan


get = _plans.get  # the plan stored under a key, or None: the calls' one lookup

# scalar arguments -> the bound calls of the signatures met last with them, latest first: a
# call tries these before the full validation. A bound call that refuses a call costs little
# (it stops at the first tensor of another dtype, device or type); a call none takes costs the
# validation, so a process's every signature of one set of scalars fits (devices, dtypes,
# option sets, alignments).
recent: dict[Any, tuple] = {}
RECENT = 32


def recent_call(key: Any, objs: tuple, scalars: tuple) -> tuple[Any, tuple | None]:
    """``(result, calls)``: the result of the first of ``key``'s recent bound calls that takes
    the call (None when none does) and those calls. An unhashable key raises TypeError."""
    calls = recent.get(key)
    if calls:
        run = _executor.run
        for bc in calls:
            r = run(bc, objs, scalars)
            if r is not None:
                return r, calls
    return None, calls


def plan_call(key: Any, plan: Any, objs: tuple, scalars: tuple, calls: tuple | None) -> Any:
    """The result of ``plan``'s bound call on the call unless it was among ``calls`` (tried
    already) or does not take it (None); a call it takes puts it first among ``key``'s."""
    bc = plan.bound
    if bc is None or (calls and bc in calls):
        return None
    r = _executor.run(bc, objs, scalars)
    if r is not None:
        if len(recent) >= LIMIT:
            recent.clear()
        recent[key] = (bc, *calls[: RECENT - 1]) if calls else (bc,)
    return r


def launcher(kernel: Any, targs: tuple, device: int) -> _launch.Launcher:
    """The launcher of one instantiation, shared by every plan that uses it."""
    return lookup(
        ("launcher", kernel.stem, kernel.name, targs, device),
        lambda: _launch.Launcher(kernel, targs, device),
    )


def clear_plans() -> None:
    """Forget every plan and bound call (the loaded functions stay)."""
    with _lock:
        _plans.clear()
        recent.clear()


def clear_cache() -> None:
    """Forget every plan, then every loaded function (the disk cache stays)."""
    clear_plans()
    _compiler.clear_functions()
