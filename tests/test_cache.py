"""zerokv/core/disk_cache.py: zerokv's cache entries, and CuPy's kernel cache when it cannot be written."""

from __future__ import annotations

import os
import sys

import pytest

from zerokv.core import disk_cache as _cache


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_cache, "_warned", set())


def test_digest_delimits_its_parts():
    assert _cache.digest("ab", "c") != _cache.digest("a", "bc")
    assert _cache.digest("a", b"b") == _cache.digest(b"a", "b")


def test_store_and_load(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROKV_CACHE_DIR", str(tmp_path / "c"))
    assert _cache.load("kind", "x.bin") is None
    assert _cache.store("kind", "x.bin", b"\x00payload")
    assert _cache.load("kind", "x.bin") == b"\x00payload"
    assert os.listdir(tmp_path / "c" / "kind") == ["x.bin"]  # no temporary file left behind


def test_default_location(monkeypatch, tmp_path):
    monkeypatch.delenv("ZEROKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _cache.cache_dir() == tmp_path / "zerokv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(_cache.cache_dir()).endswith(os.path.join(".cache", "zerokv"))


def test_unwritable_store_warns_once(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ZEROKV_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match="ZEROKV_CACHE_DIR") as record:
        assert not _cache.store("kind", "a", b"1")
        assert not _cache.store("kind", "b", b"2")
    assert len(record) == 1
    assert _cache.load("kind", "a") is None


class _Inner:
    def __init__(self, fail_save=False, fail_load=False):
        self.fail_save, self.fail_load, self.saved = fail_save, fail_load, []

    def load(self, name):
        if self.fail_load:
            raise PermissionError(13, "Permission denied")
        return b"cubin:" + name.encode()

    def save(self, name, cubin, source):
        if self.fail_save:
            raise PermissionError(13, "Permission denied")
        self.saved.append(name)


def test_tolerant_cache_reads_and_turns_a_failed_write_into_one_warning():
    inner = _Inner(fail_save=True)
    cache = _cache.TolerantCache(inner, "/some/dir")
    assert cache.load("k") == b"cubin:k"
    with pytest.warns(RuntimeWarning, match="cannot be written") as record:
        cache.save("k", b"x", "src")
        cache.save("k2", b"y", "src")
    assert len(record) == 1 and "CUPY_CACHE_DIR" in str(record[0].message)


def test_tolerant_cache_passes_writes_through_and_misses_on_unreadable_entries():
    inner = _Inner()
    cache = _cache.TolerantCache(inner, "/some/dir")
    cache.save("k", b"x", "src")
    assert inner.saved == ["k"]
    assert _cache.TolerantCache(_Inner(fail_load=True), "/d").load("k") is None


def test_guard_wraps_cupys_backend_once(monkeypatch):
    compiler = pytest.importorskip("cupy.cuda.compiler")
    original = compiler._kernel_cache_backend
    monkeypatch.setattr(compiler, "_kernel_cache_backend", original)
    monkeypatch.setattr(_cache, "_guarded", False)
    _cache.guard_cupy_cache()
    wrapped = compiler._kernel_cache_backend
    assert isinstance(wrapped, _cache.TolerantCache) and wrapped.inner is original
    monkeypatch.setattr(_cache, "_guarded", False)
    _cache.guard_cupy_cache()
    assert compiler._kernel_cache_backend is wrapped  # not wrapped twice


def test_guarded_cupy_cache_survives_a_read_only_directory(tmp_path):
    """CuPy's own disk backend on a directory whose writes fail: a warning, no exception."""
    from cupy.cuda import _compiler_cache

    d = tmp_path / "cupy-cache"
    d.mkdir()
    backend = _compiler_cache.DiskKernelCacheBackend(str(d))
    d.rmdir()  # gone after CuPy's import made it: every write fails, as on a read-only mount
    cache = _cache.TolerantCache(backend, str(d))
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        cache.save("entry.cubin", b"\x7fELF...", "source")
    assert cache.load("entry.cubin") is None


def test_cupy_cache_dir_that_cannot_be_created_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocker / "kernels"))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)  # as before the first import
    with pytest.raises(RuntimeError, match="CUPY_CACHE_DIR to a writable directory"):
        _cache.check_cupy_cache_dir()


def test_cupy_cache_dir_is_created_when_it_can_be(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "new" / "kernels"))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    _cache.check_cupy_cache_dir()
    assert (tmp_path / "new" / "kernels").is_dir()


@pytest.mark.gpu
def test_a_kernel_compiles_and_runs_with_a_read_only_cupy_cache(monkeypatch, tmp_path):
    """A kernel no cache has seen, compiled while CuPy's cache refuses writes: one warning, and
    the kernel loads and runs."""
    import uuid

    import cupy
    from cupy.cuda import compiler

    from zerokv.core import device as _device
    from zerokv.core import kernels as _kernels
    from zerokv.core import launch as _launch

    out = cupy.full(32, float("nan"), dtype=cupy.float32)  # CuPy's own fill kernel, compiled first
    _cache.guard_cupy_cache()
    backend = compiler._kernel_cache_backend
    disk = backend.inner if isinstance(backend, _cache.TolerantCache) else backend
    monkeypatch.setattr(disk, "_cache_dir", str(tmp_path / "missing"))  # every write fails
    monkeypatch.setattr(_cache, "_warned", set())  # the warning is once per process: forget it
    token = uuid.uuid4().hex  # a source no disk cache holds
    probe = _kernels.Kernel(
        stem=f"cache_probe_{token}",
        name="cache_probe_kernel",
        instances=((7,),),
        block=32,
        params=(("out", "ptr"),),
        code=f"// {token}\ntemplate <int N> __global__ void cache_probe_kernel(float* out) {{ out[threadIdx.x] = N; }}\n",
    )
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        launch = _launch.Launcher(probe, (7,), 0)
    launch(1, _device.cupy_stream(0), out.data.ptr)
    assert (out.get() == 7).all()
