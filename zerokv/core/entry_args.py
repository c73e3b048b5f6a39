"""The arguments of the two-way merge's entry (``merge_plans.two``), derived once from its
Python function and the spec.

The entry takes the parameters its Python function writes out (the op's arguments, the
adapters' and the options the spec had when it was written, each read by its name), then, as
``*more``, every other option of ``MERGE_STATE`` in the spec's order: its value (a tensor; a
tuple of its arguments when it has several; or None), then its scalars. :class:`Layout` says
from those names where each object of the bound call comes from (the spec's arguments in its
order, an option of several split into them), how each item of the key of its recent bound
calls is made, and which arguments are its scalars. The compiled entry (``launcher.c``'s
``two``) reads every call by that table, handed to it once at bind time (:meth:`Layout.table`);
the Python entry reads its written parameters as they are and the options after them through
:meth:`Layout.more_args`. A new option appended to the spec is read by both with no edit of either;
writing it out among the Python function's parameters (a tuning step) spares the Python
entry the generic read.
"""

from __future__ import annotations

import inspect
from operator import itemgetter
from typing import Any

from . import spec as _spec

SPEC = _spec.MERGE_STATE
OPTIONS = SPEC.options
OPTION_SCALARS = tuple(s.name for o in OPTIONS for s in o.scalars)  # in the spec's order

# how a key item is made (launcher.c's KEY_*): the argument; whether it is None; whether it is
# not None; the argument, or when it is None whether another argument is None
K_VALUE, K_IS_NONE, K_NOT_NONE, K_OR_IS_NONE = 0, 1, 2, 3


def _getter(at: tuple) -> Any:
    """``itemgetter`` that returns a tuple for any count of positions (a run of them: a slice)."""
    if at and at != tuple(range(at[0], at[0] + len(at))):  # two or more, not one run
        return itemgetter(*at)
    return itemgetter(slice(at[0], at[0] + len(at)) if at else slice(0, 0))


def _option_args(options: tuple) -> tuple:
    return tuple(n for o in options for n in (o.name, *(s.name for s in o.scalars)))


class Layout:
    """The entry's arguments: ``fn``'s parameters (those without a default: every call gives
    them), then the options of ``spec`` it does not name. ``key``: the key of the recent bound
    calls that ``fn`` makes of its parameters, as ``(kind, argument, other argument)``; the
    options after them add their scalars. ``scalars``: the arguments that are the bound
    call's scalars."""

    def __init__(self, fn: Any, key: tuple, scalars: tuple, spec: _spec.OpSpec = SPEC) -> None:
        params = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        written = tuple(p.name for p in params)
        self.spec, options = spec, spec.options
        named = [o for o in options if o.name in written]
        if options[: len(named)] != tuple(named):
            raise ValueError("the entry writes out the spec's first options, in its order")
        self.more = options[len(named) :]
        more_args = _option_args(self.more)
        self.names = written + more_args
        self.written = len(written)  # those a call may give by keyword
        self.required = sum(p.default is p.empty for p in params)
        more_defaults = tuple(v for o in self.more for v in (None, *(s.default for s in o.scalars)))
        self.defaults = tuple(None if p.default is p.empty else p.default for p in params) + more_defaults
        at = {n: i for i, n in enumerate(self.names)}
        self.objs = tuple((at[a.name], -1, 1) for a in spec.args) + tuple(
            (at[o.name], j if len(o.args) > 1 else -1, len(o.args))
            for o in options
            for j in range(len(o.args))
        )
        more_scalars = tuple(s.name for o in self.more for s in o.scalars)
        self.key = tuple((k, at[a], at[b] if b else 0) for k, a, b in key)
        self.key += tuple((K_VALUE, at[n], 0) for n in more_scalars)
        self.scalars = tuple(at[n] for n in scalars)
        # the options' scalars in the spec's order, from a key
        key_names = [self.names[a] if k == K_VALUE else None for k, a, _ in self.key]
        self.option_scalars = _getter(tuple(key_names.index(s.name) for o in options for s in o.scalars))
        # the Python entry's read of the options after its parameters
        n_written_objs = sum(len(o.args) for o in named) + len(spec.args)
        self._pads = tuple((None,) * (n_written_objs - n) for n in range(n_written_objs + 1))  # by len(objs)
        self._more_n = len(more_args)
        self._more_defaults = more_defaults
        self._several = tuple((more_args.index(o.name), len(o.args), o) for o in self.more if len(o.args) > 1)
        obj_at, part = [], len(more_args)
        for o in self.more:
            if len(o.args) > 1:
                obj_at += range(part, part + len(o.args))
                part += len(o.args)
            else:
                obj_at.append(more_args.index(o.name))
        self._more_objs = _getter(tuple(obj_at))
        self._more_scalars = _getter(tuple(more_args.index(n) for n in more_scalars))
        self.more_key = self._more_scalars(more_defaults)  # the key's part of a call that gives none

    def more_args(self, objs: tuple, scalars: tuple, more: tuple, names: dict | None) -> tuple[tuple, tuple]:
        """``objs`` and ``scalars`` (the Python entry's, of its written parameters) with the
        options given after them (``more``; those left out absent)."""
        if len(more) != self._more_n:
            if len(more) > self._more_n:
                raise TypeError(
                    f"merge_state's entry takes {len(self.names)} arguments ({', '.join(self.names)}), "
                    f"got {len(self.names) - self._more_n + len(more)}"
                )
            more += self._more_defaults[len(more) :]
        for i, k, o in self._several:  # an option of several: its arguments after the options
            x = more[i]
            more += (None,) * k if x is None else split(x, o, names.get(o.name, o.name) if names else o.name)
        return objs + self._pads[len(objs)] + self._more_objs(more), scalars + self._more_scalars(more)

    def table(self) -> tuple:
        """What ``launcher.c``'s ``two`` reads a call by: ``(names, required, written,
        defaults, objects, key, scalars)``: a call gives the first ``required`` names, may give
        the first ``written`` by keyword; each object ``(argument, part, parts)``: part -1 for
        the argument itself, else item ``part`` of a tuple of ``parts``. Its bind_entries
        checks every count and index."""
        return self.names, self.required, self.written, self.defaults, self.objs, self.key, self.scalars


def split(x: Any, o: _spec.Option, arg: str) -> tuple:
    """The arguments of option ``o`` of several, given as ``x`` (a tuple or list of them)."""
    k = len(o.args)
    if not isinstance(x, (tuple, list)) or len(x) != k:
        what = "a pair" if k == 2 else f"{k} arguments"
        raise TypeError(
            f"{arg}: expected {what} ({', '.join(a.name for a in o.args)}), got {type(x).__name__}"
        )
    return tuple(x)
