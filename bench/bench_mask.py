"""mask_empty_context: zerokv against the vLLM-style torch-eager equivalent (LSE of rows with an
empty context span set to -inf, then a ``masked_fill_`` of the whole output). The batch:
bench/empty_rows.py."""

from __future__ import annotations

import zerokv

from . import eager, empty_rows
from .common import Task


def _zerokv(out, lse, cu_seqlens_q, cu_seqlens_kv):
    zerokv.mask_empty_context(out, lse, cu_seqlens_q, cu_seqlens_kv)
    return out, lse


IMPLS = [("zerokv", _zerokv), ("torch", eager.mask_empty_context)]


def tasks(mode: str) -> list[Task]:
    return empty_rows.tasks("mask", "mask_empty_context", IMPLS, lambda cu, kv, cu_kv: (cu, cu_kv), mode)
