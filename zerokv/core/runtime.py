"""The one runtime every op uses: kernel sources, compile cache, devices and streams, launch.

* Sources: ``kernels_cu/<stem>.cu`` with its ``#include "x.cuh"`` lines replaced by the header
  text and the block sizes of its kernels defined on top, so the code handed to NVRTC (and
  hashed by CuPy's disk cache) covers every byte.
* Cache: one loaded function per (kernel instantiation, device), compiled on first use under a
  lock (concurrent first calls compile once) and reused from CuPy's disk cache
  (``CUPY_CACHE_DIR``) by later processes.
* Launch: :class:`Launcher` packs the arguments into a per-thread buffer and calls
  ``cuLaunchKernel`` on the given stream, in the device's context; nothing is allocated or synced.

This module imports none of the layers above it (launch plans, ops).
"""

from __future__ import annotations

import ctypes
import re
import sys
import threading
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from . import disk_cache as _cache
from . import kernels as _kernels
from .kernels import Kernel

# Options shared by the run-time (CuPy) and the offline (cuda-bindings) compiles. CuPy adds
# -arch for the device and -ftz=true itself.
NVRTC_OPTIONS = ("--std=c++17",)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    """``kernels_cu`` inside an installed wheel, or beside the package in a source tree."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"zerokv: kernel sources (kernels_cu/) not found near {here}")


def source(stem: str, directory: Path | None = None) -> str:
    """The full text of ``<stem>.cu``: block sizes defined, every local header inlined once."""
    directory = directory or kernel_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (directory / name).read_text()
        text = text.replace("#pragma once\n", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    head = f"// zerokv: {stem}.cu with headers inlined\n" + _kernels.block_defines(stem)
    return head + expand(f"{stem}.cu")


def kernel_source(kernel: Kernel) -> str:
    """What NVRTC compiles for ``kernel``: its stem's source, or its own ``code``."""
    if kernel.code is not None:
        return _kernels.block_defines(kernel.stem, (kernel,)) + kernel.code
    return source(kernel.stem)


# --- compile cache ----------------------------------------------------------------------------


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
                fn = _functions[key] = _build(kernel_source(kernel), expr, device)
    return fn


def loaded_count() -> int:
    """How many functions are loaded (``precompile`` and the tests read it)."""
    return len(_functions)


def _build(code: str, expr: str, device: int) -> Loaded:
    global _modules_built
    cupy = import_cupy()
    _cache.guard_cupy_cache()  # a read-only CUPY_CACHE_DIR: read it, keep new kernels in memory
    check_device(device)
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=code, options=NVRTC_OPTIONS, name_expressions=[expr])
        fn = module.get_function(expr)
        loaded = Loaded(module, fn.kernel.ptr)  # .kernel: the Function of the current device
    _modules_built += 1
    return loaded


def clear_functions() -> None:
    """Forget loaded functions (the disk cache stays). Call through ``_plans.clear_cache``,
    which forgets the launch plans holding their handles first."""
    with _lock:
        _functions.clear()


# --- devices and streams ----------------------------------------------------------------------

MIN_CAPABILITY = (8, 0)


def import_cupy() -> Any:
    _cache.check_cupy_cache_dir()  # a cache directory that cannot be created: a clear error
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "zerokv needs CuPy for GPU tensors: pip install 'zerokv[cuda12]' or 'zerokv[cuda13]'"
        ) from e
    return cupy


@cache
def properties(device: int) -> dict[str, Any]:
    """CUDA's device properties (queried once per device: a slow call)."""
    return import_cupy().cuda.runtime.getDeviceProperties(device)


def device_name(device: int) -> str:
    name = properties(device)["name"]
    return name.decode() if isinstance(name, bytes) else name


def capability(device: int) -> tuple[int, int]:
    props = properties(device)
    return int(props["major"]), int(props["minor"])


def check_device(device: int) -> None:
    """A clear error for GPUs older than sm_80, before anything is compiled for them."""
    cap = capability(device)
    if cap < MIN_CAPABILITY:
        name = device_name(device)
        raise RuntimeError(
            f"zerokv: cuda:{device} ({name}) has compute capability {cap[0]}.{cap[1]}; "
            "zerokv needs 8.0 or newer (A100, A10/L4, L40, H100/H200, B200, RTX 30xx and later)"
        )


