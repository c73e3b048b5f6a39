"""The Python executor's steps of a bound call's records other than tensor reads
(:mod:`zerokv.core.pyexec`): each record, once, a closure over its integers and the indices of
the call's registers (``R.at``: a register something reads; ``R.kept``: a written register's
index, or the sink's where nothing reads it; ``R.const``: a register holding a constant). A step
returns None to go on, False when the table does not take the call, ``DONE`` when there is
nothing to launch.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from . import bound as B
from .layout import distinct
from .pyexec_reads import others

DONE = 1
MADE = -2  # the register of the outputs a call allocated ({slot: tensor})

_OPS = {
    B.A_ADD: operator.add, B.A_SUB: operator.sub, B.A_MUL: operator.mul, B.A_OR: operator.or_,
    B.A_AND: operator.and_, B.A_EQ: operator.eq, B.A_LT: operator.lt, B.A_NE: operator.ne,
    B.A_MAX: lambda a, b: a if a >= b else b, B.A_GT: operator.gt,  # max() of two: slower
}  # fmt: skip


def absent(recs: list, bc: B.BoundCall, R: Any) -> Any:  # noqa: N803
    slots = tuple(i for rec in recs for i in range(64) if rec[1] >> i & 1)

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        n = len(objs)
        for i in slots:
            if i < n and objs[i] is not None:
                return False
        return None

    return step


def arith_ops(recs: list, R: Any) -> tuple:  # noqa: N803
    """Arithmetic records as ``(d, f, a, b)``: ``r[d] = f(r[a], r[b])`` (a constant operand in a
    register of its own)."""
    return tuple(
        (R.kept(rec[1]), _OPS[rec[2]], R.at(rec[3]), R.at(rec[4]) if rec[4] >= 0 else R.const(rec[5]))
        for rec in recs
    )


def arith(recs: list, R: Any) -> Any:  # noqa: N803
    """Consecutive arithmetic records as one step."""
    ops = arith_ops(recs, R)

    def step(r: list, objs: tuple, scalars: tuple) -> None:
        for d, f, a, b in ops:
            r[d] = f(r[a], r[b])

    return step


def _block(R: Any, k: int) -> tuple:  # noqa: N803
    """Tensor ``k``'s registers of pointer, sizes 0 and 1, strides 0 and 1, end."""
    a = B.tensor_base(k)
    return tuple(R.at(a + i) for i in (0, 1, 2, 5, 6, B.T_END))


def _apart(rec: tuple, bc: B.BoundCall, R: Any) -> Any:  # noqa: N803
    """Tensor ``rec[1]`` shares no byte with a tensor of mask ``rec[2]``, or is an exact alias
    (same pointer and outer strides) of one in mask ``rec[3]``."""
    a, _, _, a0, a1, a_end = _block(R, rec[1])
    oth = tuple((R.at(b), R.at(e), R.at(s0), R.at(s1), x) for b, e, s0, s1, x in others(rec[2], rec[3]))

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        p, e, s0, s1 = r[a], r[a_end], r[a0], r[a1]
        for b, b_end, b_s0, b_s1, ex in oth:
            if r[b] < e and p < r[b_end] and not (ex and r[b] == p and r[b_s0] == s0 and r[b_s1] == s1):
                return False
        return None

    return step


def _distinct(rec: tuple, bc: B.BoundCall, R: Any) -> Any:  # noqa: N803
    _, n0, n1, s0, s1, _ = _block(R, rec[1])
    inner = R.at(B.tensor_base(rec[1]) + 1 + rec[2] if rec[2] >= 0 else B.R_ONE)

    return lambda r, objs, sc: None if distinct(r[n0], r[s0], r[n1], r[s1], r[inner]) else False


def _scalar(rec: tuple, bc: B.BoundCall, R: Any) -> Any:  # noqa: N803
    i, d, lo, hi = rec[1], R.kept(rec[2]), R.at(rec[3]), R.at(rec[4])

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        v = scalars[i]
        if type(v) is not int:  # a numpy integer (a scheduler's count) as the validation takes it
            if not isinstance(v, np.integer):
                return False
            v = int(v)
        if not r[lo] <= v <= r[hi]:
            return False
        r[d] = v
        return None

    return step


def _alloc(rec: tuple, bc: B.BoundCall, R: Any) -> Any:  # noqa: N803
    """Result ``rec[1]``: a new contiguous output (allocator ``rec[2]``) of the shape in the
    registers ``rec[5:5 + rank]``, read into tensor block ``rec[3]``."""
    slot, allocate, rank = rec[1], bc.allocators[rec[2]], rec[4]
    base, made = B.tensor_base(rec[3]), R.at(MADE)
    dims, p_at = tuple(R.at(q) for q in rec[5 : 5 + rank]), R.kept(base)
    sizes = tuple(R.kept(base + 1 + i) for i in range(rank))
    strides = tuple(R.kept(base + B.T_STRIDE + i) for i in range(rank))

    def step(r: list, objs: tuple, scalars: tuple) -> None:
        shape = tuple([r[q] for q in dims])
        x, r[p_at] = allocate(shape, objs[0])
        stride = 1
        for i in range(rank - 1, -1, -1):
            r[sizes[i]] = shape[i]
            r[strides[i]] = stride
            stride *= shape[i]
        m = r[made] or {}
        m[slot] = x
        r[made] = m

    return step


def _eq(rec: tuple, bc: B.BoundCall, R: Any) -> Any:  # noqa: N803
    a, b = R.at(rec[1]), R.at(rec[2])
    return lambda r, objs, sc: False if r[a] != r[b] else None


def _range(rec: tuple, bc: B.BoundCall, R: Any) -> Any:  # noqa: N803
    a, lo, hi = R.at(rec[1]), rec[2], rec[3]
    return lambda r, objs, sc: None if lo <= r[a] < hi else False


def _check(rec: tuple, bc: B.BoundCall, R: Any) -> Any:  # noqa: N803
    a, want = R.at(rec[1]), bool(rec[2])
    return lambda r, objs, sc: None if bool(r[a]) == want else False


def _done_if_zero(rec: tuple, bc: B.BoundCall, R: Any) -> Any:  # noqa: N803
    a = R.at(rec[1])
    return lambda r, objs, sc: None if r[a] else DONE


MAKERS = {
    B.OP_EQ: _eq, B.OP_RANGE: _range, B.OP_CHECK: _check, B.OP_DONE_IF_ZERO: _done_if_zero,
    B.OP_APART: _apart, B.OP_DISTINCT: _distinct, B.OP_SCALAR: _scalar, B.OP_ALLOC: _alloc,
    B.OP_ABSENT: lambda rec, bc, R: absent([rec], bc, R),
}  # fmt: skip
