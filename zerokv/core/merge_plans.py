"""The two-way merge's one path: the bound call of the call's signature (:mod:`zerokv.core.bound`,
derived from the spec: read, cheap check, form, pack by name, launch), found among the recent
ones of the call's scalar arguments; else the full validation (:mod:`zerokv.core.validation`),
which raises with the caller's argument names, then the plan of the call's signature (built
on its first call) by its facts (:mod:`zerokv.core.facts`): its bound call, or, for a call that
takes none (a negative stride, say), the launch from the facts. Host tensors take the CPU
path after the same validation.
"""

from __future__ import annotations

import sys
from typing import Any

from . import binding as _binding
from . import bound as _bound
from . import checks as _checks
from . import cpu_path as _cpu
from . import device as _device
from . import dtypes as _dtypes
from . import entry_args as _entry
from . import facts as _facts
from . import forms as _forms
from . import kernels as _kernels
from . import outputs as _outputs
from . import plans as _plans
from . import spec as _spec
from . import validation as _validation
from .generic_tensors import generic
from .layout import INT32, extent, vec

_FORM_CACHE_LIMIT = 4096  # (H, D, layout) entries a plan remembers; past it, it starts again


class Consts:
    """A plan's launch parameters that hold for every call of its signature."""

    __slots__ = ("k", "inv_k", "suffix_verbatim", "a_is64", "prefix_rows", "ue8m0")


_getters: dict = {}


def getter(kernel: Any) -> Any:
    """``get(facts, form, plan constants)``: ``kernel``'s parameters by name, in its order, from
    merge_states' facts for its own kernel, else from a two-way merge's."""
    g = _getters.get(kernel.name)
    if g is None:
        spec = _spec.MERGE_STATES if kernel is _kernels.MERGE_STATES else _spec.MERGE_STATE
        g = _getters[kernel.name] = kernel.getter(_facts.record(spec), _forms.Form, Consts)
    return g


class Plan:
    """What both merge plans share: the device, element types, constants and form cache."""

    def _setup(self, v: Any, in_dtype: str, o: Any, aligned: bool, torch: bool) -> None:
        """``v``: the first call's :class:`~zerokv.core.validation.Checked`."""
        self.device = v.device
        self.in_dtype = in_dtype
        self.out_dtype = o.dtype if o is not None else in_dtype
        self.in_size, self.out_size = _dtypes.itemsize(in_dtype), _dtypes.itemsize(self.out_dtype)
        self.vec = vec(self.in_size) if aligned else 1
        self.ctypes = (_dtypes.ctype(in_dtype), _dtypes.ctype(self.out_dtype))
        self.dev = _forms.Device(_device.sm_count(self.device), _device.l2_bytes(self.device))
        self.intervals: dict = {}  # (H, D, layout) -> (t_breaks, {interval: entry})
        c = self.consts = Consts()
        c.k, c.inv_k = _checks.LSE_BASES[v.scalars["lse_base"]]
        c.suffix_verbatim = c.a_is64 = c.ue8m0 = 0
        self.torch = torch
        self.stream = _device.torch_stream if torch else _device.cupy_stream
        if torch:
            t = sys.modules["torch"]
            self.t_out = getattr(t, self.out_dtype)
            self.t_f32, self.empty = t.float32, t.empty
            # a device object, and sizes passed one by one below: torch parses both fastest
            self.alloc_device = t.device("cuda", self.device) if self.device >= 0 else t.device("cpu")
        self.allocators = (_allocator(self, False), _allocator(self, True))

    def outputs(self, f: Any, out: Any, out_lse: Any, T: int, H: int, D: int) -> tuple[Any, Any]:
        """The call's outputs, those it left as None allocated (the LSE only where the signature
        asks for it), their facts written into ``f``."""
        if out is None:
            out, f.out = self.allocators[0]((T, H, D), f.objs[0])
            f.out_st, f.out_sh = H * D, D
        if out_lse is None and self.allocate_lse:
            out_lse, f.olse = self.allocators[1]((T, H), f.objs[0])
            f.ol_st, f.ol_sh = H, 1
        return out, out_lse

    def form_entry(self, key: tuple, H: int, D: int) -> tuple:
        """The entry ``(form, launcher, lo, hi)`` of ``key`` (T, then the other facts that choose
        the form): one form per interval ``[lo, hi)`` of ``forms.t_breaks``, so a new T costs a
        bisection; ``self._form(key)`` on an interval's first call."""
        T, sub = key[0], key[1:]
        slot = self.intervals.get(sub)
        if slot is None:
            if len(self.intervals) >= _FORM_CACHE_LIMIT:
                self.intervals.clear()
            breaks = _forms.t_breaks(H, D, self.vec, self.in_size, self.out_size, self.dev)
            slot = self.intervals[sub] = (breaks, {})
        breaks, by_class = slot
        i = _forms.t_class(breaks, T)
        entry = by_class.get(i)
        if entry is None:
            form = self._form(key)
            lo, hi = breaks[i - 1] if i > 0 else 0, breaks[i] if i < len(breaks) else INT32
            entry = by_class[i] = (form, _plans.launcher(form.kernel, form.targs, self.device), lo, hi)
        return entry

    def fire(self, f: Any, form: Any, launcher: Any, T: int) -> None:
        """The launch of ``form`` for a checked call: its kernel's parameters by name from the
        facts ``f``, the form and the plan's constants."""
        grid, grid_y = _forms.launch_grid(form, T)
        values = getter(form.kernel)(f, form, self.consts)
        launcher.launch_values(grid, grid_y, self.stream(self.device), values)