def torch_stream(device: int) -> int:
    """Raw handle of torch's current stream on ``device`` (~0.1 µs: what Triton and Inductor use)."""
    return sys.modules["torch"]._C._cuda_getCurrentRawStream(device)


def cupy_stream(device: int) -> int:
    cupy = import_cupy()
    with cupy.cuda.Device(device):
        return cupy.cuda.get_current_stream().ptr


@cache
def l2_bytes(device: int) -> int:
    return int(properties(device)["l2CacheSize"])


@cache
def sm_count(device: int) -> int:
    return int(properties(device)["multiProcessorCount"])


# --- launch -----------------------------------------------------------------------------------

# cuLaunchKernel with all arguments in one buffer (CU_LAUNCH_PARAM_BUFFER_POINTER): one pack_into
# instead of one Python object per argument.
_BUFFER_POINTER, _BUFFER_SIZE, _END = 1, 2, 0
_CUDA_ERROR_INVALID_CONTEXT = 201
_ARENA_BYTES = 1024


class _Arena(threading.local):
    """A per-thread argument buffer: the driver copies it at launch, so reusing it across
    launches is safe, and threads never share one."""

    def __init__(self) -> None:
        self.buf = ctypes.create_string_buffer(_ARENA_BYTES)
        self.size = ctypes.c_size_t(0)
        self.extra = (ctypes.c_void_p * 5)(
            _BUFFER_POINTER, ctypes.addressof(self.buf), _BUFFER_SIZE, ctypes.addressof(self.size), _END
        )
        self.extra_ptr = ctypes.addressof(self.extra)


_arena = _Arena()


class _Driver:
    """The driver entry points the hot path needs, looked up once."""

    def __init__(self) -> None:
        cupy = import_cupy()
        from cupy.cuda import driver

        self.launch = driver.launchKernel  # Cython: the cheapest way to call cuLaunchKernel
        self.error = driver.CUDADriverError
        self.get_device = cupy.cuda.runtime.getDevice
        self.Device = cupy.cuda.Device
        self.cupy = cupy


_driver_cache: list[_Driver] = []


def driver() -> _Driver:
    if not _driver_cache:
        _driver_cache.append(_Driver())
    return _driver_cache[0]


class Launcher:
    """One loaded instantiation on one device, ready to launch with packed arguments."""

    __slots__ = ("kernel", "expr", "device", "handle", "block", "pack_into", "nbytes", "driver")

    def __init__(self, kernel: Kernel, targs: tuple, device: int) -> None:
        self.kernel = kernel
        self.expr = kernel.expr(*targs)
        self.device = device
        self.handle = function(kernel, self.expr, device).ptr
        self.block = kernel.block
        self.pack_into = kernel.packer.pack_into
        self.nbytes = kernel.packer.size
        self.driver = driver()

    def __call__(self, grid: int, stream: int, *args: Any, grid_y: int = 1) -> None:
        """Launch ``grid`` (x ``grid_y``) blocks on ``stream`` with ``args`` in the kernel's
        parameter order."""
        a = _arena
        self.pack_into(a.buf, 0, *args)
        a.size.value = self.nbytes
        d = self.driver
        try:
            if d.get_device() == self.device:
                d.launch(self.handle, grid, grid_y, 1, self.block, 1, 1, 0, stream, 0, a.extra_ptr)
            else:
                with d.Device(self.device):
                    d.launch(self.handle, grid, grid_y, 1, self.block, 1, 1, 0, stream, 0, a.extra_ptr)
        except d.error as e:
            self._retry(e, grid, grid_y, stream)

    def _retry(self, e: Exception, grid: int, grid_y: int, stream: int) -> None:
        d = self.driver
        if getattr(e, "status", None) != _CUDA_ERROR_INVALID_CONTEXT:
            raise RuntimeError(f"zerokv: launching {self.expr} failed: {e}") from e
        # A thread that never touched CUDA: bind the device's primary context, then launch.
        with d.Device(self.device):
            d.cupy.cuda.runtime.free(0)
            try:
                d.launch(self.handle, grid, grid_y, 1, self.block, 1, 1, 0, stream, 0, _arena.extra_ptr)
            except d.error as e2:
                raise RuntimeError(f"zerokv: launching {self.expr} failed: {e2}") from e2
