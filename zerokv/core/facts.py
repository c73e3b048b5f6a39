"""Reading a call's arguments once into a named record of facts.

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
from .generic_tensors import _family, _Generic, generic, writable_cheap  # noqa: F401 (the readers' API)
from .layout import INT32

_ITEMSIZE = {}  # dtype (torch object or name) -> bytes, filled as dtypes are met


def _itemsize(dtype: Any) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        from .checks import itemsize

        size = _ITEMSIZE[dtype] = dtype.itemsize if hasattr(dtype, "itemsize") else itemsize(str(dtype))
    return size


class TwoFacts:
    """A two-way merge call: its objects (``objs``, the caller's, in the order v_a, s_a, v_b,
    s_b, out, out_lse, a_cu, a_lens, row_mask, out_scale, sinks), its signature part
    (``sig``) and each tensor's facts under the kernel's parameter names (a missing tensor
    has pointer 0); ``regular``: every rank, shape and head_dim stride as a merge needs them,
    sizes nonzero and below 2^31, no negative stride; then ``spans`` (the inputs' byte ranges),
    ``out_end`` / ``ol_end``, ``widest`` (elements spanned by the widest tensor, or T * H * D)
    and ``strides_or`` hold. ``torch``: every tensor is a torch tensor."""

    __slots__ = (
        "objs", "sig", "torch", "device", "regular", "spans", "out_end", "ol_end", "widest", "strides_or",
        "va", "va_st", "va_sh", "vb", "vb_st", "vb_sh", "sa", "sa_st", "sa_sh", "sb", "sb_st", "sb_sh",
        "out", "out_st", "out_sh", "olse", "ol_st", "ol_sh", "T", "H", "D", "rows", "prefix_rows",
        "a_cu", "a_lens", "a_batch", "cu_len", "cu_st", "lens_len", "lens_st",
        "row_mask", "mask_len", "mask_st", "sinks", "sinks_len", "sinks_st", "out_scale", "scale_len",
        "bscale", "bs_st", "bs_sg", "bs_shape",
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
    """``reader(objs, family, *extra, facts)`` over the objects' generic facts (CuPy, DLPack producers, torch mixed with
    them); None when one cannot be read."""
    try:
        gen = tuple(generic(x) for x in objs)
        return reader(objs, _family(gen), *extra, gen)
    except _UNREADABLE:
        return None


def _read_two(objs: tuple, torch: bool, ht: bool, xs: tuple) -> TwoFacts:
    """``xs``: the tensors (``objs`` or their generic facts), out_block_scale last when given."""
    if len(xs) == 11:
        v_a, s_a, v_b, s_b, out, out_lse, cu, lens, mask, scale, sinks = xs
        bscale = None
    else:
        v_a, s_a, v_b, s_b, out, out_lse, cu, lens, mask, scale, sinks, bscale = xs
    # Straight-line on purpose (the hot path): byte ends as layout.end, alignment as
    # layout.aligned, written out (tests/test_host_facts.py holds them to those functions).
    f = TwoFacts()
    f.objs, f.torch = objs, torch is True
    f.va = pa = v_a.data_ptr()
    f.T, f.H, f.D = T, H, D = sh = v_a.shape
    th = (H, T) if ht else (T, H)  # the LSEs' shape
    f.va_st, f.va_sh, va_in = sta0, sta1, va_in = v_a.stride()
    f.vb = pb = v_b.data_ptr()
    f.vb_st, f.vb_sh, vb_in = stb0, stb1, vb_in = v_b.stride()
    f.sa = psa = s_a.data_ptr()
    if ht:
        ssa1, ssa0 = s_a.stride()
        ssb1, ssb0 = s_b.stride()
    else:
        ssa0, ssa1 = s_a.stride()
        ssb0, ssb1 = s_b.stride()
    f.sa_st, f.sa_sh = ssa0, ssa1
    f.sb = psb = s_b.data_ptr()
    f.sb_st, f.sb_sh = ssb0, ssb1
    dv = v_a.dtype
    f.device = dev = v_a.get_device()
    isz = _ITEMSIZE.get(dv) or _itemsize(dv)
    w = _VECTOR_BYTES // isz
    vst = sta0 | sta1 | stb0 | stb1
    st_or = vst | ssa0 | ssa1 | ssb0 | ssb1
    ok = not ((pa | pb) % _VECTOR_BYTES or (vst | D) % w)
    regular = (
        0 < T < INT32 and 0 < H < INT32 and D > 0
        and v_b.shape == sh and s_a.shape == th and s_b.shape == th and (D == 1 or va_in == vb_in == 1)
    )  # fmt: skip
    sig = [dv, v_b.dtype, s_a.dtype, s_b.dtype, dev, v_b.get_device(), s_a.get_device(), s_b.get_device()]
    widest = T * H * D
    if regular:  # each span in elements first (small ints), then its byte end
        T1, H1 = T - 1, H - 1
        xa, xb = T1 * sta0 + H1 * sta1 + D, T1 * stb0 + H1 * stb1 + D
        xsa, xsb = T1 * ssa0 + H1 * ssa1 + 1, T1 * ssb0 + H1 * ssb1 + 1
        f.spans = [(pa, pa + xa * isz), (pb, pb + xb * isz), (psa, psa + 4 * xsa), (psb, psb + 4 * xsb)]
        if xa > widest:
            widest = xa
        if xb > widest:
            widest = xb
        if xsa > widest:
            widest = xsa
        if xsb > widest:
            widest = xsb
    if out is None:
        f.out = f.out_st = f.out_sh = 0
        sig.append(None)
    else:
        f.out = po = out.data_ptr()
        f.out_st, f.out_sh, out_in = st0, st1, out_in = out.stride()
        st_or |= st0 | st1
        do = out.dtype
        osz = _ITEMSIZE.get(do) or _itemsize(do)
        ok = ok and not (po % (w * osz) or (st0 | st1) % w)
        sig += (do, out.get_device())
        regular = regular and out.shape == sh and (D == 1 or out_in == 1)
        if regular:
            n = (T - 1) * st0 + (H - 1) * st1 + D
            f.out_end = po + n * osz
            if n > widest:
                widest = n
    if out_lse is None:
        f.olse = f.ol_st = f.ol_sh = 0
        sig.append(None)
    else:
        f.olse = pl = out_lse.data_ptr()
        if ht:
            sl1, sl0 = out_lse.stride()
        else:
            sl0, sl1 = out_lse.stride()
        f.ol_st, f.ol_sh = sl0, sl1
        st_or |= sl0 | sl1
        sig += (out_lse.dtype, out_lse.get_device())
        regular = regular and out_lse.shape == th
        if regular:
            n = (T - 1) * sl0 + (H - 1) * sl1 + 1
            f.ol_end = pl + 4 * n
            if n > widest:
                widest = n
    f.a_cu = f.a_lens = f.a_batch = f.row_mask = f.sinks = f.out_scale = 0
    if cu is not None or lens is not None or mask is not None or scale is not None or sinks is not None:
        st_or |= _read_options(f, sig, cu, lens, mask, scale, sinks)
    if bscale is None:
        f.bscale = f.bs_st = f.bs_sg = 0
        f.bs_shape = None
        f.regular = regular and st_or >= 0
    else:
        f.regular = _read_block_scale(f, sig, bscale) and regular and st_or >= 0
    f.widest, f.strides_or = widest, st_or
    sig += (ok, torch)
    f.sig = tuple(sig)
    return f


_VECTOR_BYTES = _layout.VECTOR_BYTES


def _read_block_scale(f: Any, sig: list, bscale: Any) -> bool:
    """The per-group fp8 scales' facts (out_block_scale, [T, groups], any strides); False when a
    stride is negative."""
    if bscale is None:
        f.bscale = f.bs_st = f.bs_sg = 0
        f.bs_shape = None
        return True
    f.bscale, f.bs_shape = bscale.data_ptr(), bscale.shape
    f.bs_st, f.bs_sg = st = bscale.stride()
    sig += ("bscale", bscale.dtype, bscale.get_device())
    return min(st) >= 0


def _read_options(f: TwoFacts, sig: list, cu, lens, mask, scale, sinks) -> int:
    """The option tensors' facts (a_empty's pair, row_mask, out_scale, sinks), each option's
    dtype and device (or None) into ``sig``; their strides OR-ed (negative when one is)."""
    neg = 0
    if cu is None:
        sig.append(None)
    else:
        (n,) = cu.shape
        f.a_cu, f.cu_len, f.a_batch, f.cu_st = cu.data_ptr(), n, n - 1, cu.stride()[0] if n else 1
        neg |= f.cu_st
        sig += (cu.dtype, cu.get_device())
    if lens is None:
        sig.append(None)
    else:
        (n,) = lens.shape
        f.a_lens, f.lens_len, f.lens_st = lens.data_ptr(), n, lens.stride()[0] if n else 1
        neg |= f.lens_st
        sig += (lens.dtype, lens.get_device())
    if mask is None:
        sig.append(None)
    else:
        (n,) = mask.shape
        f.row_mask, f.mask_len, f.mask_st = mask.data_ptr(), n, mask.stride()[0] if n else 1
        neg |= f.mask_st
        sig += (mask.dtype, mask.get_device())
    if scale is None:
        sig.append(None)
    else:
        f.out_scale, f.scale_len = scale.data_ptr(), _numel(scale.shape)
        sig += (scale.dtype, scale.get_device())
    if sinks is None:
        sig.append(None)
    else:
        (n,) = sinks.shape
        f.sinks, f.sinks_len, f.sinks_st = sinks.data_ptr(), n, sinks.stride()[0] if n else 1
        neg |= f.sinks_st
        sig += (sinks.dtype, sinks.get_device())
    return neg


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class NFacts:
    """An N-way merge call: objects (v, s, out, out_lse, out_scale, sinks), signature part
    and facts under merge_states_kernel's parameter names."""

    __slots__ = (
        "objs", "sig", "torch", "device", "neg",
        "v", "v_sn", "v_st", "v_sh", "v_in", "s", "s_sn", "s_st", "s_sh", "s_shape",
        "out", "out_st", "out_sh", "out_in", "out_shape", "olse", "ol_st", "ol_sh", "ol_shape",
        "N", "T", "H", "D", "sinks", "sinks_len", "sinks_st", "out_scale", "scale_len",
        "bscale", "bs_st", "bs_sg", "bs_shape", "strides_or",
    )  # fmt: skip


