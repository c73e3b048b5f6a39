"""vLLM's decode / prefill context-parallel combine: ``cp_lse_ag_out_rs``, ``cp_lse_ag_out_ar``
and ``dcp_a2a_lse_reduce``.

The signatures of ``vllm/v1/attention/ops/dcp.py``; swap that import for
``from zerokv.compat.vllm import cp_lse_ag_out_rs, cp_lse_ag_out_ar, dcp_a2a_lse_reduce``.
LSE ``[T, H]``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from ..cp_merge import combine

_NAMES = {
    "v": "cp_attn_out",
    "s": "cp_attn_lse",
    "group": "cp_group",
    "lse_base": "is_lse_base_on_e",
    "seq_lens": "seq_lens",
    "query_start_loc": "query_start_loc",
}


def cp_lse_ag_out_rs(
    cp_attn_out: Any,
    cp_attn_lse: Any,
    cp_group: Any,
    ctx: Any = None,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
    seq_lens: Any = None,
    query_start_loc: Any = None,
) -> Any:
    """Combine the ranks' partial attention and scatter the heads: rank r gets ``[T, H/N, D]``.

    Args:
        cp_attn_out: ``[T, H, D]`` (or ``[T, 1, H, D]``) float16 / bfloat16 / float32, this
            rank's partial output; head_dim contiguous.
        cp_attn_lse: ``[T, H]`` (or ``[T, H, 1]`` / ``[T, 1, H]``) float32 LSE, any strides.
        cp_group: vLLM's group coordinator (its ``device_group`` is used) or a
            ``torch.distributed`` process group.
        ctx: accepted and unused (vLLM's Triton launch cache).
        return_lse: also return the global LSE of this rank's heads, ``[T, H/N]``.
        is_lse_base_on_e: True: natural-log LSE; False: base 2.
        seq_lens: ``[B]`` int32 / int64, this rank's KV length per request; with
            ``query_start_loc`` (``[B + 1]``): rows of requests with ``seq_lens == 0`` and rows
            past ``query_start_loc[B]`` (padding) count as empty on this rank.

    As vLLM: the LSE is all-gathered, each rank's output is rescaled by ``exp(lse_r - lse)``
    (an LSE of NaN, +inf or -inf, or a masked row, weighs 0 and its output is never used),
    and the shares are summed in the output dtype with a reduce-scatter over heads. All ranks
    empty: ``(0, -inf)``. The empty-shard mask is one kernel fused with the packing of the
    LSE (vLLM: eight small launches), and the rescale writes the head-major layout the
    reduce-scatter needs (vLLM: two transpose copies).

    Departures from vLLM, where vLLM fails or has side effects:
        * Any group size works (vLLM's kernel needs a power of two); a group of one combines
          with itself (vLLM fails to unpack its early return).
        * ``H % N != 0`` is a ``ValueError`` naming the sizes.
        * ``cp_attn_out`` and ``cp_attn_lse`` are left unchanged (vLLM rescales ``cp_attn_out``
          and, when it is contiguous, masks ``cp_attn_lse`` in place).
        * The returned LSE is a contiguous ``[T, H/N]`` tensor (vLLM: a view of ``[T, H]``).
        * A batch of zero requests (``seq_lens`` empty) masks only the rows past
          ``query_start_loc[0]`` (vLLM indexes ``seq_lens[-1]`` and fails).

    Returns:
        ``out`` ``[T, H/N, D]`` in the input dtype, or ``(out, lse)`` with ``return_lse``.
    """
    return _combine(cp_attn_out, cp_attn_lse, cp_group, "heads", return_lse, is_lse_base_on_e, seq_lens,
                    query_start_loc)  # fmt: skip


def cp_lse_ag_out_ar(
    cp_attn_out: Any,
    cp_attn_lse: Any,
    cp_group: Any,
    ctx: Any = None,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
    seq_lens: Any = None,
    query_start_loc: Any = None,
) -> Any:
    """As :func:`cp_lse_ag_out_rs`, with an all-reduce: every rank gets ``[T, H, D]`` (and
    the LSE ``[T, H]`` with ``return_lse``). The same departures from vLLM, except the one on
    ``H % N`` (any H works here)."""
    return _combine(cp_attn_out, cp_attn_lse, cp_group, "none", return_lse, is_lse_base_on_e, seq_lens,
                    query_start_loc)  # fmt: skip


def dcp_a2a_lse_reduce(
    cp_attn_out: Any,
    cp_attn_lse: Any,
    cp_group: Any,
    ctx: Any = None,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
    seq_lens: Any = None,
    query_start_loc: Any = None,
) -> Any:
    """Combine the ranks' partial attention with one all-to-all: rank r gets ``[T, H/N, D]``.

    Args: as :func:`cp_lse_ag_out_rs` (``cp_attn_out`` float16 / bfloat16 / float32; an LSE of
    another float dtype is taken as float32, as vLLM does).

    As vLLM: each rank sends peer j its heads ``[j H/N, (j+1) H/N)`` with the float32 LSE packed
    beside them in the output dtype, in one ``all_to_all_single``; the N partials of this rank's
    heads are merged with exact LSE weights in float32 (an LSE of NaN, +inf or -inf, or a masked
    row, weighs 0) and written in the input dtype. All ranks empty: ``(0, -inf)``. The
    empty-shard mask is fused into the pack kernel; the merge is one zerokv kernel. 8-bit
    dtypes are rejected with vLLM's error; ``H % N != 0`` too.

    Departures from vLLM, where vLLM yields NaN or does not apply its rule:
        * A row's V is never used when its LSE weighs 0 (vLLM multiplies it by 0: NaN/Inf
          scratch in an empty shard gives NaN).
        * A group of one combines with itself (the empty rule and the mask applied; vLLM returns
          its inputs as they are). The packed chunks carry V and LSE in separate 16-byte aligned
          blocks instead of ``D + 32 / bits`` columns (the same bytes in one collective).

    Returns:
        ``out`` ``[T, H/N, D]`` in the input dtype, or ``(out, lse)`` with ``return_lse``.
    """
    dtype = getattr(cp_attn_out, "dtype", None)
    if dtype is not None and getattr(dtype, "itemsize", 2) == 1:
        raise ValueError(f"Cannot pack fp32 LSE into output dtype {dtype}.")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(cp_attn_out, torch.Tensor) and cp_attn_out.ndim >= 3:
        heads = cp_attn_out.shape[-2]
        _, size, _ = importlib.import_module("zerokv.cp_merge")._group(
            torch, getattr(cp_group, "device_group", cp_group), "cp_group"
        )
        if heads % size:
            raise ValueError(f"H={heads} must be divisible by DCP world size {size}.")
    lse_dtype = getattr(cp_attn_lse, "dtype", None)
    if lse_dtype is not None and lse_dtype.is_floating_point and lse_dtype.itemsize != 4:
        cp_attn_lse = cp_attn_lse.float()
    return _combine(cp_attn_out, cp_attn_lse, cp_group, "heads", return_lse, is_lse_base_on_e, seq_lens,
                    query_start_loc, exchange="a2a")  # fmt: skip


def _combine(
    out, lse, cp_group, scatter, return_lse, base_e, seq_lens, query_start_loc, exchange="allgather"
) -> Any:
    shards = _empty_shard_args(seq_lens, query_start_loc)
    if getattr(out, "ndim", None) == 4 and out.shape[1] == 1:
        out = out.squeeze(1)
    if getattr(lse, "ndim", None) == 3 and lse.shape[-1] == 1:
        lse = lse.squeeze(-1)
    elif getattr(lse, "ndim", None) == 3 and lse.shape[1] == 1:
        lse = lse.squeeze(1)
    group = getattr(cp_group, "device_group", cp_group)
    return combine(
        out, lse, group, scatter=scatter, exchange=exchange, lse_base="e" if base_e else 2, return_lse=bool(return_lse),
        wire_dtype=getattr(out, "dtype", None), empty_shards=shards, nan_empty=True, names=_NAMES,
    )  # fmt: skip


def _empty_shard_args(seq_lens: Any, query_start_loc: Any) -> tuple[Any, Any] | None:
    """vLLM's checks of the mask inputs, with its messages."""
    if seq_lens is None and query_start_loc is None:
        return None
    if seq_lens is None or query_start_loc is None:
        raise ValueError("seq_lens and query_start_loc must be provided together")
    if (
        getattr(seq_lens, "ndim", None) != 1
        or getattr(query_start_loc, "ndim", None) != 1
        or query_start_loc.shape[0] != seq_lens.shape[0] + 1
    ):
        raise ValueError("query_start_loc must contain one boundary per sequence")
    return seq_lens, query_start_loc
