"""Caches on disk: zerokv's own (the offline compile's results) and CuPy's kernel cache.

* zerokv's cache: ``$ZEROKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/zerokv``, else
  ``~/.cache/zerokv``. Entries are named by a hash of everything that makes them (source text,
  options, arch, NVRTC version) and written atomically (a temporary file, then a rename), so
  processes may share one directory. A directory that cannot be written gives one warning and
  the work goes on uncached.
* CuPy's kernel cache (``$CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``): CuPy creates it when
  it is imported and writes every new kernel into it; a read-only one makes that write raise
  after the compile succeeded. :func:`guard_cupy_cache` keeps CuPy reading it and turns a failed
  write into one warning (the kernel stays loaded in memory); :func:`check_cupy_cache_dir` turns
  a directory that cannot be created into an error that says what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

_warned: set[str] = set()
_lock = threading.Lock()


def warn_once(what: str, message: str) -> None:
    """One ``RuntimeWarning`` per ``what`` and process."""
    with _lock:
        if what in _warned:
            return
        _warned.add(what)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# --- zerokv's cache ---------------------------------------------------------------------------


def cache_dir() -> Path:
    explicit = os.environ.get("ZEROKV_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "zerokv"


def digest(*parts: str | bytes) -> str:
    """A cache key: SHA-256 of the parts, each one delimited."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def load(kind: str, name: str) -> bytes | None:
    """The entry ``<cache>/<kind>/<name>``, or None (missing or unreadable: a miss)."""
    try:
        return (cache_dir() / kind / name).read_bytes()
    except OSError:
        return None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary file in its directory and a rename: a reader sees the
    old file or the new one, never a part; concurrent writers of one name are safe. OSError as is."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide an image's kernels from another user
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def store(kind: str, name: str, data: bytes) -> bool:
    """Write an entry atomically; False (and one warning per process) when it cannot be written."""
    directory = cache_dir() / kind
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / name, data)
        return True
    except OSError as e:
        warn_once(
            "zerokv-cache",
            f"zerokv: cannot write its cache in {directory} ({e.strerror or e}); going on without "
            "caching. Set ZEROKV_CACHE_DIR to a writable directory to keep compiled kernels between runs.",
        )
        return False


def corrupt(kind: str, name: str, why: str) -> None:
    """An entry that is truncated, corrupt or foreign: one warning per process; the caller
    rebuilds it (and its store replaces the file)."""
    warn_once(
        f"zerokv-cache-corrupt:{kind}",
        f"zerokv: cache entry {cache_dir() / kind / name} is {why}; rebuilding it "
        "(further bad entries in this cache are rebuilt without a warning)",
    )


# --- CuPy's kernel cache ----------------------------------------------------------------------


def cupy_cache_dir() -> str:
    return os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")


class CacheDirError(RuntimeError):
    """CuPy's kernel cache directory does not exist and cannot be created."""


def check_cupy_cache_dir() -> None:
    """Call before the first ``import cupy``: CuPy creates its cache directory on import and a
    directory that cannot be created fails the import with a bare ``OSError``."""
    if "cupy" in sys.modules or importlib.util.find_spec("cupy") is None:
        return  # imported already, or not installed: no directory for a library that is absent
    d = cupy_cache_dir()
    if os.path.isdir(d):
        return
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise CacheDirError(
            f"zerokv: CuPy's kernel cache directory {d} does not exist and cannot be created "
            f"({e.strerror or e}). Set CUPY_CACHE_DIR to a writable directory, or create {d}."
        ) from e


class TolerantCache:
    """CuPy's cache backend, read as before; a write that fails becomes one warning."""

    def __init__(self, inner: Any, directory: str) -> None:
        self.inner = inner
        self.directory = directory

    def load(self, name: str) -> bytes | None:
        try:
            data = self.inner.load(name)
        except OSError:
            data = None  # an unreadable entry is a miss: compile again
        if data is None and os.path.lexists(os.path.join(self.directory, name)):
            # CuPy checks each entry's SHA-1 and treats a bad one as a miss; say so once
            warn_once(
                "cupy-cache-corrupt",
                f"zerokv: CuPy's kernel cache entry {os.path.join(self.directory, name)} is truncated, "
                "corrupt or unreadable; compiling it again (further bad entries: no warning)",
            )
        return data

    def save(self, name: str, cubin: bytes, source: str) -> None:
        try:
            self.inner.save(name, cubin, source)
        except OSError as e:
            warn_once(
                "cupy-cache",
                f"zerokv: CuPy's kernel cache {self.directory} cannot be written ({e.strerror or e}); "
                "kernels compiled now stay in this process only (entries already there are still "
                "used). Point CUPY_CACHE_DIR at a writable directory to keep them.",
            )

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


_guarded = False


def guard_cupy_cache() -> None:
    """Wrap CuPy's cache backend once per process (call before the first compile; cheap after)."""
    global _guarded
    if _guarded:
        return
    with _lock:
        if _guarded:
            return
        from cupy.cuda import compiler

        backend = getattr(compiler, "_kernel_cache_backend", None)
        setter = getattr(compiler, "_set_kernel_cache_backend", None)
        if backend is not None and setter is not None and not isinstance(backend, TolerantCache):
            setter(TolerantCache(backend, cupy_cache_dir()))
        _guarded = True
