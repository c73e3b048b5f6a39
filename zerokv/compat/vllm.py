"""vLLM's signatures: ``merge_attn_states`` and ``mask_empty_context`` (LSE ``[H, T]``, natural log).

Swap ``from vllm...triton_merge_attn_states import merge_attn_states`` (or the CUDA op) for
``from zerokv.compat.vllm import merge_attn_states``. Errors name vLLM's arguments and give
LSE shapes in vLLM's ``[num_heads, num_tokens]`` order.
"""

from __future__ import annotations

from typing import Any

from ..core import empty_rows_plan as _empty_rows_plan
from ..core import kernels as _kernels
from ..core import merge_plans as _merge_plans
from ..core.tensors import view

# zerokv's argument -> vLLM's, for the messages
_MERGE_NAMES = {
    "v_a": "prefix_output",
    "s_a": "prefix_lse",
    "v_b": "suffix_output",
    "s_b": "suffix_lse",
    "out": "output",
    "out_lse": "output_lse",
    "prefix_rows": "prefill_tokens_with_context",
    "out_scale": "output_scale",
    "out_block_scale": "output_block_scale",
    "quant_group": "quant_group_size",
    "scale_format": "quant_scale_ue8m0",
}
_MASK_NAMES = ("output", "lse", "query_start_loc", "context_start_loc")  # (out, lse, cu_q, cu_kv)


def merge_attn_states(
    output: Any,
    prefix_output: Any,
    prefix_lse: Any,
    suffix_output: Any,
    suffix_lse: Any,
    output_lse: Any = None,
    prefill_tokens_with_context: int | None = None,
    output_scale: Any = None,
    output_block_scale: Any = None,
    quant_group_size: int | None = None,
    quant_scale_ue8m0: bool = False,
) -> None:
    """Merge prefix and suffix attention into ``output`` (in place; returns None).

    Args:
        output: ``[T, H, D]``, the inputs' dtype, or float8_e4m3fn with ``output_scale``
            (required, as in vLLM; may be ``prefix_output`` or ``suffix_output`` itself).
        prefix_output, suffix_output: ``[T, H, D]`` float16 / bfloat16 / float32.
        prefix_lse, suffix_lse: ``[H, T]`` float32, natural log (any strides).
        output_lse: ``[H, T]`` float32 or None (then not written).
        prefill_tokens_with_context: tokens ``>=`` this take the suffix verbatim (V and LSE
            copied as they are, as vLLM does); None: every token is merged.
        output_scale: float32 tensor of one element for an fp8 output (``merged / scale``).
        output_block_scale: float32 ``[T, H * D / quant_group_size]`` (any strides: row-major,
            column-major, padded) for a per-group fp8 ``output``: each (token, head, group)
            scale ``max(absmax, 1e-10) / 448``, rounded up to a power of two when
            ``quant_scale_ue8m0``. As vLLM: ``quant_group_size`` is required with it,
            ``output_scale`` must be None, and ``quant_group_size`` must divide the head size.

    As vLLM: an LSE of +inf counts as -inf. Unlike vLLM's kernels, two empty states give
    ``(0, -inf)`` rather than the prefix's (possibly garbage) V or NaN. A rejected call writes
    nothing.
    """
    if output is None:
        raise TypeError("output: required (vLLM's merge_attn_states writes its result into it), got None")
    lses = (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse), ("output_lse", output_lse))
    group = None
    if output_block_scale is not None:  # vLLM's rules for the per-group fp8 output
        if quant_group_size is None:
            raise ValueError("quant_group_size: required with output_block_scale")
        if output_scale is not None:
            raise ValueError("output_scale: must be None with output_block_scale")
        group = quant_group_size
    try:
        _merge_plans.two(  # the [H, T] LSEs read as [T, H]; _th makes the views the checks need
            prefix_output, prefix_lse, suffix_output, suffix_lse, output, output_lse,
            "e", prefill_tokens_with_context, None, output_scale, None, None, True, False, _MERGE_NAMES,
            output_block_scale, group, "ue8m0" if quant_scale_ue8m0 else "float32", _th,
        )  # fmt: skip
    except (TypeError, ValueError):
        _explain_lse_shapes(_token_head(prefix_output), lses)  # vLLM's [H, T] terms when an LSE is off
        raise


