"""The Python executor's reads of the usual tensors (:mod:`zerokv.core.pyexec_reads` chooses):
torch tensors whose sizes are known positive, a 3-D one with a unit inner stride (aligned with
no misalignment, or unaligned) and an unaligned 2-D one (or the transpose of one) whose sizes
are a read's before it; and a state's V and LSE in one step, the LSE's sizes V's first two.
Each without the branches of the general reads; ``c``: a read's constants and register indices
(``pyexec_reads.common``). And a 1-D input, unaligned, its size bound or compared.

An output's checks end its read: writable (no grad and a version counter: no inference tensor;
else ``writable_cheap``), distinct elements (the row-major layout first, then
``layout.distinct``), no byte shared with a tensor read before it, or an exact alias of one.
"""

from __future__ import annotations

from typing import Any

from .generic_tensors import writable_cheap
from .layout import distinct


def read1(c: dict) -> Any:
    """A 1-D input: its size bound here (no range: the table's records check it) or a register's."""
    slot, tt, dt, dev, isz, p_at, e_at = (c[k] for k in ("slot", "tt", "dt", "dev", "isz", "p_at", "e_at"))
    pt = c["pt"]
    n_at, s_at, q, unit, W, S = (c[k] for k in ("n_at", "s_at", "q", "unit", "W", "S"))  # noqa: N806
    bind = q < 0

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
        if (
            (type(x) is not tt and not issubclass(type(x), pt))
            or (x.dtype is not dt and x.dtype != dt)
            or x.get_device() != dev
        ):
            return False
        (n,) = x.shape
        if not bind and n != r[q]:
            return False
        (s,) = x.stride()
        if s < 0 or (unit and n > 1 and s != 1):
            return False
        p = x.data_ptr()
        span = (n - 1) * s + 1 if n else 0
        r[p_at] = p
        r[n_at] = n
        r[s_at] = s
        r[e_at] = p + span * isz
        r[S] |= s
        if span > r[W]:
            r[W] = span
        return None

    return step


def read3(c: dict) -> Any:
    """A 3-D tensor: its sizes bound here (in their ranges) or those of a read before it."""
    slot, tt, dt, dev, isz, p_at, e_at = (c[k] for k in ("slot", "tt", "dt", "dev", "isz", "p_at", "e_at"))
    pt = c["pt"]
    (s0_at, s1_at, s2_at), (q0, q1, q2), W, S = c["s_at"], c["q"], c["W"], c["S"]  # noqa: N806
    bind, (n0_at, n1_at, n2_at), (lo0, lo1, lo2), (hi0, hi1, hi2) = c["bind"], c["n_at"], c["lo"], c["hi"]
    aligned, align, width, dinner = c["zero"], c["align"], c["width"], c["dinner"]
    out, dist, plain, exact, cheap = c["out"], c["dist"], c["plain"], c["exact"], writable_cheap

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
        if (
            (type(x) is not tt and not issubclass(type(x), pt))
            or (x.dtype is not dt and x.dtype != dt)
            or x.get_device() != dev
        ):
            return False
        n0, n1, n2 = x.shape
        if bind:
            if not (lo0 <= n0 < hi0 and lo1 <= n1 < hi1 and lo2 <= n2 < hi2):
                return False
            r[n0_at] = n0
            r[n1_at] = n1
            r[n2_at] = n2
        elif n0 != r[q0] or n1 != r[q1] or n2 != r[q2]:
            return False
        s0, s1, s2 = x.stride()
        sor = s0 | s1 | s2
        if sor < 0 or (n2 > 1 and s2 != 1):
            return False
        p = x.data_ptr()
        if aligned and (p % align or (s0 | s1 | n2) % width):
            return False
        span = (n0 - 1) * s0 + (n1 - 1) * s1 + n2
        e = p + span * isz
        r[p_at] = p
        r[s0_at] = s0
        r[s1_at] = s1
        r[s2_at] = s2
        r[e_at] = e
        r[S] |= sor
        if span > r[W]:
            r[W] = span
        if out:
            try:
                ok = not x.requires_grad and x._version is not None
            except RuntimeError:
                ok = False
            if not ok and not cheap(x):
                return False
            w = n2 if dinner else 1
            if dist and not (s1 >= w and s0 >= (n1 - 1) * s1 + w) and not distinct(n0, s0, n1, s1, w):
                return False
            for b, b_end in plain:
                if r[b] < e and p < r[b_end]:
                    return False
            for b, b_end, b_s0, b_s1 in exact:
                if r[b] < e and p < r[b_end] and not (r[b] == p and r[b_s0] == s0 and r[b_s1] == s1):
                    return False
        return None

    return step


def read2(c: dict) -> Any:
    """A 2-D tensor (or the transpose of one) whose sizes are those of a read before it."""
    slot, tt, dt, dev, isz, p_at, e_at = (c[k] for k in ("slot", "tt", "dt", "dev", "isz", "p_at", "e_at"))
    pt = c["pt"]
    (s0_at, s1_at, _), (q0, q1), W, S, flip = c["s_at"], c["q"], c["W"], c["S"], c["flip"]  # noqa: N806
    out, dist, plain, exact, cheap = c["out"], c["dist"], c["plain"], c["exact"], writable_cheap

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
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
        if n0 != r[q0] or n1 != r[q1]:
            return False
        sor = s0 | s1
        if sor < 0:
            return False
        p = x.data_ptr()
        span = (n0 - 1) * s0 + (n1 - 1) * s1 + 1
        e = p + span * isz
        r[p_at] = p
        r[s0_at] = s0
        r[s1_at] = s1
        r[e_at] = e
        r[S] |= sor
        if span > r[W]:
            r[W] = span
        if out:
            try:
                ok = not x.requires_grad and x._version is not None
            except RuntimeError:
                ok = False
            if not ok and not cheap(x):
                return False
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


