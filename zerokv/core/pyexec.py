"""The Python executor of bound calls (:mod:`zerokv.core.bound`).

A bound call's records become, once, one function of the call (``bc.steps``): a few closures
over the records' integers (its steps) run in order on a fresh register list, then the form of
its key, the kernel's parameters from the registers, the launch. A step returns None to go on,
False when the table does not take the call (the full validation then sees it), or ``_DONE``
when there is nothing to launch. No source is generated.

A tensor's read also makes the checks that need only it and the tensors read before it (its
sizes' ranges, a zero misalignment, an output's distinct elements and separation), and the
absent arguments are checked first: a check moves only across records that can neither raise
past the executor nor end the call, so the call is taken, or refused, as the table says.
"""

from __future__ import annotations

import operator
from operator import itemgetter
from typing import Any

from . import bound as B
from .generic_tensors import _Generic, generic, writable_cheap
from .layout import distinct

_DONE = 1
_UNREADABLE = (AttributeError, TypeError, ValueError, RuntimeError, IndexError)

_OPS = {
    B.A_ADD: operator.add, B.A_SUB: operator.sub, B.A_MUL: operator.mul, B.A_OR: operator.or_,
    B.A_AND: operator.and_, B.A_EQ: operator.eq, B.A_LT: operator.lt, B.A_NE: operator.ne,
    B.A_MAX: max, B.A_GT: operator.gt,
}  # fmt: skip
_DST = (B.OP_ARITH, B.OP_SCALAR)  # records that write a register (ARITH: [1], SCALAR: [2])
# records that cannot raise past the executor, end the call or allocate: checks may move across
_PURE = {B.OP_TENSOR, B.OP_ABSENT, B.OP_EQ, B.OP_RANGE, B.OP_CHECK, B.OP_APART, B.OP_DISTINCT, *_DST}
_BLOCKS = set(range(B.TENSOR_BASE, B.DERIVED_BASE)) | {B.R_WIDEST, B.R_STOR}


def run(bc: B.BoundCall, objs: tuple, scalars: tuple) -> Any:
    """The call's result (the objects of ``bc.result``, an allocated output in its place) when
    the table takes it (launched, or nothing to launch); None when the full path must see it."""
    call = bc.steps or _decode(bc)
    return call(objs, scalars)


class _Read:
    """A tensor record and the checks moved into its read."""

    def __init__(self, rec: tuple, k: int, bc: B.BoundCall, gen: bool) -> None:
        self.rec, self.k, self.gen, self.rank, self.flags = rec, k, gen, rec[2], rec[3]
        self.dtype, self.tt, self.dev, self.base = bc.dtypes[k], bc.torch_type, bc.device, B.tensor_base(k)
        self.bounds: dict[int, tuple[int, int]] = {}  # size i in [lo, hi)
        self.zero_misalign = False  # its misalignment 0, else refused (a CHECK of R_MISALIGN)
        self.inner = -1  # an output's DISTINCT: the register of its inner extent (-1: none)
        self.apart: tuple | None = None  # an output's APART: (mask, exact)
        # read by name: a 3-D tensor, a 2-D one (or the transpose of one) unaligned
        self.named = (self.rank == 3 and not self.flags & B.F_TRANSPOSE) or (
            self.rank == 2 and not self.flags & B.F_ALIGN
        )


def _decode(bc: B.BoundCall) -> Any:
    """The function of ``bc``'s call: its steps, key, launches and result."""
    key = bc.records[-1]
    if key[0] != B.OP_KEY:
        raise RuntimeError(f"zerokv: the bound call of {bc.name} does not end with its key")
    recs, gen = bc.records[:-1], bc.torch_type is _Generic
    pure = 0  # the records before the first one a check may not move across
    while pure < len(recs) and recs[pure][0] in _PURE and not (gen and recs[pure][0] == B.OP_TENSOR):
        pure += 1
    items: list = []  # _Read objects and the records left as steps, in order
    reads: dict[int, _Read] = {}  # tensor block -> its read
    absent: list = []  # ABSENT records, checked first
    for j, rec in enumerate(recs):
        if rec[0] == B.OP_TENSOR:
            items.append(reads.setdefault(len(reads), _Read(rec, len(reads), bc, gen)))
        elif j >= pure or not _fold(rec, reads, items, absent):
            items.append(rec)
    # the registers a call keeps: the tensor blocks and the derived values the records write;
    # then one that holds the outputs it allocated ({slot: tensor}) and a scratch one
    dsts = [rec[1 if rec[0] == B.OP_ARITH else 2] for rec in recs if rec[0] in _DST]
    made_at = max(B.DERIVED_BASE, *(d + 1 for d in dsts))
    if made_at + 1 >= B.CONST_BASE:
        made_at = B.NREG - 2
    steps, run_ = [], []
    for it in items:
        if type(it) is not _Read and it[0] == B.OP_ARITH:
            run_.append(it)
            continue
        if run_:
            steps.append(_arith(run_))
            run_ = []
        op = B.OP_TENSOR if type(it) is _Read else it[0]
        steps.append(_reader(it, made_at + 1) if op == B.OP_TENSOR else _MAKERS[op](it, bc, made_at))
    steps = ([_absent(absent, bc)] if absent else []) + steps + ([_arith(run_)] if run_ else [])
    bc.steps = _call(bc, tuple(steps), itemgetter(key[1], *key[3 : 3 + key[2]]), made_at)
    return bc.steps


