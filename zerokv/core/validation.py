"""The full validation of an op's tensor arguments, derived from its spec (:mod:`zerokv.core.spec`).

In the spec's order, each given argument is read (``TypeError`` for what is not a tensor), then
its rank and dtype, its sizes against the symbols the arguments before it bound (``ValueError``
naming the symbols), a unit inner stride where the spec asks for one; then one device for the
float arguments, the offsets (``B+1`` entries, at least one) and lengths (``B``) on it, the
symbols' 32-bit limits, and the outputs: writable, an address per element, no byte shared with
another tensor of the call except an exact alias the spec allows. Messages use the caller's
names (``shown``). What is an op's own (an option's rule, a scalar) stays with the op.
"""

from __future__ import annotations

from typing import Any

from . import checks as _checks
from . import dtypes as _dtypes
from .layout import INT32
from .spec import Arg, OpSpec
from .tensors import Tensor, view


class Checked:
    """The validated records by the spec's names, the symbols' sizes and the device."""

    __slots__ = ("tensors", "sym", "device")

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor | None] = {}
        self.sym: dict[str, int] = {}
        self.device = -1


def validate(
    spec: OpSpec, objs: tuple, shown: dict[str, str] | None = None, limits: tuple[str, ...] = ("T",),
    sizes: dict[str, int] | None = None,
) -> Checked:  # fmt: skip
    """Every check of ``spec``'s tensor arguments in ``objs`` (in ``spec.all_args()`` order; an
    absent one: None). ``shown``: the caller's name of each argument; ``limits``: the symbols
    that must be below 2^31; ``sizes``: symbols already known (none by default)."""
    args = spec.all_args()
    name = {a.name: (shown or {}).get(a.name, a.name) for a in args}
    given = [(a, x) for a, x in zip(args, objs, strict=False) if x is not None]
    views = {a.name: view(x, name[a.name]) for a, x in given}
    _checks.one_library_on_gpu([(name[a.name], views.get(a.name)) for a in args])
    c = Checked()
    c.sym = dict(sizes or {})
    floats: list[tuple[str, Tensor]] = []
    index: list[tuple[Arg, Tensor]] = []
    required = {a.name for a in spec.args if not a.optional}
    for a, x in zip(args, objs + (None,) * (len(args) - len(objs)), strict=True):
        if x is None:
            if a.name in required:  # a TypeError naming it
                _checks.tensor(None, name[a.name], len(a.shape), a.dtypes)
            continue
        t = views[a.name]
        if a.dtypes == _dtypes.INDEX_NAMES:
            index.append((a, t))
            continue
        c.tensors[a.name] = t = _tensor(a, t, name[a.name], c.sym)
        other = c.tensors.get(a.same_dtype) if a.same_dtype else None
        if other is not None and t.dtype != other.dtype:
            raise TypeError(
                f"{name[a.name]}: dtype {t.dtype} differs from {name[a.same_dtype]} dtype {other.dtype}"
            )
        floats.append((name[a.name], t))
    c.device = _checks.same_device(floats)
    for a, t in index:
        c.tensors[a.name] = _offsets(a, t, name[a.name], c.sym, c.device)
    for s in limits:
        if c.sym.get(s, 0) >= INT32:
            first = args[0]
            shape = tuple(c.tensors[first.name].shape)
            raise ValueError(f"{name[first.name]}: {', '.join(limits)} must be below 2^31, got shape {shape}")
    outs = [(name[a.name], c.tensors.get(a.name), tuple(name[x] for x in a.alias)) for a in args if a.output]
    ins = [(name[a.name], c.tensors.get(a.name)) for a in args if not a.output]
    _checks.outputs(outs, [(n, t) for n, t in ins if t is not None])
    return c


def _tensor(a: Arg, t: Tensor, nm: str, sym: dict[str, int]) -> Tensor:
    """Rank, dtype, sizes against the symbols bound before (binding the new ones), unit inner
    stride."""
    t = _checks.tensor(t, nm, len(a.shape), a.dtypes)
    want = [sym.get(s) for s in a.shape]
    if None not in want:
        _checks.shape(t, nm, tuple(want), ", ".join(a.shape))
    else:
        known = [i for i, w in enumerate(want) if w is not None]
        if any(t.shape[i] != want[i] for i in known):
            _checks.shape(t, nm, tuple(w if w is not None else t.shape[i] for i, w in enumerate(want)),
                          ", ".join(a.shape))  # fmt: skip
        for s, n in zip(a.shape, t.shape, strict=True):
            sym.setdefault(s, n)
    if a.unit_inner:
        _checks.unit_last_stride(t, nm)
    return t


def _offsets(a: Arg, t: Any, nm: str, sym: dict[str, int], device: int) -> Tensor:
    """Offsets of ``B + 1`` entries (binding ``B``, at least one entry) or lengths of ``B``."""
    (s,) = a.shape
    if s.endswith("+1") and s[:-2] not in sym:
        r = _checks.offsets(t, nm, device)
        sym[s[:-2]] = r.shape[0] - 1
        return r
    n = sym[s[:-2]] + 1 if s.endswith("+1") else sym[s]
    return _checks.index_tensor(t, nm, n, device)
