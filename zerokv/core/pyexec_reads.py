"""The Python executor's tensor reads (:mod:`zerokv.core.pyexec`): each ``OP_TENSOR`` record of
a bound call, with the checks folded into it, becomes one function chosen once for its case.

A 3-D tensor and an unaligned 2-D one (or the transpose of one) whose sizes are all bound by
the read or all compared with registers are read by name, the rest by loop. A read by name
writes only the registers something reads later (the others go to a sink register) and skips
the accumulators (widest span, OR of strides, misalignment) that nothing reads; the usual ones
are :mod:`zerokv.core.pyexec_fast_reads`'s, the rest this module's.
"""

from __future__ import annotations

from typing import Any

from . import bound as B
from . import pyexec_fast_reads as fast
from .generic_tensors import also_read, generic, writable_cheap
from .layout import distinct

_FAR = (-(1 << 70), 1 << 70)


class Read:
    """A tensor record and the checks moved into its read."""

    def __init__(self, rec: tuple, k: int, bc: B.BoundCall, gen: bool) -> None:
        self.rec, self.k, self.gen, self.rank, self.flags = rec, k, gen, rec[2], rec[3]
        self.dtype, self.tt, self.dev, self.base = bc.dtypes[k], bc.torch_type, bc.device, B.tensor_base(k)
        self.pt = also_read(self.tt)  # its subclasses read as tt is (torch.nn.Parameter for torch's)
        self.bounds: dict[int, tuple[int, int]] = {}  # size i in [lo, hi)
        self.zero_misalign = False  # its misalignment 0, else refused (a CHECK of R_MISALIGN)
        self.inner = -1  # an output's DISTINCT: the register of its inner extent (-1: none)
        self.apart: tuple | None = None  # an output's APART: (mask, exact)
        self.pos = False  # its sizes known positive when it is read (ranges of reads before it)
        q = rec[8 : 8 + self.rank]
        self.binds = all(x < 0 for x in q)  # every size bound here (not compared)
        # read by name: a 3-D tensor, a 2-D one (or the transpose of one) unaligned; each size
        # bound here or each compared
        shape_ok = (self.rank == 3 and not self.flags & B.F_TRANSPOSE) or (
            self.rank == 2 and not self.flags & B.F_ALIGN
        )
        self.named = shape_ok and (self.binds or all(x >= 0 for x in q))

    def reads(self) -> set[int]:
        """The registers the read and its folded checks read."""
        got = {q for q in self.rec[8 : 8 + self.rank] if q >= 0}
        for b, b_end, b_s0, b_s1, _ in others(*(self.apart or (0, 0))):
            got |= {b, b_end, b_s0, b_s1}
        return got


def others(mask: int, exact: int) -> tuple:
    """The tensors of ``mask`` an output must share no byte with (or alias, those of ``exact``):
    registers of pointer, end and outer strides, and whether an exact alias is allowed."""
    bases = range(B.TENSOR_BASE, B.DERIVED_BASE, B.TENSOR_REGS)
    return tuple((b, b + 9, b + 5, b + 6, bool(exact >> j & 1)) for j, b in enumerate(bases) if mask >> j & 1)


def reader(rd: Read, at: Any, kept: Any, acc: tuple) -> Any:
    """The step of ``rd``: ``at(register)`` its index in the call's registers, ``kept(register)``
    that index for a register something reads later, else the sink's; ``acc``: the indices of
    the widest span, the OR of strides and the misalignment (None: read by nothing)."""
    if not rd.named:
        one = rd.rank == 1 and not rd.gen and not rd.flags & (B.F_ALIGN | B.F_OUTPUT)
        return _read1(rd, at, acc) if one else _readn(rd, at, acc)
    c = common(rd, at, kept, acc)
    kind = _usual(rd, c)
    if kind:
        return fast.read3(c) if kind == 3 else fast.read2(c)
    return (_read3 if rd.rank == 3 else _read2)(rd, at, kept, acc)


