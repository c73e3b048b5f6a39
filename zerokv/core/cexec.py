"""The compiled executor: ``launcher.c`` (and the ``launcher_*.h`` parts it includes) built at
first use with the host C compiler.

The source ships in the package; the first process that wants it compiles it (``$CC``, else
``cc``, with Python's headers: about a second) into zerokv's cache directory, under a name keyed
by the source's SHA-256, the Python ABI and the platform, written atomically beside the SHA-256
of its bytes. Later processes load that file. ``python -m zerokv compile --out DIR`` puts the
same file in ``DIR`` (:func:`build_into`), and a process with ``ZEROKV_KERNEL_DIR=DIR`` loads it
from there first: an image without a compiler still runs the compiled executor.

No compiler or no Python headers: :func:`load` returns None and why (the Python executor runs),
no warning. A build that fails: one warning. A cached file that is corrupt or foreign: rebuilt,
one warning. ``ZEROKV_SANITIZE=1`` (or ``sanitize=True``) builds with AddressSanitizer and
UndefinedBehaviorSanitizer into a file of its own (a process must preload ``libasan`` to load it).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any

from . import bound as _bound
from . import disk_cache as _cache

SOURCE = Path(__file__).with_name("launcher.c")
# its parts by job, each #included once by launcher.c: the build key covers every byte of them
PARTS = tuple(sorted(SOURCE.parent.glob("launcher_*.h")))
MODULE = "zerokv_launcher"  # the extension's PyInit_ name
KIND = "launcher"  # its folder in zerokv's cache
SANITIZE_ENV = "ZEROKV_SANITIZE"
FLAGS = ("-O2", "-shared", "-fPIC")
SANITIZE_FLAGS = ("-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer")
BUILD_SECONDS = 120  # a compile that takes longer has hung

_lock = threading.Lock()
_loaded: dict[bool, tuple[Any, str]] = {}  # sanitize -> (module or None, why), once per process


class BuildError(RuntimeError):
    """The launcher cannot be built here: no compiler or no headers (``expected``: a machine set up
    without them, no warning), or a compile that failed."""

    def __init__(self, message: str, expected: bool = False) -> None:
        super().__init__(message)
        self.expected = expected


def _sanitize(sanitize: bool | None) -> bool:
    if sanitize is not None:
        return sanitize
    return os.environ.get(SANITIZE_ENV, "").strip() not in ("", "0")


def file_name(sanitize: bool = False) -> str:
    """The launcher's file name: keyed by its source, the Python ABI, the platform and the build."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    flags = SANITIZE_FLAGS if sanitize else FLAGS
    sources = b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in (SOURCE, *PARTS))
    key = _cache.digest(sources, suffix, sysconfig.get_platform(), sys.implementation.cache_tag, *flags)
    return f"launcher-{'asan-' if sanitize else ''}{key[:24]}{suffix}"


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        raise BuildError(f"no C compiler ({' '.join(cc) or 'CC is empty'} not found)", expected=True)
    return cc


def _headers() -> str:
    include = sysconfig.get_paths().get("include") or ""
    if not (Path(include) / "Python.h").is_file():
        raise BuildError(
            f"Python's headers are not installed (no Python.h in {include or 'its include dir'})",
            expected=True,
        )
    return include


