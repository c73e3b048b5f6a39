"""The one runtime every op uses: kernel sources, compile cache, device and stream, launch.

* Sources: ``kernels_cu/<stem>.cu`` with its ``#include "x.cuh"`` lines replaced by the header
  text, so the code handed to NVRTC (and hashed by CuPy's disk cache) covers every byte.
* Cache: one CuPy ``Function`` per (stem, template instantiation, device), compiled on first use
  under a lock (concurrent first calls compile once) and reused from CuPy's disk cache
  (``CUPY_CACHE_DIR``) by later processes.
* Launch: on the given stream, in the tensor's device context; nothing is allocated or synced.
"""

from __future__ import annotations

import ctypes
import re
import struct
import sys
import threading
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, NamedTuple

# Options shared by the run-time (CuPy) and the offline (cuda-bindings) compiles. CuPy adds
# -arch for the device and -ftz=true itself.
NVRTC_OPTIONS = ("--std=c++17",)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    """``kernels_cu`` inside an installed wheel, or beside the package in a source tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"zerokv: kernel sources (kernels_cu/) not found near {here}")


def source(stem: str, directory: Path | None = None) -> str:
    """The full text of ``<stem>.cu`` with every local header inlined once."""
    directory = directory or kernel_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (directory / name).read_text()
        text = text.replace("#pragma once\n", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return f"// zerokv: {stem}.cu with headers inlined\n" + expand(f"{stem}.cu")


# --- what exists: every (stem, kernel, template arguments) the ops may launch ------------------

INSTANTIATIONS: dict[str, list[str]] = {}  # stem -> name expressions


def register(stem: str, expressions: list[str]) -> None:
    """Ops declare their instantiations, so the offline compile can build every one."""
    INSTANTIATIONS.setdefault(stem, [])
    for e in expressions:
        if e not in INSTANTIATIONS[stem]:
            INSTANTIATIONS[stem].append(e)


# --- compile cache ----------------------------------------------------------------------------

_functions: dict[tuple[str, str, int], Any] = {}
_lock = threading.Lock()
_modules_built = 0  # number of RawModules created in this process (tests read it)


def function(stem: str, expr: str, device: int) -> Loaded:
    """The kernel for ``expr`` on ``device``; compiled and loaded once per device."""
    key = (stem, expr, device)
    fn = _functions.get(key)
    if fn is None:
        with _lock:
            fn = _functions.get(key)
            if fn is None:
                fn = _functions[key] = _build(stem, expr, device)
    return fn


class Loaded(NamedTuple):
    kernel: Any  # CuPy's RawKernel: owns the loaded module
    ptr: int  # its CUfunction handle on this device


def _build(stem: str, expr: str, device: int) -> Loaded:
    global _modules_built
    cupy = import_cupy()
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=source(stem), options=NVRTC_OPTIONS, name_expressions=[expr])
        kernel = module.get_function(expr)
        loaded = Loaded(kernel, kernel.kernel.ptr)  # .kernel: the Function of the current device
    _modules_built += 1
    return loaded


def clear_cache() -> None:
    """Forget loaded functions (the disk cache stays); the next call compiles or reloads.

    The remembered launches go too: they hold the handles of the modules unloaded here."""
    with _lock:
        launches.clear()
        _functions.clear()


# --- devices and streams ----------------------------------------------------------------------


def import_cupy() -> Any:
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "zerokv needs CuPy for GPU tensors: pip install 'zerokv[cuda12]' or 'zerokv[cuda13]'"
        ) from e
    return cupy


def torch_stream(device: int) -> int:
    """Raw handle of torch's current stream on ``device`` (~0.1 µs: what Triton and Inductor use)."""
    return sys.modules["torch"]._C._cuda_getCurrentRawStream(device)


def stream_for(t: Any) -> int:
    """Raw handle of the producer's current stream on the tensor's device."""
    if t.is_torch:
        return torch_stream(t.device)
    return cupy_stream(t.device)


def cupy_stream(device: int) -> int:
    cupy = import_cupy()
    with cupy.cuda.Device(device):
        return cupy.cuda.get_current_stream().ptr


@cache
def sm_count(device: int) -> int:
    cupy = import_cupy()
    return int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])


