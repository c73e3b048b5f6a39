"""zerokv: CUDA kernels for the bookkeeping of chunked prefill and split-KV attention.

Merging partial attention states by their log-sum-exp, writing the empty state into rows of
requests that had no KV, and planning on the CPU which chunks need that at all. Kernels are
compiled at run time by NVRTC through CuPy and receive torch (or any DLPack) tensors zero-copy.
"""

import sys

__version__ = "0.1.0"
__all__ = [
    "ContextChunkPlan",
    "can_run",
    "cp_merge",
    "cp_send_buffer",
    "fixup_zero_kv_rows",
    "launcher",
    "mask_empty_context",
    "merge_state",
    "merge_states",
    "plan_context_chunks",
    "precompile",
]


def _cli_args() -> list[str] | None:
    """The arguments of ``python -m zerokv`` while that command imports this package, else None."""
    argv = getattr(sys, "orig_argv", [])
    if sys.argv[:1] != ["-m"]:
        return None
    for i, a in enumerate(argv):
        if a == "-m" and argv[i + 1 : i + 2] == ["zerokv"]:
            return argv[i + 2 :]
        if a == "-mzerokv":
            return argv[i + 1 :]
    return None


_CLI = _cli_args()
# `python -m zerokv --version` / `--help` need nothing else: they answer without importing numpy,
# torch or CuPy. The CLI's other commands register torch.ops.zerokv.* themselves when they use torch.
if _CLI is None or not any(a in ("--version", "-h", "--help") for a in _CLI):
    from .core.probe import can_run
    from .cp_merge import cp_merge, cp_send_buffer
    from .empty_rows import fixup_zero_kv_rows, mask_empty_context
    from .launcher import launcher
    from .merge import merge_state, merge_states
    from .plan import ContextChunkPlan, plan_context_chunks
    from .precompile import precompile

    if _CLI is None:
        import contextlib

        with contextlib.suppress(ImportError):  # torch.ops.zerokv.* when torch is installed
            from . import torch_ops  # noqa: F401