# --- two-way -----------------------------------------------------------------------------------


def two(
    v_a, s_a, v_b, s_b, out, out_lse, lse_base, prefix_rows, a_empty, out_scale, sinks,
    row_mask=None, suffix_verbatim=False, allocate_lse=None, names=None,
    out_block_scale=None, quant_group=None, scale_format="float32", lse_ht=None, *more,
) -> tuple[Any, Any]:  # fmt: skip
    """The two-way merge of ``merge.merge_two``'s arguments (``names``: the caller's names of
    the arguments, for messages; ``out_block_scale``, ``quant_group``, ``scale_format``: the
    per-group fp8 output). ``lse_ht``: the LSEs are ``[H, T]`` tensors, read as their
    transposes; a function ``(lse, name) -> [T, H] view`` for the full checks (the adapter's
    messages). ``more``: the spec's options after those written here, in its order
    (:class:`zerokv.core.entry_args.Layout`)."""
    if a_empty is None:
        cu = lens = None
    elif type(a_empty) is tuple and len(a_empty) == 2:
        cu, lens = a_empty
    else:
        cu, lens = _entry.split(
            a_empty, _entry.OPTIONS[0], names.get("a_empty", "a_empty") if names else "a_empty"
        )
    objs = (v_a, s_a, v_b, s_b, out, out_lse, cu, lens, row_mask, out_scale, sinks)
    if out_block_scale is not None:
        objs += (out_block_scale,)
    scalars = (
        lse_base, prefix_rows is None, suffix_verbatim, out is None if allocate_lse is None else allocate_lse,
        quant_group, scale_format, lse_ht is not None,
    )  # fmt: skip
    if more:
        objs, scalars = LAYOUT.more_args(objs, scalars, more, names)
    elif _MORE_KEY:  # the options after these left out: their scalars' defaults in the key
        scalars += _MORE_KEY
    try:  # the bound calls of the signatures met last with these scalars
        r, calls = _plans.recent_call(scalars, objs, (prefix_rows,))
    except TypeError:  # an unhashable lse_base (an array): the full checks name it
        _check(objs, lse_ht, names, lse_base, prefix_rows, scalars)
        raise
    if r is not None:
        return r
    v = _check(objs, lse_ht, names, lse_base, prefix_rows, scalars)
    f = _facts.of(_spec.MERGE_STATE, v, objs)
    if f.device < 0:
        return _cpu.merge_two(v, objs[4], objs[5], scalars[3], prefix_rows, scalars[2])
    plan = _plans.lookup((scalars, f.sig), lambda: TwoPlan(f, v, scalars, lse_ht))
    r = _plans.plan_call(scalars, plan, objs, (prefix_rows,), calls)
    return r if r is not None else plan.launch(f, prefix_rows)


# The entry's arguments: two's parameters, then the spec's options after those it names; its
# key as two makes it above (the options after them add their scalars); prefix_rows its scalar
LAYOUT = _entry.Layout(
    two,
    (
        (_entry.K_VALUE, "lse_base", None), (_entry.K_IS_NONE, "prefix_rows", None),
        (_entry.K_VALUE, "suffix_verbatim", None), (_entry.K_OR_IS_NONE, "allocate_lse", "out"),
        (_entry.K_VALUE, "quant_group", None), (_entry.K_VALUE, "scale_format", None),
        (_entry.K_NOT_NONE, "lse_ht", None),
    ),
    ("prefix_rows",),
)  # fmt: skip
_MORE_KEY = LAYOUT.more_key
_opts = LAYOUT.option_scalars  # a call's option scalars (the full checks'), from its key
python_two = two  # the Python entry (the compiled executor's entry calls it for the calls it leaves)


