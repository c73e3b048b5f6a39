"""Compile every kernel instantiation for a named arch without a GPU (NVRTC via cuda-bindings).

CuPy asks the device for its arch even when one is given, so a machine without a GPU (CI)
cannot compile through CuPy; cuda-bindings' NVRTC can. Same sources, same options (CuPy adds
``-ftz=true``; so does this). A stem's instantiations compile as one program; when it fails,
each instantiation is compiled alone to name the ones that fail. Results are cached in
zerokv's cache directory, keyed on the source text, name expressions, options, arch and NVRTC
version, so a second run compiles nothing.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from . import disk_cache as _cache
from . import kernels as _kernels
from . import sources as _sources

MIN_ARCH = 80
# Archs CI compiles for: A100, A10/L4/RTX 30, L40/RTX 40, H100/H200, B200, RTX 50.
CI_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
_ARCH = re.compile(r"^sm_(\d+)([af]?)$")


@dataclass
class Compiled:
    stem: str
    expression: str
    lowered_name: str
    cubin_bytes: int
    seconds: float  # for the whole stem (all its instantiations in one program); 0 from the cache
    cached: bool = False


class ArchError(ValueError):
    """An arch name that is malformed, older than sm_80, or unknown to this NVRTC."""


class NvrtcLibraryError(ImportError):
    """cuda-bindings is installed but the NVRTC library it loads is not (a broken install)."""


class CompileError(RuntimeError):
    """A stem that does not compile; ``failing`` names the instantiations, ``log`` is NVRTC's."""

    def __init__(self, stem: str, arch: str, failing: list[tuple[str, str]], log: str) -> None:
        self.stem, self.arch, self.failing, self.log = stem, arch, failing, log
        super().__init__(f"NVRTC compile of {stem}.cu failed for {arch}:\n{self.summary()}\n{log}")

    def summary(self) -> str:
        """One line per failing instantiation, with the first error NVRTC reported for it."""
        return "\n".join(
            f"{self.stem}.cu: {expr} fails for {self.arch}: {first}" for expr, first in self.failing
        )


# --- NVRTC through cuda-bindings --------------------------------------------------------------


def _cuda12() -> bool:
    """Whether this environment is set up for CUDA 12 (its CuPy), else CUDA 13 is assumed."""
    return _installed("cupy-cuda12x") and not _installed("cupy-cuda13x")


def install_hint() -> str:
    """The pip command that brings cuda-bindings of the CUDA major CuPy was installed for."""
    if _cuda12():
        return "pip install 'cuda-bindings>=12.9,<13' (what the cuda12 extra installs: pip install 'zerokv[cuda12]')"
    return (
        "pip install 'cuda-bindings>=13,<14' (what the cuda13 extra installs: pip install 'zerokv[cuda13]')"
    )


def nvrtc_hint() -> str:
    """The pip command that brings the NVRTC library of the CUDA major in use."""
    if _cuda12():
        return "pip install 'nvidia-cuda-nvrtc-cu12>=12.8,<13' (part of the cuda12 extra)"
    return "pip install 'nvidia-cuda-nvrtc>=13,<14' (part of the cuda13 extra)"


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def nvrtc() -> Any:
    """cuda-bindings' NVRTC module; ImportError with the install command when it is missing."""
    try:
        from cuda.bindings import nvrtc as module
    except ImportError as e:
        raise ImportError(f"compiling without a GPU needs cuda-bindings: {install_hint()}") from e
    return module


def _check(result: tuple, what: str) -> tuple:
    err, *rest = result
    if err != nvrtc().nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC {what} failed: {err}")
    return tuple(rest)


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's version; ImportError with the install command when the library cannot be loaded."""
    module = nvrtc()
    try:
        result = module.nvrtcVersion()
    except Exception as e:  # cuda-bindings loads libnvrtc on first use; its error types vary
        why = " ".join(str(e).split())  # one line
        raise NvrtcLibraryError(f"the NVRTC library cannot be loaded ({why}): {nvrtc_hint()}") from e
    major, minor = _check(result, "version")
    return int(major), int(minor)


def supported_archs() -> list[int]:
    """Compute capabilities this NVRTC compiles for, from sm_80 on (e.g. [80, 86, ..., 120])."""
    nvrtc_version()  # the library loads, or ImportError with the install command
    (archs,) = _check(nvrtc().nvrtcGetSupportedArchs(), "supported archs")
    return sorted(int(a) for a in archs if int(a) >= MIN_ARCH)


def check_arch(arch: str) -> str:
    """``arch`` if it names a target zerokv supports (``sm_80`` .. ``sm_121``, ``sm_90a``...),
    else ArchError listing the valid names: those this NVRTC compiles for, or without NVRTC
    (cuda-bindings missing) the archs CI compiles for."""
    m = _ARCH.match(arch)
    try:
        valid = supported_archs()
    except ImportError:
        valid = None
    names = ", ".join(f"sm_{a}" for a in (valid or [int(a[3:]) for a in CI_ARCHS]))
    if not m:
        raise ArchError(f"{arch!r} is not an arch name; valid: {names}")
    if int(m.group(1)) < MIN_ARCH:
        raise ArchError(f"{arch}: zerokv needs sm_80 or newer (A100 and later); valid: {names}")
    if valid is not None and int(m.group(1)) not in valid:
        major, minor = nvrtc_version()
        raise ArchError(f"{arch}: NVRTC {major}.{minor} cannot compile for it; valid: {names}")
    return arch