def pair(v: Read, s: Read, at: Any, kept: Any, acc: tuple) -> Any:
    """One step that reads ``v`` then ``s`` (:func:`pyexec_fast_reads.pair`) where ``v`` is a
    usual 3-D read, ``s`` a usual 2-D one whose sizes are ``v``'s first two, both inputs or both
    outputs; else None."""
    if not (v.named and s.named):
        return None
    c, d = common(v, at, kept, acc), common(s, at, kept, acc)
    dims = (v.base + 1, v.base + 2) if v.binds else v.rec[8:10]
    if _usual(v, c) != 3 or _usual(s, d) != 2 or c["out"] != d["out"] or tuple(s.rec[8:10]) != tuple(dims):
        return None
    return fast.pair(c, d)


def _usual(rd: Read, c: dict) -> int:
    """3 or 2 where ``rd`` is a read of :mod:`pyexec_fast_reads` (a torch tensor, its sizes known
    positive, no misalignment to keep: a 3-D one of unit inner stride, a 2-D one unaligned whose
    sizes are a read's before it), else 0."""
    if rd.gen or not rd.pos or c["acc_mis"] or (c["store_n"] and not rd.binds):
        return 0
    if rd.rank == 3 and c["unit"] and bool(rd.flags & B.F_ALIGN) == c["inner"]:
        return 3
    return 2 if rd.rank == 2 and not c["unit"] and not rd.binds else 0


def common(rd: Read, at: Any, kept: Any, acc: tuple) -> dict:
    """What both reads by name take: constants, register indices, the folded checks."""
    rec, base = rd.rec, rd.base
    widest, stor, mis = acc
    apart = others(*(rd.apart or (0, 0)))
    bounds = [rd.bounds.get(i, _FAR) for i in range(3)]
    c = {
        "slot": rec[1], "tt": rd.tt, "pt": rd.pt, "dt": rd.dtype, "dev": rd.dev, "gen": rd.gen, "isz": rec[6],
        "p_at": kept(base), "e_at": kept(base + B.T_END), "s_at": tuple(kept(base + 5 + i) for i in range(3)),
        "n_at": tuple(kept(base + 1 + i) for i in range(3)), "bind": rd.binds,
        "store_n": rd.binds or any(kept(base + 1 + i) != kept(-1) for i in range(rd.rank)),
        "q": tuple(at(q) if q >= 0 else -1 for q in rec[8 : 8 + rd.rank]),
        "lo": tuple(b[0] for b in bounds), "hi": tuple(b[1] for b in bounds),
        "acc": widest is not None or stor is not None, "out": bool(rd.flags & B.F_OUTPUT),
        "plain": tuple((at(b), at(e)) for b, e, _, _, x in apart if not x),
        "exact": tuple((at(b), at(e), at(s0), at(s1)) for b, e, s0, s1, x in apart if x),
        "dist": rd.inner >= 0, "pos": rd.pos, "unit": bool(rd.flags & B.F_UNIT_INNER),
        "flip": bool(rd.flags & B.F_TRANSPOSE),
        "dinner": rd.inner >= 0 and rd.inner != B.R_ONE,  # the DISTINCT's inner extent: the last size
    }  # fmt: skip
    # one of the accumulators read: both kept (the other to the sink)
    c["W"], c["S"] = (x if x is not None else kept(-1) for x in (widest, stor))
    aligned = bool(rd.flags & B.F_ALIGN)
    c["zero"], c["acc_mis"] = (
        aligned and rd.zero_misalign,
        aligned and not rd.zero_misalign and mis is not None,
    )
    c["M"], c["align"], c["width"] = mis if mis is not None else -1, rec[7], rec[12]
    c["inner"] = bool(rd.flags & B.F_INNER_IN_ALIGN)
    return c


def _writable(x: Any, gen: bool) -> bool:
    """An output the call may write without the full check: ``writable_cheap``'s rule, its
    common case (no grad, a version counter: no inference tensor) first."""
    if gen:
        return writable_cheap(x.obj)
    try:
        if not x.requires_grad and x._version is not None:
            return True
    except RuntimeError:  # no version counter: an inference tensor, or ask
        if not x.requires_grad and not x.is_inference():
            return True
    return writable_cheap(x)