# Launch through the driver directly: all arguments packed by ``struct`` into one buffer handed
# over with CU_LAUNCH_PARAM_BUFFER_POINTER. A CuPy Function call converts every argument to a
# Python object of its own first, which costs several µs for kernels with ~30 parameters.
_BUFFER_POINTER, _BUFFER_SIZE, _END = 1, 2, 0
_CUDA_ERROR_INVALID_CONTEXT = 201


class _Driver:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        # No argtypes: every argument is passed as a prepared ctypes object (no conversions).
        self.launch = self.lib.cuLaunchKernel
        self.launch.restype = ctypes.c_int
        import cupy

        self.get_device = cupy.cuda.runtime.getDevice

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(name))
        return (name.value or b"unknown").decode()


@lru_cache(maxsize=1)
def _driver() -> _Driver:
    return _Driver()


@cache
def _struct(fmt: str) -> struct.Struct:
    return struct.Struct(fmt)


class Launch:
    """One fully prepared launch: the kernel, its geometry and its packed arguments.

    Built once per distinct call (ops keep the ones made for torch tensors in :data:`launches`,
    keyed on every input's pointer, shape, strides, dtype and device, so a repeated call skips
    validation and packing); run on the caller's current stream each time.
    """

    __slots__ = ("expr", "device", "buf", "size", "extra", "head", "driver")

    def __init__(
        self, stem: str, expr: str, device: int, grid: tuple, block: tuple, fmt: str, args: tuple
    ) -> None:
        self.expr = expr
        self.device = device
        packer = _struct(fmt)
        self.buf = ctypes.create_string_buffer(packer.size)
        packer.pack_into(self.buf, 0, *args)  # the driver copies the arguments at each launch
        self.size = ctypes.c_size_t(packer.size)
        self.extra = (ctypes.c_void_p * 5)(
            _BUFFER_POINTER, ctypes.addressof(self.buf), _BUFFER_SIZE, ctypes.addressof(self.size), _END
        )
        u = ctypes.c_uint
        # cuLaunchKernel(f, grid x/y/z, block x/y/z, shared bytes, ...) as ready ctypes values
        self.head = (ctypes.c_void_p(function(stem, expr, device).ptr), *map(u, grid), *map(u, block), u(0))
        self.driver = _driver()

    def __call__(self, stream: int) -> None:
        d = self.driver
        if d.get_device() == self.device:
            err = d.launch(*self.head, ctypes.c_void_p(stream), None, self.extra)
            if err == _CUDA_ERROR_INVALID_CONTEXT:  # a thread that never touched CUDA yet
                cupy = sys.modules["cupy"]
                with cupy.cuda.Device(self.device):
                    cupy.cuda.runtime.free(0)  # binds the device's primary context to this thread
                    err = d.launch(*self.head, ctypes.c_void_p(stream), None, self.extra)
        else:
            with sys.modules["cupy"].cuda.Device(self.device):
                err = d.launch(*self.head, ctypes.c_void_p(stream), None, self.extra)
        if err:
            raise RuntimeError(f"zerokv: launching {self.expr} failed: {d.error_name(err)} ({err})")


class LaunchCache(dict):
    """Prepared launches by call key; cleared when it grows past ``limit`` entries."""

    def __init__(self, limit: int = 4096) -> None:
        super().__init__()
        self.limit = limit

    def remember(self, key: Any, launch: Launch) -> None:
        if key is None:
            return
        if len(self) >= self.limit:
            self.clear()
        self[key] = launch


launches = LaunchCache()


def launch(
    stem: str,
    expr: str,
    device: int,
    stream: int,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    fmt: str,
    args: tuple[Any, ...],
    key: Any = None,
) -> None:
    """Launch ``expr`` on ``stream`` in ``device``'s context (switching only when needed).

    ``fmt``: the ``struct`` format of the kernel's parameter list (``q`` for pointers and 64-bit
    integers, ``f`` for float), ``args`` the values in order. ``key``: remember the prepared
    launch under it (see :func:`zerokv._tensors.torch_key`).
    """
    prepared = Launch(stem, expr, device, grid, block, fmt, args)
    launches.remember(key, prepared)
    prepared(stream)