def read_n(objs: tuple) -> NFacts | None:
    try:
        return _read_n(objs, True, objs)
    except _UNREADABLE:
        return _read_generic(_read_n, objs)


def _read_n(objs: tuple, torch: bool, xs: tuple) -> NFacts:
    v, s, out, out_lse, scale, sinks, *rest = xs  # out_block_scale last when given
    bscale = rest[0] if rest else None
    # straight-line as _read_two (alignment as layout.aligned, written out)
    f = NFacts()
    f.objs, f.torch = objs, torch is True
    f.v = pv = v.data_ptr()
    f.N, f.T, f.H, f.D = v.shape
    f.v_sn, f.v_st, f.v_sh, f.v_in = st0, st1, st2, st3 = v.stride()
    f.s, f.s_shape = s.data_ptr(), s.shape
    f.s_sn, f.s_st, f.s_sh = ss0, ss1, ss2 = s.stride()
    dv = v.dtype
    f.device = dev = v.get_device()
    isz = _ITEMSIZE.get(dv) or _itemsize(dv)
    w = _VECTOR_BYTES // isz
    ok = not (pv % _VECTOR_BYTES or (st0 | st1 | st2 | f.D) % w)
    st_or = st1 | st2 | ss1 | ss2  # the token and head strides (the kernels' 32-bit parameters)
    sig = [dv, s.dtype, dev, s.get_device()]
    if out is None:
        f.out = f.out_st = f.out_sh = 0
        f.out_shape = None
        sig.append(None)
    else:
        f.out, f.out_shape = po, _ = out.data_ptr(), out.shape
        f.out_st, f.out_sh, f.out_in = so0, so1, so2 = out.stride()
        do = out.dtype
        ok = ok and not (po % (w * (_ITEMSIZE.get(do) or _itemsize(do))) or (so0 | so1) % w)
        st_or |= so0 | so1
        st0 |= so2  # the inner stride: its sign only
        sig += (do, out.get_device())
    if out_lse is None:
        f.olse = f.ol_st = f.ol_sh = 0
        f.ol_shape = None
        sig.append(None)
    else:
        f.olse, f.ol_shape = out_lse.data_ptr(), out_lse.shape
        f.ol_st, f.ol_sh = sl0, sl1 = out_lse.stride()
        st_or |= sl0 | sl1
        sig += (out_lse.dtype, out_lse.get_device())
    f.sinks = f.out_scale = 0
    if scale is not None:
        f.out_scale, f.scale_len = scale.data_ptr(), _numel(scale.shape)
        sig += (scale.dtype, scale.get_device())
    if sinks is not None:
        (f.sinks_len,) = sinks.shape
        f.sinks, f.sinks_st = sinks.data_ptr(), sinks.stride()[0] if f.sinks_len else 1
        sig += ("sinks", sinks.dtype, sinks.get_device())
    if bscale is None:
        f.bscale = f.bs_st = f.bs_sg = 0
        f.bs_shape = None
        f.neg = (st_or | st0 | st3 | ss0) < 0
    else:
        f.neg = not _read_block_scale(f, sig, bscale) or (st_or | st0 | st3 | ss0) < 0
    f.strides_or = st_or
    sig += (ok, torch)
    f.sig = tuple(sig)
    return f


