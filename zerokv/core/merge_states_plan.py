"""merge_states' path: as the two-way merge's (:mod:`zerokv.core.merge_plans`), its plan
built on the first call of a signature, its outputs never overlapping its inputs."""

from __future__ import annotations

from functools import partial
from typing import Any

from . import cpu_path as _cpu
from . import facts as _facts
from . import forms as _forms
from . import merge_checks as _merge_checks
from . import plans as _plans
from .layout import INT32, distinct
from .merge_plans import Plan, block_scale_check, cpu_outputs, host_only, widest_span
from .tensors import torch_tensor_type


def n(objs: tuple, scalars: tuple) -> tuple[Any, Any]:
    """``objs``: (v, s, out, out_lse, out_scale, sinks[, out_block_scale]); ``scalars``:
    (lse_base, allocate_lse, (quant_group, scale_format))."""
    f = _facts.read_n(objs)
    if f is None or f.device < 0:
        return _cpu_n(objs, scalars)
    try:
        plan = _plans.get(("n", scalars, f.sig))
    except TypeError:  # an unhashable lse_base (an array): the plan's build names it
        plan = None
    return (plan or _new_plan(f, scalars))(f, scalars)


def _new_plan(f: _facts.NFacts, scalars: tuple) -> NPlan:
    return _plans.lookup(("n", scalars, f.sig), lambda: NPlan(f, scalars))


def _quant(scalars: tuple) -> tuple:
    """(quant_group, scale_format) of the call; callers without them: no per-group fp8."""
    return scalars[2] if len(scalars) > 2 else (None, "float32")


def _cpu_n(objs: tuple, scalars: tuple) -> tuple[Any, Any]:
    v = _merge_checks.n(objs, scalars[0], _quant(scalars))
    host_only(v["device"])
    vt = v["v"]
    out, out_lse, o, ol = cpu_outputs(vt, objs[2], objs[3], v["out"], v["out_lse"], vt.shape[1:], scalars[1])
    _cpu.merge_states(v, o, ol)
    return out, out_lse


