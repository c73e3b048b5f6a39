"""The Python executor of bound calls (:mod:`zerokv.core.bound`).

Each record of a bound call becomes, once, a small function with the record's integers bound
(its step); a call runs the steps in order on a fresh register list, then looks up the form of
its key, packs the kernel's parameters from the registers and launches. A step returns None to
go on, False when the call is not one the table takes (the full validation then sees it), or
``_DONE`` when there is nothing to launch. No source is generated: the functions are closures
over the records' values.
"""

from __future__ import annotations

import operator
from operator import itemgetter
from typing import Any

from . import bound as B
from .generic_tensors import _Generic, generic, writable_cheap
from .layout import distinct

_DONE = 1
_MADE = B.NREG - 1  # the register that holds the outputs a call allocated ({slot: tensor})
_UNREADABLE = (AttributeError, TypeError, ValueError, RuntimeError, IndexError)

_OPS = {
    B.A_ADD: operator.add, B.A_SUB: operator.sub, B.A_MUL: operator.mul, B.A_OR: operator.or_,
    B.A_AND: operator.and_, B.A_EQ: operator.eq, B.A_LT: operator.lt, B.A_NE: operator.ne,
    B.A_MAX: max, B.A_GT: operator.gt,
}  # fmt: skip

# per rank: the sum of (n - 1) * stride, the OR of every stride, the OR of the outer ones
_SPAN = {
    1: lambda n, s: (n[0] - 1) * s[0],
    2: lambda n, s: (n[0] - 1) * s[0] + (n[1] - 1) * s[1],
    3: lambda n, s: (n[0] - 1) * s[0] + (n[1] - 1) * s[1] + (n[2] - 1) * s[2],
    4: lambda n, s: (n[0] - 1) * s[0] + (n[1] - 1) * s[1] + (n[2] - 1) * s[2] + (n[3] - 1) * s[3],
}
_OR = {1: lambda s: s[0], 2: lambda s: s[0] | s[1], 3: lambda s: s[0] | s[1] | s[2],
       4: lambda s: s[0] | s[1] | s[2] | s[3]}  # fmt: skip
_OUTER = {1: lambda s: 0, 2: lambda s: s[0], 3: lambda s: s[0] | s[1], 4: lambda s: s[0] | s[1] | s[2]}


def run(bc: B.BoundCall, objs: tuple, scalars: tuple) -> Any:
    """The call's result (the objects of ``bc.result``, an allocated output in its place) when
    the table takes it (launched, or nothing to launch); None when the full path must see it."""
    steps = bc.steps or _decode(bc)
    r = [0] * B.NREG
    r[B.R_ONE] = 1
    try:
        for step in steps:
            v = step(r, objs, scalars)
            if v is not None:
                return None if v is False else _result(bc, objs, r)
        key = bc.c_key(r)
    except _UNREADABLE:
        return None
    e = bc.forms.get(key) or bc.entry(key[0], key[1:])
    B.launch(bc, e, r, key[0])
    return _result(bc, objs, r)


def _result(bc: B.BoundCall, objs: tuple, r: list) -> Any:
    if not bc.result:
        return True
    made = r[_MADE]
    if not made:
        return tuple([objs[i] for i in bc.result])
    return tuple([made[i] if i in made else objs[i] for i in bc.result])


def _decode(bc: B.BoundCall) -> tuple:
    """The steps of ``bc``'s records (all but the last, its key), and its key's getter."""
    steps, k = [], 0
    gen = bc.torch_type is _Generic
    run: list = []  # consecutive arithmetic records: one step
    for rec in bc.records[:-1]:
        op = rec[0]
        if op == B.OP_ARITH:
            run.append(rec)
            continue
        if run:
            steps.append(_arith(run))
            run = []
        if op == B.OP_TENSOR:
            steps.append(_tensor(rec, k, bc.torch_type, bc.dtypes[k], bc.device, gen))
            k += 1
        else:
            steps.append(_MAKERS[op](rec, bc))
    if run:
        steps.append(_arith(run))
    key = bc.records[-1]
    if key[0] != B.OP_KEY:
        raise RuntimeError(f"zerokv: the bound call of {bc.name} does not end with its key")
    bc.c_key = itemgetter(key[1], *key[3 : 3 + key[2]])
    bc.steps = tuple(steps)
    return bc.steps