def _read3(rd: Read, at: Any, kept: Any, acc: tuple) -> Any:
    """A 3-D tensor read by name."""
    c = common(rd, at, kept, acc)
    slot, tt, dt, dev, gen, isz, p_at, e_at = (
        c[k] for k in ("slot", "tt", "dt", "dev", "gen", "isz", "p_at", "e_at")
    )
    pt = c["pt"]
    (s0_at, s1_at, s2_at), (n0_at, n1_at, n2_at), (q0, q1, q2) = c["s_at"], c["n_at"], c["q"]
    bind, store_n, pos, unit = c["bind"], c["store_n"], c["pos"], c["unit"]
    (lo0, lo1, lo2), (hi0, hi1, hi2) = c["lo"], c["hi"]
    W, S, accum, out, dist, plain, exact = (c[k] for k in ("W", "S", "acc", "out", "dist", "plain", "exact"))  # noqa: N806
    zero, acc_mis, M, align, width, inner = (
        c[k] for k in ("zero", "acc_mis", "M", "align", "width", "inner")
    )  # noqa: N806
    dinner = rd.inner >= 0 and rd.inner != B.R_ONE  # the DISTINCT's inner extent: the last size
    writable = _writable

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
        if gen:
            x = generic(x)
        if (
            (type(x) is not tt and not issubclass(type(x), pt))
            or (x.dtype is not dt and x.dtype != dt)
            or x.get_device() != dev
        ):
            return False
        n0, n1, n2 = x.shape
        s0, s1, s2 = x.stride()
        if bind:
            if not (lo0 <= n0 < hi0 and lo1 <= n1 < hi1 and lo2 <= n2 < hi2):
                return False
        elif n0 != r[q0] or n1 != r[q1] or n2 != r[q2]:
            return False
        if store_n:
            r[n0_at] = n0
            r[n1_at] = n1
            r[n2_at] = n2
        sor = s0 | s1 | s2
        if sor < 0 or (unit and n2 > 1 and s2 != 1):
            return False
        p = x.data_ptr()
        if zero:
            if p % align or (s0 | s1 | (n2 if inner else 0)) % width:
                return False
        elif acc_mis:
            r[M] |= p % align | (s0 | s1 | (n2 if inner else 0)) % width
        # sizes known positive (or none zero): the span in elements; a unit inner stride: n2 last
        if pos or (n0 and n1 and n2):
            span = (n0 - 1) * s0 + (n1 - 1) * s1 + (n2 if unit else (n2 - 1) * s2 + 1)
        else:
            span = 0
        e = p + span * isz
        r[p_at] = p
        r[s0_at] = s0
        r[s1_at] = s1
        r[s2_at] = s2
        r[e_at] = e
        if accum:
            r[S] |= sor
            if span > r[W]:
                r[W] = span
        if out:
            if not writable(x, gen):
                return False
            if dist:
                w = n2 if dinner else 1
                # the row-major layout first (layout.distinct's first case), then the rule
                if not (s1 >= w and s0 >= (n1 - 1) * s1 + w) and not distinct(n0, s0, n1, s1, w):
                    return False
            for b, b_end in plain:
                if r[b] < e and p < r[b_end]:
                    return False
            for b, b_end, b_s0, b_s1 in exact:
                if r[b] < e and p < r[b_end] and not (r[b] == p and r[b_s0] == s0 and r[b_s1] == s1):
                    return False
        return None

    return step


