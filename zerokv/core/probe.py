"""``zerokv.can_run``: whether zerokv can launch on a device, and if not why, in one line.

For an engine choosing its fallback before the first call: it never raises and compiles nothing
(it reads package metadata, asks the NVIDIA driver how many devices it sees, and only then
imports CuPy, reads the device and loads NVRTC's library to read its version). Importing CuPy
creates its kernel cache directory, so a machine without a GPU is answered before that import.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from typing import Any

from .cupy_packages import TWO_CUPY, installed_cupy_packages

FALLBACK = "use the engine's own kernels (e.g. vLLM's Triton merge) or zerokv's CPU path for CPU tensors"


def can_run(device: Any = None) -> tuple[bool, str]:
    """Whether zerokv can launch its kernels on ``device`` (None: the current CUDA device; an
    int, ``"cuda:N"`` or a ``torch.device``), and a one-line reason.

    ``(False, why)`` names the first obstacle: CuPy not installed, both CuPy packages installed,
    a ROCm build of CuPy, no usable CUDA GPU, a device that does not exist, compute capability
    below 8.0, or no NVRTC. ``(True, ...)`` names the device and its arch. Never raises and
    compiles nothing. Where it says False, use the engine's own kernels (CPU tensors still
    run zerokv's float64 reference path).
    """
    try:
        return _can_run(device)
    except Exception as e:  # a probe never raises
        return (
            False,
            f"zerokv cannot tell whether it can run here ({type(e).__name__}: {' '.join(str(e).split())})",
        )


def driver_devices() -> tuple[int, str]:
    """``(devices, why)``: how many CUDA devices the NVIDIA driver sees, asked of ``libcuda``
    directly (no CuPy import, no CUDA runtime, nothing written), and when none, why in words."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return 0, "no CUDA GPU: no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)"
    status = lib.cuInit(0)
    if status == _CUDA_ERROR_NO_DEVICE:
        return 0, "no CUDA GPU: the NVIDIA driver sees no device"
    if status != 0:
        return 0, f"no usable CUDA GPU: the NVIDIA driver fails to start ({_driver_error(lib, status)})"
    count = ctypes.c_int(0)
    status = lib.cuDeviceGetCount(ctypes.byref(count))
    if status != 0:
        return (
            0,
            f"no usable CUDA GPU: the NVIDIA driver cannot count its devices ({_driver_error(lib, status)})",
        )
    if count.value == 0:
        return 0, "no CUDA GPU: the NVIDIA driver sees no device"
    return count.value, ""


_CUDA_ERROR_NO_DEVICE = 100


def _driver_error(lib: Any, status: int) -> str:
    """The driver's name of an error code (``CUDA_ERROR_...``), else the number."""
    name = ctypes.c_char_p()
    try:
        if lib.cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
    except (AttributeError, OSError):
        pass
    return f"error {status}"


def _can_run(device: Any) -> tuple[bool, str]:
    wanted = device_argument(device)
    if isinstance(wanted, str):
        return False, wanted
    packages = installed_cupy_packages()
    if len(packages) > 1:
        return False, TWO_CUPY
    if importlib.util.find_spec("cupy") is None:
        return (
            False,
            "CuPy is not installed: pip install 'zerokv[cuda13]' (CUDA 13 driver) or 'zerokv[cuda12]'",
        )
    count, why = driver_devices()  # before CuPy's import, which creates CuPy's cache directory
    if count == 0:
        return False, why
    from . import device as _device
    from . import disk_cache as _cache

    try:
        cupy = _device.import_cupy()
    except _cache.CacheDirError as e:  # CuPy is fine; the directory its import creates is not
        return False, " ".join(str(e).removeprefix("zerokv: ").split())
    except Exception as e:
        return False, f"CuPy cannot be imported ({' '.join(str(e).split())})"
    if getattr(cupy.cuda.runtime, "is_hip", False):
        return False, "CuPy is a ROCm build: zerokv's kernels are CUDA only (AMD GPUs are not supported)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"no usable CUDA GPU ({' '.join(str(e).split())})"
    if count == 0:
        return False, "no CUDA GPU"
    index = wanted if wanted is not None else _current(cupy)
    if index >= count:
        return False, f"cuda:{index} does not exist ({count} CUDA device{'s' if count != 1 else ''})"
    major, minor = _device.capability(index)
    name = _device.device_name(index)
    if (major, minor) < _device.MIN_CAPABILITY:
        return False, (
            f"cuda:{index} ({name}) has compute capability {major}.{minor}; zerokv needs 8.0 or newer: {FALLBACK}"
        )
    try:
        from cupy_backends.cuda.libs import nvrtc

        nv = nvrtc.getVersion()
    except Exception as e:
        return (
            False,
            f"NVRTC cannot be loaded ({' '.join(str(e).split())}): pip install the extra of your CUDA major again",
        )
    return True, f"cuda:{index} ({name}, sm_{major}{minor}, NVRTC {nv[0]}.{nv[1]}): zerokv can launch here"


def device_argument(device: Any) -> int | None | str:
    """``device`` as a CUDA ordinal (None: the current device), or a one-line reason it names no
    CUDA device; read before anything else is asked, so a bad argument is what the answer names."""
    if device is None:
        return None
    if isinstance(device, bool):
        return f"device {device!r} is not a CUDA device (expected None, an int, 'cuda:N' or a torch.device)"
    if isinstance(device, int):
        return device if device >= 0 else f"device {device!r} is negative (CUDA ordinals start at 0)"
    if not isinstance(device, str) and type(device).__name__ != "device":
        return (
            f"device {device!r} ({type(device).__name__}) is not a CUDA device "
            "(expected None, an int, 'cuda:N' or a torch.device)"
        )
    text = str(device)
    kind, _, number = text.partition(":")
    if kind != "cuda" or not (number.isdigit() or number == ""):
        return f"device {device!r} is not a CUDA device (expected None, an int, 'cuda:N' or a torch.device)"
    return int(number) if number else None


def _current(cupy: Any) -> int:
    """The current CUDA device: torch's when torch is imported and sees a GPU, else CuPy's."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return int(cupy.cuda.runtime.getDevice())