def _fold(rec: tuple, reads: dict, items: list, absent: list) -> bool:
    """Move check ``rec`` into the reads made before it (or to the start of the call) where it
    needs nothing else; False: it stays a step of its own."""
    op = rec[0]
    if op == B.OP_ABSENT:
        absent.append(rec)
        return True
    written = {it[1 if it[0] == B.OP_ARITH else 2] for it in items if type(it) is not _Read and it[0] in _DST}
    if written & _BLOCKS:  # a tensor block written by arithmetic: its reads' values are not final
        return False
    if op == B.OP_RANGE:
        k, i = divmod(rec[1] - B.TENSOR_BASE, B.TENSOR_REGS)
        rd = reads.get(k)
        if rec[1] < B.TENSOR_BASE or rd is None or not rd.named or not 1 <= i <= rd.rank:
            return False
        lo, hi = rd.bounds.get(i - 1, (rec[2], rec[3]))
        rd.bounds[i - 1] = (max(lo, rec[2]), min(hi, rec[3]))
        return True
    if op == B.OP_CHECK and rec[1] == B.R_MISALIGN and not rec[2] and B.R_MISALIGN not in written:
        for rd in reads.values():
            rd.zero_misalign = bool(rd.flags & B.F_ALIGN)
        return True
    rd = reads.get(rec[1]) if op in (B.OP_DISTINCT, B.OP_APART) else None
    if rd is None or not rd.named or rd.rank < 2:
        return False
    if op == B.OP_DISTINCT:
        rd.inner = rd.base + 1 + rec[2] if rec[2] >= 0 else B.R_ONE
        return True
    before = items.index(rd)
    if any(
        rec[2] >> j & 1 and (j not in reads or items.index(reads[j]) > before) for j in range(B.N_TENSORS)
    ):
        return False
    rd.apart = (rec[2], rec[3])
    return True


def _call(bc: B.BoundCall, steps: tuple, key_of: Any, made_at: int) -> Any:
    """The call: registers, steps, the form's launch, the result."""
    size = made_at + 2  # and a scratch register
    pad, result, launch = [0] * (B.CONST_BASE - size), _result_of(bc.result, made_at), B.launch

    def call(objs: tuple, scalars: tuple) -> Any:
        r = [0] * size
        r[1] = 1
        try:
            for step in steps:
                v = step(r, objs, scalars)
                if v is not None:
                    return None if v is False else result(objs, r)
            key = key_of(r)
        except _UNREADABLE:
            return None
        e = bc.forms.get(key) or bc.entry(key[0], key[1:])
        r += pad  # the form's constants go to CONST_BASE on
        launch(bc, e, r, key[0])
        return result(objs, r)

    return call


def _result_of(slots: tuple, made_at: int) -> Any:
    if not slots:
        return lambda objs, r: True
    get = itemgetter(*slots) if len(slots) > 1 else (lambda objs: (objs[slots[0]],))

    def result(objs: tuple, r: list) -> tuple:
        made = r[made_at]
        if not made:
            return get(objs)
        return tuple([made[i] if i in made else objs[i] for i in slots])

    return result


