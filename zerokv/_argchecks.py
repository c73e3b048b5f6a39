"""Checks of whole arguments (pairs, offsets, sinks, outputs against inputs) on Tensor records."""

from __future__ import annotations

from typing import Any

from . import _dtypes
from ._checks import _where, lse_base, same_device, shape, unit_last_stride  # noqa: F401  (re-exported)
from ._tensors import Tensor


def tensor_view(t: Tensor | None, arg: str, ndim: int, dtypes: tuple[str, ...]) -> Tensor:
    if t is None:
        raise TypeError(f"{arg}: expected a tensor, got None")
    if len(t.shape) != ndim:
        raise ValueError(f"{arg}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    _dtypes.require(arg, t.dtype, dtypes)
    return t


def pair(x: Any, arg: str) -> tuple[Any, Any]:
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"{arg}: expected a pair (cu_seqlens_q, kv_lens), got {type(x).__name__}")
    return x[0], x[1]


def prefix_rows(value: Any, T: int, arg: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg}: expected an int or None, got {type(value).__name__} {value!r}")
    if not 0 <= value <= T:
        raise ValueError(f"{arg}: expected 0 <= {arg} <= T={T}, got {value}")


def contiguous_1d(t: Tensor, arg: str) -> None:
    if t.shape[0] > 1 and t.strides[0] != 1:
        raise ValueError(f"{arg}: must be contiguous, got stride {t.strides[0]}")


def index_view(t: Tensor | None, arg: str, length: int | None, device: int) -> Tensor:
    t = tensor_view(t, arg, 1, _dtypes.INDEX_NAMES)
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{arg}: expected {length} entries, got shape {tuple(t.shape)}")
    contiguous_1d(t, arg)
    if t.device != device:
        raise ValueError(f"{arg} is on {_where(t.device)} but the tensors are on {_where(device)}")
    return t


def offsets_pair(
    cu: Tensor | None, lens: Tensor | None, arg: str, device: int, n_cu: str, n_lens: str
) -> tuple[Tensor, Tensor]:
    """``(cu_seqlens_q [B + 1], kv_lens [B])``, one index dtype, on the states' device;
    ``n_cu``/``n_lens``: how the caller calls the two."""
    if cu is None or lens is None:
        missing = n_cu if cu is None else n_lens
        raise ValueError(f"{arg}: both {n_cu} and {n_lens} are needed; {missing} is None")
    c = index_view(cu, n_cu, None, device)
    if c.shape[0] < 1:
        raise ValueError(f"{n_cu}: expected B + 1 >= 1 entries, got 0")
    ln = index_view(lens, n_lens, c.shape[0] - 1, device)
    if ln.dtype != c.dtype:
        raise TypeError(
            f"{n_lens}: dtype {ln.dtype} differs from {n_cu} dtype {c.dtype}; use one index dtype"
        )
    return c, ln


def sinks(t: Tensor, arg: str, H: int, device: int) -> Tensor:
    s = tensor_view(t, arg, 1, _dtypes.LSE)
    if s.shape[0] != H:
        raise ValueError(f"{arg}: expected shape ({H},) (H), got {tuple(s.shape)}")
    contiguous_1d(s, arg)
    if s.device != device:
        raise ValueError(f"{arg} is on {_where(s.device)} but the states are on {_where(device)}")
    return s


def out_scale(t: Tensor | None, out_dtype: str, device: int, arg: str = "out_scale") -> Tensor | None:
    """The fp8 output scale: one float32 element on the states' device, given exactly when the
    output is float8_e4m3fn."""
    if out_dtype in _dtypes.FP8 and t is None:
        raise ValueError(f"{arg}: required for a {out_dtype} output")
    if t is None:
        return None
    if out_dtype not in _dtypes.FP8:
        raise ValueError(f"{arg}: only meaningful with a float8_e4m3fn output, got {out_dtype}")
    _dtypes.require(arg, t.dtype, _dtypes.LSE)
    if t.numel != 1:
        raise ValueError(f"{arg}: expected one element, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{arg} is on {_where(t.device)} but the states are on {_where(device)}")
    return t


def outputs(outs: list, ins: list) -> None:
    """Every output writable, sharing no byte with another output or an input, except an exact
    alias of the inputs it names. ``outs``: ``[(name, Tensor | None, may_alias_names)]``;
    ``ins``: ``[(name, Tensor | None)]`` (names as the caller knows them, each once)."""
    from . import _checks

    for n, t, _ in outs:
        if t is not None:
            _checks.writable(t, n)
    may_alias = [(n, a) for n, _, aliases in outs for a in aliases]
    _checks.check_outputs({n: t for n, t, _ in outs}, dict(ins), may_alias=may_alias)
