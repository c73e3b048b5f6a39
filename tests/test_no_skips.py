"""The suite's own rule: a test without the ``gpu`` marker that skips fails (a missing package
must not look green), at run time and at import; a ``gpu`` test still skips cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import HAS_GPU

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent


def _run(pytester, source: str):
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makefile(".py", tolerances=(TESTS / "tolerances.py").read_text())
    pytester.makefile(".py", oracles=(TESTS / "oracles.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n    multigpu: needs two\n")
    pytester.makepyfile(test_case=source)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rfE")


def test_a_cpu_test_that_skips_fails_and_a_gpu_test_skips(pytester):
    result = _run(
        pytester,
        "import pytest\n\n"
        "def test_cpu():\n    pytest.skip('pretend a package is missing')\n\n"
        "@pytest.mark.gpu\ndef test_gpu():\n    pass\n",
    )
    outcomes = result.parseoutcomes()
    gpu_outcome = "passed" if HAS_GPU else "skipped"
    assert outcomes.get("failed") == 1 and outcomes.get(gpu_outcome) == 1, outcomes
    result.stdout.fnmatch_lines(["*a CPU test skipped*pretend a package is missing*"])


def test_a_module_that_skips_at_import_fails(pytester):
    result = _run(
        pytester, "import pytest\n\npytest.importorskip('no_such_package_here')\n\ndef test_x():\n    pass\n"
    )
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*skipped at import*no_such_package_here*CPU tests never skip*"])


# --- a GPU run cannot go quietly green ---------------------------------------------------------

CPU_AND_GPU = "import pytest\n\ndef test_cpu():\n    pass\n\n@pytest.mark.gpu\ndef test_gpu():\n    pass\n"
# loaded before the conftest: torch says a CUDA device is there (whatever CuPy finds)
TORCH_SEES_CUDA = "import torch\n\ntorch.cuda.is_available = lambda: True\n"


def _run_without_a_usable_gpu(pytester, monkeypatch, require: str | None, torch_sees_cuda: bool):
    """The suite's conftest over one CPU and one GPU test, no GPU visible to CuPy (on any
    machine), the worktree's zerokv imported."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PYTHONPATH", str(TESTS.parent))
    if require is None:
        monkeypatch.delenv("ZEROKV_REQUIRE_GPU", raising=False)
    else:
        monkeypatch.setenv("ZEROKV_REQUIRE_GPU", require)
    args = []
    if torch_sees_cuda:
        pytester.makepyfile(torch_sees_cuda=TORCH_SEES_CUDA)
        args = ["-p", "torch_sees_cuda"]
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makefile(".py", tolerances=(TESTS / "tolerances.py").read_text())
    pytester.makefile(".py", oracles=(TESTS / "oracles.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n    multigpu: needs two\n")
    pytester.makepyfile(test_case=CPU_AND_GPU)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


@pytest.mark.parametrize(
    ("require", "torch_sees_cuda", "because"),
    [("1", False, "ZEROKV_REQUIRE_GPU=1"), (None, True, "torch sees a CUDA device")],
)
def test_a_run_that_needs_a_gpu_zerokv_cannot_use_fails_at_collection(
    pytester, monkeypatch, require, torch_sees_cuda, because
):
    result = _run_without_a_usable_gpu(pytester, monkeypatch, require, torch_sees_cuda)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    lines = [line for line in result.stderr.lines if line.strip()]
    assert len(lines) == 1, lines  # one line, the reason in it
    assert lines[0].startswith("ERROR: zerokv cannot launch (") and because in lines[0], lines[0]
    assert "CUDA GPU" in lines[0]  # zerokv.can_run's reason: no GPU it can use
    assert "passed" not in result.stdout.str() and "skipped" not in result.stdout.str()  # nothing ran


def test_asked_not_to_require_a_gpu_the_gpu_tests_skip(pytester, monkeypatch):
    result = _run_without_a_usable_gpu(pytester, monkeypatch, "0", torch_sees_cuda=True)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    assert result.parseoutcomes() == {"passed": 1, "skipped": 1}
