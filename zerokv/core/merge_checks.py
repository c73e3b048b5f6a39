"""The full validation of the merges: their specs' (:mod:`zerokv.core.validation`) with the
call's scalar arguments. It runs on the first call of a signature and on every call its bound
call does not take."""

from __future__ import annotations

from typing import Any

from . import entry_args as _entry
from . import spec as _spec
from . import validation as _validation


def two(
    objs: tuple, base: Any, prefix_rows: Any, names: dict[str, str] | None, option_scalars: tuple = ()
) -> _validation.Checked:
    """``objs``: merge_state's tensors in its spec's order; ``option_scalars``: its options'
    scalars in the spec's order (those left out: their defaults)."""
    scalars = {"lse_base": base, "prefix_rows": prefix_rows, **_options(option_scalars)}
    return _validation.validate(_spec.MERGE_STATE, objs, scalars, names)


def _options(given: tuple) -> dict:
    """The options' scalars by name, those left out at their defaults."""
    return dict(zip(_entry.OPTION_SCALARS, given + _entry.OPTION_DEFAULTS[len(given) :], strict=True))


def n(objs: tuple, base: Any, quant: tuple = (None, "float32")) -> _validation.Checked:
    """``objs``: merge_states' tensors in its spec's order; ``quant``: (quant_group, scale_format)."""
    scalars = {"lse_base": base, "quant_group": quant[0], "scale_format": quant[1]}
    return _validation.validate(_spec.MERGE_STATES, objs, scalars)