def _check(objs: tuple, lse_ht: Any, names: dict | None, base: Any, prefix_rows: Any, scalars: tuple) -> Any:
    """The full validation of a call (its options' scalars from its key)."""
    given = dict(
        zip(_entry.OPTION_SCALARS, _opts(scalars), strict=True), lse_base=base, prefix_rows=prefix_rows
    )
    return _validation.validate(_spec.MERGE_STATE, _th_views(objs, lse_ht, names), given, names)


def _th_views(objs: tuple, lse_ht: Any, names: dict | None) -> tuple:
    """The objects with their ``[H, T]`` LSEs as ``[T, H]`` views (``lse_ht(x, name)``)."""
    if lse_ht is None:
        return objs
    n = names or {}
    v_a, s_a, v_b, s_b, out, out_lse, *rest = objs
    s_a, s_b = lse_ht(s_a, n.get("s_a", "s_a")), lse_ht(s_b, n.get("s_b", "s_b"))
    out_lse = None if out_lse is None else lse_ht(out_lse, n.get("out_lse", "out_lse"))
    return (v_a, s_a, v_b, s_b, out, out_lse, *rest)


class TwoPlan(Plan):
    """Every call of one two-way merge signature: element types, vector width, features,
    constants, and the forms met so far by (T, H, D, layout)."""

    def __init__(self, f: Any, v: Any, scalars: tuple, lse_ht: Any) -> None:
        """``v``: the first call's full validation."""
        t = v.tensors
        self._setup(v, t["v_a"].dtype, t.get("out"), f.sig[-2], f.torch)
        self.features = frozenset(o.feature for o in _spec.MERGE_STATE.options if o.name in v.options)
        self.a_empty = "a_empty" in self.features
        self.consts.suffix_verbatim = int(bool(scalars[2]))
        self.consts.a_is64 = int(self.a_empty and t["cu_seqlens_q"].dtype == "int64")
        self.consts.ue8m0 = int(v.scalars["scale_format"] == "ue8m0")
        self.quant_group = v.scalars.get("quant_group") or 0
        self.option_scalars = {n: v.scalars.get(n) for n in _entry.OPTION_SCALARS}
        self.allocate_lse = scalars[3]
        self.bound = _bind_two(self, f.objs, lse_ht is not None, scalars[1])

    def launch(self, f: Any, prefix_rows: Any) -> tuple[Any, Any]:
        """A checked call the bound call did not take: the exact widths of its layout (any
        layout, any sign of stride), then its launch."""
        T, H, D = f.T, f.H, f.D
        f.prefix_rows = T if prefix_rows is None else prefix_rows
        f.rows = T * H
        widest, s32 = exact(_spec.MERGE_STATE, f, self)
        out, out_lse = self.outputs(f, f.objs[4], f.objs[5], T, H, D)
        if T * H == 0:
            return out, out_lse
        pl = f.olse
        if pl:
            inplace, tiles = pl == f.sa or pl == f.sb, f.ol_st == 1 and f.ol_sh != 1
        else:
            inplace, tiles = False, f.sa_st == 1 and f.sa_sh != 1
        key = (T, H, D, inplace, widest < INT32, s32, tiles)
        if self.a_empty:  # its batch past the window or not (the bound call's key too)
            key += (f.a_batch > _kernels.A_WINDOW,)
        self.fire(f, *self.form_entry(key, H, D)[:2], T)
        return out, out_lse

    def _form(self, key: tuple) -> tuple:
        T, H, D, inplace, fits, s32, tiles = key[:7]
        c = _forms.MergeCall(
            T, H, D, self.vec, self.in_dtype, self.out_dtype, self.features, inplace, fits, s32, tiles,
            bool(self.consts.a_is64), self.quant_group, key[7:] == (True,),  # a_empty past the window
        )  # fmt: skip
        return _forms.merge_two(c, self.dev, self.ctypes)


