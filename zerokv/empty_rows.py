"""Shared launch of the empty-rows kernels (``fixup_zero_kv_rows``, ``mask_empty_context``)."""

from __future__ import annotations

from typing import Any

from . import _checks, _dtypes, _host, _runtime, reference
from ._tensors import Tensor, torch_key

_THREADS = 256
_ARGS = "<14q"  # struct layout of the kernels' parameter lists (kernels_cu/empty_rows.cuh)
_BLOCKS_PER_SM = 4  # a persistent grid of full occupancy (the kernels are bounded to 64 registers)


def register(stem: str, kernel: str) -> None:
    _runtime.register(
        stem,
        [
            f"{kernel}<{_dtypes.ctype(d)}, {vec}>"
            for d in _dtypes.V_IN
            for vec in (1, 16 // _dtypes.itemsize(d))
        ],
    )


def run(
    stem: str,
    kernel: str,
    out: Any,
    lse: Any,
    cu_seqlens_q: Any,
    lens: Any,
    names: tuple[str, str, str, str],
    lens_are_offsets: bool,
) -> None:
    """Validate and launch. ``lens``: per-request kv lengths ``[B]`` (empty when 0) or, with
    ``lens_are_offsets``, context offsets ``[B + 1]`` (empty when two neighbours are equal)."""
    key = torch_key(out, lse, cu_seqlens_q, lens)
    if key is not None:
        key = (stem, key)
        prepared = _runtime.launches.get(key)
        if prepared is not None:  # the same call as before: already validated and packed
            prepared(_runtime.torch_stream(prepared.device))
            return

    n_out, n_lse, n_cu, n_lens = names
    o = _checks.tensor(out, n_out, 3, _dtypes.V_IN)
    T, H, D = o.shape
    _checks.unit_last_stride(o, n_out)
    s = _checks.tensor(lse, n_lse, 2, _dtypes.LSE)
    _checks.shape(s, n_lse, (T, H), "T, H")
    device = _checks.same_device([(n_out, o), (n_lse, s)])
    cu = _checks.index_tensor(cu_seqlens_q, n_cu, None, device)
    if cu.shape[0] < 1:
        raise ValueError(f"{n_cu}: expected B + 1 >= 1 entries, got 0")
    B = cu.shape[0] - 1
    ln = _checks.index_tensor(lens, n_lens, B + 1 if lens_are_offsets else B, device)
    if T >= 2**31:
        raise ValueError(f"{n_out}: T must be below 2^31, got shape {tuple(o.shape)}")

    if device < 0:
        cu64, ln64 = _host.to_f64(cu), _host.to_f64(ln)
        if lens_are_offsets:
            res, new_lse = reference.mask_empty_context(_host.to_f64(o), _host.to_f64(s), cu64, ln64)
            empty = (ln64[1:] - ln64[:-1]) == 0
        else:
            res, new_lse = reference.fixup_zero_kv_rows(_host.to_f64(o), _host.to_f64(s), ln64, cu64)
            empty = ln64 == 0
        rows = reference.rows_of_requests(cu64, empty, T)
        _host.write(o, res, rows)
        _host.write(s, new_lse, rows)
        return
    if B == 0 or T * H == 0:
        return

    vec = _vector_width(o)
    flat = int(o.strides[1] == D and o.strides[0] == H * D)
    args = (
        o.ptr, o.strides[0], o.strides[1], s.ptr, s.strides[0], s.strides[1],
        cu.ptr, int(cu.dtype == "int64"), ln.ptr, int(ln.dtype == "int64"),
        B, H, D, flat,
    )  # fmt: skip
    expr = f"{kernel}<{_dtypes.ctype(o.dtype)}, {vec}>"
    grid = (_BLOCKS_PER_SM * _runtime.sm_count(device), 1, 1)
    _runtime.launch(stem, expr, device, _runtime.stream_for(o), grid, (_THREADS, 1, 1), _ARGS, args, key)


def _vector_width(o: Tensor) -> int:
    vec = 16 // _dtypes.itemsize(o.dtype)
    D = o.shape[2]
    if D % vec or o.ptr % 16 or o.strides[0] % vec or o.strides[1] % vec:
        return 1
    return vec
