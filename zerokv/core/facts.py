"""Reading a call's arguments once into a named record of facts: a signature's first call, and
the calls its bound call (:mod:`zerokv.core.bound`) does not take.

Each op has its record: for every tensor its pointer, strides and shape under the names of
the kernels' parameters (``va``, ``va_st``, ``va_sh``, ...), so that a launch packs them by
name, plus the call's signature part (dtypes, devices, vector alignment). torch tensors are
read directly (``data_ptr``/``shape``/``stride``: no ``__dlpack__``, no stream handshake);
every other producer through :func:`zerokv.core.tensors.view`. Nothing here validates: a
reader that meets anything unexpected returns None and the op's full validation names it.
"""

from __future__ import annotations

from typing import Any

from . import layout as _layout
from .generic_tensors import _family, generic

_ITEMSIZE = {}  # dtype (torch object or name) -> bytes, filled as dtypes are met


def _itemsize(dtype: Any) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        from .checks import itemsize

        size = _ITEMSIZE[dtype] = dtype.itemsize if hasattr(dtype, "itemsize") else itemsize(str(dtype))
    return size


class TwoFacts:
    """A two-way merge call: its objects (``objs``, the caller's, in the order v_a, s_a, v_b,
    s_b, out, out_lse, a_cu, a_lens, row_mask, out_scale, sinks[, out_block_scale]), its
    signature part (``sig``) and each tensor's facts under the kernels' parameter names (a
    missing tensor has pointer 0). ``torch``: every tensor is a torch tensor."""

    __slots__ = (
        "objs", "sig", "torch", "device",
        "va", "va_st", "va_sh", "vb", "vb_st", "vb_sh", "sa", "sa_st", "sa_sh", "sb", "sb_st", "sb_sh",
        "out", "out_st", "out_sh", "olse", "ol_st", "ol_sh", "T", "H", "D", "rows", "prefix_rows",
        "a_cu", "a_lens", "a_batch", "row_mask", "sinks", "out_scale", "bscale", "bs_st", "bs_sg",
    )  # fmt: skip


def read_two(objs: tuple, lse_ht: bool = False) -> TwoFacts | None:
    """The facts of a two-way merge; None when an argument is not a tensor of the expected
    rank (the full validation then says which). ``lse_ht``: the LSEs are ``[H, T]`` tensors,
    read as their ``[T, H]`` transposes (no view made)."""
    try:
        return _read_two(objs, True, lse_ht, objs)  # torch tensors: any other object has no data_ptr
    except _UNREADABLE:
        return _read_generic(_read_two, objs, lse_ht)


_UNREADABLE = (AttributeError, TypeError, ValueError, RuntimeError)  # RuntimeError: a sparse tensor


def _read_generic(reader: Any, objs: tuple, *extra: Any) -> Any:
    """``reader(objs, family, *extra, facts)`` over the objects' generic facts (CuPy, DLPack
    producers, torch mixed with them); None when one cannot be read."""
    try:
        gen = tuple(generic(x) for x in objs)
        return reader(objs, _family(gen), *extra, gen)
    except _UNREADABLE:
        return None


def _read_two(objs: tuple, torch: bool, ht: bool, xs: tuple) -> TwoFacts:
    """``xs``: the tensors (``objs`` or their generic facts), out_block_scale last when given."""
    v_a, s_a, v_b, s_b, out, out_lse, cu, lens, mask, scale, sinks, *rest = xs
    f = TwoFacts()
    f.objs, f.torch = objs, torch is True
    f.va = pa = v_a.data_ptr()
    f.T, f.H, f.D = _, _, D = v_a.shape
    f.va_st, f.va_sh, _ = v_a.stride()
    f.vb = pb = v_b.data_ptr()
    f.vb_st, f.vb_sh, _ = v_b.stride()
    st_a, st_b = (s_a.stride()[::-1], s_b.stride()[::-1]) if ht else (s_a.stride(), s_b.stride())
    f.sa, f.sb = s_a.data_ptr(), s_b.data_ptr()
    f.sa_st, f.sa_sh = st_a
    f.sb_st, f.sb_sh = st_b
    dv = v_a.dtype
    f.device = dev = v_a.get_device()
    isz = _ITEMSIZE.get(dv) or _itemsize(dv)
    w = _layout.vec(isz)
    ok = _layout.aligned(pa, isz, w, f.va_st | f.va_sh | D) and _layout.aligned(
        pb, isz, w, f.vb_st | f.vb_sh | D
    )
    sig = [dv, v_b.dtype, s_a.dtype, s_b.dtype, dev, v_b.get_device(), s_a.get_device(), s_b.get_device()]
    if out is None:
        f.out = f.out_st = f.out_sh = 0
        sig.append(None)
    else:
        f.out = po = out.data_ptr()
        f.out_st, f.out_sh, _ = out.stride()
        do = out.dtype
        ok = ok and _layout.aligned(po, _ITEMSIZE.get(do) or _itemsize(do), w, f.out_st | f.out_sh)
        sig += (do, out.get_device())
    if out_lse is None:
        f.olse = f.ol_st = f.ol_sh = 0
        sig.append(None)
    else:
        st = out_lse.stride()
        f.olse = out_lse.data_ptr()
        f.ol_st, f.ol_sh = st[::-1] if ht else st
        sig += (out_lse.dtype, out_lse.get_device())
    f.a_cu = f.a_lens = f.a_batch = 0
    if cu is not None:
        (n,) = cu.shape
        f.a_cu, f.a_lens, f.a_batch = cu.data_ptr(), lens.data_ptr(), n - 1
    f.row_mask = mask.data_ptr() if mask is not None else 0
    f.out_scale = scale.data_ptr() if scale is not None else 0
    f.sinks = sinks.data_ptr() if sinks is not None else 0
    for x in (cu, lens, mask, scale, sinks):  # each option's dtype and device, or None
        sig += (None,) if x is None else (x.dtype, x.get_device())
    if rest:
        _read_block_scale(f, sig, rest[0])
    else:
        f.bscale = f.bs_st = f.bs_sg = 0
    sig += (ok, torch)
    f.sig = tuple(sig)
    return f


