"""Host-side planning of chunked-context attention: which chunks need the empty-row fixup.

Everything here runs on the CPU from CPU lengths (what the scheduler already has), so an
engine learns per chunk, without any device sync, whether a fixup launch is needed and whether
its attention kernel may skip its own empty-row check.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .core.layout import INT32
from .core.tensors import is_torch


@dataclass(frozen=True)
class ContextChunkPlan:
    """Chunk metadata for ``num_chunks`` passes over the cached context.

    Arrays are int32 / bool, on the CPU (torch tensors when the lengths were torch tensors,
    numpy arrays otherwise), ready to copy to the device.

    Attributes:
        num_chunks: C, the number of context chunks (0 when no request has context).
        chunk_width: W, context tokens per request per chunk (the last chunk may hold fewer).
        cu_seqlens_q: ``[B + 1]`` query offsets (the same for every chunk).
        starts: ``[C, B]`` first context position of each request in each chunk.
        lens: ``[C, B]`` context tokens of each request in each chunk (0: empty).
        cu_seqlens_kv: ``[C, B + 1]`` offsets of each chunk's packed context.
        max_seqlen_kv: ``[C]`` longest span in each chunk.
        num_empty_rows: ``[C]`` query rows whose request has no context in the chunk.
        has_empty: ``[C]`` bool, ``num_empty_rows > 0``: launch a fixup (or merge with
            ``a_empty``) for this chunk.
        all_rows_active: ``[C]`` bool, every query row attends to at least one key in this
            chunk: the attention kernel's own empty-row check can be skipped
            (``all_rows_active == ~has_empty`` by definition).
    """

    num_chunks: int
    chunk_width: int
    cu_seqlens_q: Any
    starts: Any
    lens: Any
    cu_seqlens_kv: Any
    max_seqlen_kv: Any
    num_empty_rows: Any
    has_empty: Any
    all_rows_active: Any


_INT32_MAX = INT32 - 1
_INT64_MAX = 2**63 - 1
# C * (B + 1): ~0.4 GB of int32 arrays (~2 GB while they are built); a real batch needs a few million
MAX_PLAN_ENTRIES = 1 << 25


def plan_context_chunks(
    query_lens: Any, context_lens: Any, chunk_tokens: int, *, align: int = 1
) -> ContextChunkPlan:
    """Split each request's cached context into chunks of at most ``chunk_tokens`` tokens in all.

    Chunking rule: the W = ``chunk_tokens // R`` (rounded down to a multiple of ``align``)
    context tokens ``[c * W, (c + 1) * W)`` of every request form chunk c, where R is the
    number of requests that have context; so a chunk holds at most ``R * W <= chunk_tokens``
    tokens and there are ``ceil(max(context_lens) / W)`` chunks. A request whose context ends
    before chunk c is empty in chunk c.

    Args:
        query_lens: ``[B]`` CPU integers (torch tensor, numpy array or sequence), new tokens
            of each request (>= 0).
        context_lens: ``[B]`` CPU integers, cached context length of each request (>= 0).
        chunk_tokens: the workspace budget: context tokens per chunk over the whole batch.
        align: chunk width multiple (e.g. the KV page size).

    Raises ``TypeError`` for lengths that are not integers and ``ValueError`` for lengths not
    on the CPU, not 1-D, empty, negative or of different batch sizes, for offsets that would
    not fit int32 (the sum of ``query_lens``, a context length, a chunk's total), for a budget
    too small for one token (aligned) per request, and for a plan of more than
    ``MAX_PLAN_ENTRIES`` (2^25) chunk-request entries. Every value is checked before anything
    is cast or allocated.
    """
    as_torch = is_torch(query_lens) or is_torch(context_lens)
    q = _lengths(query_lens, "query_lens")
    ctx = _lengths(context_lens, "context_lens")
    if q.shape != ctx.shape:
        raise ValueError(f"query_lens and context_lens: batch sizes differ ({q.shape[0]} vs {ctx.shape[0]})")
    chunk_tokens = _positive(chunk_tokens, "chunk_tokens")
    align = _positive(align, "align")
    total_q = int(q.sum())  # each <= 2^31 - 1, so no int64 wrap below 2^32 requests
    if total_q > _INT32_MAX:
        i = int(np.argmax(np.cumsum(q) > _INT32_MAX))
        raise ValueError(
            f"query_lens: the total {total_q} exceeds int32 query offsets (max {_INT32_MAX}): the running "
            f"sum passes it at index {i} of {q.shape[0]} requests; plan the batch in parts"
        )
    with_context = int((ctx > 0).sum())
    width = (chunk_tokens // max(with_context, 1)) // align * align
    if width == 0:
        raise ValueError(
            f"chunk_tokens: {chunk_tokens} is too small for {with_context} requests with context "
            f"at align={align} (need at least {with_context * align})"
        )
    longest = int(ctx.max())
    num_chunks = -(-longest // width)
    first_total = int(np.minimum(ctx, width).sum())  # chunk 0 holds the most context tokens
    if first_total > _INT32_MAX:
        raise ValueError(
            f"chunk_tokens: a chunk of {first_total} context tokens exceeds int32 context offsets "
            f"(max {_INT32_MAX}); use a smaller budget"
        )
    entries = num_chunks * (q.shape[0] + 1)
    if entries > MAX_PLAN_ENTRIES:
        raise ValueError(
            f"chunk_tokens: {chunk_tokens} gives {num_chunks} chunks of width {width} for a context of "
            f"{longest} tokens: {entries} plan entries (chunks x (B + 1)) exceed {MAX_PLAN_ENTRIES}; "
            "use a larger budget"
        )

    first = np.arange(num_chunks, dtype=np.int64)[:, None] * width  # [C, 1]
    starts = np.minimum(first, ctx[None, :])
    lens = np.minimum(ctx[None, :], first + width) - starts
    cu_kv = np.zeros((num_chunks, q.shape[0] + 1), dtype=np.int64)
    np.cumsum(lens, axis=1, out=cu_kv[:, 1:])
    num_empty = ((lens == 0) * q[None, :]).sum(axis=1)
    cu_q = np.zeros(q.shape[0] + 1, dtype=np.int64)
    np.cumsum(q, out=cu_q[1:])

    convert = _to_torch if as_torch else (lambda a: a)
    return ContextChunkPlan(
        num_chunks=num_chunks,
        chunk_width=width,
        cu_seqlens_q=convert(cu_q.astype(np.int32)),
        starts=convert(starts.astype(np.int32)),
        lens=convert(lens.astype(np.int32)),
        cu_seqlens_kv=convert(cu_kv.astype(np.int32)),
        max_seqlen_kv=convert(lens.max(axis=1, initial=0).astype(np.int32)),
        num_empty_rows=convert(num_empty.astype(np.int32)),
        has_empty=convert(num_empty > 0),
        all_rows_active=convert(num_empty == 0),
    )


def _positive(v: Any, arg: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{arg}: expected an int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{arg}: expected > 0, got {v}")
    if v > _INT64_MAX:
        raise ValueError(f"{arg}: expected at most 2^63 - 1, got {v}")
    return int(v)


def _lengths(x: Any, arg: str) -> np.ndarray:
    """``[B]`` lengths as int64, every value checked before the cast: integers, 0..2^31 - 1."""
    if is_torch(x):
        if x.layout is not sys.modules["torch"].strided:
            raise TypeError(
                f"{arg}: a sparse tensor ({x.layout}) is not supported; pass dense lengths (x.to_dense())"
            )
        if x.device.type != "cpu":
            raise ValueError(f"{arg}: must be on the CPU (planning never syncs a device), got {x.device}")
        if x.is_floating_point() or x.is_complex() or x.dtype is sys.modules["torch"].bool:
            raise TypeError(f"{arg}: expected integers, got dtype {x.dtype}")
        a = x.detach().numpy()
    elif hasattr(x, "__dlpack_device__") and not isinstance(x, np.ndarray) and x.__dlpack_device__()[0] != 1:
        raise ValueError(f"{arg}: must be on the CPU (planning never syncs a device)")
    elif x is None or isinstance(x, (str, bytes, int, float)):
        one = f"; for one request pass [{x!r}]" if isinstance(x, int) else ""
        raise TypeError(
            f"{arg}: expected a 1-D sequence of integer lengths, got {type(x).__name__} {x!r:.60}{one}"
        )
    else:
        try:
            a = np.asarray(x)
        except (OverflowError, ValueError):  # ragged nesting, or ints numpy cannot hold
            a = None
        if a is None or (a.dtype.kind not in "iub" and not isinstance(x, np.ndarray)):  # name the element
            problem = _element_problem(x, arg)
            if problem is not None:
                raise problem from None
        if a is None:
            raise ValueError(f"{arg}: not a 1-D sequence of integer lengths") from None
    if a.ndim == 0:
        raise ValueError(
            f"{arg}: expected a 1-D sequence of lengths, got a 0-d array ({a.item()!r}); for one request pass [{a.item()!r}]"
        )
    if a.ndim != 1:
        raise ValueError(f"{arg}: expected a 1-D sequence of lengths, got shape {a.shape}")
    if a.shape[0] == 0:
        raise ValueError(f"{arg}: empty batch")
    if a.dtype.kind not in "iu":
        raise TypeError(f"{arg}: expected integers, got dtype {a.dtype}")
    if a.dtype.kind == "i" and (a < 0).any():
        raise ValueError(f"{arg}: negative length {int(a.min())} at index {int(np.argmin(a))}")
    if (a > _INT32_MAX).any():  # compared in the array's own dtype: no wrap of uint64 >= 2^63
        i = int(np.argmax(a > _INT32_MAX))
        raise ValueError(
            f"{arg}: length {int(a[i])} at index {i} exceeds int32 offsets (lengths are 0 to {_INT32_MAX})"
        )
    return a.astype(np.int64)


def _element_problem(x: Any, arg: str) -> Exception | None:
    """The error naming the first element of the sequence ``x`` that is not an integer length
    (a nested sequence, a non-integer, a length outside 0 to 2^31 - 1), or None."""
    try:
        items = list(x)
    except TypeError:
        return None
    for i, v in enumerate(items):
        if isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) > 0:
            return ValueError(
                f"{arg}: element {i} is a {type(v).__name__} ({v!r:.60}), not a length: "
                "expected a flat 1-D sequence of integers"
            )
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            return TypeError(f"{arg}: element {i} is {v!r:.60} ({type(v).__name__}), not an integer length")
        if not 0 <= v <= _INT32_MAX:
            return ValueError(
                f"{arg}: length {v} at index {i} {'exceeds int32 offsets' if v > 0 else 'is negative'} "
                f"(lengths are 0 to {_INT32_MAX})"
            )
    return None


def _to_torch(a: np.ndarray) -> Any:
    return sys.modules["torch"].from_numpy(np.ascontiguousarray(a))
