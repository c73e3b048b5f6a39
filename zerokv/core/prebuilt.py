"""Kernel binaries built ahead of time: ``python -m zerokv compile --arch sm_XX --out DIR`` writes
them (no GPU needed), and a process with ``ZEROKV_KERNEL_DIR=DIR`` loads them at the first call
on a GPU of that arch, with no NVRTC work.

``DIR`` holds, per kernel source stem and arch, ``<stem>-<arch>.cubin`` (every instantiation of
that stem asked for, in one module) and ``<stem>-<arch>.json``: what it was built from (SHA-256
of the source text handed to NVRTC, the options, the NVRTC version), the name expressions with
their lowered names, and the cubin's SHA-256. Both files are written atomically. At run time an
entry is used only when the source, options and arch match this zerokv and, where NVRTC can be
loaded, its version too; anything else (no entry, another build, a file that is truncated,
corrupt or foreign) compiles as without ``DIR``, with one warning per directory and reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from . import disk_cache as _cache

ENV = "ZEROKV_KERNEL_DIR"
FORMAT = 1

_lock = threading.Lock()
_modules: dict[tuple[str, str, int], tuple[Any, dict[str, str]] | None] = {}
loaded = 0  # functions served from a kernel directory in this process (the tests read it)


def sha256(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def entry_name(stem: str, arch: str) -> str:
    return f"{stem}-{arch}"


# --- writing (the offline compile) ------------------------------------------------------------


def write(
    out: Path, stem: str, arch: str, code: str, options: list[str], nvrtc: tuple[int, int],
    expressions: list[str], lowered: list[str], cubin: bytes,
) -> Path:  # fmt: skip
    """Write one stem's binary for ``arch`` and its record into ``out``; returns the record's path."""
    out.mkdir(parents=True, exist_ok=True)
    name = entry_name(stem, arch)
    meta = {
        "format": FORMAT,
        "stem": stem,
        "arch": arch,
        "source_sha256": sha256(code),
        "options": list(options),
        "nvrtc": list(nvrtc),
        "expressions": list(expressions),
        "lowered": list(lowered),
        "cubin": f"{name}.cubin",
        "cubin_sha256": sha256(cubin),
    }
    _cache.write_atomic(out / f"{name}.cubin", cubin)  # the binary first: a record never names
    _cache.write_atomic(out / f"{name}.json", json.dumps(meta, indent=1).encode())  # a missing one
    return out / f"{name}.json"


def built(
    out: Path, stem: str, arch: str, code: str, options: list[str], nvrtc: tuple[int, int]
) -> list[str]:
    """The name expressions of the entry ``out`` already holds for ``stem`` and ``arch`` when it
    was built from this source text, options and NVRTC (a later ``compile --out`` into the same
    directory builds them again beside its own, so that it adds to the directory and drops
    nothing); [] for no entry, or one of another build (replaced: it could never be loaded)."""
    try:
        meta = json.loads((out / f"{entry_name(stem, arch)}.json").read_bytes())
        same = (
            meta["format"] == FORMAT
            and meta["stem"] == stem
            and meta["arch"] == arch
            and meta["source_sha256"] == sha256(code)
            and list(meta["options"]) == list(options)
            and tuple(meta["nvrtc"]) == tuple(nvrtc)
        )
        exprs = list(meta["expressions"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return [str(e) for e in exprs] if same and all(isinstance(e, str) for e in exprs) else []


# --- loading (the run time) -------------------------------------------------------------------


def archs_for(capability: tuple[int, int]) -> tuple[str, ...]:
    """Entry archs a GPU of ``capability`` runs, best first: ``sm_90``, then ``sm_90a``."""
    base = f"sm_{capability[0]}{capability[1]}"
    return (base, f"{base}a", f"{base}f")


def _runtime_nvrtc() -> tuple[int, int] | None:
    """The NVRTC version a compile here would use; None when no NVRTC can be loaded."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        major, minor = nvrtc.getVersion()
        return int(major), int(minor)
    except Exception:
        return None


def _warn(directory: Path, why: str, message: str) -> None:
    _cache.warn_once(f"kernel-dir:{directory}:{why}", f"zerokv: {ENV}={directory}: {message}")


