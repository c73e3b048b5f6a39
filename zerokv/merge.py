"""Merging partial attention states by their log-sum-exp: two-way and N-way."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _checks, _dtypes, _host, _runtime, reference
from ._tensors import Tensor, torch_key

_TILE_THREADS = 128  # per block: 4 warps, each merging a tile of 32 rows

_runtime.register(
    "merge",
    [
        f"{kernel}<{_dtypes.ctype(i)}, {_dtypes.ctype(o)}, {vec}>"
        for kernel in ("merge_state_kernel", "merge_states_kernel")
        for i in _dtypes.V_IN
        for o in _dtypes.V_OUT
        for vec in (1, 16 // _dtypes.itemsize(i))
    ],
)

_LOG2E = math.log2(math.e)
_BASES = {"e": (_LOG2E, 1.0 / _LOG2E), "2": (1.0, 1.0)}
# struct layouts of the kernels' parameter lists (see kernels_cu/merge.cu)
_MERGE_STATE_ARGS = "<30q2fq"
_MERGE_STATES_ARGS = "<20q2fq"


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
) -> tuple[Any, Any]:
    """Merge two partial attention states ``(v_a, s_a)`` and ``(v_b, s_b)`` into one.

    Args:
        v_a, v_b: ``[T, H, D]`` float16 / bfloat16 / float32, same dtype; head_dim contiguous,
            token and head strides free.
        s_a, s_b: ``[T, H]`` float32 LSE, any strides (pass ``lse.T`` for an ``[H, T]`` buffer).
        out: ``[T, H, D]`` output, float16 / bfloat16 / float32 (may differ from the inputs),
            or float8_e4m3fn with ``out_scale``; may alias ``v_a`` or ``v_b``. ``None``: allocated.
        out_lse: ``[T, H]`` float32, may alias ``s_a`` or ``s_b``. ``None`` with ``out=None``:
            allocated; ``None`` with ``out`` given: the merged LSE is not written.
        lse_base: ``"e"`` (natural log) or ``2`` (FlashInfer / trtllm-gen).
        prefix_rows: rows ``t >= prefix_rows`` take state b alone (with the empty rule).
        a_empty: ``(cu_seqlens_q [B+1], kv_lens [B])`` int32/int64: rows of requests with
            ``kv_lens[i] == 0`` treat state a as empty without reading it (the fixup fused in).
        out_scale: float32 tensor of one element: fp8 output ``clamp(merged / scale)``.

    Empty rule: an LSE of -inf or +inf gives weight 0 and that V is never read; both empty give
    ``(0, -inf)``. NaN in an LSE makes the row NaN. One launch, no host sync, no allocation
    unless an output is ``None``; runs on the current stream of the tensors' device.

    Returns:
        ``(out, out_lse)`` (``out_lse`` is ``None`` when not written).

    Example::

        out, lse = zerokv.merge_state(v_prefix, lse_prefix, v_suffix, lse_suffix)
    """
    key = None
    if out is not None and _rememberable(lse_base, prefix_rows, a_empty):
        key = _merge_key(
            v_a, s_a, v_b, s_b, out, out_lse, a_empty, None, out_scale, lse_base, prefix_rows, False
        )
        prepared = _runtime.launches.get(key)
        if prepared is not None:  # the same call as before: already validated and packed
            prepared(_runtime.torch_stream(prepared.device))
            return out, out_lse
    return merge_two(
        v_a, s_a, v_b, s_b, out, out_lse, lse_base, prefix_rows, a_empty, out_scale,
        suffix_verbatim=False, row_mask=None, allocate_lse=out is None, key=key,
    )  # fmt: skip


def merge_two(
    v_a: Any,
    s_a: Any,
    v_b: Any,
    s_b: Any,
    out: Any,
    out_lse: Any,
    lse_base: Any,
    prefix_rows: int | None,
    a_empty: tuple[Any, Any] | None,
    out_scale: Any,
    *,
    suffix_verbatim: bool,
    row_mask: Any,
    allocate_lse: bool,
    names: tuple[str, ...] = ("v_a", "s_a", "v_b", "s_b", "out", "out_lse"),
    key: Any = ...,
) -> tuple[Any, Any]:
    """The two-way merge behind ``merge_state`` and the engine adapters.

    ``suffix_verbatim``: rows past ``prefix_rows`` copy state b as it is (vLLM). ``row_mask``:
    ``[T]`` bool, rows with False are not touched (FlashInfer ``merge_state_in_place``).
    ``names``: how the arguments are called in error messages (the adapters' own names).
    ``key``: the call's key when the caller has already looked for a remembered launch.
    """
    if key is ...:
        key = None
        if out is not None and _rememberable(lse_base, prefix_rows, a_empty):
            key = _merge_key(
                v_a,
                s_a,
                v_b,
                s_b,
                out,
                out_lse,
                a_empty,
                row_mask,
                out_scale,
                lse_base,
                prefix_rows,
                suffix_verbatim,
            )
            prepared = _runtime.launches.get(key)
            if prepared is not None:  # the same call as before: already validated and packed
                prepared(_runtime.torch_stream(prepared.device))
                return out, out_lse

    n_va, n_sa, n_vb, n_sb, n_out, n_lse = names
    va = _checks.tensor(v_a, n_va, 3, _dtypes.V_IN)
    T, H, D = va.shape
    vb = _checks.tensor(v_b, n_vb, 3, _dtypes.V_IN)
    _checks.shape(vb, n_vb, (T, H, D), "T, H, D")
    if vb.dtype != va.dtype:
        raise TypeError(f"{n_vb}: dtype {vb.dtype} differs from {n_va} dtype {va.dtype}")
    sa = _checks.tensor(s_a, n_sa, 2, _dtypes.LSE)
    sb = _checks.tensor(s_b, n_sb, 2, _dtypes.LSE)
    _checks.shape(sa, n_sa, (T, H), "T, H")
    _checks.shape(sb, n_sb, (T, H), "T, H")
    _checks.unit_last_stride(va, n_va)
    _checks.unit_last_stride(vb, n_vb)
    if T >= 2**31 or H >= 2**31:
        raise ValueError(f"{n_va}: T and H must be below 2^31, got shape {(T, H, D)}")
    named = [(n_va, va), (n_sa, sa), (n_vb, vb), (n_sb, sb)]

    o = None
    if out is not None:
        o = _checks.tensor(out, n_out, 3, _dtypes.V_OUT)
        _checks.shape(o, n_out, (T, H, D), "T, H, D")
        _checks.unit_last_stride(o, n_out)
        named.append((n_out, o))
    ol = None
    if out_lse is not None:
        ol = _checks.tensor(out_lse, n_lse, 2, _dtypes.LSE)
        _checks.shape(ol, n_lse, (T, H), "T, H")
        named.append((n_lse, ol))
    device = _checks.same_device(named)
    if o is not None:
        _checks.same_memory_same_layout(o, n_out, va, n_va)
        _checks.same_memory_same_layout(o, n_out, vb, n_vb)
    if ol is not None:
        _checks.same_memory_same_layout(ol, n_lse, sa, n_sa)
        _checks.same_memory_same_layout(ol, n_lse, sb, n_sb)

    base = _checks.lse_base(lse_base)
    if prefix_rows is None:
        prefix = T
    elif isinstance(prefix_rows, bool) or not isinstance(prefix_rows, (int, np.integer)):
        raise TypeError(f"prefix_rows: expected an int, got {type(prefix_rows).__name__}")
    elif not 0 <= prefix_rows <= T:
        raise ValueError(f"prefix_rows: expected 0 <= prefix_rows <= T={T}, got {prefix_rows}")
    else:
        prefix = int(prefix_rows)

    cu = lens = None
    if a_empty is not None:
        if not isinstance(a_empty, (tuple, list)) or len(a_empty) != 2:
            raise TypeError("a_empty: expected a pair (cu_seqlens_q, kv_lens)")
        cu = _checks.index_tensor(a_empty[0], "a_empty[0] (cu_seqlens_q)", None, device)
        if cu.shape[0] < 1:
            raise ValueError("a_empty[0] (cu_seqlens_q): expected B + 1 >= 1 entries, got 0")
        lens = _checks.index_tensor(a_empty[1], "a_empty[1] (kv_lens)", cu.shape[0] - 1, device)
        if lens.dtype != cu.dtype:
            raise TypeError(
                f"a_empty: cu_seqlens_q is {cu.dtype} but kv_lens is {lens.dtype}; use one index dtype"
            )

    mask = None
    if row_mask is not None:
        mask = _checks.tensor(row_mask, "mask", 1, _dtypes.MASK_NAMES)
        _checks.shape(mask, "mask", (T,), "T")
        if mask.device != device:
            raise ValueError(f"mask is on another device than {n_va}")
        if T > 1 and mask.strides[0] != 1:
            raise ValueError(f"mask: must be contiguous, got stride {mask.strides[0]}")

    scale = _checks.out_scale(out_scale, o.dtype if o is not None else va.dtype, device)

    # -- validated: allocate what was asked for, then compute --
    if o is None:
        out = _host.new(va, (T, H, D), va.dtype)
        o = _view_new(out)
    if ol is None and allocate_lse:
        out_lse = _host.new(sa, (T, H), "float32")
        ol = _view_new(out_lse)

    if device < 0:
        _merge_two_host(va, sa, vb, sb, o, ol, base, prefix, cu, lens, mask, scale, suffix_verbatim)
        return out, out_lse
    if T * H == 0 or D == 0:
        return out, out_lse

    vec = _vector_width(va.dtype, o.dtype, D, (va, vb), o)
    tile, grid = _tiles(T * H)
    k, inv_k = _BASES[base]
    args = (
        va.ptr, va.strides[0], va.strides[1],
        vb.ptr, vb.strides[0], vb.strides[1],
        o.ptr, o.strides[0], o.strides[1],
        sa.ptr, sa.strides[0], sa.strides[1],
        sb.ptr, sb.strides[0], sb.strides[1],
        ol.ptr if ol is not None else 0, ol.strides[0] if ol else 0, ol.strides[1] if ol else 0,
        T, H, D, _lanes(D, vec), tile, prefix, int(suffix_verbatim),
        cu.ptr if cu else 0, lens.ptr if lens else 0,
        cu.shape[0] - 1 if cu else 0, int(cu is not None and cu.dtype == "int64"),
        mask.ptr if mask else 0, k, inv_k, scale.ptr if scale else 0,
    )  # fmt: skip
    expr = f"merge_state_kernel<{_dtypes.ctype(va.dtype)}, {_dtypes.ctype(o.dtype)}, {vec}>"
    stream = _runtime.stream_for(va)
    _runtime.launch("merge", expr, device, stream, grid, (_TILE_THREADS, 1, 1), _MERGE_STATE_ARGS, args, key)
    return out, out_lse


def merge_states(
    v: Any,
    s: Any,
    *,
    out: Any = None,
    out_lse: Any = None,
    lse_base: str | int = "e",
    out_scale: Any = None,
) -> tuple[Any, Any]:
    """Merge N partial states in one pass.

    Args:
        v: ``[N, T, H, D]`` float16 / bfloat16 / float32 (``[T, N, H, D]`` data passed as a
            ``permute(1, 0, 2, 3)`` view: any strides but head_dim's).
        s: ``[N, T, H]`` float32 LSE, any strides.
        out, out_lse, lse_base, out_scale: as :func:`merge_state` (``out`` must not overlap ``v``).

    Empty inputs are skipped without reading their V; all empty gives ``(0, -inf)``; NaN
    propagates. One launch, no host sync.
    """
    key = None
    if out is not None and type(lse_base) in (str, int):
        key = torch_key(v, s, out, out_lse, out_scale)
        if key is not None:
            key = ("merge_states", key, lse_base)
            prepared = _runtime.launches.get(key)
            if prepared is not None:  # the same call as before: already validated and packed
                prepared(_runtime.torch_stream(prepared.device))
                return out, out_lse

    vt = _checks.tensor(v, "v", 4, _dtypes.V_IN)
    N, T, H, D = vt.shape
    st = _checks.tensor(s, "s", 3, _dtypes.LSE)
    _checks.shape(st, "s", (N, T, H), "N, T, H")
    _checks.unit_last_stride(vt, "v")
    named = [("v", vt), ("s", st)]
    o = ol = None
    if out is not None:
        o = _checks.tensor(out, "out", 3, _dtypes.V_OUT)
        _checks.shape(o, "out", (T, H, D), "T, H, D")
        _checks.unit_last_stride(o, "out")
        named.append(("out", o))
    if out_lse is not None:
        ol = _checks.tensor(out_lse, "out_lse", 2, _dtypes.LSE)
        _checks.shape(ol, "out_lse", (T, H), "T, H")
        named.append(("out_lse", ol))
    device = _checks.same_device(named)
    base = _checks.lse_base(lse_base)
    scale = _checks.out_scale(out_scale, o.dtype if o is not None else vt.dtype, device)
    if N == 0:
        raise ValueError("v: expected at least one state (N >= 1), got N = 0")

    allocate_lse = out is None
    if o is None:
        out = _host.new(vt, (T, H, D), vt.dtype)
        o = _view_new(out)
    if ol is None and allocate_lse:
        out_lse = _host.new(st, (T, H), "float32")
        ol = _view_new(out_lse)

    if device < 0:
        res, lse = reference.merge_states(_host.to_f64(vt), _host.to_f64(st), base)
        _host.write(o, _scaled(res, scale))
        if ol is not None:
            _host.write(ol, lse)
        return out, out_lse
    if T * H == 0 or D == 0:
        return out, out_lse

    vec = _vector_width(vt.dtype, o.dtype, D, (vt,), o, extra_strides=(vt.strides[0],))
    tile, grid = _tiles(T * H)
    k, inv_k = _BASES[base]
    args = (
        vt.ptr, vt.strides[0], vt.strides[1], vt.strides[2],
        st.ptr, st.strides[0], st.strides[1], st.strides[2],
        o.ptr, o.strides[0], o.strides[1],
        ol.ptr if ol is not None else 0, ol.strides[0] if ol else 0, ol.strides[1] if ol else 0,
        N, T, H, D, _lanes(D, vec), tile, k, inv_k, scale.ptr if scale else 0,
    )  # fmt: skip
    expr = f"merge_states_kernel<{_dtypes.ctype(vt.dtype)}, {_dtypes.ctype(o.dtype)}, {vec}>"
    stream = _runtime.stream_for(vt)
    _runtime.launch("merge", expr, device, stream, grid, (_TILE_THREADS, 1, 1), _MERGE_STATES_ARGS, args, key)
    return out, out_lse


# --- helpers ----------------------------------------------------------------------------------


def _rememberable(lse_base: Any, prefix_rows: Any, a_empty: Any) -> bool:
    """Scalars that can key a remembered launch (anything else takes the validating path)."""
    return (
        type(lse_base) in (str, int)
        and (prefix_rows is None or type(prefix_rows) is int)
        and (a_empty is None or (type(a_empty) is tuple and len(a_empty) == 2))
    )


def _merge_key(
    v_a, s_a, v_b, s_b, out, out_lse, a_empty, row_mask, out_scale, lse_base, prefix_rows, verbatim
):
    tensors = torch_key(v_a, s_a, v_b, s_b, out, out_lse, *(a_empty or (None, None)), row_mask, out_scale)
    return None if tensors is None else ("merge_state", tensors, lse_base, prefix_rows, verbatim)


def _view_new(x: Any) -> Tensor:
    from ._tensors import view

    return view(x, "output")


def _vector_width(
    in_dtype: str, out_dtype: str, D: int, ins: tuple[Tensor, ...], out: Tensor, extra_strides=()
) -> int:
    """16-byte accesses where every pointer and stride allows; 1 (scalar path) otherwise."""
    vec = 16 // _dtypes.itemsize(in_dtype)
    if D % vec:
        return 1
    out_bytes = vec * _dtypes.itemsize(out_dtype)
    if out.ptr % out_bytes or out.strides[0] % vec or out.strides[1] % vec:
        return 1
    for t in ins:
        if t.ptr % 16 or any(s % vec for s in t.strides[:-1]):
            return 1
    if any(s % vec for s in extra_strides):
        return 1
    return vec


def _tiles(rows: int) -> tuple[int, tuple[int, int, int]]:
    """Rows per warp tile and the grid: 32-row tiles once there are enough rows to keep every SM
    busy (~64 rows per thread block's worth of warps), smaller tiles for small batches, so that
    their latency is one tile's, not 32 rows one after another."""
    tile = 1 << min(5, max(0, (rows // 2048).bit_length() - 1)) if rows >= 2048 else 1
    warps_per_block = _TILE_THREADS // 32
    tiles = -(-rows // tile)
    return tile, (-(-tiles // warps_per_block), 1, 1)


def _lanes(D: int, vec: int) -> int:
    """Threads per row: the accesses a row needs, rounded up to a power of two, at most 32."""
    accesses = (D + vec - 1) // vec
    return min(32, 1 << max(0, accesses - 1).bit_length())


def _scaled(res: np.ndarray, scale: Tensor | None) -> np.ndarray:
    if scale is None:
        return res
    s = float(_host.to_f64(scale).reshape(-1)[0])
    return np.clip(res / s, -448.0, 448.0)


def _merge_two_host(va, sa, vb, sb, o, ol, base, prefix, cu, lens, mask, scale, suffix_verbatim) -> None:
    T = sa.shape[0]
    a_empty_rows = None
    if cu is not None:
        a_empty_rows = reference.rows_of_requests(_host.to_f64(cu), _host.to_f64(lens) == 0, T)
    res, lse = reference.merge_state(
        _host.to_f64(va), _host.to_f64(sa), _host.to_f64(vb), _host.to_f64(sb),
        lse_base=base, prefix_rows=prefix, a_empty_rows=a_empty_rows, suffix_verbatim=suffix_verbatim,
    )  # fmt: skip
    rows = None if mask is None else _host.to_f64(mask).astype(bool)
    _host.write(o, _scaled(res, scale), rows)
    if ol is not None:
        _host.write(ol, lse, rows)
