"""Merging partial attention states by their log-sum-exp: two-way and N-way.

Every call takes one path: read the tensors (pointer, shape, strides, dtype, device), find the
launch plan of the call's signature (built and validated once), check what can change between
calls of one signature, launch. CPU tensors run the float64 reference (``zerokv.core.cpu_path``).
"""

from __future__ import annotations

import struct
import sys
from typing import Any

from .core import checks as _checks
from .core import cpu_path as _host
from .core import dtypes as _dtypes
from .core import kernels as _kernels
from .core import plans as _plans
from .core import runtime as _runtime
from .core.facts import Call, read
from .core.tensors import torch_tensor_type

_NAMES2 = ("v_a", "s_a", "v_b", "s_b", "out", "out_lse")


def merge_state(
    v_a: Any,
    s_a: Any,
    v_b: Any,
    s_b: Any,
    *,
    out: Any = None,
    out_lse: Any = None,
    lse_base: str | int = "e",
    prefix_rows: int | None = None,
    a_empty: tuple[Any, Any] | None = None,
    out_scale: Any = None,
    sinks: Any = None,
) -> tuple[Any, Any]:
    """Merge two partial attention states ``(v_a, s_a)`` and ``(v_b, s_b)`` into one.

    Args:
        v_a, v_b: ``[T, H, D]`` float16 / bfloat16 / float32, same dtype; head_dim contiguous,
            token and head strides free.
        s_a, s_b: ``[T, H]`` float32 LSE, any strides (pass ``lse.T`` for an ``[H, T]`` buffer).
        out: ``[T, H, D]`` output, float16 / bfloat16 / float32 (may differ from the inputs),
            or float8_e4m3fn with ``out_scale``; may alias ``v_a`` or ``v_b`` exactly.
            ``None``: allocated.
        out_lse: ``[T, H]`` float32, may alias ``s_a`` or ``s_b`` exactly. ``None`` with
            ``out=None``: allocated; ``None`` with ``out`` given: the merged LSE is not written.
        lse_base: ``"e"`` (natural log) or ``2`` (FlashInfer / trtllm-gen).
        prefix_rows: rows ``t >= prefix_rows`` take state b alone (with the empty rule).
        a_empty: ``(cu_seqlens_q [B+1], kv_lens [B])`` int32/int64 (one dtype): rows of
            requests with ``kv_lens[i] == 0`` treat state a as empty (the fixup fused in).
            Offsets are clipped to ``[0, T)``; rows no request covers merge normally.
        out_scale: float32 tensor of one element: fp8 output ``clamp(merged / scale)``.
        sinks: float32 ``[H]`` attention-sink logits, in the LSE's base, counted once in the
            normaliser: ``S' = logaddexp(S, sink_h)``, ``out *= base^(S - S')``.

    Empty rule: an LSE of -inf or +inf gives weight 0 and that V never reaches the output (it
    may hold NaN/Inf garbage); both empty give ``(0, -inf)``. NaN in an LSE makes the row NaN.
    One launch, no host sync, no allocation unless an output is ``None``; runs on the current
    stream of the tensors' device. Mutates ``out`` and ``out_lse`` only.

    Returns:
        ``(out, out_lse)`` (``out_lse`` is ``None`` when not written).

    Example::

        out, lse = zerokv.merge_state(v_prefix, lse_prefix, v_suffix, lse_suffix)
    """
    return _merge2(v_a, s_a, v_b, s_b, out, out_lse, lse_base, prefix_rows, a_empty, out_scale, sinks)


def merge_two(
    v_a: Any,
    s_a: Any,
    v_b: Any,
    s_b: Any,
    out: Any = None,
    out_lse: Any = None,
    *,
    lse_base: Any = "e",
    prefix_rows: Any = None,
    a_empty: Any = None,
    out_scale: Any = None,
    sinks: Any = None,
    row_mask: Any = None,
    suffix_verbatim: bool = False,
    allocate_lse: bool | None = None,
    names: dict[str, str] | None = None,
) -> tuple[Any, Any]:
    """The two-way merge behind ``merge_state`` and the engine adapters.

    ``suffix_verbatim``: rows past ``prefix_rows`` copy state b as it is (vLLM). ``row_mask``:
    ``[T]`` bool, rows with False are not touched (FlashInfer ``merge_state_in_place``).
    ``allocate_lse``: allocate ``out_lse`` when it is None (default: when ``out`` is None).
    ``names``: how the caller calls the arguments, for error messages (the adapters' names).
    """
    return _merge2(
        v_a, s_a, v_b, s_b, out, out_lse, lse_base, prefix_rows, a_empty, out_scale, sinks,
        row_mask, suffix_verbatim, allocate_lse, names,
    )  # fmt: skip


def _merge2(
    v_a, s_a, v_b, s_b, out, out_lse, lse_base, prefix_rows, a_empty, out_scale, sinks,
    row_mask=None, suffix_verbatim=False, allocate_lse=None, names=None,
):  # fmt: skip
    if allocate_lse is None:
        allocate_lse = out is None
    fast_key = None
    if a_empty is None and out_scale is None and sinks is None and row_mask is None:
        if type(v_a) is torch_tensor_type() and (out is None or type(out) is type(v_a)):
            # the engine call: torch tensors, no optional tensor; its plan checks the rest
            fast_key = (
                "merge_state:torch", lse_base, prefix_rows is None, suffix_verbatim, allocate_lse,
                out_lse is None, v_a.dtype, None if out is None else out.dtype, v_a.get_device(),
            )  # fmt: skip
            plan = _plans.find(fast_key)
            if plan is not None:
                done = plan.torch_call(v_a, s_a, v_b, s_b, out, out_lse, prefix_rows)
                if done is not None:
                    return done
        objs = (v_a, s_a, v_b, s_b, out, out_lse)
    else:
        cu, lens = (None, None) if a_empty is None else _checks.pair(a_empty, _name(names, "a_empty"))
        objs = (v_a, s_a, v_b, s_b, out, out_lse, cu, lens, row_mask, out_scale, sinks)
    call = Call("merge_state", objs, (lse_base, prefix_rows is None, suffix_verbatim, allocate_lse))
    if call.device < 0:
        return _host.merge_two(call, lambda: _validate_two(call, prefix_rows, names), prefix_rows)
    plan = _plans.lookup(call.key(_aligned_two(call)), lambda: _MergeTwoPlan(call, prefix_rows, names))
    if fast_key is not None and call.is_torch:
        _plans.remember(fast_key, plan)
    return plan(call, prefix_rows, names)


