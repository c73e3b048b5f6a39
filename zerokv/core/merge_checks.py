"""The full validation of the merges: their specs' (:mod:`zerokv.core.validation`) with the
call's scalar arguments. It runs on the first call of a signature and on every call its bound
call does not take."""

from __future__ import annotations

from typing import Any

from . import spec as _spec
from . import validation as _validation


def two(
    objs: tuple, base: Any, prefix_rows: Any, names: dict[str, str] | None, quant: tuple = (None, "float32")
) -> _validation.Checked:
    """``objs``: merge_state's tensors in its spec's order; ``quant``: (quant_group, scale_format)."""
    scalars = {
        "lse_base": base,
        "prefix_rows": prefix_rows,
        "quant_group": quant[0],
        "scale_format": quant[1],
    }
    return _validation.validate(_spec.MERGE_STATE, objs, scalars, names)


def n(objs: tuple, base: Any, quant: tuple = (None, "float32")) -> _validation.Checked:
    """``objs``: merge_states' tensors in its spec's order; ``quant``: (quant_group, scale_format)."""
    scalars = {"lse_base": base, "quant_group": quant[0], "scale_format": quant[1]}
    return _validation.validate(_spec.MERGE_STATES, objs, scalars)
