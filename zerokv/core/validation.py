"""The full validation of an op's call, derived from its spec (:mod:`zerokv.core.spec`).

Each given tensor argument is read (``TypeError`` for what is not a tensor), then the op's own
arguments in the spec's order: rank and dtype, sizes against the symbols the arguments before
bound (``ValueError`` naming the symbols), a unit inner stride where the spec asks for one; one
device for them, the symbols' 32-bit limits; the scalars (their values, ranges and the options
they belong to); the options' arguments (an option of several: all or none) on that device; the
options' rules with each other (what they exclude, the one scale of an fp8 output); last the
outputs: writable, an address per element, no byte shared with another tensor of the call
except an exact alias the spec allows. Messages use the caller's names (``shown``).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from . import checks as _checks
from . import dtypes as _dtypes
from .layout import INT32
from .spec import Arg, OpSpec, Option, Scalar
from .tensors import Tensor, view


class Checked:
    """The validated records by the spec's names, the symbols' sizes, the device, the scalars'
    values (``lse_base`` as a key of ``checks.LSE_BASES``) and the options given."""

    __slots__ = ("tensors", "sym", "device", "scalars", "options")

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor | None] = {}
        self.sym: dict[str, int] = {}
        self.device = -1
        self.scalars: dict[str, Any] = {}
        self.options: frozenset[str] = frozenset()


def _names(spec: OpSpec, shown: dict[str, str]) -> dict[str, str]:
    """The caller's name of each argument, scalar and option: ``shown``'s, else the spec's; an
    argument of an option of several as ``shown["<option>[i]"]``, else ``<option>[i] (<argument>)``."""
    rows = (*spec.scalars, *spec.all_args(), *spec.options, *(s for o in spec.options for s in o.scalars))
    name = {x.name: shown.get(x.name, x.name) for x in rows}
    for o in spec.options:
        for i, a in enumerate(o.args if len(o.args) > 1 else ()):
            name[a.name] = shown.get(f"{o.name}[{i}]") or f"{name[o.name]}[{i}] ({a.name})"
    return name


def validate(
    spec: OpSpec, objs: tuple, scalars: dict[str, Any] | None = None, shown: dict[str, str] | None = None,
    sizes: dict[str, int] | None = None, also: tuple = (),
) -> Checked:  # fmt: skip
    """Every check of a call of ``spec``: ``objs`` its tensors (in ``spec.all_args()`` order; an
    absent one: None), ``scalars`` its scalar arguments by the spec's names, ``shown`` the
    caller's names; ``sizes``: symbols the op knows already; ``also``: ``(name, Tensor)`` of
    memory the op reads beside its arguments (on their device; no output may touch it)."""
    args = spec.all_args()
    objs = objs + (None,) * (len(args) - len(objs))
    # the spec's own names: made once (read, never changed, here)
    name = _names(spec, shown) if shown else spec.once("_own_names", lambda sp: _names(sp, {}))
    views = {a.name: view(x, name[a.name]) for a, x in zip(args, objs, strict=True) if x is not None}
    _checks.one_library_on_gpu([(name[a.name], views.get(a.name)) for a in args])
    c = Checked()
    c.sym, c.scalars = dict(sizes or {}), dict(scalars or {})  # the scalars as given, for the shapes
    floats: list[tuple[str, Tensor]] = list(also)
    for a in spec.args:
        t = views.get(a.name)
        if t is None:
            if not a.optional:  # a TypeError naming it
                _checks.tensor(None, name[a.name], len(a.shape), a.dtypes)
        elif a.dtypes != _dtypes.INDEX_NAMES:
            c.tensors[a.name] = t = _tensor(a, t, name, c)
            floats.append((name[a.name], t))
    c.device = _checks.same_device(floats)
    for a in spec.args:
        if a.dtypes == _dtypes.INDEX_NAMES:
            _offsets(a, views[a.name], name, c)
    first = spec.args[0]
    for s in spec.limits:
        if c.sym.get(s, 0) >= INT32:
            shape = tuple(c.sym.get(x) for x in first.shape)
            raise ValueError(
                f"{name[first.name]}: {', '.join(spec.limits)} must be below 2^31, got shape {shape}"
            )
    given = frozenset(o.name for o in spec.options if any(a.name in views for a in o.args))
    c.scalars = _scalars(spec, scalars or {}, given, name, c.sym)
    for s, what in spec.at_least_one:
        if c.sym[s] == 0:
            raise ValueError(f"{name[first.name]}: expected at least one {what} ({s} >= 1), got {s} = 0")
    for o in spec.options:
        if o.name in given:
            _option(o, views, name, c)
    c.options = given
    _rules(spec, given, name, c, also)
    _outputs(spec, given, name, c, also)
    return c


def _tensor(a: Arg, t: Tensor, name: dict[str, str], c: Checked) -> Tensor:
    """Rank, dtype, sizes against the symbols bound before (binding the new ones), unit inner
    stride; dtype that of ``a.same_dtype``."""
    nm, sym = name[a.name], c.sym
    if a.any_shape:  # one element of any shape
        _dtypes.require(nm, t.dtype, a.dtypes)
        if t.numel != 1:
            raise ValueError(f"{nm}: expected one element, got shape {tuple(t.shape)}")
        return t
    t = _checks.tensor(t, nm, len(a.shape), a.dtypes)
    want = tuple(n if w is None else w for w, n in zip((_size(s, c) for s in a.shape), t.shape, strict=True))
    if tuple(t.shape) != want:  # the message's symbols spelled out only for it
        names = ", ".join(s.replace("*", " * ").replace("/", " / ") for s in a.shape)
        raise ValueError(f"{nm}: expected shape {want} ({names}), got {tuple(t.shape)}")
    for s, n in zip(a.shape, t.shape, strict=True):  # the symbols it binds
        if s.isidentifier():
            sym.setdefault(s, n)
    if a.unit_inner and len(a.shape) == 1:
        _checks.contiguous_1d(t, nm)
    elif (
        a.unit_inner and t.shape[-1] > 1 and t.strides[-1] != 1 and 0 not in t.shape
    ):  # zero-size: no element
        raise ValueError(
            f"{nm}: the last (head_dim) dimension must have stride 1, got strides {tuple(t.strides)}"
        )
    other = c.tensors.get(a.same_dtype) if a.same_dtype else None
    if other is not None and t.dtype != other.dtype:
        raise TypeError(f"{nm}: dtype {t.dtype} differs from {name[a.same_dtype]} dtype {other.dtype}")
    return t


def _size(s: str, c: Checked) -> int | None:
    """A shape entry's size: a bound symbol, or ``X*Y/scalar`` (None: a symbol not bound yet)."""
    if "/" not in s:
        return c.sym.get(s)
    product, scalar = s.split("/")
    n = 1
    for x in product.split("*"):
        n *= c.sym[x]
    return n // c.scalars[scalar]