# --- merge_state: validation, plan, geometry --------------------------------------------------


def _name(names: dict[str, str] | None, arg: str) -> str:
    return names.get(arg, arg) if names else arg


def _validate_two(call: Call, prefix_rows: Any, names: dict[str, str] | None) -> dict[str, Any]:
    """Every check of a two-way merge, on the host; returns the validated facts."""
    n = {a: _name(names, a) for a in (*_NAMES2, "a_empty", "prefix_rows", "out_scale", "sinks", "mask")}
    n_cu = (names or {}).get("a_empty[0]") or f"{n['a_empty']}[0] (cu_seqlens_q)"
    n_lens = (names or {}).get("a_empty[1]") or f"{n['a_empty']}[1] (kv_lens)"
    keys = ("v_a", "s_a", "v_b", "s_b", "out", "out_lse", "cu", "lens", "mask", "out_scale", "sinks")
    shown = (*(n[k] for k in keys[:6]), n_cu, n_lens, n["mask"], n["out_scale"], n["sinks"])
    t = call.views(keys, shown)
    va = _checks.tensor(t["v_a"], n["v_a"], 3, _dtypes.V_IN)
    T, H, D = va.shape
    vb = _checks.tensor(t["v_b"], n["v_b"], 3, _dtypes.V_IN)
    _checks.shape(vb, n["v_b"], (T, H, D), "T, H, D")
    if vb.dtype != va.dtype:
        raise TypeError(f"{n['v_b']}: dtype {vb.dtype} differs from {n['v_a']} dtype {va.dtype}")
    sa = _checks.tensor(t["s_a"], n["s_a"], 2, _dtypes.LSE)
    sb = _checks.tensor(t["s_b"], n["s_b"], 2, _dtypes.LSE)
    _checks.shape(sa, n["s_a"], (T, H), "T, H")
    _checks.shape(sb, n["s_b"], (T, H), "T, H")
    _checks.unit_last_stride(va, n["v_a"])
    _checks.unit_last_stride(vb, n["v_b"])
    if T >= 2**31 or H >= 2**31:
        raise ValueError(f"{n['v_a']}: T and H must be below 2^31, got shape {(T, H, D)}")
    named = [(n["v_a"], va), (n["s_a"], sa), (n["v_b"], vb), (n["s_b"], sb)]
    o = ol = None
    if t["out"] is not None:
        o = _checks.tensor(t["out"], n["out"], 3, _dtypes.V_OUT)
        _checks.shape(o, n["out"], (T, H, D), "T, H, D")
        _checks.unit_last_stride(o, n["out"])
        named.append((n["out"], o))
    if t["out_lse"] is not None:
        ol = _checks.tensor(t["out_lse"], n["out_lse"], 2, _dtypes.LSE)
        _checks.shape(ol, n["out_lse"], (T, H), "T, H")
        named.append((n["out_lse"], ol))
    device = _checks.same_device(named)
    _checks.lse_base(call.scalars[0])
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
    scale = _checks.out_scale(t["out_scale"], o.dtype if o is not None else va.dtype, device, n["out_scale"])
    outs = [(n["out"], o, (n["v_a"], n["v_b"])), (n["out_lse"], ol, (n["s_a"], n["s_b"]))]
    ins = [(n["v_a"], va), (n["s_a"], sa), (n["v_b"], vb), (n["s_b"], sb)]
    ins += [(nm, x) for nm, x in ((n_cu, cu), (n_lens, lens), (n["mask"], mask)) if x is not None]
    ins += [(nm, x) for nm, x in ((n["out_scale"], scale), (n["sinks"], sinks)) if x is not None]
    _checks.outputs(outs, ins)
    return {
        "va": va, "sa": sa, "vb": vb, "sb": sb, "out": o, "out_lse": ol, "cu": cu, "lens": lens,
        "mask": mask, "scale": scale, "sinks": sinks, "T": T, "H": H, "D": D, "device": device,
        "base": _checks.lse_base(call.scalars[0]),
    }  # fmt: skip


def _aligned_two(call: Call) -> bool:
    """Layout fact of the key: every V pointer and stride allows 16-byte accesses."""
    f = call.facts
    va, vb, out = f[0], f[2], f[4]
    shape = va[1]
    if len(shape) != 3:
        return False
    vec = _kernels.vec(call.dtypes[0]) if call.dtypes[0] in _dtypes.ITEMSIZE else 1
    if shape[2] % vec:
        return False
    for x in (va, vb):
        if x[0] % 16 or x[2][0] % vec or x[2][1] % vec:
            return False
    if out is not None:
        osize = _dtypes.ITEMSIZE.get(call.dtypes[4], 1)
        if out[0] % (vec * osize) or out[2][0] % vec or out[2][1] % vec:
            return False
    return True