def _compile(out: Path, sanitize: bool) -> None:
    """Compile the launcher into ``out`` (a new file; the caller renames it into place)."""
    cc, include = _compiler(), _headers()
    flags = SANITIZE_FLAGS + FLAGS[1:] if sanitize else FLAGS
    cmd = [*cc, *flags, f"-I{include}", str(SOURCE), "-o", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_SECONDS, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{' '.join(cc)} could not run ({e})") from e
    if done.returncode != 0 or not out.is_file():
        err = (done.stderr or done.stdout or "").strip().splitlines()
        raise BuildError(
            f"{' '.join(cc)} failed (exit {done.returncode}): {' | '.join(err[-3:]) or 'no output'}"
        )


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _import(path: Path) -> Any:
    """Load the extension at ``path`` and check it runs this zerokv's record format."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"{path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    fmt = getattr(module, "FORMAT", None)
    want = {k: getattr(_bound, k, None) for k in fmt} if isinstance(fmt, dict) else None
    if (
        want is None
        or fmt != want
        or not all(hasattr(module, f) for f in ("run", "set_recorder", "launches"))
    ):
        raise ImportError(f"{path} runs another record format than this zerokv's")
    from .generic_tensors import writable_cheap
    from .tensors import torch_tensor_type

    module.bind(writable_cheap, torch_tensor_type)
    return module


def _elf_whole(data: bytes) -> bool:
    """``data`` is a whole shared object for this machine: an ELF header of this process's class,
    byte order and machine, the program and section tables and every loaded segment inside the
    file (the dynamic loader reads past the end of a truncated one, and the process dies)."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        with open(sys.executable, "rb") as f:
            own = f.read(20)
        if data[:4] != b"\x7fELF" or data[4:6] != own[4:6] or data[18:20] != own[18:20]:
            return False
        wide, end = data[4] == 2, "<" if data[5] == 1 else ">"
        head = struct.unpack_from(end + ("QQQIHHHHHH" if wide else "IIIIHHHHHH"), data, 24)
        _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _ = head
        if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
            return False
        for i in range(phnum):
            if wide:
                kind, _, offset, _, _, size = struct.unpack_from(end + "IIQQQQ", data, phoff + i * phentsize)
            else:
                kind, offset, _, _, size = struct.unpack_from(end + "IIIII", data, phoff + i * phentsize)
            if kind == 1 and offset + size > len(data):  # a PT_LOAD segment past the end
                return False
        return True
    except (OSError, struct.error):
        return False


def _load_checked(path: Path) -> Any:
    """The module at ``path`` when its bytes match the SHA-256 written beside it and make a whole
    shared object for this machine."""
    want = path.with_name(path.name + ".sha256").read_text().strip()
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != want or not _elf_whole(data):
        raise ImportError(
            f"{path} is truncated, corrupt or foreign (its SHA-256, or not a whole shared object)"
        )
    return _import(path)


def _install(directory: Path, sanitize: bool) -> tuple[Any, Path]:
    """Build into ``directory`` (a temporary file, loaded from there, then renamed into place with
    its SHA-256 beside it): ``(module, path)``. The module is loaded from the temporary name so
    that a bad file of the final name that this process already opened is never the one used."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(sanitize)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=path.suffix)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        _compile(tmp_path, sanitize)
        os.chmod(tmp_path, 0o755)
        module = _import(tmp_path)
        _cache.write_atomic(path.with_name(path.name + ".sha256"), (_sha(tmp_path) + "\n").encode())
        os.replace(tmp_path, path)
        module.__file__ = str(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)
    return module, path


def build_into(directory: str | os.PathLike, sanitize: bool = False) -> Path:
    """Build the launcher into ``directory`` (e.g. the ``--out`` of ``python -m zerokv compile``,
    read back through ``ZEROKV_KERNEL_DIR``); its path. BuildError when it cannot be built."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(sanitize)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch) / path.name
        _compile(tmp, sanitize)
        data = tmp.read_bytes()
    _cache.write_atomic(path, data)  # the binary first: a digest never names a missing file
    _cache.write_atomic(
        path.with_name(path.name + ".sha256"), (hashlib.sha256(data).hexdigest() + "\n").encode()
    )
    os.chmod(path, 0o755)
    return path


def _prebuilt(sanitize: bool) -> tuple[Any, str] | None:
    """The launcher of ``$ZEROKV_KERNEL_DIR``, when there is one built for this zerokv and Python."""
    from . import prebuilt

    value = os.environ.get(prebuilt.ENV)
    if not value:
        return None
    path = Path(value).expanduser() / file_name(sanitize)
    if not path.is_file():
        return None
    try:
        return _load_checked(path), f"compiled executor from {prebuilt.ENV} ({path})"
    except (ImportError, OSError) as e:
        _cache.warn_once(
            f"launcher-prebuilt:{path}",
            f"zerokv: {prebuilt.ENV}: {path} cannot be loaded ({e}); building the launcher instead",
        )
        return None


def _from_cache(sanitize: bool) -> tuple[Any, str]:
    directory = _cache.cache_dir() / KIND
    path = directory / file_name(sanitize)
    if path.is_file():
        try:
            return _load_checked(path), f"compiled executor ({path})"
        except (ImportError, OSError) as e:
            _cache.corrupt(KIND, path.name, f"unusable ({e})")
    try:
        module, path = _install(directory, sanitize)
        return module, f"compiled executor, built now ({path})"
    except OSError as e:
        _cache.warn_once(
            "zerokv-cache",
            f"zerokv: cannot write its cache in {directory} ({e.strerror or e}); the launcher is built "
            "for this process only. Set ZEROKV_CACHE_DIR to a writable directory to keep it.",
        )
    scratch = Path(tempfile.mkdtemp(prefix="zerokv-launcher-"))
    module, path = _install(scratch, sanitize)
    return module, f"compiled executor, built for this process ({path})"


def _load(sanitize: bool) -> tuple[Any, str]:
    found = _prebuilt(sanitize)
    if found is not None:
        return found
    try:
        return _from_cache(sanitize)
    except BuildError as e:
        if not e.expected:
            _cache.warn_once("launcher-build", f"zerokv: the compiled executor cannot be built: {e}; "
                             "the Python executor runs the calls")  # fmt: skip
        return None, f"the compiled executor cannot be built: {e}"
    except (ImportError, OSError) as e:
        _cache.warn_once("launcher-load", f"zerokv: the compiled executor cannot be loaded ({e}); "
                         "the Python executor runs the calls")  # fmt: skip
        return None, f"the compiled executor cannot be loaded: {e}"


def load(strict: bool = False, sanitize: bool | None = None) -> tuple[Any, str]:
    """``(module, why)``: the compiled executor (built or loaded once per process), or None and
    why it cannot run; ``strict``: RuntimeError with that reason instead."""
    sanitize = _sanitize(sanitize)
    with _lock:
        if sanitize not in _loaded:
            _loaded[sanitize] = _load(sanitize)
        module, why = _loaded[sanitize]
    if module is None and strict:
        raise RuntimeError(f"zerokv: ZEROKV_LAUNCHER=c: {why}")
    return module, why
