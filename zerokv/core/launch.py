"""Launching: :class:`Launcher` holds one loaded instantiation on one device; a launch packs
the arguments into a per-thread buffer and calls ``cuLaunchKernel`` on the given stream, in
the device's context; nothing is allocated or synced."""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence
from typing import Any

from . import compiler as _compiler
from . import device as _device
from .kernels import Kernel

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
        cupy = _device.import_cupy()
        from cupy.cuda import driver

        self.launch = driver.launchKernel  # Cython: the cheapest way to call cuLaunchKernel
        self.error = driver.CUDADriverError
        self.get_device = cupy.cuda.runtime.getDevice
        self.Device = cupy.cuda.Device
        self.cupy = cupy


driver = functools.cache(_Driver)  # the process's one _Driver, made on first use


def primary_context(device: int) -> int:
    """The device's primary context (``CUcontext``, as an int)."""
    cupy = _device.import_cupy()
    with cupy.cuda.Device(device):  # from CUDA 12 this makes the primary context current
        ctx = int(cupy.cuda.driver.ctxGetCurrent())
        if not ctx:  # an older runtime: bind it (no allocation; not while a graph captures)
            cupy.cuda.runtime.free(0)
            ctx = int(cupy.cuda.driver.ctxGetCurrent())
        return ctx


class Launcher:
    """One loaded instantiation on one device, ready to launch with packed arguments."""

    __slots__ = ("kernel", "expr", "device", "handle", "context", "block", "pack_into", "nbytes", "driver")

    def __init__(self, kernel: Kernel, targs: tuple, device: int) -> None:
        self.kernel = kernel
        self.expr = kernel.expr(*targs)
        self.device = device
        self.handle = _compiler.function(kernel, self.expr, device).ptr
        self.context = primary_context(device)  # the compiled executor makes it current when it is not
        self.block = kernel.block
        self.pack_into = kernel.packer.pack_into
        self.nbytes = kernel.packer.size
        self.driver = driver()

    def __call__(self, grid: int, stream: int, *args: Any, grid_y: int = 1) -> None:
        """Launch ``grid`` (x ``grid_y``) blocks on ``stream`` with ``args`` in the kernel's
        parameter order."""
        self.launch_values(grid, grid_y, stream, args)

    def launch_values(self, grid: int, grid_y: int, stream: int, values: Sequence[Any]) -> None:
        """Launch with ``values`` (a tuple or a list), every parameter in the kernel's order: one
        ``pack_into`` of them into this thread's buffer, then ``cuLaunchKernel`` (the one launch
        body)."""
        a = _arena
        self.pack_into(a.buf, 0, *values)
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
