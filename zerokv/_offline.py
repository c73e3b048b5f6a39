"""Compile every kernel instantiation for a named arch without a GPU (NVRTC via cuda-bindings).

CuPy asks the device for its arch even when one is given, so a machine without a GPU (CI)
cannot compile through CuPy; cuda-bindings' NVRTC can. Same sources, same options.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from . import _runtime


@dataclass
class Compiled:
    stem: str
    expression: str
    lowered_name: str
    cubin_bytes: int
    seconds: float  # for the whole stem (all its instantiations in one program)


def _check(result: tuple, what: str, prog=None) -> tuple:
    from cuda.bindings import nvrtc

    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = _log(prog) if prog is not None else ""
        raise RuntimeError(f"NVRTC {what} failed: {err}\n{log}")
    return tuple(rest)


def _log(prog) -> str:
    from cuda.bindings import nvrtc

    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.decode(errors="replace").rstrip("\x00 ")


def compile_stem(stem: str, arch: str = "sm_90", directory: Path | None = None) -> list[Compiled]:
    """Compile all registered instantiations of ``kernels_cu/<stem>.cu`` for ``arch``.

    ``directory``: another folder of kernel sources to compile instead (default: the package's
    ``kernels_cu``). A failed compile raises ``RuntimeError`` carrying the NVRTC log.
    """
    from cuda.bindings import nvrtc

    exprs = _runtime.INSTANTIATIONS[stem]
    start = time.perf_counter()
    (prog,) = _check(
        nvrtc.nvrtcCreateProgram(_runtime.source(stem, directory).encode(), f"{stem}.cu".encode(), 0, [], []),
        "create",
    )
    try:
        for e in exprs:
            _check(nvrtc.nvrtcAddNameExpression(prog, e.encode()), f"add {e}")
        # -ftz=true: CuPy always adds it, so the offline build matches the run-time one.
        opts = [f"-arch={arch}".encode(), b"-ftz=true", *(o.encode() for o in _runtime.NVRTC_OPTIONS)]
        _check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), f"compile of {stem}.cu", prog)
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        seconds = time.perf_counter() - start
        out = []
        for e in exprs:
            (lowered,) = _check(nvrtc.nvrtcGetLoweredName(prog, e.encode()), f"lowered name of {e}")
            out.append(Compiled(stem, e, lowered.decode(), size, seconds))
        return out
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_all(arch: str = "sm_90") -> list[Compiled]:
    from . import fixup, mask, merge  # noqa: F401  (they register their instantiations)

    results = []
    for stem in sorted(_runtime.INSTANTIATIONS):
        results.extend(compile_stem(stem, arch))
    return results
