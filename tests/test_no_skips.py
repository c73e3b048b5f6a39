"""The suite's own rule: a test without the ``gpu`` marker that skips fails (a missing package
must not look green), at run time and at import; a ``gpu`` test still skips cleanly."""

from __future__ import annotations

from pathlib import Path

from conftest import HAS_GPU

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent


def _run(pytester, source: str):
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makefile(".py", tolerances=(TESTS / "tolerances.py").read_text())
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