def options(arch: str) -> list[str]:
    # -ftz=true: CuPy always adds it, so the offline build matches the run-time one.
    return [f"-arch={arch}", "-ftz=true", *_sources.NVRTC_OPTIONS]


def _log(prog: Any) -> str:
    nv = nvrtc()
    _, size = nv.nvrtcGetProgramLogSize(prog)
    buf = b" " * size
    nv.nvrtcGetProgramLog(prog, buf)
    return buf.decode(errors="replace").rstrip("\x00 \n")


def _compile(code: str, filename: str, exprs: list[str], arch: str) -> tuple[bytes, list[str]] | str:
    """(cubin, lowered names) or, when NVRTC fails, its log."""
    nv = nvrtc()
    (prog,) = _check(nv.nvrtcCreateProgram(code.encode(), filename.encode(), 0, [], []), "create")
    try:
        for e in exprs:
            _check(nv.nvrtcAddNameExpression(prog, e.encode()), f"add {e}")
        opts = [o.encode() for o in options(arch)]
        (res,) = nv.nvrtcCompileProgram(prog, len(opts), opts)
        if res != nv.nvrtcResult.NVRTC_SUCCESS:
            return _log(prog) or str(res)
        (size,) = _check(nv.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * size
        _check(nv.nvrtcGetCUBIN(prog, cubin), "cubin")
        lowered = [
            _check(nv.nvrtcGetLoweredName(prog, e.encode()), f"lowered name of {e}")[0].decode()
            for e in exprs
        ]
        return cubin, lowered
    finally:
        nv.nvrtcDestroyProgram(prog)


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line:
            return line.strip()[:200]
    return (log.strip().splitlines() or ["(no log)"])[0][:200]


# --- compile, with the cache ------------------------------------------------------------------


def compile_stem(
    stem: str, arch: str = "sm_90", directory: Path | None = None, *, cache: bool = True
) -> list[Compiled]:
    """Compile all instantiations of ``kernels_cu/<stem>.cu`` for ``arch``.

    ``directory``: another folder of kernel sources to compile instead (default: the package's
    ``kernels_cu``). A failed compile raises :class:`CompileError` naming each failing
    instantiation and carrying the NVRTC log.
    """
    exprs = _kernels.instantiations()[stem]
    code = _sources.source(stem, directory)
    filename = f"{stem}.cu"
    key = _cache.digest(
        code, "\0".join(exprs), " ".join(options(arch)), "nvrtc {}.{}".format(*nvrtc_version())
    )
    if cache:
        hit = _load(key, stem, exprs)
        if hit is not None:
            return hit
    start = time.perf_counter()
    result = _compile(code, filename, exprs, arch)
    if isinstance(result, str):
        common = _compile(code, filename, [], arch)  # no instantiation: an error every one shares
        if isinstance(common, str):
            raise CompileError(
                stem, arch, [(f"every instantiation ({len(exprs)})", _first_error(common))], result
            )
        failing = []
        for e in exprs:  # alone, each instantiation shows whether it is one that fails
            alone = _compile(code, filename, [e], arch)
            if isinstance(alone, str):
                failing.append((e, _first_error(alone)))
        if not failing:  # only together (should not happen): name the program
            failing = [(f"{len(exprs)} instantiations together", _first_error(result))]
        raise CompileError(stem, arch, failing, result)
    cubin, lowered = result
    seconds = time.perf_counter() - start
    if cache:
        meta = {
            "stem": stem,
            "arch": arch,
            "expressions": exprs,
            "lowered": lowered,
            "cubin_bytes": len(cubin),
        }
        _cache.store("offline", f"{key}.json", json.dumps(meta).encode())  # what a rerun reports
    return [Compiled(stem, e, low, len(cubin), seconds) for e, low in zip(exprs, lowered, strict=True)]


def _load(key: str, stem: str, exprs: list[str]) -> list[Compiled] | None:
    raw = _cache.load("offline", f"{key}.json")
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
        lowered, size = meta["lowered"], int(meta["cubin_bytes"])
        ok = meta["expressions"] == exprs and len(lowered) == len(exprs)
    except (ValueError, KeyError, TypeError):
        return None
    if not ok:
        return None
    return [Compiled(stem, e, low, size, 0.0, cached=True) for e, low in zip(exprs, lowered, strict=True)]


def compile_arch(arch: str, *, cache: bool = True) -> Iterator[tuple[str, list[Compiled] | CompileError]]:
    """``(stem, results)`` of every stem for ``arch`` in turn; a stem that fails gives its
    :class:`CompileError` in place of the results, and the others still compile."""
    for stem in _kernels.instantiations():
        try:
            yield stem, compile_stem(stem, arch, cache=cache)
        except CompileError as e:
            yield stem, e
