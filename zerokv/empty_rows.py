"""Writing the empty state (V = 0, LSE = -inf) into the rows of requests that are empty, in place.

Two rules, one kernel (``kernels_cu/empty_rows.cu``, the rule a template parameter):
:func:`fixup_zero_kv_rows` (``kv_lens[i] == 0``) and :func:`mask_empty_context` (the context span
``[cu_kv[i], cu_kv[i + 1])`` is empty).
"""

from __future__ import annotations

import sys
from typing import Any

from .core import checks as _checks
from .core import cpu_path as _host
from .core import dtypes as _dtypes
from .core import kernels as _kernels
from .core import plans as _plans
from .core import runtime as _runtime
from .core.facts import Call
from .core.tensors import torch_tensor_type

_BLOCKS_PER_SM = 1  # one block per SM: fastest at 0, 4096 and 32768 empty rows of 2, 4 and 8 (bench/NOTES.md)


def fixup_zero_kv_rows(
    out: Any, lse: Any, kv_lens: Any, cu_seqlens_q: Any, max_seqlen_q: int | None = None
) -> None:
    """In place: every row of every request with ``kv_lens[i] == 0`` gets ``V = 0`` and
    ``LSE = -inf``; every other row is left bitwise untouched.

    Args:
        out: ``[T, H, D]`` float16 / bfloat16 / float32, head_dim contiguous (mutated).
        lse: ``[T, H]`` float32, any strides (mutated).
        kv_lens: ``[B]`` int32 / int64, KV length of each request in this chunk.
        cu_seqlens_q: ``[B + 1]`` int32 / int64, query row offsets (same dtype or not).
        max_seqlen_q: accepted for signature compatibility and ignored: it never causes rows
            to be skipped.

    Offsets are trusted for meaning, never for memory: each request's rows are clipped to
    ``[0, T)``, a span with ``end <= start`` covers no row. One launch of a persistent grid
    whose work scales with the number of empty rows; no host sync; runs on the current stream
    of the tensors' device.
    """
    if max_seqlen_q is not None and (isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int)):
        raise TypeError(f"max_seqlen_q: expected an int or None, got {type(max_seqlen_q).__name__}")
    _run(_kernels.RULE_KV_LENS_ZERO, out, lse, cu_seqlens_q, kv_lens, None)


def mask_empty_context(out: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any) -> None:
    """In place: rows of requests whose context span is empty (``cu_seqlens_kv[i + 1] <=
    cu_seqlens_kv[i]``) get ``V = 0`` and ``LSE = -inf``, V and LSE in one launch; other rows
    are untouched.

    Args:
        out: ``[T, H, D]`` float16 / bfloat16 / float32, head_dim contiguous (mutated).
        lse: ``[T, H]`` float32, any strides (an ``[H, T]`` buffer as ``lse.T``) (mutated).
        cu_seqlens_q: ``[B + 1]`` int32 / int64 query row offsets (clipped to ``[0, T)``).
        cu_seqlens_kv: ``[B + 1]`` int32 / int64 context offsets of this chunk.

    No host sync; runs on the current stream of the tensors' device.
    """
    _run(_kernels.RULE_CONTEXT_SPAN_EMPTY, out, lse, cu_seqlens_q, cu_seqlens_kv, None)


_NAMES = {
    _kernels.RULE_KV_LENS_ZERO: ("out", "lse", "cu_seqlens_q", "kv_lens"),
    _kernels.RULE_CONTEXT_SPAN_EMPTY: ("out", "lse", "cu_seqlens_q", "cu_seqlens_kv"),
}


def _run(rule: int, out: Any, lse: Any, cu: Any, lens: Any, names: tuple[str, ...] | None) -> None:
    """``names``: how the caller calls (out, lse, cu, lens), for error messages."""
    fast_key = None
    if type(out) is torch_tensor_type():
        # the engine call: a short signature, its plan checks the rest (try: free when it works,
        # where a suppress() context would cost an object per call)
        try:  # noqa: SIM105
            fast_key = ("empty_rows:torch", rule, out.dtype, out.get_device(), cu.dtype, lens.dtype)
        except AttributeError:  # offsets that are not tensors: the validating path names them
            pass
        plan = _plans.find(fast_key)
        if plan is not None and plan.torch_call(out, lse, cu, lens):
            return
    call = Call("empty_rows", (out, lse, cu, lens), (rule,))
    names = names or _NAMES[rule]
    if call.device < 0:
        _host.empty_rows(_validate(call, rule, names), rule_offsets=rule == _kernels.RULE_CONTEXT_SPAN_EMPTY)
        return
    plan = _plans.lookup(call.key(_aligned(call)), lambda: _EmptyRowsPlan(call, rule, names))
    if fast_key is not None and call.is_torch:
        _plans.remember(fast_key, plan)
    plan(call, rule, names)


def _validate(call: Call, rule: int, names: tuple[str, ...]) -> dict[str, Any]:
    n_out, n_lse, n_cu, n_lens = names
    t = call.views(names)
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
    if T >= 2**31:
        raise ValueError(f"{n_out}: T must be below 2^31, got shape {tuple(o.shape)}")
    _checks.outputs([(n_out, o, ()), (n_lse, s, ())], [(n_cu, c), (n_lens, ln)])
    return {"out": o, "lse": s, "cu": c, "lens": ln, "device": device}


def _aligned(call: Call) -> bool:
    o = call.facts[0]
    if len(o[1]) != 3 or call.dtypes[0] not in _dtypes.ITEMSIZE:
        return False
    vec = _kernels.vec(call.dtypes[0])
    return not (o[1][2] % vec or o[0] % 16 or o[2][0] % vec or o[2][1] % vec)


