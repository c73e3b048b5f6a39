"""The full validation of the merges, with messages naming the caller's arguments.

It runs on the first call of a signature (building its plan) and whenever a plan's cheap
check fails; it raises ``TypeError`` / ``ValueError`` or returns the validated records.
"""

from __future__ import annotations

from typing import Any

from . import checks as _checks
from . import dtypes as _dtypes
from . import spec as _spec
from . import validation as _validation
from .kernels import QUANT_GROUPS
from .tensors import Tensor, view

_NAMES2 = ("v_a", "s_a", "v_b", "s_b", "out", "out_lse")
_STATE_PAIR = _spec.OpSpec("merge_state", _spec.MERGE_STATE.args)  # its tensors, without the options


def _views(objs: tuple, keys: tuple, shown: tuple) -> dict[str, Tensor | None]:
    """Records of every argument by name; ``view`` raises a ``TypeError`` naming the argument
    (as ``shown``, the caller's names) for anything that is not a tensor, and torch beside
    another library on a GPU is a ``TypeError`` naming both."""
    t = {k: (None if x is None else view(x, s)) for k, s, x in zip(keys, shown, objs, strict=True)}
    _checks.one_library_on_gpu([(s, t[k]) for k, s in zip(keys, shown, strict=True)])
    return t


def _name(names: dict[str, str] | None, arg: str) -> str:
    return names.get(arg, arg) if names else arg


