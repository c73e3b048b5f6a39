"""The empty-row ops' one path: the signature's bound call (:mod:`zerokv.core.bound`), else the
facts, the plan of the signature and the full validation; launch.

Both rules (``kernels.RULE_*``) share empty_rows_kernel; the rule and the offsets' widths are
template arguments, so they are part of the signature.
"""

from __future__ import annotations

from typing import Any

from . import binding as _binding
from . import bound as _bound
from . import cpu_path as _cpu
from . import device as _device
from . import dtypes as _dtypes
from . import facts as _facts
from . import forms as _forms
from . import kernels as _kernels
from . import plans as _plans
from . import spec as _spec
from . import validation as _validation
from .layout import INT32

_SPECS = {
    _kernels.RULE_KV_LENS_ZERO: _spec.FIXUP_ZERO_KV_ROWS,
    _kernels.RULE_CONTEXT_SPAN_EMPTY: _spec.MASK_EMPTY_CONTEXT,
}


def run(rule: int, objs: tuple, names: tuple[str, ...] | None) -> None:
    """``objs``: (out, lse, cu_q, lens); ``names``: how the caller calls them (messages). The
    bound calls of recent signatures first, else the full validation, then the plan of the
    call's signature: its bound call, or the launch of the checked call."""
    key = ("empty_rows", rule)
    done, calls = _plans.recent_call(key, objs, ())  # the bound calls of the signatures met last
    if done:
        return
    c = validate(objs, rule, names)
    f = _facts.of(_SPECS[rule], c, objs)
    if f.device < 0:
        _cpu.empty_rows(c, rule_offsets=rule == _kernels.RULE_CONTEXT_SPAN_EMPTY)
        return
    plan = _plans.lookup(("empty_rows", rule, f.sig), lambda: Plan(f, c, rule))
    if not _plans.plan_call(key, plan, objs, (), calls):
        plan.launch(f)


python_run = run  # the Python entry (the compiled executor's entry calls it for the calls it leaves)


def validate(objs: tuple, rule: int, names: tuple[str, ...] | None) -> _validation.Checked:
    """Every check of an empty-rows call (its spec's), with the caller's names (out, lse, cu,
    lens; None: the spec's)."""
    spec = _SPECS[rule]
    shown = dict(zip((a.name for a in spec.args), names, strict=True)) if names else None
    return _validation.validate(spec, objs, shown=shown)


class Consts:
    __slots__ = ("q_is64",)


class Plan:
    """Every call of one empty-rows signature: the instantiation and the offsets' widths."""

    def __init__(self, f: Any, c: _validation.Checked, rule: int) -> None:
        """``c``: the first call's full validation."""
        o, cu = c.tensors["out"], c.tensors["cu_seqlens_q"]
        lens = c.tensors["cu_seqlens_kv" if rule == _kernels.RULE_CONTEXT_SPAN_EMPTY else "kv_lens"]
        self.device = c.device
        self.vec = _kernels.vec(o.dtype) if f.sig[-2] else 1
        self.consts = Consts()
        self.consts.q_is64 = int(cu.dtype == "int64")
        targs = (_dtypes.ctype(o.dtype), self.vec, rule, int(lens.dtype == "int64"))
        self.launcher = _plans.launcher(_kernels.EMPTY_ROWS, targs, self.device)
        self.get = _kernels.EMPTY_ROWS.getter(_facts.record(_SPECS[rule]), Consts)
        self.dev = _forms.Device(_device.sm_count(self.device), _device.l2_bytes(self.device))
        self.stream = _device.torch_stream if f.torch else _device.cupy_stream
        self.torch, self.in_size, self.targs = f.torch, _dtypes.itemsize(o.dtype), targs
        self.bound = _bind(self, f.objs, rule, targs)

    def launch(self, f: Any) -> None:
        """A checked call the bound call did not take: its launch."""
        T, H, D = f.T, f.H, f.D
        if f.batch == 0 or T * H == 0:
            return
        f.flat = int(f.out_sh == D and f.out_st == H * D)
        grid, _ = _forms.launch_grid(_forms.empty_rows_form(H, D, self.vec, self.dev, self.targs), T)
        self.launcher.launch_values(grid, 1, self.stream(self.device), self.get(f, self.consts))


def _bind(plan: Plan, objs: tuple, rule: int, targs: tuple) -> _bound.BoundCall | None:
    """The bound call of an empty-rows signature: the spec's records; nothing to launch when no
    row or no request; the form of ``(H, D)`` serves every T."""
    if _binding.family(plan, objs) is None:
        return None
    A = _bound
    t = _binding.Table()
    spec = _SPECS[rule]
    t.args(spec, objs, plan)
    T, H, D = t.sym["T"], t.sym["H"], t.sym["D"]
    t.add(A.OP_RANGE, T, 0, INT32)
    t.add(A.OP_DONE_IF_ZERO, t.arith(A.A_MUL, t.arith(A.A_MUL, T, H), t.sym["B"]))
    t.add(A.OP_RANGE, D, 1, INT32)
    regs = dict(t.regs)
    hd = t.arith(A.A_MUL, H, D)
    regs["flat"] = t.arith(A.A_AND, t.arith(A.A_EQ, regs["out_sh"], D), t.arith(A.A_EQ, regs["out_st"], hd))
    t.add(A.OP_KEY, T, 2, H, D)

    def resolve(T_: int, rest: tuple) -> _bound.Entry:
        H_, D_ = rest
        form = _forms.empty_rows_form(H_, D_, plan.vec, plan.dev, targs)
        return _bound.make_entry(plan.launcher, form, 0, INT32, regs, {"q_is64": plan.consts.q_is64})

    return t.bound(spec.name, plan, 4, resolve, params=regs.values())
