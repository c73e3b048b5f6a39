"""zerokv: CUDA kernels for the bookkeeping of chunked prefill and split-KV attention.

Merging partial attention states by their log-sum-exp, writing the empty state into rows of
requests that had no KV, and planning on the CPU which chunks need that at all. Kernels are
compiled at run time by NVRTC through CuPy and receive torch (or any DLPack) tensors zero-copy.
"""

import contextlib
import sys

from .core.probe import can_run
from .cp_merge import cp_merge
from .empty_rows import fixup_zero_kv_rows, mask_empty_context
from .merge import merge_state, merge_states
from .plan import ContextChunkPlan, plan_context_chunks
from .precompile import precompile


def _cli_importing() -> bool:
    """True while ``python -m zerokv`` imports this package: the CLI registers the torch ops
    itself for the commands that use torch, so ``--version`` and ``--help`` never import it."""
    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and any(
        a == "-m" and argv[i + 1 : i + 2] == ["zerokv"] or a == "-mzerokv" for i, a in enumerate(argv)
    )


if not _cli_importing():
    with contextlib.suppress(ImportError):  # torch.ops.zerokv.* when torch is installed
        from . import torch_ops  # noqa: F401

__all__ = [
    "ContextChunkPlan",
    "can_run",
    "cp_merge",
    "fixup_zero_kv_rows",
    "mask_empty_context",
    "merge_state",
    "merge_states",
    "plan_context_chunks",
    "precompile",
]
__version__ = "0.1.0"
