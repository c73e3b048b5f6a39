"""Which executor runs the bound calls: the compiled one where it can be built and loaded,
else the Python one (:func:`zerokv.core.bound.run`). ``ZEROKV_LAUNCHER=auto|c|python``."""

from __future__ import annotations

from typing import Any

from . import bound as _bound


def run(bc: _bound.BoundCall, objs: tuple, scalars: tuple) -> Any:
    return _bound.run(bc, objs, scalars)
