"""The Python examples of docs/*.md run as written: the CPU ones here, those fenced as
``python gpu`` on a GPU (the README's are run by test_readme.py)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"^( *)```([^\n]*)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)


def _examples(kind: str) -> list[tuple[str, str]]:
    """``(doc:number, code)`` of every fenced block whose info string is ``kind``, dedented."""
    found = []
    for doc in sorted(DOCS.glob("*.md")):
        blocks = [m.group(3) for m in FENCE.finditer(doc.read_text()) if m.group(2).strip() == kind]
        found += [(f"{doc.name}:{i + 1}", textwrap.dedent(code)) for i, code in enumerate(blocks)]
    return found


CPU = _examples("python")
GPU = _examples("python gpu")


def test_the_docs_have_cpu_examples():
    assert len(CPU) >= 2, [name for name, _ in CPU]


@pytest.mark.parametrize(("name", "code"), CPU, ids=[name for name, _ in CPU])
def test_a_docs_example_runs_as_written(name, code):
    exec(compile(code, f"docs/{name}", "exec"), {"__name__": "docs_example"})


if GPU:  # none today: the GPU-only examples (precompile) are in the README

    @pytest.mark.gpu
    @pytest.mark.parametrize(("name", "code"), GPU, ids=[name for name, _ in GPU])
    def test_a_docs_gpu_example_runs_as_written(name, code):
        exec(compile(code, f"docs/{name}", "exec"), {"__name__": "docs_example"})
