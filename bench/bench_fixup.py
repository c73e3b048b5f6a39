"""fixup_zero_kv_rows: zerokv against the torch-eager equivalent (row mask by
``repeat_interleave`` from ``kv_lens`` and ``cu_seqlens_q`` on the device, then
``out[mask] = 0``, ``lse[mask] = -inf``). The batch: bench/empty_rows.py."""

from __future__ import annotations

import zerokv

from . import eager, empty_rows
from .common import Task


def _zerokv(out, lse, kv_lens, cu_seqlens_q):
    zerokv.fixup_zero_kv_rows(out, lse, kv_lens, cu_seqlens_q)
    return out, lse


IMPLS = [("zerokv", _zerokv), ("torch", eager.fixup_zero_kv_rows)]


def tasks(mode: str) -> list[Task]:
    return empty_rows.tasks("fixup", "fixup_zero_kv_rows", IMPLS, lambda cu, kv, cu_kv: (kv, cu), mode)
