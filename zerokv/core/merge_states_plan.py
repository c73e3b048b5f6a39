"""merge_states' path: as the two-way merge's (:mod:`zerokv.core.merge_plans`), its plan
built on the first call of a signature, its outputs never overlapping its inputs."""

from __future__ import annotations

from typing import Any

from . import binding as _binding
from . import bound as _bound
from . import cpu_path as _cpu
from . import facts as _facts
from . import forms as _forms
from . import kernels as _kernels
from . import plans as _plans
from . import spec as _spec
from . import validation as _validation
from .layout import INT32
from .merge_plans import Plan, exact


def n(objs: tuple, scalars: tuple) -> tuple[Any, Any]:
    """``objs``: (v, s, out, out_lse, out_scale, sinks[, out_block_scale]); ``scalars``:
    (lse_base, allocate_lse, (quant_group, scale_format))."""
    key = ("n", scalars)
    try:  # the bound calls of the signatures met last with these scalars
        r, calls = _plans.recent_call(key, objs, ())
    except TypeError:  # an unhashable lse_base (an array): the full checks name it
        _check(objs, scalars)
        raise
    if r is not None:
        return r
    v = _check(objs, scalars)
    f = _facts.of(_spec.MERGE_STATES, v, objs)
    if f.device < 0:
        return _cpu.merge_states(v, objs[2], objs[3], scalars[1])
    plan = _plans.lookup(("n", scalars, f.sig), lambda: NPlan(f, v, scalars))
    r = _plans.plan_call(key, plan, objs, (), calls)
    return r if r is not None else plan.launch(f)


python_n = n  # the Python entry (the compiled executor's entry calls it for the calls it leaves)


def _check(objs: tuple, scalars: tuple) -> Any:
    """The full validation of a call; callers without (quant_group, scale_format): no per-group fp8."""
    quant = dict(zip(("quant_group", "scale_format"), scalars[2], strict=True)) if len(scalars) > 2 else {}
    return _validation.validate(_spec.MERGE_STATES, objs, {"lse_base": scalars[0], **quant})


class NPlan(Plan):
    """Every call of one merge_states signature; N = 2 without sinks or fp8 scale takes
    merge_state's flat forms (they move the data faster than the N-way loop)."""

    def __init__(self, f: Any, v: Any, scalars: tuple) -> None:
        """``v``: the first call's full validation."""
        self._setup(v, v.tensors["v"].dtype, v.tensors.get("out"), f.sig[-2], f.torch)
        self.plain = not v.options
        self.group = v.scalars.get("quant_group") or 0
        self.no_sinks = "sinks" not in v.options
        self.consts.ue8m0 = int(v.scalars["scale_format"] == "ue8m0")
        self.allocate_lse = scalars[1]
        self.consts.prefix_rows = 0
        self.bound = _bind_n(self, f.objs)

    def launch(self, f: Any) -> tuple[Any, Any]:
        """A checked call the bound call did not take: the exact widths of its layout (any
        layout, any sign of stride), then its launch."""
        widest, s32 = exact(_spec.MERGE_STATES, f, self)
        N, T, H, D = f.N, f.T, f.H, f.D
        out, out_lse = self.outputs(f, f.objs[2], f.objs[3], T, H, D)
        if T * H == 0:
            return out, out_lse
        tiles = f.ol_st == 1 and f.ol_sh != 1 if f.olse else f.s_st == 1 and f.s_sh != 1
        key = (T, N, H, D, widest < INT32, s32, tiles)
        form, launcher, _, _ = self.form_entry(key, H, D)
        self.fire(f if form.kernel is _kernels.MERGE_STATES else _as_two(self.in_size, f), form, launcher, T)
        return out, out_lse

    def _form(self, key: tuple) -> tuple:
        T, N, H, D, fits, s32, tiles = key
        if N == 2 and (self.plain and D or self.group and self.no_sinks):  # two states: the flat family
            c = _forms.MergeCall(
                T, H, D, self.vec, self.in_dtype, self.out_dtype, frozenset({"group_fp8"} if self.group else ()),
                False, fits, s32, tiles, quant_group=self.group,
            )  # fmt: skip
            form = (_forms.flat_options if self.group else _forms.flat_family)(c, self.dev, self.ctypes)
            if form is not None:
                return form
            if self.group:  # per-group fp8 of two states has no other form
                raise ValueError(
                    "out_block_scale: no kernel form takes this call (unaligned, past 2^31 elements)"
                )
        return _forms.merge_states(N, T, H, D, self.vec, self.dev, (*self.ctypes, self.vec), self.group)


