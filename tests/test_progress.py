"""Progress of the long compiles: on a terminal a line redrawn with instantiations done / total
and seconds; piped, one line per arch as each arch ends; ``--quiet``: none of it. The compile
is replaced by a stand-in that takes a few milliseconds a kernel source."""

from __future__ import annotations

import io
import re
import time

import pytest

from zerokv import progress, selfcheck
from zerokv.__main__ import main
from zerokv.core import offline

ARCHS = ("sm_80", "sm_90")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def quick_compile(monkeypatch):
    """compile_stem as a stand-in: the results of every asked instantiation, from no cache,
    after a few milliseconds; nvrtc_version without NVRTC. Returns the instantiation count."""

    def compile_stem(stem, arch="sm_90", directory=None, *, cache=True, exprs=None, out=None):
        time.sleep(0.003)
        return [offline.Compiled(stem, e, f"_Z{i}", 1000, 0.003) for i, e in enumerate(exprs)]

    monkeypatch.setattr(offline, "compile_stem", compile_stem)
    monkeypatch.setattr(offline, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(offline, "check_arch", lambda arch: arch)
    return sum(len(e) for e in offline.selected().values())


def _drawn(text: str) -> list[str]:
    """The states of a redrawn line, in order."""
    return [part.strip() for part in text.split("\r") if part.strip()]


def test_on_a_terminal_the_line_counts_up_to_the_total_then_is_erased():
    out = Terminal()
    p = progress.Progress(out, every=0.01)
    p.start("sm_90", 10)
    p.stage("merge")
    time.sleep(0.05)  # the clock redraws while a part compiles
    p.advance(4)
    p.stage("empty_rows")
    p.advance(6)
    p.finish()
    states = _drawn(out.getvalue())
    assert "sm_90: 0 / 10 instantiations, 0 s (compiling merge)" in states
    assert states.count("sm_90: 0 / 10 instantiations, 0 s (compiling merge)") >= 2  # the clock ran
    assert "sm_90: 4 / 10 instantiations, 0 s (compiling empty_rows)" in states
    assert states[-1] == "sm_90: 10 / 10 instantiations, 0 s"
    assert out.getvalue().endswith("\r" + " " * len(states[-1]) + "\r")  # erased for the result line


@pytest.mark.parametrize(
    ("stream", "quiet"), [(io.StringIO(), False), (Terminal(), True)], ids=["piped", "quiet"]
)
def test_piped_or_quiet_the_progress_draws_nothing(stream, quiet):
    p = progress.Progress(stream, quiet=quiet, every=0.01)
    p.start("sm_90", 3)
    p.stage("merge")
    time.sleep(0.03)
    p.advance(3)
    p.finish()
    assert stream.getvalue() == "" and not p.live


def test_compile_piped_prints_one_line_per_arch(quick_compile, capsys):
    assert main(["compile", "--arch", ",".join(ARCHS)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == len(ARCHS), lines
    for arch, line in zip(ARCHS, lines, strict=True):
        assert re.fullmatch(
            rf"{arch}: {quick_compile} instantiations compiled by NVRTC 13\.0 \(0 from the cache\), [\d.]+ s",
            line,
        ), line
    assert captured.err == ""


def test_compile_on_a_terminal_shows_done_of_total(quick_compile, capsys, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["compile", "--arch", "sm_90"]) == 0
    states = _drawn(terminal.getvalue())
    assert f"sm_90: 0 / {quick_compile} instantiations, 0 s" in states
    assert any(s.startswith(f"sm_90: {quick_compile} / {quick_compile} instantiations") for s in states)
    assert capsys.readouterr().out.startswith(f"sm_90: {quick_compile} instantiations compiled")


@pytest.mark.parametrize("argv", [["compile", "--quiet"], ["--quiet", "compile"], ["compile", "-q"]])
def test_compile_quiet_prints_neither_progress_nor_arch_lines(quick_compile, capsys, monkeypatch, argv):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main([*argv, "--arch", "sm_80,sm_90"]) == 0
    assert capsys.readouterr().out == "" and terminal.getvalue() == ""


def test_the_selfcheck_compile_prints_one_line_per_arch_piped(quick_compile, capsys):
    line, passed = selfcheck.offline_compile()
    assert passed and f"compiled {quick_compile * len(selfcheck.OFFLINE_ARCHS)} kernel" in line
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0].strip() for ln in lines] == list(selfcheck.OFFLINE_ARCHS)
    assert all(f"{quick_compile} of {quick_compile} instantiations" in ln for ln in lines)


def test_the_selfcheck_compile_on_a_terminal_and_quiet(quick_compile, capsys, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    selfcheck.offline_compile()
    assert any(s.startswith("sm_80: 0 / ") for s in _drawn(terminal.getvalue()))
    capsys.readouterr()
    terminal.truncate(0)
    terminal.seek(0)
    selfcheck.offline_compile(quiet=True)
    assert capsys.readouterr().out == "" and terminal.getvalue() == ""


@pytest.mark.parametrize(
    ("argv", "quiet"), [([], False), (["--quiet"], True), (["check", "-q"], True), (["-q", "check"], True)]
)
def test_the_selfcheck_takes_quiet(argv, quiet, monkeypatch):
    seen = []
    monkeypatch.setattr(selfcheck, "main", lambda quiet=False: seen.append(quiet) or 0)
    assert main(argv) == 0 and seen == [quiet]