def _offsets(a: Arg, t: Tensor, name: dict[str, str], c: Checked) -> None:
    """Offsets of ``B + 1`` entries (binding ``B``, at least one entry) or lengths of ``B``, one
    index dtype with ``a.same_dtype``, on the call's device."""
    (s,) = a.shape
    nm, sym, n = name[a.name], c.sym, s.removesuffix("+1")
    extra = int(n != s)  # offsets: one more entry than requests
    r = _checks.tensor(t, nm, 1, _dtypes.INDEX_NAMES)
    if n in sym and r.shape[0] != sym[n] + extra:
        raise ValueError(f"{nm}: expected {sym[n] + extra} entries, got shape {tuple(r.shape)}")
    _checks.contiguous_1d(r, nm)
    if r.device != c.device:
        raise ValueError(
            f"{nm} is on {_checks.where(r.device)} but the tensors are on {_checks.where(c.device)}"
        )
    if n not in sym:  # binds the symbol (offsets: at least one entry)
        if extra and r.shape[0] < 1:
            raise ValueError(f"{nm}: expected B + 1 >= 1 entries, got 0")
        sym[n] = r.shape[0] - extra
    other = c.tensors.get(a.same_dtype) if a.same_dtype else None
    if other is not None and r.dtype != other.dtype:
        raise TypeError(
            f"{nm}: dtype {r.dtype} differs from {name[a.same_dtype]} dtype {other.dtype}; use one index dtype"
        )
    c.tensors[a.name] = r


def _option(o: Option, views: dict[str, Tensor], name: dict[str, str], c: Checked) -> None:
    """An option's arguments: all of them given, each checked as its row says, on the device."""
    missing = [a for a in o.args if a.name not in views]
    if missing:
        both = " and ".join(name[a.name] for a in o.args)
        raise ValueError(f"{name[o.name]}: both {both} are needed; {name[missing[0].name]} is None")
    for a in o.args:
        if a.dtypes == _dtypes.INDEX_NAMES:
            _offsets(a, views[a.name], name, c)
            continue
        t = c.tensors[a.name] = _tensor(a, views[a.name], name, c)
        if t.device != c.device:
            raise ValueError(
                f"{name[a.name]} is on {_checks.where(t.device)} but the states are on {_checks.where(c.device)}"
            )


