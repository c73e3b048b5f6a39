"""Deriving a signature's bound call (:mod:`zerokv.core.bound`) from its op's spec.

:class:`Table` writes the records every op shares from the spec's rows: each given tensor's
read (producer, dtype, device, rank, shapes by symbol, unit inner stride, the vector
alignment of the signature), which arguments are absent, outputs' distinct elements and their
separation from every other tensor (or an exact alias where the spec allows one). The op's
plan adds what is its own (the form key's terms) and names the registers its kernels'
parameters read.
"""

from __future__ import annotations

from typing import Any

from . import bound as B
from . import dtypes as _dtypes
from .generic_tensors import _Generic, generic
from .layout import INT32, VECTOR_BYTES
from .spec import Arg, OpSpec
from .tensors import torch_dtype_names, torch_tensor_type


class Table:
    """A bound call's records in the making, with its register names."""

    def __init__(self) -> None:
        self.records: list[tuple[int, ...]] = []
        self.dtypes: list[Any] = []
        self.regs: dict[str, int] = {}  # kernel parameter or symbol -> register
        self.sym: dict[str, int] = {}
        self.tensor: dict[str, int] = {}  # argument name -> tensor block
        self.next_reg = B.DERIVED_BASE
        self.n_tensors = 0

    def reg(self) -> int:
        r = self.next_reg
        if r >= B.CONST_BASE:
            raise RuntimeError("zerokv: a bound call needs more registers than it has")
        self.next_reg += 1
        return r

    def arith(self, fn: int, a: int, b: int | None = None, k: int = 0, dst: int | None = None) -> int:
        d = self.reg() if dst is None else dst
        self.records.append((B.OP_ARITH, d, fn, a, -1 if b is None else b, k))
        return d

    def add(self, *rec: int) -> None:
        self.records.append(rec)

    def args(
        self, spec: OpSpec, objs: tuple, plan: Any, lse_ht: bool = False, scalars: dict | None = None
    ) -> None:
        """The records of the spec's tensor arguments as ``objs`` (the signature's first call,
        fully validated) gives them; absent ones must stay absent. ``scalars``: the values of
        the scalar arguments a shape divides by (fixed by the signature)."""
        absent, seen, outputs = 0, 0, []
        width = VECTOR_BYTES // plan.in_size
        for slot, arg in enumerate(spec.all_args()):
            x = objs[slot] if slot < len(objs) else None
            if x is None:
                absent |= 1 << slot
                for p in arg.params:
                    self.regs.setdefault(p, B.R_ZERO)
                continue
            k = self.tensor[arg.name] = self.allocated(arg)
            base = B.tensor_base(k)
            shape = ("1",) * len(x.shape) if arg.any_shape else arg.shape
            eqs, binds, divided = [], [], []
            for i, s in enumerate(shape):
                if s == "1":
                    eqs.append(B.R_ONE)
                elif s.endswith("+1") and s[:-2] in self.sym:  # one more than a bound symbol
                    eqs.append(self.arith(B.A_ADD, self.sym[s[:-2]], k=1))
                elif s.endswith("+1"):  # binds the symbol as this size less one
                    binds.append((s[:-2], base + 1 + i))
                    eqs.append(-1)
                elif "/" in s:  # X*Y/scalar: this size times the scalar is X*Y
                    divided.append((s, base + 1 + i))
                    eqs.append(-1)
                elif s in self.sym:
                    eqs.append(self.sym[s])
                else:
                    self.sym[s] = base + 1 + i
                    eqs.append(-1)
            flags = (B.F_OUTPUT if arg.output else 0) | (B.F_UNIT_INNER if arg.unit_inner else 0)
            if arg.lse and lse_ht:
                flags |= B.F_TRANSPOSE
            dt = x.dtype if plan.torch else generic(x).dtype  # what a later call's tensor reports
            dname = torch_dtype_names()[dt] if plan.torch else dt
            size = _dtypes.itemsize(dname)
            align, w = 1, 1
            if arg.vector:
                flags |= B.F_ALIGN | B.F_INNER_IN_ALIGN
                align, w = width * size, width
            self.dtypes.append(dt)
            self.add(
                B.OP_TENSOR, slot, len(shape), flags, _dtypes.dlpack_code(dname), plan.device, size, align,
                *(eqs + [-1] * (4 - len(eqs))), w,
            )  # fmt: skip
            for sym, r in binds:
                self.sym[sym] = self.arith(B.A_SUB, r, k=1)
            for s, r in divided:
                product, scalar = s.split("/")
                x, *ys = (self.sym[y] for y in product.split("*"))
                for y in ys:
                    x = self.arith(B.A_MUL, x, y)
                self.add(B.OP_EQ, self.arith(B.A_MUL, r, k=scalars[scalar]), x)
            if arg.output:
                outputs.append((k, arg, len(shape)))
            else:
                seen |= 1 << k
        given = {o.name for o in spec.options if any(a.name in self.tensor for a in o.args)}
        for p in (p for o in spec.options if o.name not in given for p in o.params):
            self.regs.setdefault(p, B.R_ZERO)  # an option not given: its kernel parameters are 0
        self.add(B.OP_ABSENT, absent)
        no_alias = {x for o in spec.options if o.name in given for x in o.no_alias}
        for k, arg, rank in outputs:
            exact = 0
            for name in () if arg.name in no_alias else arg.alias:  # an exact alias keeps the element type
                j = self.tensor.get(name)
                if j is not None and self.dtypes[j] == self.dtypes[k]:
                    exact |= 1 << j
            self.add(B.OP_DISTINCT, k, 2 if rank == 3 and arg.unit_inner else -1)
            self.add(B.OP_APART, k, seen, exact)
            seen |= 1 << k
        self.add(B.OP_CHECK, B.R_MISALIGN, int(plan.vec == 1))
        for p, r in self.sym.items():
            self.regs.setdefault(p, r)
        for p, s in spec.sym_params:  # a symbol's size as a kernel parameter (0 when not bound)
            self.regs[p] = self.sym.get(s, B.R_ZERO)

    def allocated(self, arg: Arg) -> int:
        """A tensor block for ``arg`` (given, or an output the call leaves None: the op allocates
        it), its kernel parameters' registers named as the spec names them."""
        k = self.n_tensors
        self.n_tensors += 1
        base = B.tensor_base(k)
        for i, p in enumerate(arg.params):  # the pointer, then the strides (cp_merge's: none)
            self.regs[p] = base + B.T_STRIDE + i - 1 if i else base + B.T_PTR
        return k

    def positive(self, *names: str) -> None:
        """Each symbol in ``[1, 2^31)`` (zero-size calls take the full path: no launch)."""
        for n in names:
            self.add(B.OP_RANGE, self.sym[n], 1, INT32)

    def bound(self, name: str, plan: Any, n_slots: int, resolve: Any, result: tuple = (),
              allocators: tuple = (), params: Any = None) -> B.BoundCall:  # fmt: skip
        """The bound call of the records; ``params``: the registers ``resolve``'s entries read
        their kernels' parameters from (None: any register)."""
        return B.BoundCall(
            name, self.records, self.dtypes, plan.tensor_type, plan.device, n_slots, resolve, plan.stream,
            result, allocators, params,
        )  # fmt: skip


def family(plan: Any, objs: tuple) -> type | None:
    """The type a signature's tensors have on its later calls (torch's tensor type, or the
    generic record of another producer), set on ``plan``; None for torch beside another
    producer (no bound call: the full path takes those)."""
    if plan.torch:
        plan.tensor_type = torch_tensor_type()
    elif any(type(generic(x)) is not _Generic for x in objs if x is not None):
        plan.tensor_type = None
    else:
        plan.tensor_type = _Generic
    return plan.tensor_type


def entry_for(regs: dict, plan: Any, form: Any, launcher: Any, lo: int, hi: int) -> B.Entry:
    """The bound call's entry of ``form`` for the Ts of its interval ``[lo, hi)`` (the plan's
    ``form_entry``)."""
    consts = {n: getattr(plan.consts, n) for n in plan.consts.__slots__ if hasattr(plan.consts, n)}
    return B.make_entry(launcher, form, lo, hi, regs, consts)