class _MergePlan:
    """What both merge plans share: their constants (``_setup``), the outputs a call leaves to
    the op (``outputs``) and merge_state_flat_kernel, whose launchers are loaded by the first
    call that uses each; ``flat_targs`` None: never."""

    flat_targs: tuple | None = None

    # The fast paths' short keys do not hold the layout, so each plan's fast path takes only
    # calls of its own alignment: an unaligned call does not leave the aligned calls after it
    # on a plan without vector accesses (the validating path finds and remembers theirs).

    def _setup(
        self, call: Call, device: int, in_dtype: str, out_dtype: str, vec: int, allocate_lse: bool
    ) -> None:
        self.device = device
        self.flat = [None] * len(_FLAT_FORMS)  # a launcher per form, loaded by the first call of each
        self.heads: dict[int, Any] = {}  # merge_state_heads_kernel's launchers by VEC, the same way
        self.sms = _runtime.sm_count(device)
        self.small_threads = _FLAT_SMALL_BLOCKS_PER_SM * self.sms * _FLAT_BLOCK  # one wave: SMALL up to here
        self.vec = vec  # vec_max when the signature is aligned, else 1
        self.vec_max = _kernels.vec(in_dtype)
        # bf16 packs of 8 bytes in the smallest calls (half the values to widen after the loads
        # arrive): measured 0.2-3 % faster than 16 bytes at T = 1 for bf16, 0-2 % slower for fp16
        self.heads_vec = max(vec // 2, 1) if in_dtype == "bfloat16" else vec
        self.out_dtype = out_dtype
        self.allocate_lse = allocate_lse
        self.k, self.inv_k = _checks.LSE_BASES[_checks.lse_base(call.scalars[0])]
        self.itemsizes = [None if d is None else _dtypes.ITEMSIZE.get(d) for d in call.dtypes]
        self.in_size, self.out_size = _dtypes.itemsize(in_dtype), _dtypes.itemsize(out_dtype)
        if call.is_torch:
            torch = sys.modules["torch"]
            self.t_in, self.t_out, self.t_f32 = (getattr(torch, d) for d in (in_dtype, out_dtype, "float32"))
            self.empty = torch.empty

    def outputs(self, call: Call, out: Any, o: Any, out_lse: Any, ol: Any, T: int, H: int, D: int):
        """``(out, o, out_lse, ol)``: the call's outputs and their facts, with those it left to
        the op allocated (the LSE only when this signature asks for it)."""
        if o is None:
            out = call.new((T, H, D), self.out_dtype)
            o = read(out)
        if ol is None and self.allocate_lse:
            out_lse = call.new((T, H), "float32")
            ol = read(out_lse)
        return out, o, out_lse, ol

    def launch_flat(
        self, stream, T, H, D, prefix, verbatim, pa, sta, pb, stb, psa, ssa, psb, ssb, po, sto, pl, stl, wide=False
    ):  # fmt: skip
        """One launch of the flat kernel (the caller checked that it applies: no FULL code, out_lse
        not in place, D > 0); ``st*``: (token, head) strides; ``wide``: a tensor spans 2^31
        elements or more (64-bit offsets). False when the call does not fit the kernel: a
        32-bit parameter overflows (a size-1 dimension may carry any stride), or, wide, the
        thread index reaches 2^31 or the call is not aligned."""
        vec = self.vec
        packs = D // vec
        threads = T * H * packs
        if wide:
            if threads >= _INT32 or vec == 1:
                return False
            form = _FLAT_64_GATHERED
        elif threads >= _FLAT_GATHERED_THREADS and vec > 1:
            lse = stl if pl else ssa  # rows in tiles of 8 tokens where this LSE's tokens are unit-stride
            form = _FLAT_GATHERED + int(lse[0] == 1 and lse[1] != 1)
        elif (
            threads <= _HEADS_PACKS
            and vec > 1
            and self.launch_heads(
                stream, T, H, D, prefix, verbatim, pa, sta, pb, stb, psa, ssa, psb, ssb, po, sto, pl, stl
            )
        ):
            return True
        else:
            form = int(threads <= self.small_threads)  # SMALL
        kernel, extra = _FLAT_FORMS[form]
        blocks = -(-threads // kernel.block)
        launch = self.flat[form]
        if launch is None:
            targs = (*self.flat_targs[:2], vec, *extra)
            launch = self.flat[form] = _plans.launcher(kernel, targs, self.device)
        div = _kernels.fast_divisor
        try:
            launch(
                blocks, stream, pa, pb, psa, psb, po, pl, T * H, H, packs, *div(packs), *div(H),
                ssa[0], ssa[1], ssb[0], ssb[1], sta[0], sta[1], stb[0], stb[1], sto[0], sto[1],
                stl[0], stl[1], prefix, verbatim, self.k, self.inv_k, *_NO_OPTIONS,
            )  # fmt: skip
        except struct.error:
            return False
        return True

    def launch_heads(
        self, stream, T, H, D, prefix, verbatim, pa, sta, pb, stb, psa, ssa, psb, ssb, po, sto, pl, stl
    ):
        """One launch of merge_state_heads_kernel, or False when the call does not fit it: rows
        of a power-of-two number of packs, at most a block; 32-bit parameters."""
        vec = self.heads_vec
        if D // vec > _HEADS_BLOCK:  # bf16 rows past 512 elements: 16-byte packs
            vec = self.vec
        packs = D // vec
        if packs > _HEADS_BLOCK or packs & (packs - 1):
            return False
        launch = self.heads.get(vec)
        if launch is None:
            targs = (*self.flat_targs[:2], vec)
            launch = self.heads[vec] = _plans.launcher(_kernels.MERGE_STATE_HEADS, targs, self.device)
        try:
            launch(
                -(-H * packs // _HEADS_BLOCK), stream, pa, pb, psa, psb, po, pl,
                H, packs, packs.bit_length() - 1, ssa[0], ssa[1], ssb[0], ssb[1], sta[0], sta[1],
                stb[0], stb[1], sto[0], sto[1], stl[0], stl[1], prefix, verbatim, self.k, self.inv_k,
                *_NO_OPTIONS, grid_y=T,
            )  # fmt: skip
        except struct.error:
            return False
        return True


class _MergeTwoPlan(_MergePlan):
    """What every call of one merge_state signature shares: the instantiation, the constants."""

    def __init__(self, call: Call, prefix_rows: Any, names: dict[str, str] | None) -> None:
        v = _validate_two(call, prefix_rows, names)  # the first call of a signature: every check
        va, o = v["va"], v["out"]
        out_dtype = o.dtype if o is not None else va.dtype
        vec = _kernels.vec(va.dtype) if call.aligned else 1
        targs = (_dtypes.ctype(va.dtype), _dtypes.ctype(out_dtype), vec)
        self.targs = targs  # (in, out, vec); the packs per thread come with the geometry
        # the kernel with a_empty / mask / sinks / fp8-scale code only when the signature has one
        self.full = int(any(x is not None for x in call.objs[6:]) or out_dtype in _dtypes.FP8)
        self.geo: dict = {}
        self.last_geo_key, self.last_geo = None, None
        self.block = _kernels.MERGE_STATE.block
        self._setup(call, v["device"], va.dtype, out_dtype, vec, call.scalars[3])
        self.verbatim = int(bool(call.scalars[2]))
        self.a_is64 = int(len(call.dtypes) > 6 and call.dtypes[6] == "int64")
        self.elem_bytes = 2 * self.in_size + self.out_size
        l2 = _runtime.l2_bytes(self.device)
        self.mid_lo, self.mid_hi = l2 // 10, 6 * l2 // 10
        self.flat_targs = None if self.full else targs  # the common call: the flat kernel

    def geometry(self, D: int, rows: int, inplace_lse: bool) -> tuple[int, Any, Any]:
        """``(lanes, launcher with int indices, launcher with 64-bit indices)`` for rows of
        width D: the packs per thread and the index type pick the instantiation.
        ``inplace_lse``: out_lse is s_a or s_b, so a row's lanes must share one warp."""
        nbytes = rows * D * self.elem_bytes
        key = (D, self.mid_lo <= nbytes <= self.mid_hi, inplace_lse)
        if key == self.last_geo_key:  # an engine's calls: one D, one layout
            return self.last_geo
        mid = key[1]
        g = self.geo.get(key)
        if g is None:
            lanes, ppt = _geometry(D // self.vec, mid, inplace_lse)
            wide = _plans.launcher(
                _kernels.MERGE_STATE, (*self.targs, ppt, self.full, "long long"), self.device
            )
            narrow = (
                wide
                if self.full
                else _plans.launcher(_kernels.MERGE_STATE, (*self.targs, ppt, 0, "int"), self.device)
            )
            g = self.geo[key] = (lanes, narrow, wide)
        self.last_geo_key, self.last_geo = key, g
        return g

    def torch_call(self, v_a, s_a, v_b, s_b, out, out_lse, prefix_rows):
        """The engine call (torch tensors, no optional tensor) in straight-line code: read each
        tensor once, check what may change between calls of this signature, launch. Returns
        None when the call is not for this plan or a check fails: the validating path then
        finds the right plan or raises with the argument's name."""
        try:
            dev = self.device
            f32 = self.t_f32
            if (
                v_b.dtype is not self.t_in or s_a.dtype is not f32 or s_b.dtype is not f32
                or v_b.get_device() != dev or s_a.get_device() != dev or s_b.get_device() != dev
            ):  # fmt: skip
                return None
            sha = v_a.shape
            T, H, D = sha
            th = (T, H)
            if v_b.shape != sha or s_a.shape != th or s_b.shape != th or T == 0 or H == 0 or T >= 2**31:
                return None
            sta, stb, ssa, ssb = v_a.stride(), v_b.stride(), s_a.stride(), s_b.stride()
            pa, pb, psa, psb = v_a.data_ptr(), v_b.data_ptr(), s_a.data_ptr(), s_b.data_ptr()
            if D > 1 and (sta[2] != 1 or stb[2] != 1):
                return None
            w, vectorised = self.vec_max, self.vec > 1
            aligned = not ((pa | pb) & 15 or (sta[0] | sta[1] | stb[0] | stb[1] | D) & (w - 1))
            if vectorised and not aligned:
                return None
            if prefix_rows is not None and (type(prefix_rows) is not int or not 0 <= prefix_rows <= T):
                return None
            # bytes each tensor spans (torch strides are never negative)
            isz = self.in_size
            end_a = pa + ((T - 1) * sta[0] + (H - 1) * sta[1] + D) * isz
            end_b = pb + ((T - 1) * stb[0] + (H - 1) * stb[1] + D) * isz
            end_sa = psa + ((T - 1) * ssa[0] + (H - 1) * ssa[1] + 1) * 4
            end_sb = psb + ((T - 1) * ssb[0] + (H - 1) * ssb[1] + 1) * 4
            if out is None:  # allocated: aligned
                if aligned != vectorised:
                    return None
                out = self.empty(sha, dtype=self.t_out, device=v_a.device)
                po, sto = out.data_ptr(), (H * D, D, 1)
                end_o = po
            else:
                if out.get_device() != dev or out.shape != sha or out.requires_grad or out.is_inference():
                    return None
                po, sto = out.data_ptr(), out.stride()
                if (D > 1 and sto[2] != 1) or (T > 1 and sto[0] == 0) or (H > 1 and sto[1] == 0):
                    return None
                if aligned and (po & (w * self.out_size - 1) or (sto[0] | sto[1]) & (w - 1)):
                    aligned = False
                if aligned != vectorised:
                    return None
                end_o = po + ((T - 1) * sto[0] + (H - 1) * sto[1] + D) * self.out_size
                same = self.t_in is self.t_out
                if po < end_a and pa < end_o and not (same and po == pa and sto == sta):
                    return None
                if po < end_b and pb < end_o and not (same and po == pb and sto == stb):
                    return None
                if (po < end_sa and psa < end_o) or (po < end_sb and psb < end_o):
                    return None
            if out_lse is None and self.allocate_lse:
                out_lse = self.empty(th, dtype=f32, device=v_a.device)
                pl, stl = out_lse.data_ptr(), (H, 1)
                end_l = pl
            elif out_lse is not None:
                if (
                    out_lse.dtype is not f32 or out_lse.get_device() != dev or out_lse.shape != th
                    or out_lse.requires_grad or out_lse.is_inference()
                ):  # fmt: skip
                    return None
                pl, stl = out_lse.data_ptr(), out_lse.stride()
                if (T > 1 and stl[0] == 0) or (H > 1 and stl[1] == 0):
                    return None
                end_l = pl + ((T - 1) * stl[0] + (H - 1) * stl[1] + 1) * 4
                if pl < end_sa and psa < end_l and not (pl == psa and stl == ssa):
                    return None
                if pl < end_sb and psb < end_l and not (pl == psb and stl == ssb):
                    return None
                if (pl < end_a and pa < end_l) or (pl < end_b and pb < end_l) or (pl < end_o and po < end_l):
                    return None
            else:
                pl, stl, end_l = 0, (0, 0), 0
        except (AttributeError, TypeError, ValueError):  # not torch tensors, or not 3-D / 2-D
            return None
        # 32-bit index math when every tensor's span in elements (which bounds any element offset
        # the kernel forms in it) and the thread index fit
        span = max(
            (end_a - pa) // isz, (end_b - pb) // isz, (end_sa - psa) // 4, (end_sb - psb) // 4,
            (end_o - po) // self.out_size, T * H * max(D, 1),
        )  # fmt: skip
        fits = span < _INT32 and (out_lse is None or (end_l - pl) // 4 < _INT32)
        inplace = pl in (psa, psb)
        prefix = T if prefix_rows is None else prefix_rows
        if self.flat_targs is not None and not inplace and D and self.launch_flat(
            _runtime.torch_stream(dev), T, H, D, prefix, self.verbatim,
            pa, sta, pb, stb, psa, ssa, psb, ssb, po, sto, pl, stl, not fits,
        ):  # fmt: skip
            return out, out_lse
        lanes, narrow, wide = self.geometry(D, T * H, inplace)
        (narrow if fits and T * H * lanes < _INT32 else wide)(
            -(-T * H * lanes // self.block), _runtime.torch_stream(dev),
            pa, sta[0], sta[1], pb, stb[0], stb[1], po, sto[0], sto[1],
            psa, ssa[0], ssa[1], psb, ssb[0], ssb[1], pl, stl[0], stl[1],
            T, H, D, lanes, prefix, self.verbatim, 0, 0, 0, 0, 0, 0, self.k, self.inv_k, 0,
        )  # fmt: skip
        return out, out_lse

    def __call__(self, call: Call, prefix_rows: Any, names: dict[str, str] | None) -> tuple[Any, Any]:
        f = call.facts
        if len(f) == 6:
            va, sa, vb, sb, o, ol = f
            cu = lens = mask = scale = sinks = None
        else:
            va, sa, vb, sb, o, ol, cu, lens, mask, scale, sinks = f
        ok = (
            _fast_checks_two(f, prefix_rows)
            and call.disjoint_outputs(self.itemsizes, _OUTS_TWO)
            and call.writable((4, 5))
        )
        if not ok:  # something changed since the plan was built: the full checks say what
            _validate_two(call, prefix_rows, names)
        T, H, D = va[1]
        out, o, out_lse, ol = self.outputs(call, call.objs[4], o, call.objs[5], ol, T, H, D)
        if T * H == 0:
            return out, out_lse
        inplace = ol is not None and ol[0] in (sa[0], sb[0])
        # 32-bit index math when every tensor's span in elements and the thread index fit; the
        # outputs allocated above are contiguous, T * H * D elements at most
        widest = _INT32 if call.widest is None else max(call.widest, T * H * max(D, 1))
        prefix = T if prefix_rows is None else int(prefix_rows)
        sa_s, sb_s, va_s, vb_s, o_s = sa[2], sb[2], va[2], vb[2], o[2]
        ol_ptr, ol_st, ol_sh = (ol[0], ol[2][0], ol[2][1]) if ol is not None else (0, 0, 0)
        if self.flat_targs is not None and not inplace and D and self.launch_flat(
            call.stream(), T, H, D, prefix, self.verbatim, va[0], va_s, vb[0], vb_s, sa[0], sa_s,
            sb[0], sb_s, o[0], o_s, ol_ptr, (ol_st, ol_sh), widest >= _INT32,
        ):  # fmt: skip
            return out, out_lse
        lanes, narrow, wide = self.geometry(D, T * H, inplace)
        launch = narrow if T * H * lanes < _INT32 and widest < _INT32 else wide
        launch(
            -(-T * H * lanes // self.block), call.stream(),
            va[0], va_s[0], va_s[1], vb[0], vb_s[0], vb_s[1], o[0], o_s[0], o_s[1],
            sa[0], sa_s[0], sa_s[1], sb[0], sb_s[0], sb_s[1], ol_ptr, ol_st, ol_sh,
            T, H, D, lanes, prefix, self.verbatim,
            cu[0] if cu else 0, lens[0] if lens else 0, cu[1][0] - 1 if cu else 0, self.a_is64,
            mask[0] if mask else 0, sinks[0] if sinks else 0, self.k, self.inv_k,
            scale[0] if scale else 0,
        )  # fmt: skip
        return out, out_lse


# outputs of a two-way merge and the inputs each may alias exactly (facts indices)
_OUTS_TWO = ((4, (0, 2)), (5, (1, 3)))


def _fast_checks_two(f: list, prefix_rows: Any) -> bool:
    """What may change between calls of one signature, checked without building messages."""
    va, sa, vb, sb, o, ol = f[:6]
    cu, lens, mask, scale, sinks = f[6:] if len(f) > 6 else (None,) * 5
    shape = va[1]
    if len(shape) != 3 or vb[1] != shape or sa[1] != shape[:2] or sb[1] != shape[:2]:
        return False
    T, H, D = shape
    if D > 1 and (va[2][2] != 1 or vb[2][2] != 1):
        return False
    if T >= 2**31 or H >= 2**31:
        return False
    if o is not None and (o[1] != shape or (D > 1 and o[2][2] != 1)):
        return False
    if ol is not None and ol[1] != shape[:2]:
        return False
    if prefix_rows is not None and (type(prefix_rows) is not int or not 0 <= prefix_rows <= T):
        return False
    if cu is not None:
        if lens is None or len(cu[1]) != 1 or len(lens[1]) != 1 or lens[1][0] != cu[1][0] - 1:
            return False
        if (cu[1][0] > 1 and cu[2][0] != 1) or (lens[1][0] > 1 and lens[2][0] != 1):
            return False
    elif lens is not None:
        return False
    if mask is not None and (mask[1] != (T,) or (T > 1 and mask[2][0] != 1)):
        return False
    if sinks is not None and (sinks[1] != (H,) or (H > 1 and sinks[2][0] != 1)):
        return False
    return not (scale is not None and _numel(scale[1]) != 1)


_INT32 = 1 << 31
# the tuned forms' option parameters (a_empty, row mask, sinks, fp8 scales) of a plain call
_NO_OPTIONS = (0,) * 11
_FLAT_BLOCK = _kernels.MERGE_STATE_FLAT.block
# Aligned calls of at least this many threads (one per pack), and every wide call (64-bit
# offsets), take the flat kernel in blocks of 512 with the output LSE gathered through shared
# memory; in 32 bits, its rows in tiles of 8 tokens when out_lse (or, without one, s_a) is laid
# [H, T] (merge.cu): measured on an H200 over the grid (bench/NOTES.md), from 2^19 threads on
# 0.5-2 % faster than the forms before it with a [T, H] LSE, up to 5 % with [H, T] (tiles).
_FLAT_GATHERED_THREADS = 1 << 19
# Aligned calls of at most this many packs (16 bytes; a few tokens), whose rows are a power of
# two of at most _HEADS_BLOCK packs, take merge_state_heads_kernel: measured on an H200
# (bench/NOTES.md), 2-4.5 % faster than the flat kernel's SMALL form at T = 1.
_HEADS_PACKS = 2048
_HEADS_BLOCK = _kernels.MERGE_STATE_HEADS.block
# The flat kernel's forms: (kernel, template arguments after the element types and VEC); the
# first two are SMALL = 0 and SMALL = 1, so that a form's index is SMALL there; the 32-bit
# gathered form is followed by its TILE variant.
_FLAT_FORMS = (
    (_kernels.MERGE_STATE_FLAT, (0,)),
    (_kernels.MERGE_STATE_FLAT, (1,)),
    (_kernels.MERGE_STATE_FLAT_GATHERED, (0,)),
    (_kernels.MERGE_STATE_FLAT_GATHERED, (1,)),
    (_kernels.MERGE_STATE_FLAT64_GATHERED, ()),
)
_FLAT_GATHERED, _FLAT_64_GATHERED = 2, 4  # _FLAT_GATHERED + 1: rows in tiles
# Grids of at most this many blocks per SM (one wave: 16 blocks of 128 fill an SM's 2048
# threads) take the flat kernel's SMALL form: measured on an H200 (bench/NOTES.md), up to 6 %
# faster than SMALL = 0 on the smallest grids, 0.5-2.8 % (bf16; fp16 within 0.8 % either way)
# at 2^17-2^18 threads, up to 4 % slower at 31 blocks per SM.
_FLAT_SMALL_BLOCKS_PER_SM = 16


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --- merge_states ------------------------------------------------------------------------------


def merge_states(
    v: Any,
    s: Any,
    *,
    out: Any = None,
    out_lse: Any = None,
    lse_base: str | int = "e",
    out_scale: Any = None,
    sinks: Any = None,
) -> tuple[Any, Any]:
    """Merge N partial states in one pass.

    Args:
        v: ``[N, T, H, D]`` float16 / bfloat16 / float32 (``[T, N, H, D]`` data passed as a
            ``permute(1, 0, 2, 3)`` view: any strides but head_dim's).
        s: ``[N, T, H]`` float32 LSE, any strides.
        out, out_lse, lse_base, out_scale, sinks: as :func:`merge_state`; the outputs may not
            overlap ``v`` or ``s`` at all.

    Empty inputs contribute nothing and their V never reaches the output; all empty gives
    ``(0, -inf)``; NaN propagates. One launch, no host sync.
    """
    fast_key = None
    if (
        out_scale is None
        and sinks is None
        and type(v) is torch_tensor_type()
        and (out is None or type(out) is type(v))
    ):
        # the engine call (torch tensors): a short signature, its plan checks the rest
        fast_key = (
            "merge_states:torch", lse_base, out is None, out_lse is None, v.dtype,
            None if out is None else out.dtype, v.get_device(),
        )  # fmt: skip
        plan = _plans.find(fast_key)
        if plan is not None:
            done = plan.torch_call(v, s, out, out_lse)
            if done is not None:
                return done
    call = Call("merge_states", (v, s, out, out_lse, out_scale, sinks), (lse_base, out is None))
    if call.device < 0:
        return _host.merge_states(call, lambda: _validate_n(call))
    plan = _plans.lookup(call.key(_aligned_n(call)), lambda: _MergeNPlan(call))
    if fast_key is not None and call.is_torch:
        _plans.remember(fast_key, plan)
    return plan(call)


def _validate_n(call: Call) -> dict[str, Any]:
    t = call.views(("v", "s", "out", "out_lse", "out_scale", "sinks"))
    vt = _checks.tensor(t["v"], "v", 4, _dtypes.V_IN)
    N, T, H, D = vt.shape
    st = _checks.tensor(t["s"], "s", 3, _dtypes.LSE)
    _checks.shape(st, "s", (N, T, H), "N, T, H")
    _checks.unit_last_stride(vt, "v")
    if T >= 2**31 or H >= 2**31 or N >= 2**31:
        raise ValueError(f"v: N, T and H must be below 2^31, got shape {(N, T, H, D)}")
    named = [("v", vt), ("s", st)]
    o = ol = None
    if t["out"] is not None:
        o = _checks.tensor(t["out"], "out", 3, _dtypes.V_OUT)
        _checks.shape(o, "out", (T, H, D), "T, H, D")
        _checks.unit_last_stride(o, "out")
        named.append(("out", o))
    if t["out_lse"] is not None:
        ol = _checks.tensor(t["out_lse"], "out_lse", 2, _dtypes.LSE)
        _checks.shape(ol, "out_lse", (T, H), "T, H")
        named.append(("out_lse", ol))
    device = _checks.same_device(named)
    _checks.lse_base(call.scalars[0])
    sinks = _checks.sinks(t["sinks"], "sinks", H, device) if t["sinks"] is not None else None
    scale = _checks.out_scale(t["out_scale"], o.dtype if o is not None else vt.dtype, device, "out_scale")
    if N == 0:
        raise ValueError("v: expected at least one state (N >= 1), got N = 0")
    ins = [("v", vt), ("s", st)] + [(nm, x) for nm, x in (("out_scale", scale), ("sinks", sinks)) if x]
    _checks.outputs([("out", o, ()), ("out_lse", ol, ())], ins)
    return {
        "v": vt, "s": st, "out": o, "out_lse": ol, "scale": scale, "sinks": sinks, "device": device,
        "base": _checks.lse_base(call.scalars[0]),
    }  # fmt: skip


def _aligned_n(call: Call) -> bool:
    v, out = call.facts[0], call.facts[2]
    if len(v[1]) != 4 or call.dtypes[0] not in _dtypes.ITEMSIZE:
        return False
    vec = _kernels.vec(call.dtypes[0])
    if v[1][3] % vec or v[0] % 16 or any(st % vec for st in v[2][:3]):
        return False
    if out is not None:
        osize = _dtypes.ITEMSIZE.get(call.dtypes[2], 1)
        if out[0] % (vec * osize) or out[2][0] % vec or out[2][1] % vec:
            return False
    return True


class _MergeNPlan(_MergePlan):
    def __init__(self, call: Call) -> None:
        v = _validate_n(call)
        vt, o = v["v"], v["out"]
        out_dtype = o.dtype if o is not None else vt.dtype
        vec = _kernels.vec(vt.dtype) if call.aligned else 1
        targs = (_dtypes.ctype(vt.dtype), _dtypes.ctype(out_dtype), vec)
        self.launch = _plans.launcher(_kernels.MERGE_STATES, targs, v["device"])
        self.block = _kernels.MERGE_STATES.block
        self._setup(call, v["device"], vt.dtype, out_dtype, vec, call.scalars[1])
        # N = 2 without sinks or fp8 scale is merge_state's common call: its flat kernel moves the
        # data faster than the N-way kernel's loop over inputs (bench/NOTES.md)
        self.flat_targs = None if call.objs[4] is not None or call.objs[5] is not None else targs

    def launch_two(self, stream, T, H, D, pv, stv, ps, sts, po, sto, pl, stl, wide) -> bool:
        """States 0 and 1 (at v, v + stv[0]; s, s + sts[0]) through the flat kernel."""
        sv, ss = stv[1:], sts[1:]
        pb, psb = pv + stv[0] * self.in_size, ps + sts[0] * 4
        return self.launch_flat(
            stream, T, H, D, T, 0, pv, sv, pb, sv, ps, ss, psb, ss, po, sto, pl, stl, wide
        )

    def torch_call(self, v: Any, s: Any, out: Any, out_lse: Any) -> tuple[Any, Any] | None:
        """The engine call in straight-line code (see ``_MergeTwoPlan.torch_call``); None sends
        the call to the validating path. The outputs may not overlap the inputs at all."""
        try:
            dev, f32 = self.device, self.t_f32
            if v.dtype is not self.t_in or s.dtype is not f32 or s.get_device() != dev:
                return None
            N, T, H, D = v.shape
            if s.shape != (N, T, H) or N == 0 or T == 0 or H == 0 or T >= 2**31:
                return None
            stv, pv = v.stride(), v.data_ptr()
            w, vectorised = self.vec_max, self.vec > 1
            aligned = not (pv & 15 or (stv[0] | stv[1] | stv[2] | D) & (w - 1))
            if out is None:  # allocated: contiguous, aligned, apart from the inputs
                if aligned != vectorised:
                    return None
                out = self.empty((T, H, D), dtype=self.t_out, device=v.device)
                if out_lse is None and self.allocate_lse:
                    out_lse = self.empty((T, H), dtype=f32, device=v.device)
            elif out.get_device() != dev or out.requires_grad or out.is_inference() or out.shape != (T, H, D):
                return None
            sts, sto = s.stride(), out.stride()
            ps, po = s.data_ptr(), out.data_ptr()
            if (D > 1 and (stv[3] != 1 or sto[2] != 1)) or (T > 1 and sto[0] == 0) or (H > 1 and sto[1] == 0):
                return None
            if aligned and (po & (w * self.out_size - 1) or (sto[0] | sto[1]) & (w - 1)):
                aligned = False
            if aligned != vectorised:
                return None
            end_v = pv + ((N - 1) * stv[0] + (T - 1) * stv[1] + (H - 1) * stv[2] + D) * self.in_size
            end_s = ps + ((N - 1) * sts[0] + (T - 1) * sts[1] + (H - 1) * sts[2] + 1) * 4
            end_o = po + ((T - 1) * sto[0] + (H - 1) * sto[1] + D) * self.out_size
            if (po < end_v and pv < end_o) or (po < end_s and ps < end_o):
                return None
            if out_lse is not None:
                if (
                    out_lse.dtype is not f32 or out_lse.get_device() != dev or out_lse.shape != (T, H)
                    or out_lse.requires_grad or out_lse.is_inference()
                ):  # fmt: skip
                    return None
                pl, stl = out_lse.data_ptr(), out_lse.stride()
                if (T > 1 and stl[0] == 0) or (H > 1 and stl[1] == 0):
                    return None
                end_l = pl + ((T - 1) * stl[0] + (H - 1) * stl[1] + 1) * 4
                if (pl < end_v and pv < end_l) or (pl < end_s and ps < end_l) or (pl < end_o and po < end_l):
                    return None
            else:
                pl, stl = 0, (0, 0)
        except (AttributeError, TypeError, ValueError):
            return None
        # 32-bit index math by elements, as on the validating path
        if (
            N == 2
            and self.flat_targs is not None
            and D
            and self.launch_two(
                _runtime.torch_stream(dev), T, H, D, pv, stv, ps, sts, po, sto, pl, stl,
                max((end_v - pv) // self.in_size, (end_s - ps) // 4, (end_o - po) // self.out_size, T * H * D)
                >= _INT32 or (out_lse is not None and (end_l - pl) // 4 >= _INT32),
            )
        ):  # fmt: skip
            return out, out_lse
        lanes = _lanes_n(D // self.vec, T * H, self.sms)
        self.launch(
            -(-T * H * lanes // self.block), _runtime.torch_stream(dev),
            pv, stv[0], stv[1], stv[2], ps, sts[0], sts[1], sts[2], po, sto[0], sto[1],
            pl, stl[0], stl[1], N, T, H, D, lanes, 0, self.k, self.inv_k, 0,
        )  # fmt: skip
        return out, out_lse

    def __call__(self, call: Call) -> tuple[Any, Any]:
        f = call.facts
        v, s, o, ol, scale, sinks = f
        if not (
            _fast_checks_n(f) and call.disjoint_outputs(self.itemsizes, _OUTS_N) and call.writable((2, 3))
        ):
            _validate_n(call)
        N, T, H, D = v[1]
        out, o, out_lse, ol = self.outputs(call, call.objs[2], o, call.objs[3], ol, T, H, D)
        if T * H == 0:
            return out, out_lse
        vs, ss, os_ = v[2], s[2], o[2]
        ol_ptr, ol_st, ol_sh = (ol[0], ol[2][0], ol[2][1]) if ol is not None else (0, 0, 0)
        # outputs allocated above are contiguous, T * H * D elements at most
        widest = _INT32 if call.widest is None else max(call.widest, T * H * max(D, 1))
        if (
            N == 2
            and self.flat_targs is not None
            and D
            and self.launch_two(
                call.stream(), T, H, D, v[0], vs, s[0], ss, o[0], os_, ol_ptr, (ol_st, ol_sh), widest >= _INT32
            )
        ):  # fmt: skip
            return out, out_lse
        lanes = _lanes_n(D // self.vec, T * H, self.sms)
        self.launch(
            -(-T * H * lanes // self.block), call.stream(),
            v[0], vs[0], vs[1], vs[2], s[0], ss[0], ss[1], ss[2], o[0], os_[0], os_[1],
            ol_ptr, ol_st, ol_sh, N, T, H, D, lanes,
            sinks[0] if sinks else 0, self.k, self.inv_k, scale[0] if scale else 0,
        )  # fmt: skip
        return out, out_lse


_OUTS_N = ((2, ()), (3, ()))


def _fast_checks_n(f: list) -> bool:
    v, s, o, ol, scale, sinks = f
    shape = v[1]
    if len(shape) != 4 or s[1] != shape[:3] or shape[0] == 0:
        return False
    N, T, H, D = shape
    if (D > 1 and v[2][3] != 1) or T >= 2**31 or H >= 2**31 or N >= 2**31:
        return False
    if o is not None and (o[1] != shape[1:] or (D > 1 and o[2][2] != 1)):
        return False
    if ol is not None and ol[1] != shape[1:3]:
        return False
    if sinks is not None and (sinks[1] != (H,) or (H > 1 and sinks[2][0] != 1)):
        return False
    return not (scale is not None and _numel(scale[1]) != 1)


# --- geometry -----------------------------------------------------------------------------------


_ROW_GROUP_MAX = 128  # lanes of a row group at most: one block (kernels_cu/merge.cu)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _geometry(packs: int, mid: bool, inplace_lse: bool) -> tuple[int, int]:
    """``(lanes, packs per thread)`` of merge_state's row groups (kernels_cu/merge.cu).

    One pack per thread, a row's packs over ``lanes`` threads, is the fastest in the measurements
    (bench/NOTES.md) except: batches that stay in L2 (``mid``: a tenth to six tenths of it) run
    faster with two packs per thread; a row of more than 32 packs whose LSE is written in place
    keeps its lanes in one warp (two packs each); a row wider than one block, two per round."""
    lanes = _pow2_at_least(packs)
    if packs > 32:
        if inplace_lse:
            return 32, 2
        return min(lanes, _ROW_GROUP_MAX), 1 if packs <= _ROW_GROUP_MAX else 2
    if mid and packs >= 4:
        return lanes // 2, 2
    return lanes, 1


def _lanes_n(packs: int, rows: int, sms: int) -> int:
    """Threads per row of merge_states: as merge_state's, two packs per lane for large batches."""
    lanes = min(32, _pow2_at_least(packs))
    if lanes > 1 and rows * packs >= (1 << 16) * sms:  # 64 K elements per SM
        lanes //= 2
    return lanes
