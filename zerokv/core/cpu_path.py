"""Host memory: the CPU path of every op (through the float64 reference) and output allocation.

Each CPU entry point validates the whole call first (``validate()`` raises before anything is
written), allocates what was asked for, computes with :mod:`zerokv.reference` and writes back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from .tensors import Tensor, view


def merge_two(call: Any, validate: Callable[[], dict], prefix_rows: int | None) -> tuple[Any, Any]:
    v = validate()
    va, o, ol = v["va"], v["out"], v["out_lse"]
    T, H, D = v["T"], v["H"], v["D"]
    verbatim = call.scalars[2]
    out, o, out_lse, ol = _outputs(call.objs[4], o, call.objs[5], ol, va, (T, H, D), call.scalars[3])
    a_empty_rows = None
    if v["cu"] is not None:
        a_empty_rows = reference.rows_with_empty_a(to_f64(v["cu"]), to_f64(v["lens"]), T)
    res, lse = reference.merge_state(
        to_f64(va), to_f64(v["sa"]), to_f64(v["vb"]), to_f64(v["sb"]),
        lse_base=v["base"], prefix_rows=T if prefix_rows is None else prefix_rows,
        a_empty_rows=a_empty_rows, suffix_verbatim=verbatim,
        sinks=None if v["sinks"] is None else to_f64(v["sinks"]),
    )  # fmt: skip
    rows = None if v["mask"] is None else to_f64(v["mask"]).astype(bool)
    write_merged(o, res, v, rows)
    if ol is not None:
        write(ol, lse, rows)
    return out, out_lse


def merge_states(call: Any, validate: Callable[[], dict]) -> tuple[Any, Any]:
    v = validate()
    vt, o, ol = v["v"], v["out"], v["out_lse"]
    _, T, H, D = vt.shape
    out, o, out_lse, ol = _outputs(call.objs[2], o, call.objs[3], ol, vt, (T, H, D), call.scalars[1])
    sinks = None if v["sinks"] is None else to_f64(v["sinks"])
    res, lse = reference.merge_states(to_f64(vt), to_f64(v["s"]), v["base"], sinks)
    write_merged(o, res, v)
    if ol is not None:
        write(ol, lse)
    return out, out_lse


def _outputs(out, o, out_lse, ol, like, shape, allocate_lse):
    """The merge's outputs and their records, allocating ``out`` (like the inputs) when None and
    ``out_lse`` when None and ``allocate_lse``."""
    if o is None:
        out = new(like, shape, like.dtype)
        o = view(out, "out")
    if ol is None and allocate_lse:
        out_lse = new(like, shape[:2], "float32")
        ol = view(out_lse, "out_lse")
    return out, o, out_lse, ol


def empty_rows(v: dict, rule_offsets: bool) -> None:
    """fixup (``rule_offsets=False``: ``lens`` are kv lengths) or mask (context offsets)."""
    o, s, cu, lens = v["out"], v["lse"], to_f64(v["cu"]), to_f64(v["lens"])
    empty = reference.empty_context_requests(lens) if rule_offsets else reference.zero_kv_requests(lens)
    rows = reference.rows_of_requests(cu, empty, o.shape[0])
    res, new_lse = reference.write_empty_rows(to_f64(o), to_f64(s), rows)
    write(o, res, rows)
    write(s, new_lse, rows)


def write_merged(o: Tensor, res: np.ndarray, v: dict, rows: np.ndarray | None = None) -> None:
    """The merged rows into ``o`` in the call's output format: per-group fp8 with its scales
    into ``v["block_scale"]`` (``v["quant_group"]``, ``v["scale_format"]``), fp8 with one scale,
    or the output dtype as it is."""
    bs = v.get("block_scale")
    if bs is None:
        write(o, scaled(res, v["scale"]), rows)
        return
    values, scales = reference.fp8_group_scales(res, v["quant_group"], v["scale_format"] == "ue8m0")
    write(o, values, rows)
    write(bs, scales, rows)


def scaled(res: np.ndarray, scale: Tensor | None) -> np.ndarray:
    """fp8 output: ``clamp(merged / scale, -448, 448)``."""
    if scale is None:
        return res
    s = float(to_f64(scale).reshape(-1)[0])
    return np.clip(res / s, -448.0, 448.0)


def to_f64(t: Tensor) -> np.ndarray:
    """A float64 (or int64 for indices) numpy copy of a host tensor."""
    x = t.obj
    if t.is_torch:
        torch = sys.modules["torch"]
        wide = torch.float64 if x.is_floating_point() else torch.int64
        return x.detach().to(wide).numpy()
    a = x if isinstance(x, np.ndarray) else np.from_dlpack(x)
    return a.astype(np.float64 if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else np.int64)


def write(t: Tensor, value: np.ndarray, rows: np.ndarray | None = None) -> None:
    """Store ``value`` into host tensor ``t`` (casting), only at ``rows`` when given."""
    x = t.obj
    if t.is_torch:
        torch = sys.modules["torch"]
        src = torch.from_numpy(np.ascontiguousarray(value))
        if rows is None:
            x.copy_(src)
        else:
            idx = torch.from_numpy(np.flatnonzero(rows))
            x[idx] = src[idx].to(x.dtype)
        return
    a = x if isinstance(x, np.ndarray) else np.from_dlpack(x)
    if rows is None:
        a[...] = value.astype(a.dtype)
    else:
        a[rows] = value[rows].astype(a.dtype)


def new(like: Tensor, shape: tuple[int, ...], dtype: str) -> Any:
    """An uninitialised tensor of the same producer family and device as ``like``."""
    if like.is_torch:
        torch = sys.modules["torch"]
        device = "cpu" if like.device < 0 else like.device
        return torch.empty(shape, dtype=getattr(torch, dtype), device=device)
    if like.device < 0:
        return np.empty(shape, dtype=_numpy_dtype(dtype))
    import cupy

    with cupy.cuda.Device(like.device):
        return cupy.empty(shape, dtype=_numpy_dtype(dtype))


def _numpy_dtype(name: str) -> Any:
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return getattr(ml_dtypes, name)
    return np.dtype(name)