def _read_block_scale(f: Any, sig: list, bscale: Any) -> None:
    """The per-group fp8 scales' facts (out_block_scale, [T, groups], any strides)."""
    f.bscale = bscale.data_ptr()
    f.bs_st, f.bs_sg = bscale.stride()
    sig += ("bscale", bscale.dtype, bscale.get_device())


class NFacts:
    """An N-way merge call: objects (v, s, out, out_lse, out_scale, sinks[, out_block_scale]),
    signature part and facts under merge_states_kernel's parameter names."""

    __slots__ = (
        "objs", "sig", "torch", "device",
        "v", "v_sn", "v_st", "v_sh", "s", "s_sn", "s_st", "s_sh",
        "out", "out_st", "out_sh", "out_shape", "olse", "ol_st", "ol_sh", "ol_shape",
        "N", "T", "H", "D", "sinks", "out_scale", "bscale", "bs_st", "bs_sg",
    )  # fmt: skip


def read_n(objs: tuple) -> NFacts | None:
    try:
        return _read_n(objs, True, objs)
    except _UNREADABLE:
        return _read_generic(_read_n, objs)


def _read_n(objs: tuple, torch: bool, xs: tuple) -> NFacts:
    v, s, out, out_lse, scale, sinks, *rest = xs  # out_block_scale last when given
    f = NFacts()
    f.objs, f.torch = objs, torch is True
    f.v = pv = v.data_ptr()
    f.N, f.T, f.H, f.D = v.shape
    f.v_sn, f.v_st, f.v_sh, _ = st = v.stride()
    f.s = s.data_ptr()
    f.s_sn, f.s_st, f.s_sh = s.stride()
    dv = v.dtype
    f.device = dev = v.get_device()
    isz = _ITEMSIZE.get(dv) or _itemsize(dv)
    w = _layout.vec(isz)
    ok = _layout.aligned(pv, isz, w, st[0] | st[1] | st[2] | f.D)
    sig = [dv, s.dtype, dev, s.get_device()]
    if out is None:
        f.out = f.out_st = f.out_sh = 0
        f.out_shape = None
        sig.append(None)
    else:
        f.out = po = out.data_ptr()
        f.out_shape = out.shape
        f.out_st, f.out_sh, _ = out.stride()
        do = out.dtype
        ok = ok and _layout.aligned(po, _ITEMSIZE.get(do) or _itemsize(do), w, f.out_st | f.out_sh)
        sig += (do, out.get_device())
    if out_lse is None:
        f.olse = f.ol_st = f.ol_sh = 0
        f.ol_shape = None
        sig.append(None)
    else:
        f.olse, f.ol_shape = out_lse.data_ptr(), out_lse.shape
        f.ol_st, f.ol_sh = out_lse.stride()
        sig += (out_lse.dtype, out_lse.get_device())
    f.sinks = f.out_scale = 0
    if scale is not None:
        f.out_scale = scale.data_ptr()
        sig += (scale.dtype, scale.get_device())
    if sinks is not None:
        f.sinks = sinks.data_ptr()
        sig += ("sinks", sinks.dtype, sinks.get_device())
    if rest:
        _read_block_scale(f, sig, rest[0])
    else:
        f.bscale = f.bs_st = f.bs_sg = 0
    sig += (ok, torch)
    f.sig = tuple(sig)
    return f


class RowsFacts:
    """An empty-rows call: objects (out, lse, cu_q, lens) and facts under empty_rows_kernel's
    parameter names."""

    __slots__ = (
        "objs", "sig", "torch", "device", "out", "out_st", "out_sh", "lse", "lse_st", "lse_sh",
        "cu_q", "lens", "batch", "T", "H", "D", "flat",
    )  # fmt: skip


def read_rows(objs: tuple) -> RowsFacts | None:
    try:
        return _read_rows(objs, True, objs)
    except _UNREADABLE:
        return _read_generic(_read_rows, objs)


def _read_rows(objs: tuple, torch: bool, xs: tuple) -> RowsFacts:
    out, lse, cu, lens = xs
    f = RowsFacts()
    f.objs, f.torch = objs, torch is True
    f.out = po = out.data_ptr()
    f.T, f.H, f.D = _, H, D = out.shape
    f.out_st, f.out_sh, _ = st0, st1, _ = out.stride()
    f.lse = lse.data_ptr()
    f.lse_st, f.lse_sh = lse.stride()
    (n,) = cu.shape
    f.cu_q, f.lens, f.batch = cu.data_ptr(), lens.data_ptr(), n - 1
    f.flat = int(st1 == D and st0 == H * D)
    do = out.dtype
    f.device = dev = out.get_device()
    isz = _ITEMSIZE.get(do) or _itemsize(do)
    ok = _layout.aligned(po, isz, _layout.vec(isz), st0 | st1 | D)
    devices = (dev, lse.get_device(), cu.get_device(), lens.get_device())
    f.sig = (do, lse.dtype, cu.dtype, lens.dtype, *devices, ok, torch)
    return f
