"""The Python executor of bound calls (:mod:`zerokv.core.bound`).

A bound call's records become, once, one function of the call (``bc.steps``): a few closures
over the records' integers (its steps) run in order on a fresh register list, then the form of
its key, the kernel's parameters from the registers, the launch. A step returns None to go on,
False when the table does not take the call (the full validation then sees it), or
``pyexec_steps.DONE`` when there is nothing to launch. No source is generated.

A tensor's read (:mod:`zerokv.core.pyexec_reads`) also makes the checks that need only it and
the tensors read before it (its sizes' ranges, a zero misalignment, an output's distinct
elements and separation), and the absent arguments are checked first: a check moves only across
records that can neither raise past the executor nor end the call, so the call is taken, or
refused, as the table says.

The call's registers are the table's that something reads (a step, the key or a kernel
parameter, ``bc.params``), numbered anew one after another; a value nothing reads goes to one
sink register. The launch of a key (entry, grid, parameters' getter) is found once, and a new
T's entry among those of its interval. The first entry launched orders the registers of the
calls after it: its kernel's parameters first, in its order, its constants in place, so that
they are one slice of the registers.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from . import bound as B
from . import pyexec_steps as S
from .forms import launch_grid
from .generic_tensors import _Generic
from .pyexec_reads import Read, others, pair, reader

_UNREADABLE = (AttributeError, TypeError, ValueError, RuntimeError, IndexError)
_FORMS_LIMIT = 4096  # keys whose launch a call keeps; past it, it starts again

_DST = (B.OP_ARITH, B.OP_SCALAR)  # records that write a register (ARITH: [1], SCALAR: [2])
# records that cannot raise past the executor, end the call or allocate: checks may move across
_PURE = {B.OP_TENSOR, B.OP_ABSENT, B.OP_EQ, B.OP_RANGE, B.OP_CHECK, B.OP_APART, B.OP_DISTINCT, *_DST}
_BLOCKS = set(range(B.TENSOR_BASE, B.DERIVED_BASE)) | {B.R_WIDEST, B.R_STOR}
_SINK = -1  # the register of the values nothing reads


def run(bc: B.BoundCall, objs: tuple, scalars: tuple) -> Any:
    """The call's result (the objects of ``bc.result``, an allocated output in its place) when
    the table takes it (launched, or nothing to launch); None when the full path must see it."""
    call = bc.steps or _decode(bc)
    return call(objs, scalars)


class _Registers:
    """The call's registers: each table register something reads, numbered in order of need;
    ``values``: each one's value at the start of a call. Given the first entry a call launches,
    its kernel's parameters come first, in its order: its constants in place, a register in
    its first place (``sliced``: every parameter in its place, the parameters one slice)."""

    def __init__(self, live: set | None, first: tuple | None, blocks: list[int]) -> None:
        self.index: dict[int, int] = {}
        self.live = live  # None: every register
        self.values: list = []
        self.consts: dict[int, int] = {}  # constant -> the register holding it
        self.first_rest, self.first = first or (None, None)
        self.sliced = False
        first = self.first
        # the blocks read by loop keep their registers one after another (not in the parameters)
        held = {b + i for b in blocks for i in range(B.TENSOR_REGS)}
        if first is not None and all(
            s >= B.CONST_BASE or s == B.R_ZERO or live is None or s in live for s in first.srcs
        ):
            apart = False  # a parameter not in its place: a register's second place, or held
            for src in first.srcs:
                apart |= src in held or (src in self.index and src != B.R_ZERO)
                if src >= B.CONST_BASE:
                    self.values.append(first.consts[src - B.CONST_BASE])
                elif src in held:
                    self.values.append(0)
                else:  # each place of R_ZERO a zero of its own: nothing writes them
                    self.index.setdefault(src, len(self.values))
                    self.values.append(1 if src == B.R_ONE else 0)
            self.sliced = not apart
        for b in blocks:
            for i in range(B.TENSOR_REGS):
                self.at(b + i)
        self.at(B.R_ZERO)
        self.sink = self.at(_SINK)

    def at(self, reg: int) -> int:
        i = self.index.get(reg)
        if i is None:
            i = self.index[reg] = len(self.values)
            self.values.append(1 if reg == B.R_ONE else 0)
        return i

    def kept(self, reg: int) -> int:
        """``reg``'s index where something reads it, else the sink's."""
        return self.at(reg) if self.live is None or reg in self.live else self.sink

    def const(self, k: int) -> int:
        i = self.consts.get(k)
        if i is None:
            i = self.consts[k] = len(self.values)
            self.values.append(k)
        return i


def _decode(bc: B.BoundCall, first: tuple | None = None) -> Any:
    """The function of ``bc``'s call: its steps, key, launches and result; ``first``: the rest of
    the key and the entry of its first launch (its parameters first among the registers), None
    before it."""
    key = bc.records[-1]
    if key[0] != B.OP_KEY:
        raise RuntimeError(f"zerokv: the bound call of {bc.name} does not end with its key")
    recs, gen = bc.records[:-1], bc.torch_type is _Generic
    pure = 0  # the records before the first one a check may not move across
    while pure < len(recs) and recs[pure][0] in _PURE and not (gen and recs[pure][0] == B.OP_TENSOR):
        pure += 1
    items: list = []  # Read objects and the records left as steps, in order
    reads: dict[int, Read] = {}  # tensor block -> its read
    absent: list = []  # ABSENT records, checked first
    for j, rec in enumerate(recs):
        if rec[0] == B.OP_TENSOR:
            items.append(reads.setdefault(len(reads), Read(rec, len(reads), bc, gen)))
        elif j >= pure or not _fold(rec, reads, items, absent):
            items.append(rec)
    _positive(reads)
    blocks = [rd.base for rd in reads.values() if not rd.named]
    R = _Registers(_live(bc, items, key), first, blocks)  # noqa: N806
    acc = tuple(
        R.at(x) if R.live is None or x in R.live else None for x in (B.R_WIDEST, B.R_STOR, B.R_MISALIGN)
    )
    steps, run_, j = [], [], 0
    while j < len(items):
        it, j = items[j], j + 1
        if type(it) is not Read and it[0] == B.OP_ARITH:
            run_.append(it)
            continue
        if run_:
            steps.append(S.arith(run_, R))
            run_ = []
        if type(it) is not Read:
            steps.append(S.MAKERS[it[0]](it, bc, R))
            continue
        both = pair(it, items[j], R.at, R.kept, acc) if j < len(items) and type(items[j]) is Read else None
        steps.append(both or reader(it, R.at, R.kept, acc))
        j += both is not None  # a state's V and LSE in one step
    tail = S.arith_ops(run_, R)  # the arithmetic after the last step: run in the call itself
    slots = sorted(i for rec in absent for i in range(64) if rec[1] >> i & 1)
    run_of = (slots[0], slots[-1] + 1) if slots and slots[-1] - slots[0] + 1 == len(slots) else None
    if absent and run_of is None:  # not one run of slots: a step that checks them one by one
        steps.insert(0, S.absent(absent, bc, R))
    key_of = itemgetter(*(R.at(x) for x in (key[1], *key[3 : 3 + key[2]])))
    bc.steps = _call(bc, tuple(steps), tail, key_of, R, run_of)
    return bc.steps


def _positive(reads: dict) -> None:
    """Mark the reads whose sizes are known positive: ranges from 1 folded into the read, or
    each size equal to such a size of a read before it."""
    known: set[int] = set()
    for rd in reads.values():
        if not rd.named:
            continue
        if rd.binds:
            ones = [i for i in range(rd.rank) if rd.bounds.get(i, (0,))[0] >= 1]
            known |= {rd.base + 1 + i for i in ones}
            rd.pos = len(ones) == rd.rank
        else:
            rd.pos = all(q in known for q in rd.rec[8 : 8 + rd.rank])


def _live(bc: B.BoundCall, items: list, key: tuple) -> set | None:
    """The table registers something reads: the steps, the key, the kernels' parameters (None:
    every register, where the bound call does not name its parameters')."""
    if bc.params is None:
        return None
    live = set(bc.params) | {key[1], *key[3 : 3 + key[2]]}
    for it in items:
        if type(it) is Read:
            live |= it.reads()
            continue
        op = it[0]
        if op in (B.OP_EQ, B.OP_RANGE, B.OP_CHECK, B.OP_DONE_IF_ZERO):
            live |= {it[1], it[2]} if op == B.OP_EQ else {it[1]}
        elif op == B.OP_ARITH:
            live |= {it[3], it[4]} if it[4] >= 0 else {it[3]}
        elif op == B.OP_SCALAR:
            live |= {it[3], it[4]}
        elif op == B.OP_ALLOC:
            live |= set(it[5 : 5 + it[4]])
        elif op == B.OP_DISTINCT:
            a = B.tensor_base(it[1])
            live |= {a + 1, a + 2, a + 5, a + 6, a + 1 + it[2] if it[2] >= 0 else B.R_ONE}
        elif op == B.OP_APART:
            a = B.tensor_base(it[1])
            for b, b_end, b_s0, b_s1, _ in ((a, a + B.T_END, a + 5, a + 6, 0), *others(it[2], it[3])):
                live |= {b, b_end, b_s0, b_s1}
    return live


