"""The CPU path of every op: host tensors, computed through the float64 reference.

Each entry point takes a call its op has validated (and whose outputs it has allocated),
computes with :mod:`zerokv.reference` and writes the results back.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import numpy as np

from .. import reference
from . import checks as _checks
from . import dtypes as _dtypes
from . import outputs as _outputs
from . import spec as _spec
from .tensors import Tensor
from .validation import Checked

# merge_state's options the reference takes by their names, with their scalars (those that
# change the merged values); the others are the output's writing, here (WRITING: the rows a
# mask leaves, fp8 scales)
_TAKES = inspect.signature(reference.merge_state).parameters
_TO_REFERENCE = tuple(o for o in _spec.MERGE_STATE.options if o.name in _TAKES)
WRITING = ("row_mask", "out_scale", "out_block_scale")


def _outputs_of(c: Checked, like: Tensor, out: Any, out_lse: Any, want_lse: bool) -> tuple:
    """``(out, out_lse, out view, out_lse view)`` of a validated merge: those the call left None
    allocated on the host like ``like`` (the LSE only when ``want_lse``)."""
    o, ol = c.tensors.get("out"), c.tensors.get("out_lse")
    T, H, D = like.shape[-3:]
    if o is None:
        out = _outputs.new(like.obj, like.is_torch, -1, (T, H, D), like.dtype)
        o = _checks.view(out, "out")
    if ol is None and want_lse:
        out_lse = _outputs.new(like.obj, like.is_torch, -1, (T, H), "float32")
        ol = _checks.view(out_lse, "out_lse")
    return out, out_lse, o, ol


def merge_two(c: Checked, out: Any, out_lse: Any, want_lse: bool, prefix_rows: Any, verbatim: bool) -> tuple:
    """A validated two-way merge on the host (``prefix_rows`` None: T); its outputs."""
    t = c.tensors
    out, out_lse, o, ol = _outputs_of(c, t["v_a"], out, out_lse, want_lse)
    prefix_rows = c.sym["T"] if prefix_rows is None else prefix_rows
    options = {}
    for opt in _TO_REFERENCE:  # each given one as float64 arrays (a tuple of several)
        if opt.name in c.options:
            x = tuple(to_f64(t[a.name]) for a in opt.args)
            options[opt.name] = x if len(x) > 1 else x[0]
            options.update((s.name, c.scalars[s.name]) for s in opt.scalars if s.name in _TAKES)
    res, lse = reference.merge_state(
        to_f64(t["v_a"]), to_f64(t["s_a"]), to_f64(t["v_b"]), to_f64(t["s_b"]),
        lse_base=c.scalars["lse_base"], prefix_rows=prefix_rows, suffix_verbatim=verbatim, **options,
    )  # fmt: skip
    rows = to_f64(t["row_mask"]).astype(bool) if "row_mask" in t else None
    write_merged(o, res, c, rows)
    if ol is not None:
        write(ol, lse, rows)
    return out, out_lse


def merge_states(c: Checked, out: Any, out_lse: Any, want_lse: bool) -> tuple:
    """A validated N-way merge on the host; its outputs."""
    t = c.tensors
    out, out_lse, o, ol = _outputs_of(c, t["v"], out, out_lse, want_lse)
    sinks = to_f64(t["sinks"]) if "sinks" in t else None
    res, lse = reference.merge_states(to_f64(t["v"]), to_f64(t["s"]), c.scalars["lse_base"], sinks)
    write_merged(o, res, c)
    if ol is not None:
        write(ol, lse)
    return out, out_lse


def empty_rows(c: Checked, rule_offsets: bool) -> None:
    """fixup (``rule_offsets=False``: ``kv_lens``) or mask (``cu_seqlens_kv``, context offsets)."""
    t = c.tensors
    o, s, cu = t["out"], t["lse"], to_f64(t["cu_seqlens_q"])
    lens = to_f64(t["cu_seqlens_kv"] if rule_offsets else t["kv_lens"])
    empty = reference.empty_context_requests(lens) if rule_offsets else reference.zero_kv_requests(lens)
    rows = reference.rows_of_requests(cu, empty, o.shape[0])
    res, new_lse = reference.write_empty_rows(to_f64(o), to_f64(s), rows)
    write(o, res, rows)
    write(s, new_lse, rows)


def write_merged(o: Tensor, res: np.ndarray, c: Checked, rows: np.ndarray | None = None) -> None:
    """The merged rows into ``o`` in the call's output format: per-group fp8 with its scales
    into ``out_block_scale`` (``quant_group``, ``scale_format``), fp8 with one scale, or the
    output dtype as it is."""
    bs = c.tensors.get("out_block_scale")
    if bs is None:
        write(o, scaled(res, c.tensors.get("out_scale")), rows)
        return
    values, scales = reference.fp8_group_scales(
        res, c.scalars["quant_group"], c.scalars["scale_format"] == "ue8m0"
    )
    write(o, values, rows)
    write(bs, scales, rows)


def scaled(res: np.ndarray, scale: Tensor | None) -> np.ndarray:
    """fp8 output: ``clamp(merged / scale, -max, max)``, the fp8 type's largest finite value."""
    if scale is None:
        return res
    s = float(to_f64(scale).reshape(-1)[0])
    top = _dtypes.TABLE[_dtypes.FP8[0]].saturate
    return np.clip(res / s, -top, top)


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