def _reader(rd: _Read, scratch: int) -> Any:
    """Read argument ``rd.rec[1]`` into tensor block ``rd.k`` (bound.OP_TENSOR): by name
    (``special``: a 2-D tensor's third size and stride, 1 and 0, go to register ``scratch``),
    else by loop."""
    if not rd.named:
        return _readn(rd)
    rec, base, tt, dt, dev, gen, rank = rd.rec, rd.base, rd.tt, rd.dtype, rd.dev, rd.gen, rd.rank
    slot, isz, align, width, flags = rec[1], rec[6], rec[7], rec[12], rd.flags
    three, flip, out = rank == 3, flags & B.F_TRANSPOSE, flags & B.F_OUTPUT
    unit3, unit2 = flags & B.F_UNIT_INNER and three, flags & B.F_UNIT_INNER and not three
    aligned, inner, zero = flags & B.F_ALIGN, flags & B.F_INNER_IN_ALIGN, rd.zero_misalign
    q0, q1, q2 = (rec[8 + i] if i < rank else -1 for i in range(3))
    far = (-(1 << 70), 1 << 70)
    lo0, hi0, lo1, hi1, lo2, hi2 = (x for i in range(3) for x in rd.bounds.get(i, far))
    others = _others(*(rd.apart or (0, 0)))
    ranged, dist, di = bool(rd.bounds), rd.inner >= 0, rd.inner - base - 1
    b1, b2, b5, b6, end = base + 1, base + 2, base + 5, base + 6, base + B.T_END
    b3, b7 = (base + 3, base + 7) if three else (scratch, scratch)
    WIDEST, STOR, MISALIGN, cheap = B.R_WIDEST, B.R_STOR, B.R_MISALIGN, writable_cheap  # noqa: N806

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
        if gen:
            x = generic(x)
        if type(x) is not tt or (x.dtype is not dt and x.dtype != dt) or x.get_device() != dev:
            return False
        if three:
            n0, n1, n2 = x.shape
            s0, s1, s2 = x.stride()
        else:
            if flip:
                n1, n0 = x.shape
                s1, s0 = x.stride()
            else:
                n0, n1 = x.shape
                s0, s1 = x.stride()
            n2, s2 = 1, 0
        if (q0 >= 0 and r[q0] != n0) or (q1 >= 0 and r[q1] != n1) or (q2 >= 0 and r[q2] != n2):
            return False
        if ranged and not (lo0 <= n0 < hi0 and lo1 <= n1 < hi1 and lo2 <= n2 < hi2):
            return False
        sor = s0 | s1 | s2
        if sor < 0 or (unit3 and n2 > 1 and s2 != 1) or (unit2 and n1 > 1 and s1 != 1):
            return False
        p = x.data_ptr()
        span = (n0 - 1) * s0 + (n1 - 1) * s1 + (n2 - 1) * s2 + 1 if n0 and n1 and n2 else 0
        e = p + span * isz
        r[base], r[b1], r[b2], r[b3], r[b5], r[b6], r[b7], r[end] = p, n0, n1, n2, s0, s1, s2, e
        r[STOR] |= sor
        if span > r[WIDEST]:
            r[WIDEST] = span
        if aligned:
            m = p % align | (s0 | s1 | (n2 if inner else 0)) % width
            if zero:
                if m:
                    return False
            else:
                r[MISALIGN] |= m
        if out:
            if not (cheap(x.obj) if gen else not x.requires_grad and not x.is_inference() or cheap(x)):
                return False
            if dist:
                w = (n0, n1, n2)[di] if di >= 0 else 1
                # the row-major layout first (layout.distinct's first case), then the rule
                if not (s1 >= w and s0 >= (n1 - 1) * s1 + w) and not distinct(n0, s0, n1, s1, w):
                    return False
            for b, b_end, b_s0, b_s1, ex in others:
                if r[b] < e and p < r[b_end] and not (ex and r[b] == p and r[b_s0] == s0 and r[b_s1] == s1):
                    return False
        return None

    return step


def _readn(rd: _Read) -> Any:
    """A tensor of any rank, its sizes and strides by loop."""
    rec, base, tt, dt, dev, gen, rank = rd.rec, rd.base, rd.tt, rd.dtype, rd.dev, rd.gen, rd.rank
    slot, flags, isz, align, width = rec[1], rd.flags, rec[6], rec[7], rec[12]
    eqs = tuple((i, rec[8 + i]) for i in range(rank) if rec[8 + i] >= 0)
    flip, unit, out = flags & B.F_TRANSPOSE, flags & B.F_UNIT_INNER, flags & B.F_OUTPUT
    aligned, inner, zero = flags & B.F_ALIGN, flags & B.F_INNER_IN_ALIGN, rd.zero_misalign
    last = rank - 1
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
        outer = span = 0
        for i in range(last):
            outer |= st[i]
            span += (shape[i] - 1) * st[i]
        n, s = (shape[last], st[last]) if rank else (1, 0)
        if (outer | s) < 0 or (unit and n > 1 and s != 1):
            return False
        p = r[base] = x.data_ptr()
        r[sizes], r[strides] = shape, st
        r[B.R_STOR] |= outer | s
        span = 0 if 0 in shape else span + (n - 1) * s + 1
        r[base + B.T_END] = p + span * isz
        if span > r[B.R_WIDEST]:
            r[B.R_WIDEST] = span
        if aligned:
            m = p % align | (outer | (n if inner else 0)) % width
            if zero:
                if m:
                    return False
            else:
                r[B.R_MISALIGN] |= m
        if out and not (
            writable_cheap(x.obj)
            if gen
            else not x.requires_grad and not x.is_inference() or writable_cheap(x)
        ):
            return False
        return None

    return step


