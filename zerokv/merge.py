"""Merging partial attention states by their log-sum-exp: two-way and N-way.

The signatures and their documentation; every call takes one path through the core
(:mod:`zerokv.core.merge_plans`): the bound call of the call's signature reads the
arguments, checks them cheaply, packs by name and launches (host tensors: the float64
reference).
"""

from __future__ import annotations

from typing import Any

from .core import entries as _entries  # noqa: F401 - the compiled entries, when chosen
from .core import merge_plans as _merge_plans
from .core import merge_states_plan as _merge_states_plan


def merge_state(
    v_a: Any,
    s_a: Any,
    v_b: Any,
    s_b: Any,
    *,
    out: Any = None,
    out_lse: Any = None,
    lse_base: str | int = "e",
    prefix_rows: int | None = None,
    a_empty: tuple[Any, Any] | None = None,
    out_scale: Any = None,
    sinks: Any = None,
    out_block_scale: Any = None,
    quant_group: int | None = None,
    scale_format: str = "float32",
) -> tuple[Any, Any]:
    """Merge two partial attention states ``(v_a, s_a)`` and ``(v_b, s_b)`` into one.

    Args:
        v_a, v_b: ``[T, H, D]`` float16 / bfloat16 / float32, same dtype; head_dim contiguous,
            token and head strides free.
        s_a, s_b: ``[T, H]`` float32 LSE, any strides (pass ``lse.T`` for an ``[H, T]`` buffer).
        out: ``[T, H, D]`` output, float16 / bfloat16 / float32 (may differ from the inputs),
            or float8_e4m3fn with ``out_scale``; may alias ``v_a`` or ``v_b`` exactly.
            ``None``: allocated.
        out_lse: ``[T, H]`` float32, may alias ``s_a`` or ``s_b`` exactly. ``None`` with
            ``out=None``: allocated; ``None`` with ``out`` given: the merged LSE is not written.
        lse_base: ``"e"`` (natural log) or ``2`` (FlashInfer / trtllm-gen).
        prefix_rows: rows ``t >= prefix_rows`` take state b alone (with the empty rule).
        a_empty: ``(cu_seqlens_q [B+1], kv_lens [B])`` int32/int64 (one dtype): rows of
            requests with ``kv_lens[i] == 0`` treat state a as empty (the fixup fused in).
            Offsets are clipped to ``[0, T)``; rows no request covers merge normally.
        out_scale: float32 tensor of one element: fp8 output ``clamp(merged / scale)``.
        sinks: float32 ``[H]`` attention-sink logits, in the LSE's base, counted once in the
            normaliser: ``S' = logaddexp(S, sink_h)``, ``out *= base^(S - S')``.
        out_block_scale: per-group fp8 output (vLLM's rule, for fp8 block-scaled GEMMs): float32
            ``[T, H * D / quant_group]``, any strides, receives each (token, head, group of
            ``quant_group`` values along D) scale ``max(absmax, 1e-10) / 448``; ``out`` must be
            float8_e4m3fn and receives ``fp8(clamp(x / scale))``. An empty row gives zeros and
            the smallest scale. Not with ``out_scale``, ``a_empty`` or ``sinks``.
        quant_group: the group size with ``out_block_scale``: 16, 32, 64 or 128, dividing D.
        scale_format: ``"float32"``, or ``"ue8m0"``: each scale rounded up to a power of two.

    Empty rule: an LSE of -inf or +inf gives weight 0 and that V never reaches the output (it
    may hold NaN/Inf garbage); both empty give ``(0, -inf)``. NaN in an LSE makes the row NaN.
    One launch, no host sync, no allocation unless an output is ``None``; runs on the current
    stream of the tensors' device. Mutates ``out`` and ``out_lse`` only.

    Returns:
        ``(out, out_lse)`` (``out_lse`` is ``None`` when not written).

    Example::

        out, lse = zerokv.merge_state(v_prefix, lse_prefix, v_suffix, lse_suffix)
    """
    return _merge_plans.two(
        v_a, s_a, v_b, s_b, out, out_lse, lse_base, prefix_rows, a_empty, out_scale, sinks,
        None, False, None, None, out_block_scale, quant_group, scale_format,
    )  # fmt: skip


def merge_two(
    v_a: Any,
    s_a: Any,
    v_b: Any,
    s_b: Any,
    out: Any = None,
    out_lse: Any = None,
    *,
    lse_base: Any = "e",
    prefix_rows: Any = None,
    a_empty: Any = None,
    out_scale: Any = None,
    sinks: Any = None,
    row_mask: Any = None,
    suffix_verbatim: bool = False,
    allocate_lse: bool | None = None,
    names: dict[str, str] | None = None,
    out_block_scale: Any = None,
    quant_group: int | None = None,
    scale_format: str = "float32",
) -> tuple[Any, Any]:
    """The two-way merge behind ``merge_state`` and the engine adapters.

    ``suffix_verbatim``: rows past ``prefix_rows`` copy state b as it is (vLLM). ``row_mask``:
    ``[T]`` bool, rows with False are not touched (FlashInfer ``merge_state_in_place``).
    ``allocate_lse``: allocate ``out_lse`` when it is None (default: when ``out`` is None).
    ``names``: how the caller calls the arguments, for error messages (the adapters' names).
    """
    return _merge_plans.two(
        v_a, s_a, v_b, s_b, out, out_lse, lse_base, prefix_rows, a_empty, out_scale, sinks,
        row_mask, suffix_verbatim, allocate_lse, names, out_block_scale, quant_group, scale_format,
    )  # fmt: skip


def merge_states(
    v: Any,
    s: Any,
    *,
    out: Any = None,
    out_lse: Any = None,
    lse_base: str | int = "e",
    out_scale: Any = None,
    sinks: Any = None,
    out_block_scale: Any = None,
    quant_group: int | None = None,
    scale_format: str = "float32",
) -> tuple[Any, Any]:
    """Merge N partial states in one pass.

    Args:
        v: ``[N, T, H, D]`` float16 / bfloat16 / float32 (``[T, N, H, D]`` data passed as a
            ``permute(1, 0, 2, 3)`` view: any strides but head_dim's).
        s: ``[N, T, H]`` float32 LSE, any strides.
        out, out_lse, lse_base, out_scale, sinks: as :func:`merge_state`; the outputs may not
            overlap ``v`` or ``s`` at all.
        out_block_scale, quant_group, scale_format: per-group fp8 output as
            :func:`merge_state` (with sinks too; states not aligned to 16 bytes take groups
            of at most 32 values).

    Empty inputs contribute nothing and their V never reaches the output; all empty gives
    ``(0, -inf)``; NaN propagates. One launch, no host sync.
    """
    objs = (v, s, out, out_lse, out_scale, sinks) + (() if out_block_scale is None else (out_block_scale,))
    return _merge_states_plan.n(objs, (lse_base, out is None, (quant_group, scale_format)))
