"""The options part of ``torch.ops.zerokv``'s merge schemas, derived from the spec.

A schema takes the options of its op's spec that are not an adapter's (an fp8 output's only
where it takes ``out``), in the spec's order: each argument as an optional tensor (an output
annotated as written, its alias letter after ``out`` and ``out_lse``'s ``a`` and ``b``) under
its schema name, then the option's scalars (a string with its default, or an optional int).
:class:`Options` writes that text and turns the schema's option arguments, as torch passes
them (those left at their defaults at the end omitted), into the two-way entry's arguments
after ``prefix_rows`` (:class:`zerokv.core.entry_args.Layout`); :class:`Keywords`, for an op
whose options are one argument each (``merge_states``), into the public function's keywords.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from . import entry_args as _entry


def _schema_args(spec: Any, out: bool) -> tuple[str, tuple, dict, tuple]:
    """The schema text of the options of ``spec`` its schemas take (not an adapter's; an fp8
    output's only where it takes ``out``), each part after a ``", "``; the defaults of its
    arguments, each one-argument option's and scalar's place among them, and the options of
    several arguments as ``(first, last + 1, option)``."""
    parts: list[str] = []
    defaults: list[Any] = []
    pos: dict[str, int] = {}
    several = []
    letters = iter("cdefghijklmnopqrstuvwxyz")  # out and out_lse are a and b
    for o in (o for o in spec.options if not o.adapter and (out or not o.fp8_scale)):
        names = o.schema_names or tuple(a.name for a in o.args)
        if len(o.args) > 1:
            several.append((len(defaults), len(defaults) + len(o.args), o))
        else:
            pos[o.name] = len(defaults)
        for a, name in zip(o.args, names, strict=True):
            parts.append(f"Tensor({next(letters)}!)? {name}=None" if a.output else f"Tensor? {name}=None")
            defaults.append(None)
        for s in o.scalars:
            d = s.default
            kind = "str" if s.values and all(isinstance(v, str) for v in s.values) else "int"
            parts.append(f"{kind}? {s.name}=None" if d is None else f"{kind} {s.name}={d!r}")
            pos[s.name] = len(defaults)
            defaults.append(d)
    return "".join(", " + p for p in parts), tuple(defaults), pos, tuple(several)


class Keywords:
    """The options part of an op's schemas whose options are each one argument (``merge_states``):
    ``schema``, and the public function's keywords from the schema's option arguments."""

    def __init__(self, spec: Any, out: bool) -> None:
        self.schema, self.defaults, pos, several = _schema_args(spec, out)
        if several:
            raise ValueError(f"{spec.name}: an option of several arguments needs an entry's layout (Options)")
        self.names = tuple(sorted(pos, key=pos.get))

    def __call__(self, args: tuple) -> dict:
        """The given option arguments ``args`` (torch omits those left at their defaults at the
        end) by their keywords."""
        return dict(zip(self.names, args, strict=False))


class Options:
    """``layout``: the entry's; ``out``: the schema takes ``out``; ``fixed``: the values the
    schema's calls give the entry's other arguments after ``prefix_rows`` (by name)."""

    def __init__(self, layout: Any, out: bool, fixed: dict) -> None:
        self.schema, self.defaults, pos, self.several = _schema_args(layout.spec, out)
        # gathered: the schema's arguments, each option of several joined, then the entry's
        # arguments after prefix_rows as the schema's calls give them (fixed, else defaults)
        n = len(self.defaults)
        for k, (_, _, o) in enumerate(self.several):
            pos[o.name] = n + k
        first = layout.names.index("prefix_rows") + 1
        tail = layout.names[first:]
        base = n + len(self.several)
        self.rest = tuple(fixed.get(a, d) for a, d in zip(tail, layout.defaults[first:], strict=True))
        self._get = itemgetter(*(pos.get(a, base + i) for i, a in enumerate(tail)))

    def __call__(self, args: tuple) -> tuple:
        """The entry's arguments after ``prefix_rows`` from the schema's option arguments
        ``args``; an option of several arguments given in part raises ``ValueError``."""
        args += self.defaults[len(args) :]
        joined = ()
        for lo, hi, o in self.several:
            part = args[lo:hi]
            if all(x is None for x in part):
                joined += (None,)
            elif any(x is None for x in part):
                raise ValueError(_partly(o, part))
            else:
                joined += (part,)
        return self._get(args + joined + self.rest)


def several_names() -> dict[str, str]:
    """The schemas' names of the arguments of each option of several (``"a_empty[0]"``), for
    the checks' messages."""
    return {
        f"{o.name}[{j}]": n for o in _entry.OPTIONS if len(o.args) > 1 for j, n in enumerate(o.schema_names)
    }


def _partly(o: Any, part: tuple) -> str:
    names = o.schema_names or tuple(a.name for a in o.args)
    given = [n for n, x in zip(names, part, strict=True) if x is not None]
    missing = [n for n, x in zip(names, part, strict=True) if x is None]
    return (
        f"{' and '.join(names)}: give {'both' if len(names) == 2 else 'all'} or neither "
        f"({', '.join(given)} given, {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} None)"
    )