def _as_two(isz: int, f: Any) -> Any:
    """States 0 and 1 of a two-state merge_states as a two-way merge's facts."""
    t = _facts.record(_spec.MERGE_STATE)()
    t.va, t.va_st, t.va_sh = f.v, f.v_st, f.v_sh
    t.vb, t.vb_st, t.vb_sh = f.v + f.v_sn * isz, f.v_st, f.v_sh
    t.sa, t.sa_st, t.sa_sh = f.s, f.s_st, f.s_sh
    t.sb, t.sb_st, t.sb_sh = f.s + f.s_sn * 4, f.s_st, f.s_sh
    t.out, t.out_st, t.out_sh, t.olse, t.ol_st, t.ol_sh = f.out, f.out_st, f.out_sh, f.olse, f.ol_st, f.ol_sh
    t.T, t.H, t.D, t.prefix_rows, t.rows = f.T, f.H, f.D, f.T, f.T * f.H
    t.a_cu = t.a_lens = t.a_batch = t.row_mask = t.sinks = t.out_scale = 0
    t.bscale, t.bs_st, t.bs_sg = f.bscale, f.bs_st, f.bs_sg
    return t


def _bind_n(plan: NPlan, objs: tuple) -> _bound.BoundCall | None:
    """The bound call of an N-way signature: the spec's records, the form key ``(T, N, H, D,
    spans fit 32 bits, strides fit 32 bits, LSE tiles)``, the outputs left None allocated; a
    two-way form reads states 0 and 1 (``_as_two``'s registers)."""
    if _binding.family(plan, objs) is None:
        return None
    A = _bound
    t = _binding.Table()
    t.args(_spec.MERGE_STATES, objs, plan, scalars={"quant_group": plan.group})
    N, T, H, D = (t.sym[n] for n in "NTHD")
    t.positive("N", "T", "H", "D")
    if objs[2] is None:
        t.add(A.OP_ALLOC, 2, 0, t.allocated(_spec.MERGE_STATES.args[2]), 3, T, H, D)
    if objs[3] is None and plan.allocate_lse:
        t.add(A.OP_ALLOC, 3, 1, t.allocated(_spec.MERGE_STATES.args[3]), 2, T, H)
    rows = t.arith(A.A_MUL, T, H)
    widest = t.arith(A.A_MAX, A.R_WIDEST, t.arith(A.A_MUL, rows, D))
    if objs[3] is not None or plan.allocate_lse:
        l0, l1 = t.regs["ol_st"], t.regs["ol_sh"]
    else:
        l0, l1 = t.regs["s_st"], t.regs["s_sh"]
    tiles = t.arith(A.A_AND, t.arith(A.A_EQ, l0, k=1), t.arith(A.A_NE, l1, k=1))
    key = [N, H, D, t.arith(A.A_LT, widest, k=INT32), t.arith(A.A_LT, A.R_STOR, k=INT32), tiles]
    regs = dict(t.regs)
    two = {  # states 0 and 1 as a two-way form's a and b
        **regs, "va": regs["v"], "va_st": regs["v_st"], "va_sh": regs["v_sh"], "vb_st": regs["v_st"],
        "vb_sh": regs["v_sh"], "sa": regs["s"], "sa_st": regs["s_st"], "sa_sh": regs["s_sh"],
        "sb_st": regs["s_st"], "sb_sh": regs["s_sh"], "rows": rows, "prefix_rows": T,
        "vb": t.arith(A.A_ADD, regs["v"], t.arith(A.A_MUL, regs["v_sn"], k=plan.in_size)),
        "sb": t.arith(A.A_ADD, regs["s"], t.arith(A.A_MUL, regs["s_sn"], k=4)),
    }  # fmt: skip
    for name in ("a_cu", "a_lens", "a_batch", "row_mask", "sinks", "out_scale"):
        two[name] = A.R_ZERO
    t.add(A.OP_KEY, T, len(key), *key)

    def resolve(T_: int, rest: tuple) -> _bound.Entry:
        N_, H_, D_ = rest[:3]
        key_ = (T_, N_, H_, D_, *(bool(x) for x in rest[3:]))
        form, launcher, lo, hi = plan.form_entry(key_, H_, D_)
        names = regs if form.kernel is _kernels.MERGE_STATES else two
        return _binding.entry_for(names, plan, form, launcher, lo, hi)

    return t.bound("merge_states", plan, 7, resolve, (2, 3), plan.allocators, (*regs.values(), *two.values()))
