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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import disk_cache as _cache
from . import kernels as _kernels
from . import prebuilt as _prebuilt
from . import sources as _sources
from .cupy_packages import installed_cupy_packages

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
    kept: bool = False  # not asked for: built before into the same --out directory, built again


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
    return installed_cupy_packages() == ["cupy-cuda12x"]


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


def nvrtc() -> Any:
    """cuda-bindings' NVRTC module, else the same calls over CuPy's NVRTC bindings; ImportError
    with the install command when neither is installed."""
    try:
        from cuda.bindings import nvrtc as module
    except ImportError as e:
        try:
            from cupy_backends.cuda.libs import nvrtc as cupy_module
        except ImportError:
            raise ImportError(f"compiling without a GPU needs cuda-bindings: {install_hint()}") from e
        from .cupy_nvrtc import CupyNvrtc

        return CupyNvrtc(cupy_module)
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


def accepted_archs() -> list[str]:
    """Every arch name ``compile --arch`` takes with this NVRTC: each supported compute capability
    from sm_80 on, with its ``a`` variant from sm_90 and its ``f`` (family) variant from sm_100,
    as NVRTC 12.9+ names them. ImportError (with the install command) without NVRTC."""
    nvrtc_version()  # the library loads, or ImportError with the install command
    (archs,) = _check(nvrtc().nvrtcGetSupportedArchs(), "supported archs")
    names = []
    for a in sorted(int(a) for a in archs if int(a) >= MIN_ARCH):
        names.append(f"sm_{a}")
        if a >= 90:
            names.append(f"sm_{a}a")
        if a >= 100:
            names.append(f"sm_{a}f")
    return names


def check_arch(arch: str) -> str:
    """``arch`` if it names a target zerokv supports (see :func:`accepted_archs`), else ArchError
    listing the valid names: those of this NVRTC, or without NVRTC (cuda-bindings missing) the
    archs CI compiles for."""
    m = _ARCH.match(arch)
    try:
        valid = accepted_archs()
    except ImportError:
        valid = None
    names = ", ".join(valid or CI_ARCHS)
    if not m:
        raise ArchError(f"{arch!r} is not an arch name; valid: {names}")
    if int(m.group(1)) < MIN_ARCH:
        raise ArchError(f"{arch}: zerokv needs sm_80 or newer (A100 and later); valid: {names}")
    if valid is not None and arch not in valid:
        major, minor = nvrtc_version()
        raise ArchError(f"{arch}: NVRTC {major}.{minor} cannot compile for it; valid: {names}")
    return arch


options = _sources.nvrtc_options


def _log(prog: Any) -> str:
    nv = nvrtc()
    _, size = nv.nvrtcGetProgramLogSize(prog)
    buf = bytearray(size)
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
        buf = bytearray(size)
        _check(nv.nvrtcGetCUBIN(prog, buf), "cubin")
        cubin = bytes(buf)
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
    stem: str,
    arch: str = "sm_90",
    directory: Path | None = None,
    *,
    cache: bool = True,
    exprs: list[str] | None = None,
    out: Path | None = None,
) -> list[Compiled]:
    """Compile all instantiations of ``kernels_cu/<stem>.cu`` for ``arch`` (or only ``exprs``).

    ``directory``: another folder of kernel sources to compile instead (default: the package's
    ``kernels_cu``). ``out``: a kernel directory to write the binary and its record into (what
    ``ZEROKV_KERNEL_DIR`` serves at run time; the instantiations an entry there already holds
    for this build are built again beside ``exprs``, so the directory only grows; they come back
    marked ``kept``). A failed compile raises :class:`CompileError`
    naming each failing instantiation and carrying the NVRTC log.
    """
    exprs = list(_kernels.instantiations()[stem] if exprs is None else exprs)
    code = _sources.source(stem, directory)
    version = nvrtc_version()
    asked = set(exprs)
    if out is not None:  # what the directory holds of this build stays in it, beside the new
        before = set(_prebuilt.built(out, stem, arch, code, options(arch), version)) - asked
        if before:
            order = [e for e in _kernels.instantiations().get(stem, []) if e in asked | before]
            exprs = order + sorted((asked | before) - set(order))
    key = _cache.digest(code, "\0".join(exprs), " ".join(options(arch)), "nvrtc {}.{}".format(*version))
    hit = _load(key, stem, exprs) if cache else None
    if hit is not None:
        lowered, cubin, seconds, cached = hit[0], hit[1], 0.0, True
    else:
        start = time.perf_counter()
        cubin, lowered = _compile_or_raise(code, f"{stem}.cu", exprs, arch, stem)
        seconds, cached = time.perf_counter() - start, False
        if cache:
            _store(key, stem, arch, exprs, lowered, cubin)
    if out is not None:
        _prebuilt.write(out, stem, arch, code, options(arch), version, exprs, lowered, cubin)
    return [
        Compiled(stem, e, low, len(cubin), seconds, cached, kept=e not in asked)
        for e, low in zip(exprs, lowered, strict=True)
    ]


