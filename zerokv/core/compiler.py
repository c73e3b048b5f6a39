"""The compile and function cache: one loaded function per (kernel instantiation, device),
compiled by NVRTC through CuPy on first use under a lock (concurrent first calls compile once)
and reused from CuPy's disk cache (``CUPY_CACHE_DIR``) by later processes."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from . import device as _device
from . import disk_cache as _cache
from . import sources as _sources
from .kernels import Kernel


class Loaded(NamedTuple):
    module: Any  # CuPy's RawModule: owns the loaded code
    ptr: int  # the CUfunction handle on its device


_functions: dict[tuple[str, str, int], Loaded] = {}
_lock = threading.Lock()
_modules_built = 0  # number of RawModules created in this process (tests read it)


def function(kernel: Kernel, expr: str, device: int) -> Loaded:
    """The function ``expr`` of ``kernel`` on ``device``; compiled and loaded once per device."""
    key = (kernel.stem if kernel.code is None else f"{kernel.stem}:{kernel.name}", expr, device)
    fn = _functions.get(key)
    if fn is None:
        with _lock:
            fn = _functions.get(key)
            if fn is None:
                fn = _functions[key] = _build(_sources.kernel_source(kernel), expr, device)
    return fn


def loaded_count() -> int:
    """How many functions are loaded (``precompile`` and the tests read it)."""
    return len(_functions)


def _build(code: str, expr: str, device: int) -> Loaded:
    global _modules_built
    cupy = _device.import_cupy()
    _cache.guard_cupy_cache()  # a read-only CUPY_CACHE_DIR: read it, keep new kernels in memory
    _device.check_device(device)
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=code, options=_sources.NVRTC_OPTIONS, name_expressions=[expr])
        fn = module.get_function(expr)
        loaded = Loaded(module, fn.kernel.ptr)  # .kernel: the Function of the current device
    _modules_built += 1
    return loaded


def clear_functions() -> None:
    """Forget loaded functions (the disk cache stays). Call through ``plans.clear_cache``,
    which forgets the launch plans holding their handles first."""
    with _lock:
        _functions.clear()