def exact(spec: _spec.OpSpec, f: Any, plan: Plan) -> tuple[int, bool]:
    """The widest span in elements of the spec's own tensors the call gives (its options' not)
    and whether every stride fits 32 bits, for a call the full checks accepted (any layout, any
    sign of stride)."""
    widest, s32 = f.T * f.H * max(f.D, 1), True
    for a, x in zip(spec.args, f.objs, strict=False):
        if x is None:
            continue
        shape = tuple(getattr(f, s) for s in a.shape)
        strides = (*(getattr(f, p) for p in a.params[1:]), *(1,) * (len(shape) + 1 - len(a.params)))
        size = 4 if a.dtypes == _dtypes.LSE else plan.out_size if a.output else plan.in_size
        lo, hi = extent(getattr(f, a.params[0]), shape, strides, size)
        widest = max(widest, (hi - lo) // size)
        s32 = s32 and all(-INT32 <= s < INT32 for s in strides)
    return widest, s32


def _bind_two(plan: TwoPlan, objs: tuple, lse_ht: bool, prefix_none: bool) -> _bound.BoundCall | None:
    """The bound call of a two-way signature: the spec's records, ``prefix_rows``, the form
    key ``(T, H, D, in-place LSE, spans fit 32 bits, strides fit 32 bits, LSE tiles[, batch
    past the window])`` and the outputs left None allocated."""
    if _binding.family(plan, objs) is None:
        return None
    t = _binding.Table()
    t.args(_spec.MERGE_STATE, objs, plan, lse_ht, plan.option_scalars)
    A = _bound
    T, H, D = t.sym["T"], t.sym["H"], t.sym["D"]
    t.positive("T", "H", "D")
    if prefix_none:
        t.regs["prefix_rows"] = T
    else:
        t.regs["prefix_rows"] = pr = t.reg()
        t.add(A.OP_SCALAR, 0, pr, A.R_ZERO, T)
    t.regs["rows"] = rows = t.arith(A.A_MUL, T, H)
    if objs[4] is None:
        t.add(A.OP_ALLOC, 4, 0, t.allocated(_spec.MERGE_STATE.args[4]), 3, T, H, D)
    if objs[5] is None and plan.allocate_lse:
        t.add(A.OP_ALLOC, 5, 1, t.allocated(_spec.MERGE_STATE.args[5]), 2, T, H)
    widest = t.arith(A.A_MAX, A.R_WIDEST, t.arith(A.A_MUL, rows, D))
    if objs[5] is not None or plan.allocate_lse:
        pl, l0, l1 = t.regs["olse"], t.regs["ol_st"], t.regs["ol_sh"]
        inplace = t.arith(A.A_OR, t.arith(A.A_EQ, pl, t.regs["sa"]), t.arith(A.A_EQ, pl, t.regs["sb"]))
    else:
        l0, l1 = t.regs["sa_st"], t.regs["sa_sh"]
        inplace = A.R_ZERO
    tiles = t.arith(A.A_AND, t.arith(A.A_EQ, l0, k=1), t.arith(A.A_NE, l1, k=1))
    key = [H, D, inplace, t.arith(A.A_LT, widest, k=INT32), t.arith(A.A_LT, A.R_STOR, k=INT32), tiles]
    if plan.a_empty:  # its batch past the window or not (TwoPlan.finish's key too)
        key.append(t.arith(A.A_GT, t.sym["B"], k=_kernels.A_WINDOW))
    t.add(A.OP_KEY, T, len(key), *key)
    regs = dict(t.regs)

    def resolve(T_: int, rest: tuple) -> _bound.Entry:
        key_ = (T_, *(int(x) if i < 2 else bool(x) for i, x in enumerate(rest)))
        return _binding.entry_for(regs, plan, *plan.form_entry(key_, rest[0], rest[1]))

    return t.bound("merge_state", plan, 12, resolve, (4, 5), plan.allocators, regs.values())


def _allocator(plan: Plan, lse: bool):
    """``(shape, like) -> (output, pointer)``: a new output of the plan's family."""
    if plan.torch:
        empty, dtype, device = plan.empty, plan.t_f32 if lse else plan.t_out, plan.alloc_device

        def alloc_torch(shape: tuple, like: Any) -> tuple:
            x = empty(*shape, dtype=dtype, device=device)
            return x, x.data_ptr()

        alloc_torch.direct = (empty, dtype, device)  # the compiled executor calls empty itself
        return alloc_torch

    dtype_name = "float32" if lse else plan.out_dtype

    def alloc(shape: tuple, like: Any) -> tuple:
        x = _outputs.new(like, False, plan.device, shape, dtype_name)
        return x, generic(x).data_ptr()

    return alloc