def _scalars(spec: OpSpec, values: dict[str, Any], given: frozenset, name: dict, sym: dict) -> dict[str, Any]:
    """Each scalar's value checked; an option's required scalar given exactly with it."""
    out = {}
    for o in spec.options:
        for s in o.scalars:
            v = values.get(s.name, s.default)  # left out: its default
            if s.required and o.name not in given and v is not None:
                raise ValueError(f"{name[s.name]}: only meaningful with {name[o.name]}, got {v!r} without it")
            if s.required and o.name in given and v is None:
                raise ValueError(f"{name[s.name]}: required with {name[o.name]}")
            if v is not None or not s.required:
                out[s.name] = scalar(s, v, name[s.name], sym)
    for s in spec.scalars:
        out[s.name] = scalar(s, values.get(s.name), name[s.name], sym)
    return out


def scalar(s: Scalar, v: Any, nm: str, sym: dict[str, int]) -> Any:
    """``v`` checked against ``s``'s row; returns it (a number of ``s.values`` as its string)."""
    if not s.values and not s.upto:  # a value the op passes
        return v
    if s.upto:
        if v is None:
            return None
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{nm}: expected an int or None, got {type(v).__name__} {v!r}")
        if not 0 <= v <= sym[s.upto]:
            raise ValueError(f"{nm}: expected 0 <= {nm} <= {s.upto}={sym[s.upto]}, got {v}")
        return v
    # any number but a bool: one equal to a value has its hash, so a later call's key finds the
    # bound call of that value
    number = not isinstance(v, (bool, np.bool_)) and isinstance(v, numbers.Number)
    for x in s.values:
        if number and not isinstance(x, str) and v == x:
            break
        if isinstance(x, str) and isinstance(v, str) and v == x:
            break
    else:
        says = s.says or " or ".join(repr(x) for x in s.values)
        hint = "".join(
            f" (the number {x}, not a string)" for x in s.values if not isinstance(x, str) and v == str(x)
        )
        raise ValueError(f"{nm}: expected {says}{hint}, got {v!r}")
    if s.divides and sym[s.divides] % v:
        what = "head_dim" if s.divides == "D" else s.divides
        raise ValueError(f"{nm}: must divide {what} {sym[s.divides]}, got {v}")
    return x if isinstance(x, str) or s.exact_int else str(x)


def _rules(spec: OpSpec, given: frozenset, name: dict[str, str], c: Checked, also: tuple) -> None:
    """The options' rules: what each excludes; an fp8 output scaled by exactly one option."""
    for o in spec.options:
        if o.name in given and given & set(o.excludes):
            others = [name[x] for x in o.excludes]
            listed = ", ".join(others[:-1]) + " or " + others[-1] if len(others) > 1 else others[0]
            raise ValueError(f"{name[o.name]}: {o.says} does not combine with {listed}")
    if not any(o.fp8_scale for o in spec.options):
        return
    scales = [o.name for o in spec.options if o.fp8_scale and o.name in given]
    if len(scales) > 1:
        raise ValueError(f"{' and '.join(name[x] for x in scales)}: give one fp8 scale, not both")
    first = c.tensors.get("out") or next((c.tensors[a.name] for a in spec.args if a.name in c.tensors), None)
    out_dtype = (first or also[0][1]).dtype  # the output's, else the first input's
    if out_dtype in _dtypes.FP8 and not scales:
        o = next(o for o in spec.options if o.fp8_scale)
        raise ValueError(f"{name[o.name]}: required for a {out_dtype} output")
    if out_dtype not in _dtypes.FP8 and scales:
        fp8 = " or ".join(_dtypes.FP8)
        raise ValueError(f"{name[scales[0]]}: only meaningful with a {fp8} output, got a {out_dtype} output")


def _outputs(spec: OpSpec, given: frozenset, name: dict[str, str], c: Checked, also: tuple) -> None:
    """Outputs writable and apart from every other tensor, except the exact aliases the spec
    allows (none for an output an option given takes them from)."""
    no_alias = {x: o for o in spec.options if o.name in given for x in o.no_alias}
    outs, ins, may_alias = {}, dict(also), []
    for a in spec.all_args():
        t = c.tensors.get(a.name)
        if not a.output:
            if t is not None:
                ins[name[a.name]] = t
            continue
        alias = a.alias
        if a.name in no_alias and t is not None:
            if any(c.tensors[x].ptr == t.ptr for x in a.alias):
                shown = " or ".join(name[x] for x in a.alias)
                raise ValueError(f"{name[a.name]}: may not alias {shown} with {name[no_alias[a.name].name]}")
            alias = ()
        outs[name[a.name]] = t
        may_alias += ((name[a.name], name[x]) for x in alias)
    for n, t in outs.items():
        if t is not None:
            _checks.writable(t, n)
    _checks.check_outputs(outs, ins, may_alias=may_alias)
