"""The bound call of a signature: a table of integers that an executor runs on each later call.

A signature's first call is fully validated; then its bound call is built from the op's spec
(:mod:`zerokv.core.spec`): fixed-size records of integers saying what a later call must check
(which arguments are given, producer, dtype, device, rank, shapes, unit strides, alignment,
writable outputs whose elements are distinct and that share no byte with another tensor or
alias one exactly) and which registers hold the values the form key and the kernel's
parameters read. Two executors run the same table: the compiled one (``launcher.c``) and the
Python one (:mod:`zerokv.core.pyexec`). A call the table does not take returns False and goes to the full
validation, which raises with the caller's names or builds the call's own signature.

Registers are 64-bit integers: ``R_ZERO``/``R_ONE`` constants, accumulators, scalar arguments,
each tensor's block (``tensor_base(k)``: pointer, 4 sizes, 4 strides in elements, end byte),
then values derived by the table's arithmetic and, at launch, the form's constants.
"""

from __future__ import annotations

import struct
from typing import Any

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

# arithmetic (comparisons give 1 or 0)
A_ADD, A_SUB, A_MUL, A_OR, A_AND, A_EQ, A_LT, A_NE, A_MAX, A_GT = range(10)


def tensor_base(k: int) -> int:
    return TENSOR_BASE + k * TENSOR_REGS


class Entry:
    """One form of a bound call: what a launch for the Ts of ``[t_lo, t_hi)`` and one rest of
    the key needs. ``srcs``: the register of each kernel parameter in order (constants sit in
    ``CONST_BASE + i``, ``consts[i]``); ``pack``: the records of the compiled executor
    ``(offset, bytes, register)``."""

    __slots__ = (
        "launcher", "kernel", "handle", "context", "block", "grid", "per_token", "run_tail",
        "run_spans", "srcs", "consts", "nbytes", "t_lo", "t_hi", "pack", "const_bits", "cap", "form",
    )  # fmt: skip


class BoundCall:
    """The table of one signature, and what its executors keep beside it (the Python
    executor's dtypes, the forms met so far, the plan that resolves a new form)."""

    __slots__ = (
        "records", "steps", "dtypes", "torch_type", "device", "n_slots", "resolve", "forms", "stream",
        "table", "name", "c_state", "result", "allocators", "c_ok", "params",
    )  # fmt: skip

    def __init__(self, name: str, records: list[tuple[int, ...]], dtypes: list, torch_type: type,
                 device: int, n_slots: int, resolve: Any, stream: Any, result: tuple = (),
                 allocators: tuple = (), params: Any = None) -> None:  # fmt: skip
        self.name = name
        self.result = result  # the argument slots the call returns (an allocated one in its place)
        self.allocators = allocators  # (T, H, D) -> a new output
        # the registers the kernels' parameters are read from (None: any register)
        self.params = None if params is None else frozenset(params)
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
        self.steps = None  # the Python executor's functions of the records (pyexec)
        self.table = b"".join(int(x).to_bytes(8, "little", signed=True) for r in self.records for x in r)

    def entry(self, T: int, rest: tuple) -> Entry:
        key = (T, *rest)
        e = self.forms.get(key)
        if e is None:
            if len(self.forms) >= 4096:
                self.forms.clear()
            e = self.forms[key] = self.resolve(T, rest)
        return e


def make_entry(launcher: Any, form: Any, t_lo: int, t_hi: int, regs: dict[str, int], consts: dict) -> Entry:
    """The entry of ``form`` (a ``forms.Form``) for Ts in ``[t_lo, t_hi)``: each of its
    kernel's parameters from the register ``regs[name]``, else the form's field of that name,
    else the plan's constant ``consts[name]``."""
    from .kernels import A_RUN_SPANS, CTYPES

    e = Entry()
    e.launcher, e.kernel, e.form = launcher, form.kernel, form  # its grid: forms.launch_grid
    e.handle = getattr(launcher, "handle", 0)
    e.context = getattr(launcher, "context", 0)
    e.block = form.kernel.block
    e.grid, e.per_token, e.run_tail, e.cap = form.grid, form.per_token, form.run_tail, form.cap
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
            bits.append(
                struct.unpack("<I", struct.pack("<f", v))[0] if ctype == "f32" else int(v)
            )  # f32: its IEEE bits
        srcs.append(src)
        pack.append((offset, size | (4 if ctype == "f32" else 0) << 8, src))
        offset += size
    if len(cvals) > N_CONSTS:
        raise RuntimeError(f"zerokv: {form.kernel.name} has more constants than registers")
    e.srcs, e.consts, e.const_bits, e.pack = tuple(srcs), tuple(cvals), tuple(bits), tuple(pack)
    e.nbytes = offset + (-offset % 8)
    return e