def _read(directory: Path, stem: str, arch: str, code: str, options: list[str]) -> dict | None:
    """The checked record and cubin of one entry, or None (with a warning where it is unusable)."""
    name = entry_name(stem, arch)
    path = directory / f"{name}.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(directory, f"unreadable:{name}", f"{path} cannot be read ({e}); compiling instead")
        return None
    try:
        meta = json.loads(raw)
        ok = meta["format"] == FORMAT and meta["stem"] == stem and meta["arch"] == arch
        exprs, lowered = list(meta["expressions"]), list(meta["lowered"])
        ok = ok and len(exprs) == len(lowered) and all(isinstance(x, str) for x in exprs + lowered)
        cubin_name, cubin_sha = str(meta["cubin"]), str(meta["cubin_sha256"])
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        _warn(directory, f"corrupt:{name}", f"{path} is not a zerokv kernel record; compiling instead")
        return None
    if meta["source_sha256"] != sha256(code) or list(meta["options"]) != options:
        _warn(
            directory,
            f"stale:{name}",
            f"{name} was built from other kernel sources or options (another zerokv version?); "
            "compiling instead. Run `python -m zerokv compile ... --out` again with this zerokv.",
        )
        return None
    here = _runtime_nvrtc()
    if here is not None and tuple(meta["nvrtc"]) != here:
        built = ".".join(str(v) for v in meta["nvrtc"])
        _warn(
            directory,
            f"nvrtc:{name}",
            f"{name} was built by NVRTC {built}, this process has NVRTC {here[0]}.{here[1]}; compiling instead",
        )
        return None
    try:
        cubin = (directory / Path(cubin_name).name).read_bytes()
    except OSError as e:
        _warn(directory, f"corrupt:{name}", f"{name}'s binary cannot be read ({e}); compiling instead")
        return None
    if sha256(cubin) != cubin_sha:
        _warn(
            directory,
            f"corrupt:{name}",
            f"{name}.cubin is truncated or corrupt (its SHA-256 differs from the record); compiling instead",
        )
        return None
    return {"cubin": cubin, "names": dict(zip(exprs, lowered, strict=True))}


def _module(directory: Path, stem: str, code: str, device: int, capability: tuple[int, int]) -> Any:
    """(loaded CuPy Module, expression -> lowered name) of ``stem`` on ``device``, or None."""
    from . import device as _device
    from . import sources as _sources

    key = (str(directory), stem, device)
    if key in _modules:
        return _modules[key]
    found = None
    for arch in archs_for(capability):
        entry = _read(directory, stem, arch, code, _sources.nvrtc_options(arch))
        if entry is None:
            continue
        cupy = _device.import_cupy()
        try:
            with cupy.cuda.Device(device):
                module = cupy.cuda.function.Module()
                module.load(entry["cubin"])  # cuModuleLoadData: no NVRTC
        except Exception as e:
            _warn(
                directory,
                f"load:{stem}-{arch}",
                f"the driver refused {stem}-{arch}.cubin ({e}); compiling instead",
            )
            continue
        found = (module, entry["names"])
        break
    else:
        _warn(
            directory,
            f"missing:sm_{capability[0]}{capability[1]}",
            f"no usable binaries of {stem} for sm_{capability[0]}{capability[1]} "
            f"(build them with `python -m zerokv compile --arch sm_{capability[0]}{capability[1]} --out ...`); compiling",
        )
    _modules[key] = found
    return found


def load(stem: str, code: str, expr: str, device: int, capability: tuple[int, int]) -> tuple[Any, int] | None:
    """``(module, CUfunction handle)`` of ``expr`` from ``$ZEROKV_KERNEL_DIR``, or None to compile."""
    global loaded
    value = os.environ.get(ENV)
    if not value:
        return None
    directory = Path(value).expanduser()
    with _lock:
        found = _module(directory, stem, code, device, capability)
        if found is None:
            return None
        module, names = found
        lowered = names.get(expr)
        if lowered is None:
            _warn(
                directory,
                f"expr:{stem}",
                f"{expr} (and maybe others of {stem}) was not built into it (see --dtypes/--ops); compiling those",
            )
            return None
        function = module.get_function(lowered)
        loaded += 1
        return module, int(function.ptr)


def forget() -> None:
    """Drop the loaded modules (with ``compiler.clear_functions``; tests)."""
    with _lock:
        _modules.clear()