def _fold(rec: tuple, reads: dict, items: list, absent: list) -> bool:
    """Move check ``rec`` into the reads made before it (or to the start of the call) where it
    needs nothing else; False: it stays a step of its own."""
    op = rec[0]
    if op == B.OP_ABSENT:
        absent.append(rec)
        return True
    written = {it[1 if it[0] == B.OP_ARITH else 2] for it in items if type(it) is not Read and it[0] in _DST}
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


def _call(
    bc: B.BoundCall, steps: tuple, tail: tuple, key_of: Any, R: _Registers, absent: tuple | None
) -> Any:  # noqa: N803
    """The call: absent arguments, registers, steps, arithmetic, the form's launch, the result."""
    values, made = R.values, R.index.get(S.MADE, -1)
    size, fresh = len(values), all(type(v) is int and not v for v in values)
    lo, hi = absent or (0, 0)
    given, result = _result_of(bc.result, made)
    launches: dict = {}  # form key -> (launch, grid, grid_y, parameters' getter, constants)
    entries: dict = {}  # the rest of a form key -> [(entry, getter, constants)] met so far
    # the entry the registers are ordered for serves its interval
    seed = {R.first_rest: (R.first, *_params(bc, R.first, R))} if R.first is not None else {}
    entries.update((rest, [hit]) for rest, hit in seed.items())
    stream, device = bc.stream, bc.device

    def launch_of(key: tuple) -> tuple:
        """The launch of a key met for the first time: the entry of its T's interval (from the
        entries met so far, else the bound call's), the grid of its T. The first entry met
        orders the registers of the calls after it (:class:`_Registers`)."""
        T, rest = key[0], key[1:]
        met = entries.setdefault(rest, [])
        for e, get, consts in met:  # noqa: B007 - the entry found and its getter
            if e.t_lo <= T < e.t_hi:
                break
        else:
            e = bc.forms.get(key) or bc.entry(T, rest)
            get, consts = _params(bc, e, R)
            met.append((e, get, consts))
            if R.first is None:
                _decode(bc, (rest, e))
        if len(launches) >= _FORMS_LIMIT:
            launches.clear()
            entries.clear()
            entries.update((rest, [hit]) for rest, hit in seed.items())
        hit = launches[key] = (e.launcher.launch_values, *launch_grid(e.form, T), get, consts)
        return hit

    def call(objs: tuple, scalars: tuple) -> Any:
        if absent:  # the absent arguments still None
            for x in objs[lo:hi]:
                if x is not None:
                    return None
        r = [0] * size if fresh else values.copy()
        try:
            for step in steps:
                v = step(r, objs, scalars)
                if v is not None:
                    return None if v is False else given(objs) if given else result(objs, r)
            for d, f, a, b in tail:
                r[d] = f(r[a], r[b])
            key = key_of(r)
        except _UNREADABLE:
            return None
        launch, grid, grid_y, get, consts = launches.get(key) or launch_of(key)
        if consts:
            r += consts  # another entry's constants after the call's registers
        launch(grid, grid_y, stream(device), get(r))
        return given(objs) if given else result(objs, r)

    return call


