"""Reading tensors of any producer without copying them.

``view(x)`` returns a :class:`Tensor` record: data pointer, shape, strides in elements, canonical
dtype name and device (-1 for host memory). torch tensors take a fast path that reads the same
facts DLPack would carry straight from the tensor (no ``__dlpack__`` call, so no per-call stream
handshake); every other producer (CuPy, JAX, numpy, ...) goes through its ``__dlpack__`` capsule,
parsed here with ctypes: zero-copy, and bfloat16 works for every producer.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, NamedTuple

import numpy as np

from . import dtypes as _dtypes


class Tensor(NamedTuple):
    obj: Any  # the caller's object (kept alive, and used for host-side fallbacks)
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str
    device: int  # CUDA ordinal, or -1 for host memory
    is_torch: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


_TORCH_DTYPES: dict[Any, str] = {}


def torch_dtype_names() -> dict[Any, str]:
    """torch dtype -> canonical name (``{}`` before torch is imported)."""
    torch = sys.modules.get("torch")
    if not _TORCH_DTYPES and torch is not None:
        for name in (*_dtypes.TABLE, "float64"):  # float64: named in messages, taken by the CPU path
            if hasattr(torch, name):
                _TORCH_DTYPES[getattr(torch, name)] = name
    return _TORCH_DTYPES


_new = tuple.__new__  # skips NamedTuple's Python-level __new__ on the hot path


def torch_view(t: Any) -> Tensor:
    """The torch fast path: the facts DLPack would export, read directly."""
    dtypes = _TORCH_DTYPES or torch_dtype_names()
    dtype = dtypes.get(t.dtype)
    if dtype is None:
        dtype = str(t.dtype).removeprefix("torch.")
    return _new(Tensor, (t, t.data_ptr(), t.shape, t.stride(), dtype, t.get_device(), True))


def _torch_kind_check(t: Any, arg: str) -> None:
    """Raise a TypeError naming ``arg`` for torch tensors that hold no strided data: meta, sparse
    and nested tensors (whose ``data_ptr`` / ``stride`` / ``numpy`` fail with messages naming no
    argument)."""
    if t.is_meta:
        raise TypeError(f"{arg}: a meta tensor has no data to compute on; pass a tensor on the CPU or a GPU")
    if getattr(t, "is_nested", False):
        raise TypeError(f"{arg}: a nested tensor is not supported; pass a dense, strided tensor")
    layout = t.layout
    if layout is not sys.modules["torch"].strided:
        raise TypeError(
            f"{arg}: a sparse tensor ({str(layout).removeprefix('torch.')}) is not supported; "
            "pass a dense, strided tensor (x.to_dense())"
        )


class _NoTorch:
    """Stands for torch.Tensor before torch is imported: no object has this type."""


TORCH_FLOAT32: list = []  # [torch.Tensor, torch.float32] once torch is imported


def torch_float32() -> list:
    """``[torch.Tensor, torch.float32]`` once torch is imported, else ``[]``: an adapter's test
    of a float32 torch LSE by identity (``type(s) is f[0] and s.dtype is f[1]``)."""
    if not TORCH_FLOAT32:
        torch = sys.modules.get("torch")
        if torch is not None:
            TORCH_FLOAT32[:] = [torch.Tensor, torch.float32]
    return TORCH_FLOAT32


def torch_tensor_type() -> type:
    """``torch.Tensor`` once torch is imported (a type no object has before)."""
    return (TORCH_FLOAT32 or torch_float32() or (_NoTorch,))[0]


# --- DLPack (legacy, unversioned capsule "dltensor") -------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_DTYPES = {d.dlpack: n for n, d in _dtypes.TABLE.items() if d.kind != "fp8"} | {(2, 64): "float64"}
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def dlpack_view(x: Any, stream: int | None = None, device: tuple[int, int] | None = None) -> Tensor:
    """Parse ``x.__dlpack__()`` in place. ``stream``: the CUDA stream the consumer will use
    (the producer orders its pending work before it, as the DLPack protocol says);
    ``device``: ``x.__dlpack_device__()`` when the caller has read it."""
    dev_type, dev_id = device or x.__dlpack_device__()
    if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED) and stream is not None:
        capsule = x.__dlpack__(stream=stream)
    else:
        capsule = x.__dlpack__()
    t = _DLTensor.from_address(_get_pointer(capsule, b"dltensor"))
    ndim = t.ndim
    shape = tuple(t.shape[i] for i in range(ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(ndim))
    else:  # compact row-major
        acc, rev = 1, []
        for s in reversed(shape):
            rev.append(acc)
            acc *= s
        strides = tuple(reversed(rev))
    code = (t.dtype.code, t.dtype.bits)
    dtype = _DL_DTYPES.get(code, f"dlpack(code={code[0]}, bits={code[1]})")
    if t.dtype.lanes != 1:
        dtype = f"dlpack(lanes={t.dtype.lanes})"
    ptr = (t.data or 0) + t.byte_offset
    device = -1 if dev_type in (_DL_CPU, _DL_CUDA_HOST) else dev_id
    # The capsule is released here (its deleter runs); x itself keeps the memory alive.
    return Tensor(x, ptr, shape, strides, dtype, device, False)


def is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def view(x: Any, arg: str) -> Tensor:
    """Any tensor-like to a :class:`Tensor`; ``TypeError`` naming ``arg`` otherwise."""
    if type(x) is torch_tensor_type() or is_torch(x):
        _torch_kind_check(x, arg)
        return torch_view(x)
    if isinstance(x, np.ndarray):
        return _numpy_view(x)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device = x.__dlpack_device__()
        return dlpack_view(x, _producer_stream(device), device)
    raise TypeError(
        f"{arg}: expected a tensor (torch, CuPy, numpy or any DLPack producer), got {type(x).__name__}"
    )


_NUMPY_NAMES = set(_DL_DTYPES.values())


def _numpy_view(a: np.ndarray) -> Tensor:
    name = a.dtype.name
    if name not in _NUMPY_NAMES:
        name = f"numpy.{name}"
    item = a.itemsize
    strides = tuple(s // item for s in a.strides)
    return Tensor(a, a.__array_interface__["data"][0], a.shape, strides, name, -1, False)


def _producer_stream(device: tuple[int, int]) -> int | None:
    """The stream a non-torch CUDA producer (on DLPack ``device``) hands its data on: CuPy's
    current stream."""
    if device[0] not in (_DL_CUDA, _DL_CUDA_MANAGED):
        return None
    from . import device as _device

    return _device.cupy_stream(device[1]) or 1  # 1: the legacy default stream