class _EmptyRowsPlan:
    def __init__(self, call: Call, rule: int, names: tuple[str, ...]) -> None:
        v = _validate(call, rule, names)
        o = v["out"]
        self.vec_max = _kernels.vec(o.dtype)
        self.vec = self.vec_max if call.aligned else 1
        self.q_is64 = int(call.dtypes[2] == "int64")
        self.lens_is64 = int(call.dtypes[3] == "int64")
        targs = (_dtypes.ctype(o.dtype), self.vec, rule, self.lens_is64)
        self.launch = _plans.launcher(_kernels.EMPTY_ROWS, targs, v["device"])
        self.grid = _BLOCKS_PER_SM * _runtime.sm_count(v["device"])
        self.q_size, self.lens_size = 4 + 4 * self.q_is64, 4 + 4 * self.lens_is64
        self.lens_extra = int(rule == _kernels.RULE_CONTEXT_SPAN_EMPTY)
        self.itemsizes = [_dtypes.ITEMSIZE.get(d) for d in call.dtypes]
        self.device = v["device"]
        self.out_size = _dtypes.itemsize(o.dtype)
        if call.is_torch:
            self.t_out, self.t_f32 = (getattr(sys.modules["torch"], d) for d in (o.dtype, "float32"))

    def blocks(self, T: int, H: int, D: int) -> int:
        """A persistent grid of _BLOCKS_PER_SM blocks per SM, or fewer when even every row
        empty would not give each thread one store (small batches: less to launch, the same
        scan)."""
        return min(self.grid, -(-T * H * max(1, D // self.vec) // _kernels.EMPTY_ROWS.block))

    def torch_call(self, out: Any, lse: Any, cu: Any, lens: Any) -> bool:
        """The engine call in straight-line code (see merge's ``torch_call``); False sends the
        call to the validating path."""
        try:
            dev = self.device
            if (
                out.dtype is not self.t_out or lse.dtype is not self.t_f32 or lse.get_device() != dev
                or cu.get_device() != dev or lens.get_device() != dev
                or out.requires_grad or lse.requires_grad or out.is_inference() or lse.is_inference()
            ):  # fmt: skip
                return False
            sho = out.shape
            T, H, D = sho
            if lse.shape != (T, H) or T >= 2**31:
                return False
            (n_cu,), (n_lens,) = cu.shape, lens.shape
            B = n_cu - 1
            if B < 0 or n_lens != B + self.lens_extra:
                return False
            sto, stl, po, pl = out.stride(), lse.stride(), out.data_ptr(), lse.data_ptr()
            if (n_cu > 1 and cu.stride()[0] != 1) or (n_lens > 1 and lens.stride()[0] != 1):
                return False
            if (
                (D > 1 and sto[2] != 1)
                or (T > 1 and (sto[0] == 0 or stl[0] == 0))
                or (H > 1 and (sto[1] == 0 or stl[1] == 0))
            ):
                return False
            w = self.vec_max  # only calls of this plan's alignment (see merge's plans)
            if (self.vec > 1) == bool(po & 15 or (sto[0] | sto[1] | D) & (w - 1)):
                return False
            if B == 0 or T == 0 or H == 0:
                return True
            end_o = po + ((T - 1) * sto[0] + (H - 1) * sto[1] + D) * self.out_size
            end_l = pl + ((T - 1) * stl[0] + (H - 1) * stl[1] + 1) * 4
            pc, pn = cu.data_ptr(), lens.data_ptr()
            end_c, end_n = pc + n_cu * self.q_size, pn + n_lens * self.lens_size
            for lo, hi in ((pl, end_l), (pc, end_c), (pn, end_n)):
                if po < hi and lo < end_o:
                    return False
            if (pl < end_c and pc < end_l) or (pl < end_n and pn < end_l):
                return False
        except (AttributeError, TypeError, ValueError):
            return False
        flat = int(sto[1] == D and sto[0] == H * D)
        self.launch(
            self.blocks(T, H, D), _runtime.torch_stream(dev),
            po, sto[0], sto[1], pl, stl[0], stl[1], pc, self.q_is64, pn, B, T, H, D, flat,
        )  # fmt: skip
        return True

    def __call__(self, call: Call, rule: int, names: tuple[str, ...]) -> None:
        o, s, cu, lens = call.facts
        shape = o[1]
        ok = (
            len(shape) == 3
            and s[1] == shape[:2]
            and (shape[2] <= 1 or o[2][2] == 1)
            and len(cu[1]) == 1
            and cu[1][0] >= 1
            and (cu[1][0] <= 1 or cu[2][0] == 1)
            and lens[1] == (cu[1][0] - 1 + self.lens_extra,)
            and (lens[1][0] <= 1 or lens[2][0] == 1)
            and shape[0] < 2**31
            and call.disjoint_outputs(self.itemsizes, _OUTS)
            and call.writable((0, 1))
        )
        if not ok:
            _validate(call, rule, names)
        T, H, D = shape
        B = cu[1][0] - 1
        if B == 0 or T * H == 0:
            return
        flat = int(o[2][1] == D and o[2][0] == H * D)
        os_, ss = o[2], s[2]
        self.launch(
            self.blocks(T, H, D), call.stream(),
            o[0], os_[0], os_[1], s[0], ss[0], ss[1], cu[0], self.q_is64, lens[0], B, T, H, D, flat,
        )  # fmt: skip


_OUTS = ((0, ()), (1, ()))