def _params(bc: B.BoundCall, e: B.Entry, R: _Registers) -> tuple:  # noqa: N803
    """The getter of entry ``e``'s kernel parameters from the call's registers and the constants
    to put after them first (none for the entry whose parameters are in place)."""
    if e is R.first and R.sliced:
        return itemgetter(slice(0, len(e.srcs))), ()
    size, idx = len(R.values), []
    for src in e.srcs:
        if src >= B.CONST_BASE:
            idx.append(size + src - B.CONST_BASE)
        elif src in R.index:
            idx.append(R.index[src])
        elif R.live is None or src in R.live:  # a register nothing writes: zero
            idx.append(R.index[B.R_ZERO])
        else:
            raise RuntimeError(f"zerokv: {bc.name}'s kernel reads register {src}, not among its parameters'")
    return (itemgetter(*idx) if len(idx) > 1 else (lambda r, i=idx[0]: (r[i],))), e.consts


def _result_of(slots: tuple, made: int) -> tuple:
    """``(given, result)``: the call's result from its objects (``given(objs)``) where it
    allocates nothing, else from them and the outputs it made (``result(objs, r)``)."""
    if not slots:
        return (lambda objs: True), None
    get = itemgetter(*slots) if len(slots) > 1 else (lambda objs: (objs[slots[0]],))
    if made < 0:
        return get, None

    def result(objs: tuple, r: list) -> tuple:
        m = r[made]
        if not m:
            return get(objs)
        return tuple([m[i] if i in m else objs[i] for i in slots])

    return None, result
