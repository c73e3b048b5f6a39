"""The README as a user reads it: its Python examples run as written (the GPU-only ones, fenced
as ``python gpu``, on a GPU), its two set-up commands are the ones CI runs, its image-build
lines are commands the CLI takes, and its links work from a package index page."""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest

from zerokv.__main__ import parser
from zerokv.core import prebuilt

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^( *)```([^\n]*)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)


def blocks(kind: str) -> list[str]:
    """The text of every fenced block whose info string is ``kind``, dedented."""
    return [textwrap.dedent(m.group(3)) for m in FENCE.finditer(README) if m.group(2).strip() == kind]


CPU_EXAMPLES = blocks("python")
GPU_EXAMPLES = blocks("python gpu")


def test_the_readme_has_examples_of_both_kinds():
    assert len(CPU_EXAMPLES) >= 3 and len(GPU_EXAMPLES) >= 1


@pytest.mark.parametrize("index", range(len(CPU_EXAMPLES)))
def test_a_cpu_example_runs_as_written(index):
    code = CPU_EXAMPLES[index]
    exec(compile(code, f"README.md example {index + 1}", "exec"), {"__name__": "readme_example"})


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(GPU_EXAMPLES)))
def test_a_gpu_example_runs_as_written(index):
    code = GPU_EXAMPLES[index]
    exec(compile(code, f"README.md GPU example {index + 1}", "exec"), {"__name__": "readme_example"})


def _commands(text: str) -> list[str]:
    """Command lines of a shell text: comments (`# ...` after the command) stripped."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def test_the_readme_opens_with_the_two_commands_ci_runs():
    setup = README[README.index("## Set-up") :]
    first_bash = next(m.group(3) for m in FENCE.finditer(setup) if m.group(2).strip() == "bash")
    two = _commands(first_bash)
    assert len(two) == 2
    assert two[0].endswith("python -m zerokv") and two[1].endswith("python -m pytest -q")
    assert (
        "torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu" in two[1]
    )  # the CPU build
    ci = _commands((ROOT / ".ci" / "run").read_text())
    for command in two:
        assert command in ci, f".ci/run does not run the README's command: {command}"


def test_the_image_build_lines_are_what_the_cli_and_runtime_take():
    section = README[README.index("## Kernels built into an image") :]
    lines = _commands(next(m.group(3) for m in FENCE.finditer(section) if m.group(2).strip() == "bash"))
    compile_line, export_line = lines
    argv = shlex.split(compile_line)
    assert argv[:3] == ["python", "-m", "zerokv"]
    args = parser().parse_args(argv[3:])
    assert args.command == "compile" and args.out is not None
    assert export_line == f"export {prebuilt.ENV}={args.out}"


def test_every_link_is_absolute_and_names_a_file_of_the_repository():
    pyproject = (ROOT / "pyproject.toml").read_text()
    home = re.search(r'^Homepage = "([^"]+)"', pyproject, re.MULTILINE).group(1).rstrip("/")
    links = re.findall(r"\]\(([^)]+)\)", README)
    assert links
    for link in links:
        assert link.startswith("https://"), f"relative link (breaks on a package index page): {link}"
        if link.startswith(f"{home}/blob/main/"):
            path = link.removeprefix(f"{home}/blob/main/").split("#")[0]
            assert (ROOT / path).exists(), f"{link}: no {path} in the repository"