def _absent(recs: list, bc: B.BoundCall) -> Any:
    slots = tuple(i for rec in recs for i in range(64) if rec[1] >> i & 1)

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        n = len(objs)
        for i in slots:
            if i < n and objs[i] is not None:
                return False
        return None

    return step


def _arith(recs: list) -> Any:
    """Consecutive arithmetic records (``r[d] = f(r[a], r[b] or k)``) as one step."""
    ops = tuple((rec[1], _OPS[rec[2]], rec[3], rec[4], rec[5]) for rec in recs)

    def step(r: list, objs: tuple, scalars: tuple) -> None:
        for d, f, a, b, k in ops:
            r[d] = f(r[a], r[b] if b >= 0 else k)

    return step


def _apart(rec: tuple, bc: B.BoundCall, made_at: int = 0) -> Any:
    """Tensor ``rec[1]`` shares no byte with a tensor of mask ``rec[2]``, or is an exact alias
    (same pointer and outer strides) of one in mask ``rec[3]``."""
    a, others = B.TENSOR_BASE + rec[1] * B.TENSOR_REGS, _others(rec[2], rec[3])

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        p, e, s0, s1 = r[a], r[a + B.T_END], r[a + B.T_STRIDE], r[a + B.T_STRIDE + 1]
        for b, b_end, b_s0, b_s1, ex in others:
            if r[b] < e and p < r[b_end] and not (ex and r[b] == p and r[b_s0] == s0 and r[b_s1] == s1):
                return False
        return None

    return step


def _others(mask: int, exact: int) -> tuple:
    """The tensors of ``mask`` an output must share no byte with (or alias, those of ``exact``):
    registers of pointer, end and outer strides, and whether an exact alias is allowed."""
    bases = range(B.TENSOR_BASE, B.DERIVED_BASE, B.TENSOR_REGS)
    return tuple((b, b + 9, b + 5, b + 6, bool(exact >> j & 1)) for j, b in enumerate(bases) if mask >> j & 1)


def _distinct(rec: tuple, bc: B.BoundCall, made_at: int = 0) -> Any:
    a = B.TENSOR_BASE + rec[1] * B.TENSOR_REGS
    inner = a + 1 + rec[2] if rec[2] >= 0 else B.R_ONE

    return lambda r, objs, sc: None if distinct(r[a + 1], r[a + 5], r[a + 2], r[a + 6], r[inner]) else False


def _scalar(rec: tuple, bc: B.BoundCall, made_at: int = 0) -> Any:
    i, d, lo, hi = rec[1], rec[2], rec[3], rec[4]

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        v = scalars[i]
        if type(v) is not int or not r[lo] <= v <= r[hi]:
            return False
        r[d] = v
        return None

    return step


def _alloc(rec: tuple, bc: B.BoundCall, made_at: int = 0) -> Any:
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
        made = r[made_at] or {}
        made[slot] = x
        r[made_at] = made

    return step


_MAKERS = {
    B.OP_EQ: lambda rec, bc, made_at: lambda r, objs, sc: False if r[rec[1]] != r[rec[2]] else None,
    B.OP_RANGE: lambda rec, bc, made_at: lambda r, objs, sc: None if rec[2] <= r[rec[1]] < rec[3] else False,
    B.OP_CHECK: lambda rec, bc, made_at: lambda r, objs, sc: None if bool(r[rec[1]]) == bool(rec[2]) else False,
    B.OP_DONE_IF_ZERO: lambda rec, bc, made_at: lambda r, objs, sc: None if r[rec[1]] else _DONE,
    B.OP_APART: _apart, B.OP_DISTINCT: _distinct, B.OP_SCALAR: _scalar, B.OP_ALLOC: _alloc,
    B.OP_ABSENT: lambda rec, bc, made_at: _absent([rec], bc),
}  # fmt: skip
