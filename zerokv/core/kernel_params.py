"""A kernel's parameter list from its text: ``"ptr va, i64 va_st, ..."``, where ``@name`` stands
for the kernel parameters of its op's option ``name`` as the spec's row gives them, typed by
rule (:func:`option_params`), and ``@*`` for those of every option its generic kernel takes that
the text does not place. A new option of ``merge_state`` so reaches ``merge_state_kernel``'s
description from its row alone."""

from __future__ import annotations

from . import spec as _spec


def params(text: str, op: _spec.OpSpec | None = None, ints: str = "i64") -> tuple[tuple[str, str], ...]:
    """``"ptr va, i64 va_st, ..."`` -> ((name, type), ...). ``@name`` stands for the kernel
    parameters of ``op``'s option ``name`` (:func:`option_params`, their integers as ``ints``);
    ``@*`` for those of every option of ``op`` its generic kernel takes that the text does not
    place, in the spec's order."""
    items = [i.strip() for i in text.split(",")]
    placed = {i[1:] for i in items if i.startswith("@")}
    out = []
    for item in items:
        if item == "@*":
            for o in op.options:
                if o.generic and o.name not in placed:
                    out += option_params(o, ints)
        elif item.startswith("@"):
            out += option_params(next(o for o in op.options if o.name == item[1:]), ints)
        else:
            ctype, name = item.split()
            out.append((name, ctype))
    return tuple(out)


def option_params(option: _spec.Option, ints: str) -> list[tuple[str, str]]:
    """The kernel parameters of a spec row, typed: its arguments' pointers ``ptr``, the rest
    (strides, sizes, what the plan derives) integers of type ``ints``."""
    ptrs = {a.params[0] for a in option.args if a.params}
    return [(n, "ptr" if n in ptrs else ints) for n in (*option.params, *option.derived)]