def block_scale(
    x: Any, group: Any, fmt: Any, o: Tensor | None, scale: Any, T: int, H: int, D: int, device: int, n: dict
) -> Tensor | None:
    """Per-group fp8 output (vLLM's rule): ``out_block_scale`` float32 ``[T, H * D / g]`` (any
    strides) with ``quant_group=g`` (a power of two, 16-128, dividing D) and ``scale_format``
    "float32" or "ue8m0", an fp8 e4m3 ``out``, no ``out_scale``. None when not asked for."""
    nb, ng, nf = (n.get(k, k) for k in ("out_block_scale", "quant_group", "scale_format"))
    if fmt not in ("float32", "ue8m0"):
        raise ValueError(f"{nf}: expected 'float32' or 'ue8m0', got {fmt!r}")
    if x is None:
        if group is not None:
            raise ValueError(f"{ng}: only meaningful with {nb}, got {group!r} without it")
        return None
    if group is None:
        raise ValueError(f"{ng}: required with {nb}")
    if type(group) is not int or group not in QUANT_GROUPS:
        raise ValueError(f"{ng}: expected a power of two from 16 to 128, got {group!r}")
    if D % group:
        raise ValueError(f"{ng}: must divide head_dim {D}, got {group}")
    if scale is not None:
        raise ValueError(f"{n.get('out_scale', 'out_scale')} and {nb}: give one fp8 scale, not both")
    if o is None or o.dtype not in _dtypes.FP8:
        got = "None" if o is None else o.dtype
        raise ValueError(f"{n.get('out', 'out')}: {nb} needs a float8_e4m3fn output, got {got}")
    t = _checks.tensor(x, nb, 2, _dtypes.LSE)
    _checks.shape(t, nb, (T, H * D // group), "T, H * D / quant_group")
    if t.device != device:
        raise ValueError(
            f"{nb} is on {_checks._where(t.device)} but the states are on {_checks._where(device)}"
        )
    return t


def two(
    objs: tuple, base: Any, prefix_rows: Any, names: dict[str, str] | None, quant: tuple = (None, "float32")
) -> dict[str, Any]:
    """Every check of a two-way merge, on the host; returns the validated records. ``objs``:
    (v_a, s_a, v_b, s_b, out, out_lse, a_cu, a_lens, row_mask, out_scale, sinks[, out_block_scale]);
    ``quant``: (quant_group, scale_format)."""
    n = {a: _name(names, a) for a in (*_NAMES2, "a_empty", "prefix_rows", "out_scale", "sinks", "mask")}
    n_cu = (names or {}).get("a_empty[0]") or f"{n['a_empty']}[0] (cu_seqlens_q)"
    n_lens = (names or {}).get("a_empty[1]") or f"{n['a_empty']}[1] (kv_lens)"
    keys = ("v_a", "s_a", "v_b", "s_b", "out", "out_lse", "cu", "lens", "mask", "out_scale", "sinks")
    shown = (*(n[k] for k in keys[:6]), n_cu, n_lens, n["mask"], n["out_scale"], n["sinks"])
    nb = _name(names, "out_block_scale")
    t = _views(objs[:11], keys, shown)
    t_bs = None if len(objs) < 12 or objs[11] is None else view(objs[11], nb)
    c = _validation.validate(_STATE_PAIR, objs[:6], {k: n[k] for k in _NAMES2}, limits=("T", "H"))
    va, sa, vb, sb, o, ol = (c.tensors.get(k) for k in _NAMES2)
    T, H, D, device = c.sym["T"], c.sym["H"], c.sym["D"], c.device
    _checks.lse_base(base)
    _checks.prefix_rows(prefix_rows, T, n["prefix_rows"])
    cu = lens = None
    if t["cu"] is not None or t["lens"] is not None:
        cu, lens = _checks.offsets_pair(t["cu"], t["lens"], n["a_empty"], device, n_cu, n_lens)
    mask = None
    if t["mask"] is not None:
        mask = _checks.tensor(t["mask"], n["mask"], 1, _dtypes.MASK_NAMES)
        _checks.shape(mask, n["mask"], (T,), "T")
        _checks.same_device([(n["v_a"], va), (n["mask"], mask)])
        _checks.contiguous_1d(mask, n["mask"])
    sinks = None
    if t["sinks"] is not None:
        sinks = _checks.sinks(t["sinks"], n["sinks"], H, device)
    names_q = {
        k: _name(names, k) for k in ("out_block_scale", "quant_group", "scale_format", "out", "out_scale")
    }
    bs = block_scale(
        t_bs, quant[0], quant[1], o, t["out_scale"], T, H, D, device, {**names_q, "v_a": n["v_a"]}
    )
    if bs is not None:
        if t["cu"] is not None or t["mask"] is not None or t["sinks"] is not None:
            raise ValueError(f"{nb}: per-group fp8 output does not combine with a_empty, a row mask or sinks")
        if ol is not None and ol.ptr in (sa.ptr, sb.ptr):
            raise ValueError(f"{n['out_lse']}: may not alias {n['s_a']} or {n['s_b']} with {nb}")
        scale = None
    else:
        scale = _checks.out_scale(
            t["out_scale"], o.dtype if o is not None else va.dtype, device, n["out_scale"]
        )
    outs = [(n["out"], o, (n["v_a"], n["v_b"])), (n["out_lse"], ol, (n["s_a"], n["s_b"]))]
    if bs is not None:
        outs.append((nb, bs, ()))
    ins = [(n["v_a"], va), (n["s_a"], sa), (n["v_b"], vb), (n["s_b"], sb)]
    ins += [(nm, x) for nm, x in ((n_cu, cu), (n_lens, lens), (n["mask"], mask)) if x is not None]
    ins += [(nm, x) for nm, x in ((n["out_scale"], scale), (n["sinks"], sinks)) if x is not None]
    _checks.outputs(outs, ins)
    return {
        "va": va, "sa": sa, "vb": vb, "sb": sb, "out": o, "out_lse": ol, "cu": cu, "lens": lens,
        "mask": mask, "scale": scale, "sinks": sinks, "T": T, "H": H, "D": D, "device": device,
        "base": _checks.lse_base(base), "block_scale": bs, "quant_group": quant[0], "scale_format": quant[1],
    }  # fmt: skip


_STATES = _spec.OpSpec("merge_states", _spec.MERGE_STATES.args)  # its tensors, without the options


def n(objs: tuple, base: Any, quant: tuple = (None, "float32")) -> dict[str, Any]:
    """Every check of an N-way merge; ``objs``: (v, s, out, out_lse, out_scale, sinks[,
    out_block_scale]); ``quant``: (quant_group, scale_format)."""
    keys = ("v", "s", "out", "out_lse", "out_scale", "sinks")
    t = _views(objs[:6], keys, keys)
    t_bs = None if len(objs) < 7 or objs[6] is None else view(objs[6], "out_block_scale")
    c = _validation.validate(_STATES, objs[:4], limits=("N", "T", "H"))  # the spec's tensor rows
    vt, st, o, ol = (c.tensors.get(k) for k in keys[:4])
    N, T, H, D, device = c.sym["N"], c.sym["T"], c.sym["H"], c.sym["D"], c.device
    _checks.lse_base(base)
    sinks = _checks.sinks(t["sinks"], "sinks", H, device) if t["sinks"] is not None else None
    bs = block_scale(t_bs, quant[0], quant[1], o, t["out_scale"], T, H, D, device, {})
    if bs is None:
        scale = _checks.out_scale(t["out_scale"], o.dtype if o is not None else vt.dtype, device, "out_scale")
    else:
        scale = None
    if N == 0:
        raise ValueError("v: expected at least one state (N >= 1), got N = 0")
    ins = [("v", vt), ("s", st)] + [(nm, x) for nm, x in (("out_scale", scale), ("sinks", sinks)) if x]
    outs = [("out", o, ()), ("out_lse", ol, ())] + ([("out_block_scale", bs, ())] if bs is not None else [])
    _checks.outputs(outs, ins)
    return {
        "v": vt, "s": st, "out": o, "out_lse": ol, "scale": scale, "sinks": sinks, "device": device,
        "base": _checks.lse_base(base), "block_scale": bs, "quant_group": quant[0], "scale_format": quant[1],
    }  # fmt: skip
