"""The runtime without a GPU: source assembly, cache keys, offline compile, the wheel, the lock."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from zerokv.core import compiler as _compiler
from zerokv.core import kernels as _kernels
from zerokv.core import offline as _offline
from zerokv.core import sources as _sources

REPO = Path(__file__).resolve().parent.parent
KERNELS = REPO / "kernels_cu"
STEMS = sorted(p.stem for p in KERNELS.glob("*.cu"))
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _headers_reached(stem: str, directory: Path = KERNELS) -> list[str]:
    """Every local header ``<stem>.cu`` reaches, directly or through another header."""
    seen: list[str] = []
    todo = [f"{stem}.cu"]
    while todo:
        for name in INCLUDE.findall((directory / todo.pop()).read_text()):
            if name not in seen:
                seen.append(name)
                todo.append(name)
    return seen


def _body(header: str) -> str:
    """A header's text as it appears once inlined: no pragma, no include lines."""
    text = (KERNELS / header).read_text().replace("#pragma once\n", "")
    return INCLUDE.sub("", text).strip()


# --- sources ----------------------------------------------------------------------------------


def test_every_stem_is_a_kernel_source():
    assert STEMS, "kernels_cu/ holds no .cu file"
    assert set(STEMS) == set(_kernels.instantiations()), "every .cu has described kernels"


@pytest.mark.parametrize("stem", STEMS)
def test_source_inlines_every_header_once(stem):
    text = _sources.source(stem)
    assert '#include "' not in text
    headers = _headers_reached(stem)
    assert headers, f"{stem}.cu includes no local header"
    for header in headers:
        # one distinctive line of the header, present exactly once
        lines = [ln for ln in _body(header).splitlines() if len(ln.strip()) > 20 and "#include" not in ln]
        marker = max(lines, key=lambda ln: len(ln))
        assert text.count(marker) == 1, f"{header} inlined {text.count(marker)} times into {stem}"
    own = [
        ln for ln in (KERNELS / f"{stem}.cu").read_text().splitlines() if ln.strip() and "#include" not in ln
    ]
    assert all(ln in text for ln in own)


def test_source_from_another_directory(tmp_path):
    copy = tmp_path / "kernels_cu"
    shutil.copytree(KERNELS, copy)
    assert _sources.source("merge", directory=copy) == _sources.source("merge")


def test_editing_a_header_changes_the_compiled_text(tmp_path):
    """The text handed to NVRTC is what CuPy hashes: an edited header must change it."""
    copy = tmp_path / "kernels_cu"
    shutil.copytree(KERNELS, copy)
    before = _sources.source("merge", directory=copy)
    header = copy / "common.cuh"
    header.write_text(header.read_text() + "\n// an edit that changes no code\n")
    after = _sources.source("merge", directory=copy)
    assert after != before
    assert "an edit that changes no code" in after
    assert (copy / "merge.cu").read_text() == (KERNELS / "merge.cu").read_text()


def test_editing_a_header_changes_cupys_cache_key(tmp_path, monkeypatch):
    """CuPy's own key, computed by CuPy's compile path up to the cache lookup (no GPU needed:
    the device query for the arch is replaced, the lookup records the key and stops)."""
    from cupy.cuda import compiler  # CuPy >= 14.2 (the cuda extras) has the pluggable backend

    assert hasattr(compiler, "_set_kernel_cache_backend") and hasattr(compiler, "_compile_module_with_cache")
    from cupy.cuda._compiler_cache import KernelCacheBackend

    class Looked(Exception):
        pass

    class Recorder(KernelCacheBackend):
        names: list[str] = []

        def load(self, name):
            self.names.append(name)
            raise Looked

        def save(self, name, cubin, source):  # pragma: no cover - load stops first
            raise Looked

    monkeypatch.setattr(compiler, "_kernel_cache_backend", Recorder())
    monkeypatch.setattr(
        compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=sm_{arch}", "cubin")
    )

    def key(code: str) -> str:
        expr = _kernels.MERGE_STATE.expressions[0]
        with pytest.raises(Looked):
            compiler._compile_module_with_cache(
                code, _sources.NVRTC_OPTIONS, arch="90", name_expressions=[expr]
            )
        return Recorder.names[-1]

    copy = tmp_path / "kernels_cu"
    shutil.copytree(KERNELS, copy)
    before = key(_sources.source("merge", directory=copy))
    assert key(_sources.source("merge", directory=copy)) == before  # the key is stable
    header = copy / "common.cuh"
    header.write_text(header.read_text() + "\n// an edit that changes no code\n")
    assert key(_sources.source("merge", directory=copy)) != before


