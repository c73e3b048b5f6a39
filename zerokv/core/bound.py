"""The bound call of a signature: a table of integers that an executor runs on each later call.

A signature's first call is fully validated; then its bound call is built from the op's spec
(:mod:`zerokv.core.spec`): fixed-size records of integers saying what a later call must check
(which arguments are given, producer, dtype, device, rank, shapes, unit strides, alignment,
writable outputs whose elements are distinct and that share no byte with another tensor or
alias one exactly) and which registers hold the values the form key and the kernel's
parameters read. Two executors run the same table: the compiled one (``launcher.c``) and
:func:`run` here. A call the table does not take returns False and goes to the full
validation, which raises with the caller's names or builds the call's own signature.

Registers are 64-bit integers: ``R_ZERO``/``R_ONE`` constants, accumulators, scalar arguments,
each tensor's block (``tensor_base(k)``: pointer, 4 sizes, 4 strides in elements, end byte),
then values derived by the table's arithmetic and, at launch, the form's constants.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from .generic_tensors import _Generic, generic, writable_cheap
from .layout import INT32, distinct

RECORD = 16  # integers per record
NREG = 192  # registers per call
N_TENSORS = 12  # tensor blocks

# fixed registers
R_ZERO, R_ONE, R_WIDEST, R_STOR, R_MISALIGN = 0, 1, 2, 3, 4
R_SCALAR = 5  # scalar arguments taken into registers (SCALAR records), 3 of them
TENSOR_BASE, TENSOR_REGS = 8, 10  # tensor k: TENSOR_BASE + k * TENSOR_REGS
DERIVED_BASE = TENSOR_BASE + N_TENSORS * TENSOR_REGS  # 128: the table's own values
CONST_BASE = 160  # the form's constants, loaded at launch
N_CONSTS = NREG - CONST_BASE

# the offsets inside a tensor block
T_PTR, T_SIZE, T_STRIDE, T_END = 0, 1, 5, 9

# opcodes
OP_TENSOR = 1  # [1] slot, [2] rank, [3] flags, [4] dtype code, [5] device, [6] itemsize,
#                [7] pointer alignment (bytes), [8..11] the register each size must equal
#                (-1: none), [12] stride alignment (elements)
OP_ABSENT = 2  # a: bit mask of argument slots that must be None
OP_SCALAR = 3  # [1] scalar index, [2] dst, [3] lo register, [4] hi register: an int in [lo, hi]
OP_EQ = 4  # r[[1]] == r[[2]]
OP_RANGE = 5  # [2] <= r[[1]] < [3]
OP_CHECK = 6  # bool(r[[1]]) == bool([2])
OP_APART = 7  # tensor [1] shares no byte with the tensors of mask [2], unless an exact alias
#               (same pointer, outer strides) of one in mask [3]
OP_ARITH = 8  # r[[1]] = fn [2] of r[[3]] and r[[4]] ([4] < 0: the constant [5])
OP_DONE_IF_ZERO = 9  # r[[1]] == 0: the call is taken, nothing to launch
OP_KEY = 10  # [1] the T register, [2] count, [3..] the registers of the rest of the form key
OP_DISTINCT = 11  # tensor [1]'s [n0, n1, inner] elements distinct; [2] the inner dim (-1: 1)
OP_ALLOC = 12  # result [1] is a new tensor (allocator [2]) read into tensor block [3]: rank [4]

# tensor flags
F_TRANSPOSE = 1  # a 2-D [H, T] tensor read as its [T, H] transpose
F_OUTPUT = 2  # writable, elements distinct
F_UNIT_INNER = 4  # the last stride is 1 unless the last size is 1
F_ALIGN = 8  # pointer and strides OR-ed into R_MISALIGN (by g bytes and h elements)
F_INNER_IN_ALIGN = 16  # the last size too (the vector's inner extent)

# arithmetic
A_ADD, A_SUB, A_MUL, A_DIV, A_MOD, A_OR, A_AND, A_EQ, A_LT, A_NE, A_MAX, A_GT = range(12)
_ARITH = {
    A_ADD: lambda x, y: x + y,
    A_SUB: lambda x, y: x - y,
    A_MUL: lambda x, y: x * y,
    A_DIV: lambda x, y: x // y if y else 0,
    A_MOD: lambda x, y: x % y if y else 0,
    A_OR: lambda x, y: x | y,
    A_AND: lambda x, y: x & y,
    A_EQ: lambda x, y: int(x == y),
    A_LT: lambda x, y: int(x < y),
    A_NE: lambda x, y: int(x != y),
    A_MAX: lambda x, y: max(x, y),
    A_GT: lambda x, y: int(x > y),
}

# DLPack dtype codes (code | bits << 8 | lanes << 16)
_DL = {
    "float16": (2, 16),
    "bfloat16": (4, 16),
    "float32": (2, 32),
    "float64": (2, 64),
    "float8_e4m3fn": (10, 8),
    "int32": (0, 32),
    "int64": (0, 64),
    "uint8": (1, 8),
    "bool": (6, 8),
}


def dl_code(dtype_name: str) -> int:
    code, bits = _DL[dtype_name]
    return code | bits << 8 | 1 << 16


def tensor_base(k: int) -> int:
    return TENSOR_BASE + k * TENSOR_REGS


class Entry:
    """One form of a bound call: what a launch for the Ts of ``[t_lo, t_hi)`` and one rest of
    the key needs. ``srcs``: the register of each kernel parameter in order (constants sit in
    ``CONST_BASE + i``, ``consts[i]``); ``pack``: the records of the compiled executor
    ``(offset, bytes, register)``."""

    __slots__ = (
        "launcher", "kernel", "handle", "context", "block", "grid", "per_token", "run_tail",
        "run_spans", "srcs", "getter", "consts", "nbytes", "t_lo", "t_hi", "pack", "const_bits", "cap",
    )  # fmt: skip


class BoundCall:
    """The table of one signature, and what its executors keep beside it (the Python
    executor's dtypes, the forms met so far, the plan that resolves a new form)."""

    __slots__ = (
        "records", "steps", "dtypes", "torch_type", "device", "n_slots", "resolve", "forms", "stream",
        "table", "name", "c_state", "result", "allocators", "c_ok",
    )  # fmt: skip

    def __init__(self, name: str, records: list[tuple[int, ...]], dtypes: list, torch_type: type,
                 device: int, n_slots: int, resolve: Any, stream: Any, result: tuple = (),
                 allocators: tuple = ()) -> None:  # fmt: skip
        self.name = name
        self.result = result  # the argument slots the call returns (an allocated one in its place)
        self.allocators = allocators  # (T, H, D) -> a new output
        self.records = tuple(tuple(r) + (0,) * (RECORD - len(r)) for r in records)
        self.dtypes = dtypes  # per TENSOR record: the producer's dtype object
        self.torch_type = torch_type
        self.device = device
        self.n_slots = n_slots
        self.resolve = resolve  # (T, rest of the key) -> Entry
        self.forms: dict = {}
        self.stream = stream
        self.c_state = None  # the compiled executor's own cache (its forms met so far)
        # the compiled executor takes torch signatures (DLPack's C exchange API on the type)
        self.c_ok = torch_type is not None and hasattr(torch_type, "__dlpack_c_exchange_api__")
        self.steps = _decode(self.records)
        self.table = b"".join(int(x).to_bytes(8, "little", signed=True) for r in self.records for x in r)

    def entry(self, T: int, rest: tuple) -> Entry:
        key = (T, *rest)
        e = self.forms.get(key)
        if e is None:
            if len(self.forms) >= 4096:
                self.forms.clear()
            e = self.forms[key] = self.resolve(T, rest)
        return e


def _decode(records: tuple) -> tuple:
    """The records as ``(opcode, record)`` pairs with the TENSOR records numbered."""
    steps, k = [], 0
    for r in records:
        if r[0] == OP_TENSOR:
            steps.append((OP_TENSOR, r, k))
            k += 1
        else:
            steps.append((r[0], r, 0))
    return tuple(steps)


class Launches:
    """Where launches go: the driver, or a recorder (``zerokv.testing``)."""

    recorder: Any = None


def run(bc: BoundCall, objs: tuple, scalars: tuple) -> Any:
    """The Python executor: the call's result (the objects of ``bc.result``, an allocated
    output in its place) when the call was taken (launched, or nothing to launch); None when
    the full path must see it."""
    r = [0] * NREG
    r[R_ONE] = 1
    tt = bc.torch_type
    gen = tt is _Generic
    dtypes = bc.dtypes
    dev = bc.device
    made = None
    try:
        for op, rec, k in bc.steps:
            if op == OP_TENSOR:
                x = objs[rec[1]]
                if gen:
                    x = generic(x)
                if type(x) is not tt or x.dtype != dtypes[k] or x.get_device() != dev:
                    return None
                shape = x.shape
                rank = rec[2]
                if len(shape) != rank:
                    return None
                st = x.stride()
                flags = rec[3]
                if flags & F_TRANSPOSE:
                    shape, st = shape[::-1], st[::-1]
                base = TENSOR_BASE + k * TENSOR_REGS
                p = r[base] = x.data_ptr()
                span, empty, sor = 1, False, 0
                for i in range(rank):
                    n, s = shape[i], st[i]
                    eq = rec[8 + i]
                    if eq >= 0 and r[eq] != n:
                        return None
                    r[base + 1 + i] = n
                    r[base + 5 + i] = s
                    sor |= s
                    if n == 0:
                        empty = True
                    else:
                        span += (n - 1) * s
                if sor < 0:
                    return None
                r[R_STOR] |= sor
                if empty:
                    span = 0
                r[base + T_END] = p + span * rec[6]
                if span > r[R_WIDEST]:
                    r[R_WIDEST] = span
                if flags & F_UNIT_INNER and shape[rank - 1] > 1 and st[rank - 1] != 1:
                    return None
                if flags & F_ALIGN:  # pointer by rec[7] bytes, outer strides (and D) by rec[12]
                    outer = shape[rank - 1] if flags & F_INNER_IN_ALIGN else 0
                    for i in range(rank - 1):
                        outer |= st[i]
                    r[R_MISALIGN] |= p % rec[7] | outer % rec[12]
                if flags & F_OUTPUT and not _writable(x):
                    return None
            elif op == OP_ABSENT:
                m, i, n = rec[1], 0, len(objs)
                while m and i < n:
                    if m & 1 and objs[i] is not None:
                        return None
                    m >>= 1
                    i += 1
            elif op == OP_EQ:
                if r[rec[1]] != r[rec[2]]:
                    return None
            elif op == OP_RANGE:
                if not rec[2] <= r[rec[1]] < rec[3]:
                    return None
            elif op == OP_CHECK:
                if bool(r[rec[1]]) != bool(rec[2]):
                    return None
            elif op == OP_ARITH:
                y = r[rec[4]] if rec[4] >= 0 else rec[5]
                r[rec[1]] = _ARITH[rec[2]](r[rec[3]], y)
            elif op == OP_APART:
                if not _apart(r, rec[1], rec[2], rec[3]):
                    return None
            elif op == OP_DISTINCT:
                a = TENSOR_BASE + rec[1] * TENSOR_REGS
                inner = r[a + 1 + rec[2]] if rec[2] >= 0 else 1
                if not distinct(r[a + 1], r[a + T_STRIDE], r[a + 2], r[a + T_STRIDE + 1], inner):
                    return None
            elif op == OP_SCALAR:
                v = scalars[rec[1]]
                if type(v) is not int or not r[rec[3]] <= v <= r[rec[4]]:
                    return None
                r[rec[2]] = v
            elif op == OP_ALLOC:
                if made is None:
                    made = {}
                made[rec[1]] = _alloc(bc, r, rec, objs[0])
            elif op == OP_DONE_IF_ZERO:
                if not r[rec[1]]:
                    return _result(bc, objs, made)
            elif op == OP_KEY:
                T = r[rec[1]]
                rest = tuple([r[i] for i in rec[3 : 3 + rec[2]]])
                e = bc.forms.get((T, *rest)) or bc.entry(T, rest)
                _launch(bc, e, r, T)
                return _result(bc, objs, made)
    except (AttributeError, TypeError, ValueError, RuntimeError, IndexError):
        return None
    return None  # pragma: no cover - every table ends with its key


def _result(bc: BoundCall, objs: tuple, made: dict | None) -> Any:
    if not bc.result:
        return True
    if made is None:
        return tuple([objs[i] for i in bc.result])
    return tuple([made[i] if i in made else objs[i] for i in bc.result])


def _apart(r: list, k: int, mask: int, exact: int) -> bool:
    """Tensor ``k`` shares no byte with a tensor of ``mask``, or is an exact alias of one in
    ``exact`` (same pointer and outer strides)."""
    a = TENSOR_BASE + k * TENSOR_REGS
    lo, hi = r[a], r[a + T_END]
    j = 0
    while mask:
        if mask & 1:
            b = TENSOR_BASE + j * TENSOR_REGS
            if (
                r[b] < hi
                and lo < r[b + T_END]
                and not (
                    exact >> j & 1
                    and r[b] == lo
                    and r[b + T_STRIDE] == r[a + T_STRIDE]
                    and r[b + T_STRIDE + 1] == r[a + T_STRIDE + 1]
                )
            ):
                return False
        mask >>= 1
        j += 1
    return True


def _alloc(bc: BoundCall, r: list, rec: tuple, like: Any) -> Any:
    """A new contiguous output of the shape in registers ``rec[5:5 + rank]``, read into its
    tensor block (row-major strides)."""
    rank = rec[4]
    shape = tuple([r[rec[5 + i]] for i in range(rank)])
    x, r[TENSOR_BASE + rec[3] * TENSOR_REGS] = bc.allocators[rec[2]](shape, like)
    base = TENSOR_BASE + rec[3] * TENSOR_REGS
    stride = 1
    for i in range(rank - 1, -1, -1):
        r[base + 1 + i] = shape[i]
        r[base + T_STRIDE + i] = stride
        stride *= shape[i]
    return x


def _writable(x: Any) -> bool:
    if type(x) is _Generic:
        return writable_cheap(x.obj)
    return (not x.requires_grad and not x.is_inference()) or writable_cheap(x)


def _launch(bc: BoundCall, e: Entry, r: list, T: int) -> bool:
    r[CONST_BASE : CONST_BASE + len(e.consts)] = e.consts
    pt = e.per_token
    if pt:
        grid = -(-T * pt // e.block)
        if e.cap:
            grid = min(grid, e.cap)
        elif e.run_tail:
            grid -= max(0, (grid - e.run_tail) // e.run_spans) * (e.run_spans - 1)
        grid_y = 1
    else:
        grid, grid_y = e.grid, T
    e.launcher.launch_values(grid, grid_y, bc.stream(bc.device), e.getter(r))
    return True


def make_entry(launcher: Any, form: Any, t_lo: int, t_hi: int, regs: dict[str, int], consts: dict) -> Entry:
    """The entry of ``form`` (a ``forms.Form``) for Ts in ``[t_lo, t_hi)``: each of its
    kernel's parameters from the register ``regs[name]``, else the form's field of that name,
    else the plan's constant ``consts[name]``."""
    from .kernels import CTYPES

    e = Entry()
    e.launcher, e.kernel = launcher, form.kernel
    e.handle = getattr(launcher, "handle", 0)
    e.context = getattr(launcher, "context", 0)
    e.block = form.kernel.block
    e.grid, e.per_token, e.run_tail, e.cap = form.grid, form.per_token, form.run_tail, form.cap
    from .kernels import A_RUN_SPANS

    e.run_spans = A_RUN_SPANS
    e.t_lo, e.t_hi = t_lo, t_hi
    srcs, cvals, pack, bits, offset = [], [], [], [], 0
    for name, ctype in form.kernel.params:
        size = CTYPES[ctype][1]
        offset += -offset % size
        if name in regs:
            src = regs[name]
        else:
            v = getattr(form, name) if name in form._fields else consts[name]
            src = CONST_BASE + len(cvals)
            cvals.append(v)
            bits.append(_bits(v, ctype))
        srcs.append(src)
        pack.append((offset, size | (4 if ctype == "f32" else 0) << 8, src))
        offset += size
    if len(cvals) > N_CONSTS:
        raise RuntimeError(f"zerokv: {form.kernel.name} has more constants than registers")
    e.srcs, e.consts, e.const_bits, e.pack = tuple(srcs), tuple(cvals), tuple(bits), tuple(pack)
    e.getter = itemgetter(*srcs) if len(srcs) > 1 else (lambda r, i=srcs[0]: (r[i],))
    e.nbytes = offset + (-offset % 8)
    return e


def _bits(v: Any, ctype: str) -> int:
    """A constant's bits as the compiled executor writes them (f32 as its IEEE bits)."""
    if ctype == "f32":
        import struct

        return struct.unpack("<I", struct.pack("<f", v))[0]
    return int(v)


def fits32(x: int) -> bool:
    return x < INT32