def _tensor(rec: tuple, k: int, tt: type, dt: Any, dev: int, gen: bool) -> Any:
    """Read argument ``rec[1]`` into tensor block ``k`` (bound.OP_TENSOR); 2-D and 3-D
    tensors (the states, LSEs and outputs) unpacked by name, the others by loop."""
    slot, rank, flags, isz, align, width = rec[1], rec[2], rec[3], rec[6], rec[7], rec[12]
    base = B.TENSOR_BASE + k * B.TENSOR_REGS
    eqs = tuple((i, rec[8 + i]) for i in range(rank) if rec[8 + i] >= 0)
    flip, unit, out = flags & B.F_TRANSPOSE, flags & B.F_UNIT_INNER, flags & B.F_OUTPUT
    aligned, inner = flags & B.F_ALIGN, flags & B.F_INNER_IN_ALIGN
    if rank == 3 and not flip:
        return _tensor3(slot, base, eqs, isz, align, width, unit, out, aligned, inner, tt, dt, dev, gen)
    if rank == 2 and not aligned:
        return _tensor2(slot, base, eqs, isz, flip, unit, out, tt, dt, dev, gen)
    last, span_of, or_of, outer_of = rank - 1, _SPAN[rank], _OR[rank], _OUTER[rank]
    sizes, strides = slice(base + 1, base + 1 + rank), slice(base + B.T_STRIDE, base + B.T_STRIDE + rank)

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
        if gen:
            x = generic(x)
        if type(x) is not tt or (x.dtype is not dt and x.dtype != dt) or x.get_device() != dev:
            return False
        shape, st = tuple(x.shape), x.stride()
        if len(shape) != rank:
            return False
        if flip:
            shape, st = shape[::-1], st[::-1]
        for i, q in eqs:
            if r[q] != shape[i]:
                return False
        sor = or_of(st)
        if sor < 0 or (unit and shape[last] > 1 and st[last] != 1):
            return False
        p = r[base] = x.data_ptr()
        r[sizes], r[strides] = shape, st
        r[B.R_STOR] |= sor
        span = 0 if 0 in shape else span_of(shape, st) + 1
        r[base + B.T_END] = p + span * isz
        if span > r[B.R_WIDEST]:
            r[B.R_WIDEST] = span
        if aligned:
            r[B.R_MISALIGN] |= p % align | (outer_of(st) | (shape[last] if inner else 0)) % width
        if out and not _writable(x):
            return False
        return None

    return step


def _tensor3(slot, base, eqs, isz, align, width, unit, out, aligned, inner, tt, dt, dev, gen) -> Any:  # noqa: ANN001
    """A ``[n0, n1, n2]`` tensor (``_tensor``'s rank-3 case, its sizes and strides by name)."""
    q0, q1, q2 = (dict(eqs).get(i, -1) for i in range(3))
    b1, b2, b3, b5, b6, b7, end = base + 1, base + 2, base + 3, base + 5, base + 6, base + 7, base + B.T_END

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
        if gen:
            x = generic(x)
        if type(x) is not tt or (x.dtype is not dt and x.dtype != dt) or x.get_device() != dev:
            return False
        n0, n1, n2 = x.shape
        s0, s1, s2 = x.stride()
        if (q0 >= 0 and r[q0] != n0) or (q1 >= 0 and r[q1] != n1) or (q2 >= 0 and r[q2] != n2):
            return False
        sor = s0 | s1 | s2
        if sor < 0 or (unit and n2 > 1 and s2 != 1):
            return False
        p = r[base] = x.data_ptr()
        r[b1], r[b2], r[b3], r[b5], r[b6], r[b7] = n0, n1, n2, s0, s1, s2
        r[B.R_STOR] |= sor
        span = (n0 - 1) * s0 + (n1 - 1) * s1 + (n2 - 1) * s2 + 1 if n0 and n1 and n2 else 0
        r[end] = p + span * isz
        if span > r[B.R_WIDEST]:
            r[B.R_WIDEST] = span
        if aligned:
            r[B.R_MISALIGN] |= p % align | (s0 | s1 | (n2 if inner else 0)) % width
        if out and not _writable(x):
            return False
        return None

    return step


def _tensor2(slot, base, eqs, isz, flip, unit, out, tt, dt, dev, gen) -> Any:  # noqa: ANN001
    """A ``[n0, n1]`` tensor, or the transpose of an ``[n1, n0]`` one (``flip``)."""
    q0, q1 = (dict(eqs).get(i, -1) for i in range(2))
    b1, b2, b5, b6, end = base + 1, base + 2, base + 5, base + 6, base + B.T_END

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
        if gen:
            x = generic(x)
        if type(x) is not tt or (x.dtype is not dt and x.dtype != dt) or x.get_device() != dev:
            return False
        if flip:
            n1, n0 = x.shape
            s1, s0 = x.stride()
        else:
            n0, n1 = x.shape
            s0, s1 = x.stride()
        if (q0 >= 0 and r[q0] != n0) or (q1 >= 0 and r[q1] != n1):
            return False
        sor = s0 | s1
        if sor < 0 or (unit and n1 > 1 and s1 != 1):
            return False
        p = r[base] = x.data_ptr()
        r[b1], r[b2], r[b5], r[b6] = n0, n1, s0, s1
        r[B.R_STOR] |= sor
        span = (n0 - 1) * s0 + (n1 - 1) * s1 + 1 if n0 and n1 else 0
        r[end] = p + span * isz
        if span > r[B.R_WIDEST]:
            r[B.R_WIDEST] = span
        if out and not _writable(x):
            return False
        return None

    return step