class NPlan(Plan):
    """Every call of one merge_states signature; N = 2 without sinks or fp8 scale takes
    merge_state's flat forms (they move the data faster than the N-way loop, entry 19)."""

    def __init__(self, f: _facts.NFacts, scalars: tuple) -> None:
        v = _merge_checks.n(f.objs, scalars[0], _quant(scalars))
        self._setup(v, v["v"].dtype, v["out"], f.sig[-2], f.torch)
        self.plain = v["scale"] is None and v["sinks"] is None and v["block_scale"] is None
        self.group = v["quant_group"] if v["block_scale"] is not None else 0
        self.no_sinks = v["sinks"] is None
        self.consts.ue8m0 = int(v["scale_format"] == "ue8m0")
        self.scale, self.sinks = v["scale"] is not None, v["sinks"] is not None
        self.tensor_type = torch_tensor_type()
        self.allocate_lse = scalars[1]
        self.consts.prefix_rows = 0

    def __call__(self, f: _facts.NFacts, scalars: tuple) -> tuple[Any, Any]:
        widest = self.check(f)
        if widest < 0:
            _merge_checks.n(f.objs, scalars[0], _quant(scalars))
            widest, s32 = _exact_n(f, self)
        else:
            s32 = f.strides_or < INT32
        N, T, H, D = f.N, f.T, f.H, f.D
        out, out_lse = self.outputs(f, f.objs[2], f.objs[3], T, H, D)
        if T * H == 0:
            return out, out_lse
        tiles = f.ol_st == 1 and f.ol_sh != 1 if f.olse else f.s_st == 1 and f.s_sh != 1
        key = (T, N, H, D, widest < INT32, s32, tiles)
        form, launcher, bind, adapt = self.forms.get(key) or self.form_entry(key, H, D, self._form)
        grid, grid_y = _forms.launch_grid(form, T)
        launcher.launch(
            grid, grid_y, self.stream(self.device), bind, f if adapt is None else adapt(f), form, self.consts
        )
        return out, out_lse

    def _form(self, key: tuple) -> tuple:
        T, N, H, D, fits, s32, tiles = key
        if self.group and N == 2 and self.no_sinks:  # per-group fp8, two states: the flat family
            c = _forms.MergeCall(
                T, H, D, self.vec, self.in_dtype, self.out_dtype, frozenset({"group_fp8"}), False, fits, s32,
                tiles, quant_group=self.group,
            )  # fmt: skip
            form = _forms.flat_options(c, self.dev, self.ctypes)
            if form is None:
                raise ValueError(
                    "out_block_scale: no kernel form takes this call (unaligned, past 2^31 elements)"
                )
            return form, _facts.TwoFacts, partial(_as_two, self.in_size)
        if N == 2 and self.plain and D:
            c = _forms.MergeCall(
                T, H, D, self.vec, self.in_dtype, self.out_dtype, frozenset(), False, fits, s32, tiles
            )
            form = _forms.flat_family(c, self.dev, self.ctypes)
            if form is not None:
                return form, _facts.TwoFacts, partial(_as_two, self.in_size)
        form = _forms.merge_states(N, T, H, D, self.vec, self.dev, (*self.ctypes, self.vec), self.group)
        return form, _facts.NFacts, None

    def check(self, f: _facts.NFacts) -> int:
        """As ``TwoPlan.check``; the outputs may not overlap the inputs at all (byte ends as
        layout.end and the apart tests written out)."""
        N, T, H, D = f.N, f.T, f.H, f.D
        if f.neg or not (N and T and H and D) or N >= INT32 or T >= INT32 or H >= INT32:
            return -1
        if f.s_shape != (N, T, H) or (D > 1 and f.v_in != 1):
            return -1
        isz, pv, ps, T1, H1 = self.in_size, f.v, f.s, T - 1, H - 1
        end_v = pv + ((N - 1) * f.v_sn + T1 * f.v_st + H1 * f.v_sh + D) * isz
        end_s = ps + ((N - 1) * f.s_sn + T1 * f.s_st + H1 * f.s_sh + 1) * 4
        spans = [(pv, end_v), (ps, end_s)]
        widest = T * H * D
        n = (end_v - pv) // isz
        widest = n if n > widest else widest
        n = (end_s - ps) >> 2
        widest = n if n > widest else widest
        if self.sinks:
            if f.sinks_len != H or (H > 1 and f.sinks_st != 1):
                return -1
            spans.append((f.sinks, f.sinks + 4 * H))
        if self.scale:
            if f.scale_len != 1:
                return -1
            spans.append((f.out_scale, f.out_scale + 4))
        objs, tt = f.objs, self.tensor_type
        if f.out_shape is not None:
            po, o, st0, st1 = f.out, objs[2], f.out_st, f.out_sh
            if f.out_shape != (T, H, D) or (D > 1 and f.out_in != 1):
                return -1
            if (type(o) is not tt or o.requires_grad or o.is_inference()) and not _facts.writable_cheap(o):
                return -1
            if not ((H <= 1 or st1 >= D) and (T <= 1 or st0 >= H1 * st1 + D) or distinct(T, st0, H, st1, D)):
                return -1
            end_o = po + (T1 * st0 + H1 * st1 + D) * self.out_size
            for lo, hi in spans:
                if lo < end_o and po < hi:
                    return -1
            spans.append((po, end_o))
            n = (end_o - po) // self.out_size
            widest = n if n > widest else widest
        if f.ol_shape is not None:
            pl, o, st0, st1 = f.olse, objs[3], f.ol_st, f.ol_sh
            if f.ol_shape != (T, H):
                return -1
            if (type(o) is not tt or o.requires_grad or o.is_inference()) and not _facts.writable_cheap(o):
                return -1
            if not ((H <= 1 or st1 >= 1) and (T <= 1 or st0 >= H1 * st1 + 1) or distinct(T, st0, H, st1, 1)):
                return -1
            end_l = pl + (T1 * st0 + H1 * st1 + 1) * 4
            for lo, hi in spans:
                if lo < end_l and pl < hi:
                    return -1
            n = (end_l - pl) >> 2
            widest = n if n > widest else widest
            spans.append((pl, end_l))
        if f.bscale:
            widest = block_scale_check(f, objs[6], self.group, spans, widest)
        return widest


def _as_two(isz: int, f: _facts.NFacts) -> _facts.TwoFacts:
    """States 0 and 1 of a two-state merge_states as a two-way merge's facts."""
    t = _facts.TwoFacts()
    t.va, t.va_st, t.va_sh = f.v, f.v_st, f.v_sh
    t.vb, t.vb_st, t.vb_sh = f.v + f.v_sn * isz, f.v_st, f.v_sh
    t.sa, t.sa_st, t.sa_sh = f.s, f.s_st, f.s_sh
    t.sb, t.sb_st, t.sb_sh = f.s + f.s_sn * 4, f.s_st, f.s_sh
    t.out, t.out_st, t.out_sh, t.olse, t.ol_st, t.ol_sh = f.out, f.out_st, f.out_sh, f.olse, f.ol_st, f.ol_sh
    t.T, t.H, t.D, t.prefix_rows, t.rows = f.T, f.H, f.D, f.T, f.T * f.H
    t.a_cu = t.a_lens = t.a_batch = t.row_mask = t.sinks = t.out_scale = 0
    t.bscale, t.bs_st, t.bs_sg = f.bscale, f.bs_st, f.bs_sg
    return t


def _exact_n(f: _facts.NFacts, plan: NPlan) -> tuple[int, bool]:
    N, T, H, D = f.N, f.T, f.H, f.D
    tensors = [
        (f.v, (N, T, H, D), (f.v_sn, f.v_st, f.v_sh, 1), plan.in_size),
        (f.s, (N, T, H), (f.s_sn, f.s_st, f.s_sh), 4),
    ]
    if f.out_shape is not None:
        tensors.append((f.out, (T, H, D), (f.out_st, f.out_sh, 1), plan.out_size))
    if f.ol_shape is not None:
        tensors.append((f.olse, (T, H), (f.ol_st, f.ol_sh), 4))
    return widest_span(tensors, T * H * max(D, 1))