def pair(c: dict, d: dict) -> Any:
    """:func:`read3` of ``c`` then :func:`read2` of ``d`` in one step, ``d``'s sizes compared
    with ``c``'s first two; both inputs or both outputs. :func:`read3`'s body is written out here
    rather than called: a state's two reads are then one Python call (the sizes it compares may
    live in no kept register), the cheapest of the ways measured."""
    slot, tt, dt, dev, isz, p_at, e_at = (c[k] for k in ("slot", "tt", "dt", "dev", "isz", "p_at", "e_at"))
    pt = c["pt"]
    (s0_at, s1_at, s2_at), (q0, q1, q2), W, S = c["s_at"], c["q"], c["W"], c["S"]  # noqa: N806
    bind, (n0_at, n1_at, n2_at), (lo0, lo1, lo2), (hi0, hi1, hi2) = c["bind"], c["n_at"], c["lo"], c["hi"]
    aligned, align, width, dinner = c["zero"], c["align"], c["width"], c["dinner"]
    out, dist, plain, exact, cheap = c["out"], c["dist"], c["plain"], c["exact"], writable_cheap
    lslot, ldt, lsz, lp_at, le_at, (ls0_at, ls1_at, _) = (
        d[k] for k in ("slot", "dt", "isz", "p_at", "e_at", "s_at")
    )
    flip, ldist, lplain, lexact = d["flip"], d["dist"], d["plain"], d["exact"]

    def step(r: list, objs: tuple, scalars: tuple) -> Any:
        x = objs[slot]
        if (
            (type(x) is not tt and not issubclass(type(x), pt))
            or (x.dtype is not dt and x.dtype != dt)
            or x.get_device() != dev
        ):
            return False
        n0, n1, n2 = x.shape
        if bind:
            if not (lo0 <= n0 < hi0 and lo1 <= n1 < hi1 and lo2 <= n2 < hi2):
                return False
            r[n0_at] = n0
            r[n1_at] = n1
            r[n2_at] = n2
        elif n0 != r[q0] or n1 != r[q1] or n2 != r[q2]:
            return False
        s0, s1, s2 = x.stride()
        sor = s0 | s1 | s2
        if sor < 0 or (n2 > 1 and s2 != 1):
            return False
        p = x.data_ptr()
        if aligned and (p % align or (s0 | s1 | n2) % width):
            return False
        span = (n0 - 1) * s0 + (n1 - 1) * s1 + n2
        e = p + span * isz
        r[p_at] = p
        r[s0_at] = s0
        r[s1_at] = s1
        r[s2_at] = s2
        r[e_at] = e
        r[S] |= sor
        if span > r[W]:
            r[W] = span
        if out:
            try:
                ok = not x.requires_grad and x._version is not None
            except RuntimeError:
                ok = False
            if not ok and not cheap(x):
                return False
            w = n2 if dinner else 1
            if dist and not (s1 >= w and s0 >= (n1 - 1) * s1 + w) and not distinct(n0, s0, n1, s1, w):
                return False
            for b, b_end in plain:
                if r[b] < e and p < r[b_end]:
                    return False
            for b, b_end, b_s0, b_s1 in exact:
                if r[b] < e and p < r[b_end] and not (r[b] == p and r[b_s0] == s0 and r[b_s1] == s1):
                    return False
        x = objs[lslot]  # the LSE: [n0, n1]
        if (
            (type(x) is not tt and not issubclass(type(x), pt))
            or (x.dtype is not ldt and x.dtype != ldt)
            or x.get_device() != dev
        ):
            return False
        if flip:
            m1, m0 = x.shape
            s1, s0 = x.stride()
        else:
            m0, m1 = x.shape
            s0, s1 = x.stride()
        if m0 != n0 or m1 != n1:
            return False
        sor = s0 | s1
        if sor < 0:
            return False
        p = x.data_ptr()
        span = (n0 - 1) * s0 + (n1 - 1) * s1 + 1
        e = p + span * lsz
        r[lp_at] = p
        r[ls0_at] = s0
        r[ls1_at] = s1
        r[le_at] = e
        r[S] |= sor
        if span > r[W]:
            r[W] = span
        if out:
            try:
                ok = not x.requires_grad and x._version is not None
            except RuntimeError:
                ok = False
            if not ok and not cheap(x):
                return False
            if ldist and not (s1 >= 1 and s0 >= (n1 - 1) * s1 + 1) and not distinct(n0, s0, n1, s1, 1):
                return False
            for b, b_end in lplain:
                if r[b] < e and p < r[b_end]:
                    return False
            for b, b_end, b_s0, b_s1 in lexact:
                if r[b] < e and p < r[b_end] and not (r[b] == p and r[b_s0] == s0 and r[b_s1] == s1):
                    return False
        return None

    return step
