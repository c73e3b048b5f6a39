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


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(path: Path) -> set[str]:
    """The anchors a renderer gives the headings of a Markdown file (lowercase, punctuation
    dropped, spaces as hyphens)."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_is_relative_and_names_a_file_of_the_repository(doc):
    """Links that work in a clone, a fork and offline: relative, to a file (and heading) that
    exists; no URL to a host the project does not have."""
    links = LINK.findall(doc.read_text())
    for link in links:
        assert "://" not in link and not link.startswith("/"), f"{doc.name}: not a relative link: {link}"
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        assert target.exists(), f"{doc.name}: {link}: no {target.relative_to(ROOT)} in the repository"
        if anchor:
            assert anchor in _anchors(target), f"{doc.name}: {link}: no heading #{anchor}"


def test_no_page_or_metadata_names_a_project_host():
    texts = [p.read_text() for p in DOCS] + [(ROOT / "pyproject.toml").read_text()]
    for text in texts:
        assert "github.com/zerokv" not in text
    assert "[project.urls]" not in (ROOT / "pyproject.toml").read_text()


def test_one_plot_of_a_benchmark_run_is_embedded():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert len(images) == 1 and images[0].startswith("bench/h200/") and images[0].endswith(".png")
    assert (ROOT / images[0]).is_file()


def test_every_figure_of_the_table_is_in_the_run_it_names():
    """Each GPU and host figure of the README's table appears in a benchmark file of the date
    and GPU its row names: figures are copied from runs, never typed from memory."""
    section = README[README.index("## Figures") :]
    rows = [r for r in section.splitlines() if r.startswith("| GPU µs") or r.startswith("| host µs")]
    assert len(rows) >= 3
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        gpu, date = cells[-1].split(", ")
        runs = [
            p.read_text()
            for p in (ROOT / "bench" / "h200").glob(f"zerokv-bench-{date.replace('-', '')}-*.md")
            if gpu in p.read_text().splitlines()[0]
        ]
        assert runs, f"no {gpu} run of {date} in bench/h200/"
        for cell in cells[1:-1]:
            for figure in re.findall(r"\d+(?:\.\d+)?(?= \(| ?$)", cell):
                assert any(re.search(rf"(?<![\d.]){re.escape(figure)}\*? ", run) for run in runs), (
                    f"{figure} ({row}) is in no {gpu} run of {date}"
                )