def _compile_or_raise(
    code: str, filename: str, exprs: list[str], arch: str, stem: str
) -> tuple[bytes, list[str]]:
    result = _compile(code, filename, exprs, arch)
    if not isinstance(result, str):
        return result
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


def _store(key: str, stem: str, arch: str, exprs: list[str], lowered: list[str], cubin: bytes) -> None:
    meta = {
        "stem": stem,
        "arch": arch,
        "expressions": exprs,
        "lowered": lowered,
        "cubin_bytes": len(cubin),
        "cubin_sha256": _prebuilt.sha256(cubin),
    }
    # the binary first, then the record that vouches for it (each written atomically)
    if _cache.store("offline", f"{key}.cubin", cubin):
        _cache.store("offline", f"{key}.json", json.dumps(meta).encode())


def _load(key: str, stem: str, exprs: list[str]) -> tuple[list[str], bytes] | None:
    """(lowered names, cubin) of a cached compile, or None: missing, or truncated, corrupt or
    foreign (one warning; the caller compiles and the store replaces it)."""
    raw = _cache.load("offline", f"{key}.json")
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
        lowered = [str(x) for x in meta["lowered"]]
        ok = meta["expressions"] == exprs and len(lowered) == len(exprs)
        want = str(meta["cubin_sha256"])
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        _cache.corrupt("offline", f"{key}.json", "not a record of this compile")
        return None
    cubin = _cache.load("offline", f"{key}.cubin")
    if cubin is None or _prebuilt.sha256(cubin) != want:
        _cache.corrupt("offline", f"{key}.cubin", "missing, truncated or corrupt")
        return None
    return lowered, cubin


def selected(exprs: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """stem -> the name expressions a compile builds (``exprs``, default all), stems with none
    left out: what :func:`compile_arch` compiles, in its order (the progress' total)."""
    wanted = _kernels.instantiations() if exprs is None else exprs
    return {stem: list(e) for stem, e in wanted.items() if e}


def compile_arch(
    arch: str,
    *,
    cache: bool = True,
    exprs: dict[str, list[str]] | None = None,
    out: Path | None = None,
    before: Callable[[str, int], None] | None = None,
) -> Iterator[tuple[str, list[Compiled] | CompileError]]:
    """``(stem, results)`` of every stem for ``arch`` in turn (``exprs``: stem -> the name
    expressions to build, default all; ``out``: a kernel directory to write; ``before(stem, n)``:
    called as a stem of n instantiations starts); a stem that fails gives its
    :class:`CompileError` in place of the results, and the others still compile."""
    for stem, stem_exprs in selected(exprs).items():
        if before is not None:
            before(stem, len(stem_exprs))
        try:
            yield stem, compile_stem(stem, arch, cache=cache, exprs=stem_exprs, out=out)
        except CompileError as e:
            yield stem, e
