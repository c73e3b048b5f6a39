"""vLLM's signatures: ``merge_attn_states`` and ``mask_empty_context`` (LSE ``[H, T]``, natural log).

Swap ``from vllm...triton_merge_attn_states import merge_attn_states`` (or the CUDA op) for
``from zerokv.compat.vllm import merge_attn_states``.
"""

from __future__ import annotations

from typing import Any

from .. import _checks
from ..empty_rows import mask_empty_context as _mask
from ..merge import merge_two

_NAMES = ("prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output", "output_lse")


def _hn(x: Any, arg: str) -> Any:
    """A ``[H, T]`` LSE as the ``[T, H]`` view the native ops take (zero-copy)."""
    if getattr(x, "ndim", None) != 2:
        raise ValueError(
            f"{arg}: expected an [num_heads, num_tokens] LSE, got shape {tuple(getattr(x, 'shape', ()))}"
        )
    return x.T


def merge_attn_states(
    output: Any,
    prefix_output: Any,
    prefix_lse: Any,
    suffix_output: Any,
    suffix_lse: Any,
    output_lse: Any = None,
    prefill_tokens_with_context: int | None = None,
    output_scale: Any = None,
) -> None:
    """Merge prefix and suffix attention into ``output`` (in place; returns None).

    Args:
        output: ``[T, H, D]``, the inputs' dtype, or float8_e4m3fn with ``output_scale``.
        prefix_output, suffix_output: ``[T, H, D]`` float16 / bfloat16 / float32.
        prefix_lse, suffix_lse: ``[H, T]`` float32, natural log (any strides).
        output_lse: ``[H, T]`` float32 or None (then not written).
        prefill_tokens_with_context: tokens ``>=`` this take the suffix verbatim (V and LSE
            copied as they are, as vLLM does); None: every token is merged.
        output_scale: float32 tensor of one element for an fp8 output (``merged / scale``).

    As vLLM: an LSE of +inf counts as -inf. Unlike vLLM's kernels, two empty states give
    ``(0, -inf)`` rather than the prefix's (possibly garbage) V or NaN.
    """
    if prefill_tokens_with_context is not None and not isinstance(prefill_tokens_with_context, int):
        raise TypeError(
            f"prefill_tokens_with_context: expected an int or None, got {type(prefill_tokens_with_context).__name__}"
        )
    merge_two(
        prefix_output, _hn(prefix_lse, "prefix_lse"), suffix_output, _hn(suffix_lse, "suffix_lse"),
        output, None if output_lse is None else _hn(output_lse, "output_lse"), "e",
        prefill_tokens_with_context, None, output_scale,
        suffix_verbatim=True, row_mask=None, allocate_lse=False, names=_NAMES,
    )  # fmt: skip


def mask_empty_context(lse: Any, output: Any, query_start_loc: Any, context_start_loc: Any) -> None:
    """In place: tokens of requests whose context chunk is empty
    (``context_start_loc[i + 1] == context_start_loc[i]``) get ``lse = -inf`` and ``output = 0``,
    in one launch.

    Args:
        lse: ``[H, T]`` float32 (any strides).
        output: ``[T, H, D]`` (or ``[T, H * D]``) float16 / bfloat16 / float32.
        query_start_loc: ``[B + 1]`` int32 / int64 query offsets.
        context_start_loc: ``[B + 1]`` int32 / int64 context offsets of the chunk.
    """
    lse_th = _hn(lse, "lse")
    if getattr(output, "ndim", None) == 2:
        T, width = output.shape
        H = lse_th.shape[1]
        if H == 0 or width % H:
            raise ValueError(f"output: width {width} is not a multiple of num_heads {H}")
        output = output.view(T, H, width // H)
    elif getattr(output, "ndim", None) != 3:
        _checks.tensor(output, "output", 3, ())  # raises the usual message
    _mask(output, lse_th, query_start_loc, context_start_loc)