def _read2(rd: Read, at: Any, kept: Any, acc: tuple) -> Any:
    """A 2-D tensor (or the transpose of one) read by name, unaligned."""
    c = common(rd, at, kept, acc)
    slot, tt, dt, dev, gen, isz, p_at, e_at = (
        c[k] for k in ("slot", "tt", "dt", "dev", "gen", "isz", "p_at", "e_at")
    )
    pt = c["pt"]
    (s0_at, s1_at, _), (n0_at, n1_at, _), (q0, q1) = c["s_at"], c["n_at"], c["q"]
    bind, store_n, pos, unit = c["bind"], c["store_n"], c["pos"], c["unit"]
    (lo0, lo1, _), (hi0, hi1, _) = c["lo"], c["hi"]
    W, S, accum, out, dist, plain, exact = (c[k] for k in ("W", "S", "acc", "out", "dist", "plain", "exact"))  # noqa: N806
    flip = rd.flags & B.F_TRANSPOSE
    writable = _writable

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
        if gen:
            x = generic(x)
        if (
            (type(x) is not tt and not issubclass(type(x), pt))
            or (x.dtype is not dt and x.dtype != dt)
            or x.get_device() != dev
        ):
            return False
        if flip:
            n1, n0 = x.shape
            s1, s0 = x.stride()
        else:
            n0, n1 = x.shape
            s0, s1 = x.stride()
        if bind:
            if not (lo0 <= n0 < hi0 and lo1 <= n1 < hi1):
                return False
        elif n0 != r[q0] or n1 != r[q1]:
            return False
        if store_n:
            r[n0_at] = n0
            r[n1_at] = n1
        sor = s0 | s1
        if sor < 0 or (unit and n1 > 1 and s1 != 1):
            return False
        p = x.data_ptr()
        span = (n0 - 1) * s0 + (n1 - 1) * s1 + 1 if pos or (n0 and n1) else 0
        e = p + span * isz
        r[p_at] = p
        r[s0_at] = s0
        r[s1_at] = s1
        r[e_at] = e
        if accum:
            r[S] |= sor
            if span > r[W]:
                r[W] = span
        if out:
            if not writable(x, gen):
                return False
            # the row-major layout first (layout.distinct's first case), then the rule
            if dist and not (s1 >= 1 and s0 >= (n1 - 1) * s1 + 1) and not distinct(n0, s0, n1, s1, 1):
                return False
            for b, b_end in plain:
                if r[b] < e and p < r[b_end]:
                    return False
            for b, b_end, b_s0, b_s1 in exact:
                if r[b] < e and p < r[b_end] and not (r[b] == p and r[b_s0] == s0 and r[b_s1] == s1):
                    return False
        return None

    return step


def _read1(rd: Read, at: Any, acc: tuple) -> Any:
    """A 1-D input of torch's, unaligned: :func:`pyexec_fast_reads.read1` on its block."""
    rec, base = rd.rec, rd.base
    W, S = (x if x is not None else at(-1) for x in acc[:2])  # noqa: N806
    c = {
        "slot": rec[1], "tt": rd.tt, "pt": rd.pt, "dt": rd.dtype, "dev": rd.dev, "isz": rec[6], "p_at": at(base),
        "n_at": at(base + 1), "s_at": at(base + B.T_STRIDE), "e_at": at(base + B.T_END),
        "q": at(rec[8]) if rec[8] >= 0 else -1, "unit": bool(rd.flags & B.F_UNIT_INNER), "W": W, "S": S,
    }  # fmt: skip
    return fast.read1(c)


def _readn(rd: Read, at: Any, acc: tuple) -> Any:
    """A tensor of any rank, its sizes and strides by loop, every register of its block written
    (``at`` gives the block's registers one after another)."""
    rec, base, tt, pt, dt, dev, gen, rank = rd.rec, rd.base, rd.tt, rd.pt, rd.dtype, rd.dev, rd.gen, rd.rank
    slot, flags, isz, align, width = rec[1], rd.flags, rec[6], rec[7], rec[12]
    eqs = tuple((i, at(rec[8 + i])) for i in range(rank) if rec[8 + i] >= 0)
    flip, unit, out = flags & B.F_TRANSPOSE, flags & B.F_UNIT_INNER, flags & B.F_OUTPUT
    aligned, inner, zero = flags & B.F_ALIGN, flags & B.F_INNER_IN_ALIGN, rd.zero_misalign
    last, p_at, e_at = rank - 1, at(base), at(base + B.T_END)
    sizes = slice(at(base + 1), at(base + 1) + rank)
    strides = slice(at(base + B.T_STRIDE), at(base + B.T_STRIDE) + rank)
    W, S, M = (x if x is not None else at(-1) for x in acc)  # noqa: N806
    writable = _writable

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
        if gen:
            x = generic(x)
        if (
            (type(x) is not tt and not issubclass(type(x), pt))
            or (x.dtype is not dt and x.dtype != dt)
            or x.get_device() != dev
        ):
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
        p = r[p_at] = x.data_ptr()
        r[sizes], r[strides] = shape, st
        r[S] |= outer | s
        span = 0 if 0 in shape else span + (n - 1) * s + 1
        r[e_at] = p + span * isz
        if span > r[W]:
            r[W] = span
        if aligned:
            m = p % align | (outer | (n if inner else 0)) % width
            if zero:
                if m:
                    return False
            else:
                r[M] |= m
        if out and not writable(x, gen):
            return False
        return None

    return step