def mask_empty_context(lse: Any, output: Any, query_start_loc: Any, context_start_loc: Any) -> None:
    """In place: tokens of requests whose context chunk is empty
    (``context_start_loc[i + 1] <= context_start_loc[i]``) get ``lse = -inf`` and ``output = 0``,
    in one launch.

    Args:
        lse: ``[H, T]`` float32 (any strides).
        output: ``[T, H, D]`` (or ``[T, H * D]``) float16 / bfloat16 / float32, head_dim contiguous.
        query_start_loc: ``[B + 1]`` int32 / int64 query offsets (clipped to ``[0, T)``).
        context_start_loc: ``[B + 1]`` int32 / int64 context offsets of the chunk.

    A rejected call writes nothing.
    """
    if getattr(output, "ndim", None) == 2:
        output = _split_heads(output, lse)
    try:
        _empty_rows_plan.run(
            _kernels.RULE_CONTEXT_SPAN_EMPTY, (output, _th(lse, "lse"), query_start_loc, context_start_loc),
            _MASK_NAMES,
        )  # fmt: skip
    except (TypeError, ValueError):
        _explain_lse_shapes(_token_head(output), (("lse", lse),))
        raise


# --- [H, T] LSEs in vLLM's own terms ------------------------------------------------------------


def _th(x: Any, arg: str) -> Any:
    """A ``[H, T]`` LSE as the ``[T, H]`` view the native ops take (zero-copy)."""
    if getattr(x, "ndim", None) == 2:
        try:
            return x.T
        except AttributeError:
            pass
    shape = tuple(view(x, arg).shape)  # TypeError naming arg for what is not a tensor
    if len(shape) == 2:
        raise TypeError(f"{arg}: a {type(x).__name__} has no .T; pass a torch, numpy or CuPy array")
    raise ValueError(f"{arg}: expected an [num_heads, num_tokens] LSE (2 dimensions), got shape {shape}")


def _token_head(v: Any) -> tuple[int, int] | None:
    """(T, H) of a ``[T, H, D]`` tensor, or None when it is not one (its own check reports it)."""
    shape = getattr(v, "shape", None)
    return (int(shape[0]), int(shape[1])) if shape is not None and len(shape) == 3 else None


def _explain_lse_shapes(th: tuple[int, int] | None, lses: tuple[tuple[str, Any], ...]) -> None:
    """Raise a ``ValueError`` in ``[num_heads, num_tokens]`` terms for the first LSE whose shape
    is not ``(H, T)``; return quietly when every one fits (the native error stands)."""
    if th is None:
        return
    T, H = th
    for arg, x in lses:
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) != 2 or tuple(shape) == (H, T):
            continue
        hint = " (a [num_tokens, num_heads] LSE? pass lse.T)" if tuple(shape) == (T, H) else ""
        raise ValueError(
            f"{arg}: expected shape ({H}, {T}) (num_heads, num_tokens), got {tuple(shape)}{hint}"
        ) from None


def _split_heads(output: Any, lse: Any) -> Any:
    """vLLM's ``[T, H * D]`` output as the ``[T, H, D]`` view (heads from the ``[H, T]`` LSE)."""
    T, width = output.shape
    lse_shape = tuple(_th(lse, "lse").shape)  # (T, H) if lse is the [H, T] vLLM passes
    if lse_shape[0] != T:
        raise ValueError(
            f"lse: expected shape (num_heads, {T}) (num_heads, num_tokens) for an output of {T} tokens, "
            f"got {lse_shape[::-1]}"
        )
    H = lse_shape[1]
    if H == 0 or width % H:
        raise ValueError(f"output: width {width} is not a multiple of num_heads {H} (lse's first dimension)")
    return output.reshape(T, H, width // H)  # splitting one axis: always a view, never a copy


from .vllm_dcp import cp_lse_ag_out_ar, cp_lse_ag_out_rs, dcp_a2a_lse_reduce  # noqa: E402,F401
