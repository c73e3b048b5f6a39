"""The empty-row ops' one path: facts, the plan of the signature, its cheap check, launch.

Both rules (``kernels.RULE_*``) share empty_rows_kernel; the rule and the offsets' widths are
template arguments, so they are part of the signature.
"""

from __future__ import annotations

from typing import Any

from . import checks as _checks
from . import cpu_path as _cpu
from . import device as _device
from . import dtypes as _dtypes
from . import facts as _facts
from . import forms as _forms
from . import kernels as _kernels
from . import plans as _plans
from .layout import INT32, apart, distinct
from .tensors import torch_tensor_type, view

_NAMES = {
    _kernels.RULE_KV_LENS_ZERO: ("out", "lse", "cu_seqlens_q", "kv_lens"),
    _kernels.RULE_CONTEXT_SPAN_EMPTY: ("out", "lse", "cu_seqlens_q", "cu_seqlens_kv"),
}


def run(rule: int, objs: tuple, names: tuple[str, ...] | None) -> None:
    """``objs``: (out, lse, cu_q, lens); ``names``: how the caller calls them (messages)."""
    f = _facts.read_rows(objs)
    if f is None or f.device < 0:
        v = validate(objs, rule, names or _NAMES[rule])
        if v["device"] >= 0:  # pragma: no cover - every unreadable argument fails validation
            raise RuntimeError("zerokv: the arguments passed validation but could not be read")
        _cpu.empty_rows(v, rule_offsets=rule == _kernels.RULE_CONTEXT_SPAN_EMPTY)
        return
    plan = _plans.get(("empty_rows", rule, f.sig)) or _new_plan(f, rule, names)
    plan(f, rule, names)


def _new_plan(f: _facts.RowsFacts, rule: int, names: tuple[str, ...] | None) -> Plan:
    return _plans.lookup(("empty_rows", rule, f.sig), lambda: Plan(f, rule, names or _NAMES[rule]))


def validate(objs: tuple, rule: int, names: tuple[str, ...]) -> dict[str, Any]:
    """Every check of an empty-rows call, with the caller's names (out, lse, cu, lens)."""
    n_out, n_lse, n_cu, n_lens = names
    t = {n: (None if x is None else view(x, n)) for n, x in zip(names, objs, strict=True)}
    _checks.one_library_on_gpu(list(t.items()))
    o = _checks.tensor(t[n_out], n_out, 3, _dtypes.V_IN)
    T, H, D = o.shape
    _checks.unit_last_stride(o, n_out)
    s = _checks.tensor(t[n_lse], n_lse, 2, _dtypes.LSE)
    _checks.shape(s, n_lse, (T, H), "T, H")
    device = _checks.same_device([(n_out, o), (n_lse, s)])
    c = _checks.offsets(t[n_cu], n_cu, device)
    B = c.shape[0] - 1
    ln = _checks.index_tensor(
        t[n_lens], n_lens, B + 1 if rule == _kernels.RULE_CONTEXT_SPAN_EMPTY else B, device
    )
    if T >= INT32:
        raise ValueError(f"{n_out}: T must be below 2^31, got shape {tuple(o.shape)}")
    _checks.outputs([(n_out, o, ()), (n_lse, s, ())], [(n_cu, c), (n_lens, ln)])
    return {"out": o, "lse": s, "cu": c, "lens": ln, "device": device}


_GRID_CACHE_LIMIT = 4096  # distinct (T, H, D) a plan keeps; past it, it starts again


class Consts:
    __slots__ = ("q_is64",)


class Plan:
    """Every call of one empty-rows signature: the instantiation and the offsets' widths."""

    def __init__(self, f: _facts.RowsFacts, rule: int, names: tuple[str, ...]) -> None:
        v = validate(f.objs, rule, names)
        o = v["out"]
        self.device = v["device"]
        self.vec = _kernels.vec(o.dtype) if f.sig[-2] else 1
        self.consts = Consts()
        self.consts.q_is64 = int(v["cu"].dtype == "int64")
        self.q_size = 8 if self.consts.q_is64 else 4
        self.lens_size = 8 if v["lens"].dtype == "int64" else 4
        self.lens_extra = int(rule == _kernels.RULE_CONTEXT_SPAN_EMPTY)
        targs = (_dtypes.ctype(o.dtype), self.vec, rule, int(self.lens_size == 8))
        self.launcher = _plans.launcher(_kernels.EMPTY_ROWS, targs, self.device)
        self.bind = _kernels.EMPTY_ROWS.binder(("f", _facts.RowsFacts), ("c", Consts))
        self.dev = _forms.Device(_device.sm_count(self.device), _device.l2_bytes(self.device))
        self.out_size = _dtypes.itemsize(o.dtype)
        self.stream = _device.torch_stream if f.torch else _device.cupy_stream
        self.tensor_type = torch_tensor_type()
        self.grids: dict = {}  # (T, H, D) -> the grid of that size

    def __call__(self, f: _facts.RowsFacts, rule: int, names: tuple[str, ...] | None) -> None:
        if not self.check(f):
            validate(f.objs, rule, names or _NAMES[rule])
        T, H, D = f.T, f.H, f.D
        if f.batch == 0 or T * H == 0:
            return
        grid = self.grids.get((T, H, D))
        if grid is None:
            if len(self.grids) >= _GRID_CACHE_LIMIT:
                self.grids.clear()
            grid = self.grids[T, H, D] = _forms.empty_rows_grid(T, H, D, self.vec, self.dev)
        self.launcher.launch(grid, 1, self.stream(self.device), self.bind, f, self.consts)

    def check(self, f: _facts.RowsFacts) -> bool:
        """Shapes, unit strides of head_dim and the offsets, writable outputs apart from each
        other and from the offsets; False: the full checks decide."""
        T, H, D = f.T, f.H, f.D
        n = f.cu_len
        if f.neg or f.lse_shape != (T, H) or T >= INT32 or n < 1 or f.lens_len != n - 1 + self.lens_extra:
            return False
        if (D > 1 and f.out_in != 1) or (n > 1 and f.cu_st != 1) or (f.lens_len > 1 and f.lens_st != 1):
            return False
        objs, tt = f.objs, self.tensor_type
        for o in objs[:2]:  # writable_cheap's torch case written out first
            if (type(o) is not tt or o.requires_grad or o.is_inference()) and not _facts.writable_cheap(o):
                return False
        st0, st1, sl0, sl1 = f.out_st, f.out_sh, f.lse_st, f.lse_sh
        if not ((H <= 1 or st1 >= D) and (T <= 1 or st0 >= (H - 1) * st1 + D) or distinct(T, st0, H, st1, D)):
            return False
        if not ((H <= 1 or sl1 >= 1) and (T <= 1 or sl0 >= (H - 1) * sl1 + 1) or distinct(T, sl0, H, sl1, 1)):
            return False
        if not (T and H):
            return True  # nothing to write
        if not D:
            return False
        po, pl, pc, pn = f.out, f.lse, f.cu_q, f.lens
        end_o = po + ((T - 1) * st0 + (H - 1) * st1 + D) * self.out_size  # layout.end, written out
        end_l = pl + ((T - 1) * sl0 + (H - 1) * sl1 + 1) * 4
        end_c, end_n = pc + n * self.q_size, pn + f.lens_len * self.lens_size
        return (
            apart(po, end_o, pl, end_l) and apart(po, end_o, pc, end_c) and apart(po, end_o, pn, end_n)
            and apart(pl, end_l, pc, end_c) and apart(pl, end_l, pn, end_n)
        )  # fmt: skip