def _writable(x: Any) -> bool:
    if type(x) is _Generic:
        return writable_cheap(x.obj)
    return (not x.requires_grad and not x.is_inference()) or writable_cheap(x)


def _absent(rec: tuple, bc: B.BoundCall) -> Any:
    slots = tuple(i for i in range(64) if rec[1] >> i & 1)

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        n = len(objs)
        for i in slots:
            if i < n and objs[i] is not None:
                return False
        return None

    return step


def _eq(rec: tuple, bc: B.BoundCall) -> Any:
    a, b = rec[1], rec[2]
    return lambda r, objs, scalars: False if r[a] != r[b] else None


def _range(rec: tuple, bc: B.BoundCall) -> Any:
    a, lo, hi = rec[1], rec[2], rec[3]
    return lambda r, objs, scalars: None if lo <= r[a] < hi else False


def _check(rec: tuple, bc: B.BoundCall) -> Any:
    a, want = rec[1], bool(rec[2])
    return lambda r, objs, scalars: None if bool(r[a]) == want else False


def _arith(recs: list) -> Any:
    """Consecutive arithmetic records (``r[d] = f(r[a], r[b] or k)``) as one step."""
    ops = tuple((rec[1], _OPS[rec[2]], rec[3], rec[4], rec[5]) for rec in recs)
    if len(ops) == 1:
        ((d, f, a, b, k),) = ops
        if b >= 0:
            return lambda r, objs, scalars: r.__setitem__(d, f(r[a], r[b]))
        return lambda r, objs, scalars: r.__setitem__(d, f(r[a], k))

    def step(r: list, objs: tuple, scalars: tuple) -> None:
        for d, f, a, b, k in ops:
            r[d] = f(r[a], r[b] if b >= 0 else k)

    return step


def _apart(rec: tuple, bc: B.BoundCall) -> Any:
    """Tensor ``rec[1]`` shares no byte with a tensor of mask ``rec[2]``, or is an exact alias
    (same pointer and outer strides) of one in mask ``rec[3]``."""
    a = B.TENSOR_BASE + rec[1] * B.TENSOR_REGS
    others = tuple(
        (B.TENSOR_BASE + j * B.TENSOR_REGS, bool(rec[3] >> j & 1))
        for j in range(B.N_TENSORS)
        if rec[2] >> j & 1
    )
    s0, s1 = a + B.T_STRIDE, a + B.T_STRIDE + 1

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        lo, hi = r[a], r[a + B.T_END]
        for b, exact in others:
            if (
                r[b] < hi
                and lo < r[b + B.T_END]
                and not (
                    exact and r[b] == lo and r[b + B.T_STRIDE] == r[s0] and r[b + B.T_STRIDE + 1] == r[s1]
                )
            ):
                return False
        return None

    return step


def _distinct(rec: tuple, bc: B.BoundCall) -> Any:
    a = B.TENSOR_BASE + rec[1] * B.TENSOR_REGS
    inner = a + 1 + rec[2] if rec[2] >= 0 else B.R_ONE

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        ok = distinct(r[a + 1], r[a + B.T_STRIDE], r[a + 2], r[a + B.T_STRIDE + 1], r[inner])
        return None if ok else False

    return step


def _scalar(rec: tuple, bc: B.BoundCall) -> Any:
    i, d, lo, hi = rec[1], rec[2], rec[3], rec[4]

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        v = scalars[i]
        if type(v) is not int or not r[lo] <= v <= r[hi]:
            return False
        r[d] = v
        return None

    return step


def _alloc(rec: tuple, bc: B.BoundCall) -> Any:
    """Result ``rec[1]``: a new contiguous output (allocator ``rec[2]``) of the shape in the
    registers ``rec[5:5 + rank]``, read into tensor block ``rec[3]``."""
    slot, allocate, rank = rec[1], bc.allocators[rec[2]], rec[4]
    base = B.TENSOR_BASE + rec[3] * B.TENSOR_REGS
    dims = rec[5 : 5 + rank]

    def step(r: list, objs: tuple, scalars: tuple) -> None:
        shape = tuple([r[q] for q in dims])
        x, r[base] = allocate(shape, objs[0])
        stride = 1
        for i in range(rank - 1, -1, -1):
            r[base + 1 + i] = shape[i]
            r[base + B.T_STRIDE + i] = stride
            stride *= shape[i]
        made = r[_MADE] or {}
        made[slot] = x
        r[_MADE] = made

    return step


def _done_if_zero(rec: tuple, bc: B.BoundCall) -> Any:
    a = rec[1]
    return lambda r, objs, scalars: None if r[a] else _DONE


_MAKERS = {
    B.OP_ABSENT: _absent, B.OP_EQ: _eq, B.OP_RANGE: _range, B.OP_CHECK: _check,
    B.OP_APART: _apart, B.OP_DISTINCT: _distinct, B.OP_SCALAR: _scalar, B.OP_ALLOC: _alloc,
    B.OP_DONE_IF_ZERO: _done_if_zero,
}  # fmt: skip