# --- offline compile --------------------------------------------------------------------------


def test_offline_compile_of_each_kernels_instantiations():
    """Each kernel's first and last instantiation for sm_90 through the offline compile (every
    instantiation with ZEROKV_TEST_EVERY_ARCH=1; CI's last step compiles all of them for every
    arch): in order, each with its own mangled name and a binary."""
    inst = _kernels.instantiations()
    if os.environ.get("ZEROKV_TEST_EVERY_ARCH") != "1":
        inst = {
            stem: list(
                dict.fromkeys(
                    e
                    for k in _kernels.KERNELS
                    if k.stem == stem
                    for e in (k.expressions[0], k.expressions[-1])
                )
            )
            for stem in inst
        }
    results = []
    for _, res in _offline.compile_arch("sm_90", exprs=inst):
        if isinstance(res, Exception):
            raise res
        results += res
    expected = [(stem, e) for stem in inst for e in inst[stem]]
    assert [(r.stem, r.expression) for r in results] == expected
    assert len(expected) == len(set(expected))
    for r in results:
        assert r.lowered_name, r.expression
        assert r.lowered_name.startswith("_Z"), r.lowered_name  # a mangled template instance
        assert r.cubin_bytes > 0
    assert len({r.lowered_name for r in results}) == len(results)


def test_offline_compile_of_a_broken_source_raises_with_the_log(tmp_path):
    copy = tmp_path / "kernels_cu"
    shutil.copytree(KERNELS, copy)
    header = copy / "common.cuh"
    header.write_text(header.read_text() + "\nthis is not C++ zerokv_broken_token;\n")
    with pytest.raises(RuntimeError, match="NVRTC compile of merge.cu failed") as info:
        _offline.compile_stem("merge", "sm_90", directory=copy)
    log = str(info.value)
    assert "error" in log
    assert "merge.cu(" in log  # the log names the file and line


# --- the installed wheel ----------------------------------------------------------------------


def _build_wheel(out: Path) -> Path:
    try:
        import build  # noqa: F401

        cmd = [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(REPO)]
    except ImportError:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(REPO)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = out.glob("zerokv-*.whl")
    return wheel


def test_installed_wheel_finds_its_kernels(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index"]
    res = subprocess.run(
        [*pip, "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (target / "zerokv" / "kernels_cu" / "common.cuh").is_file()

    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path

        import zerokv
        from zerokv.core import offline as _offline, sources as _sources

        target = Path(sys.argv[1]).resolve()
        assert Path(zerokv.__file__).resolve().is_relative_to(target), zerokv.__file__
        assert _sources.kernel_dir().resolve().is_relative_to(target), _sources.kernel_dir()
        assert '#include "' not in _sources.source("merge")
        results = _offline.compile_stem("empty_rows", "sm_90")
        assert results and all(r.lowered_name and r.cubin_bytes > 0 for r in results)
        print("ok", len(results))
        """
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    res = subprocess.run(
        [sys.executable, "-c", script, str(target)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("ok ")


# --- the compile cache under concurrent first calls -------------------------------------------


def test_concurrent_first_calls_build_once(monkeypatch):
    builds: dict[tuple[str, int], int] = {}
    count_lock = threading.Lock()

    def slow_build(code, expr, device):
        with count_lock:
            builds[(expr, device)] = builds.get((expr, device), 0) + 1
        time.sleep(0.05)
        return object()

    monkeypatch.setattr(_compiler, "_build", slow_build)
    monkeypatch.setattr(_compiler, "_functions", {})
    merge_expr = _kernels.MERGE_STATE.expressions[0]
    rows_expr = _kernels.EMPTY_ROWS.expressions[0]
    keys = [(_kernels.MERGE_STATE, merge_expr, 0), (_kernels.MERGE_STATE, merge_expr, 1)]
    keys += [(_kernels.EMPTY_ROWS, rows_expr, 0)]
    n_threads = 8
    start = threading.Barrier(n_threads)
    got: list[list[object]] = [[] for _ in range(n_threads)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            start.wait()
            for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
                got[i].append((key, _compiler.function(*key)))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert builds == {(e, d): 1 for _, e, d in keys}
    for key in keys:
        assert len({id(fn) for results in got for k, fn in results if k == key}) == 1
    # later calls hit the cache
    assert _compiler.function(*keys[0]) is dict(got[0])[keys[0]]
    assert builds == {(e, d): 1 for _, e, d in keys}
