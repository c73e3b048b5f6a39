"""``zerokv.precompile``: compile and load, before serving, every kernel an engine will launch.

The first call of each (op, dtype combination, vector width) on a device compiles its kernel
through NVRTC (or reads it from CuPy's disk cache) and loads it. Done during serving that is a
stall; done inside CUDA-graph capture it compiles outside the graph's stream but still costs
the time. ``precompile`` does all of it up front, for the ops and dtypes named.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

from .core import compiler as _compiler
from .core import device as _device
from .core import disk_cache as _cache
from .core import dtypes as _dtypes
from .core import kernels as _kernels

_FLAT = tuple(
    k.name
    for k in (
        _kernels.MERGE_STATE_FLAT,
        _kernels.MERGE_STATE_HEADS,
        _kernels.MERGE_STATE_FLAT_GATHERED,
        _kernels.MERGE_STATE_FLAT64_GATHERED,
    )
)
# public op -> which kernel instantiations it launches (the compat adapters use the same ones);
# the empty-row kernel's third template argument is its emptiness rule
OPS: dict[str, Callable[[_kernels.Kernel, tuple], bool]] = {
    "merge_state": lambda k, t: k.name in ("merge_state_kernel", *_FLAT),
    "merge_states": lambda k, t: k.name in ("merge_states_kernel", *_FLAT),  # N = 2: the flat kernels
    "fixup_zero_kv_rows": lambda k, t: k.name == "empty_rows_kernel" and t[2] == _kernels.RULE_KV_LENS_ZERO,
    "mask_empty_context": lambda k, t: (
        k.name == "empty_rows_kernel" and t[2] == _kernels.RULE_CONTEXT_SPAN_EMPTY
    ),
    "cp_merge": lambda k, t: k.stem == "cp_merge",
}
# element types a kernel is instantiated over: C type -> dtype name
_FLOAT_CTYPES = {_dtypes.ctype(n): n for n in (*_dtypes.V_IN, *_dtypes.V_OUT)}
DTYPES = tuple(dict.fromkeys((*_dtypes.V_IN, *_dtypes.V_OUT)))


def precompile(
    dtypes: Iterable[Any] | None = None, ops: Iterable[str] | None = None, device: Any = None
) -> int:
    """Compile and load every kernel instantiation the given ops may launch with the given dtypes.

    Args:
        dtypes: element types of V and of the outputs, as names (``"bfloat16"``), torch or numpy
            dtypes; every instantiation whose element types are all among them is built. E.g.
            ``("bfloat16",)`` for bf16 partials merged into bf16; add ``"float32"`` for fp32
            partials or outputs and ``"float8_e4m3fn"`` for fp8 outputs. None: all of
            float16, bfloat16, float32, float8_e4m3fn.
        ops: names of public ops (``"merge_state"``, ``"merge_states"``,
            ``"fixup_zero_kv_rows"``, ``"mask_empty_context"``, ``"cp_merge"``); the compat
            adapters use the same kernels. None: every op.
        device: a CUDA device index, ``"cuda:N"`` or a ``torch.device``; None: the current one.

    Returns:
        The number of kernel instantiations now loaded on the device for this selection.

    Cost: one NVRTC compile per instantiation not yet in CuPy's disk cache (``CUPY_CACHE_DIR``),
    about 0.1-0.5 s each, then a load of a few ms; every instantiation cached on disk: well under
    a second. Instantiations already loaded in this process cost nothing. Call it once per device
    before serving or before CUDA-graph capture; thread-safe.
    """
    wanted_dtypes = _dtype_names(dtypes)
    wanted_ops = _op_names(ops)
    dev = _device_index(device)
    _check_exists(dev)
    _device.check_device(dev)  # a GPU older than sm_80: a clear error before any compile
    _cache.guard_cupy_cache()
    count = 0
    for kernel, targs in selection(wanted_dtypes, wanted_ops):
        _compiler.function(kernel, kernel.expr(*targs), dev)
        count += 1
    return count


def selection(
    dtypes: tuple[str, ...] = DTYPES, ops: tuple[str, ...] = tuple(OPS)
) -> list[tuple[_kernels.Kernel, tuple]]:
    """(kernel, template arguments) of every instantiation an op in ``ops`` launches with
    element types among ``dtypes``, in the order of ``_kernels.KERNELS``."""
    out = []
    for kernel in _kernels.KERNELS:
        for targs in kernel.instances:
            if not any(OPS[op](kernel, targs) for op in ops):
                continue
            kinds = [_FLOAT_CTYPES[a] for a in targs if isinstance(a, str) and a in _FLOAT_CTYPES]
            if all(k in dtypes for k in kinds):
                out.append((kernel, targs))
    return out


def _dtype_names(dtypes: Iterable[Any] | None) -> tuple[str, ...]:
    if dtypes is None:
        return DTYPES
    if isinstance(dtypes, str) or not isinstance(dtypes, Iterable):
        dtypes = (dtypes,)
    names = []
    for d in dtypes:
        name = _dtype_name(d)
        if name not in DTYPES:
            raise TypeError(
                f"precompile: dtypes: {d!r} is not supported; expected some of {', '.join(DTYPES)}"
            )
        names.append(name)
    return tuple(names)


def _dtype_name(d: Any) -> str:
    if isinstance(d, str):
        return d.removeprefix("torch.")
    if type(d).__module__.startswith("torch"):
        return str(d).removeprefix("torch.")
    try:
        import numpy as np

        return np.dtype(d).name
    except TypeError:
        return repr(d)


def _op_names(ops: Iterable[str] | None) -> tuple[str, ...]:
    if ops is None:
        return tuple(OPS)
    if isinstance(ops, str):
        ops = (ops,)
    names = tuple(ops)
    for op in names:
        if op not in OPS:
            raise ValueError(f"precompile: ops: {op!r} is not an op; expected some of {', '.join(OPS)}")
    return names


def _check_exists(index: int) -> None:
    cupy = _device.import_cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise RuntimeError(f"precompile: no CUDA device can be used here ({e})") from e
    if index >= count:
        raise ValueError(f"precompile: device: cuda:{index} does not exist ({count} CUDA devices)")


def _device_index(device: Any) -> int:
    """A CUDA device index from None (the current device), an int, ``"cuda[:N]"`` or a torch.device."""
    if device is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.current_device())
        return int(_device.import_cupy().cuda.runtime.getDevice())
    if isinstance(device, bool):
        raise TypeError(f"precompile: device: {device!r} is not a device")
    if isinstance(device, int):
        index = device
    elif isinstance(device, str) or type(device).__name__ == "device":
        text = str(device)
        kind, _, number = text.partition(":")
        if kind != "cuda" or not (number.isdigit() or number == ""):
            raise ValueError(f"precompile: device: {device!r} is not a CUDA device")
        if number == "":
            return _device_index(None)
        index = int(number)
    else:
        raise TypeError(
            f"precompile: device: expected an int, 'cuda:N' or a torch.device, got {type(device).__name__}"
        )
    if index < 0:
        raise ValueError(f"precompile: device: {device!r} is negative")
    return index