class RowsFacts:
    """An empty-rows call: objects (out, lse, cu_q, lens) and facts under empty_rows_kernel's
    parameter names."""

    __slots__ = (
        "objs", "sig", "torch", "device", "neg",
        "out", "out_st", "out_sh", "out_in", "lse", "lse_st", "lse_sh", "lse_shape",
        "cu_q", "cu_len", "cu_st", "lens", "lens_len", "lens_st", "batch", "T", "H", "D", "flat",
    )  # fmt: skip


def read_rows(objs: tuple) -> RowsFacts | None:
    try:
        return _read_rows(objs, True, objs)
    except _UNREADABLE:
        return _read_generic(_read_rows, objs)


def _read_rows(objs: tuple, torch: bool, xs: tuple) -> RowsFacts:
    out, lse, cu, lens = xs
    # straight-line as _read_two (alignment as layout.aligned, written out)
    f = RowsFacts()
    f.objs, f.torch = objs, torch is True
    f.out = po = out.data_ptr()
    f.T, f.H, f.D = T, H, D = out.shape
    f.out_st, f.out_sh, f.out_in = st0, st1, st2 = out.stride()
    f.lse, f.lse_shape = lse.data_ptr(), lse.shape
    f.lse_st, f.lse_sh = sl0, sl1 = lse.stride()
    (f.cu_len,), (f.lens_len,) = (n,), (m,) = cu.shape, lens.shape
    f.cu_q, f.lens = cu.data_ptr(), lens.data_ptr()
    f.cu_st = sc = cu.stride()[0] if n else 1
    f.lens_st = sn = lens.stride()[0] if m else 1
    f.batch = n - 1
    f.flat = int(st1 == D and st0 == H * D)
    do = out.dtype
    f.device = dev = out.get_device()
    isz = _ITEMSIZE.get(do) or _itemsize(do)
    ok = not (po % _VECTOR_BYTES or (st0 | st1 | D) % (_VECTOR_BYTES // isz))
    f.neg = (st0 | st1 | st2 | sl0 | sl1 | sc | sn) < 0
    devices = (dev, lse.get_device(), cu.get_device(), lens.get_device())
    f.sig = (do, lse.dtype, cu.dtype, lens.dtype, *devices, ok, torch)
    return f
