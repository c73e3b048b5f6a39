"""merge_state and merge_states: zerokv against torch eager, a Triton merge (bench/triton_merge.py)
and FlashInfer's ``merge_state`` when importable.

Bytes floor: merge_state reads 2 V + 2 LSE and writes 1 V + 1 LSE; merge_states reads N V + N LSE
and writes 1 V + 1 LSE. Inputs are random with finite LSEs (every V is read).
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import zerokv
from zerokv import reference

from . import eager
from .common import MAX_BYTES, Bench, Row, Sets, Task, max_err, sample_rows, to_np

# label -> (input dtype, output dtype)
DTYPES = {
    "bf16": ("bfloat16", "bfloat16"),
    "fp16": ("float16", "float16"),
    "fp32->bf16": ("float32", "bfloat16"),
}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
NAN = float("nan")


def merge_bytes(key: str, T: int, H: int, D: int) -> int:
    tin, tout = DTYPES[key]
    return T * H * D * (2 * ITEMSIZE[tin] + ITEMSIZE[tout]) + 3 * T * H * 4


def states_bytes(N: int, T: int, H: int, D: int) -> int:
    return (N + 1) * T * H * D * 2 + (N + 1) * T * H * 4


def merge_grid(mode: str) -> list[tuple[str, int, int, int]]:
    """(dtype label, T, H, D) for merge_state."""
    if mode == "dry":
        return [("bf16", 3, 2, 64), ("fp32->bf16", 5, 2, 16), ("fp16", 1, 2, 8), ("bf16", 40, 4, 32)]
    if mode == "quick":
        return [
            ("bf16", 256, 128, 128),
            ("bf16", 16384, 128, 128),
            ("fp32->bf16", 256, 128, 128),
            ("fp32->bf16", 16384, 128, 128),
            ("bf16", 65536, 16, 512),
        ]
    grid = [
        (key, T, H, D)
        for key in DTYPES
        for T in (1, 16, 256, 4096, 16384, 65536)
        for H in (16, 128)
        for D in (128, 512)
    ]
    return [g for g in grid if merge_bytes(*g) <= MAX_BYTES]


def states_grid(mode: str) -> list[tuple[int, int, int, int]]:
    """(N, T, H, D) for merge_states, bf16."""
    if mode == "dry":
        return [(2, 3, 2, 64), (4, 5, 2, 16)]
    if mode == "quick":
        return [(2, 16384, 128, 128), (4, 16384, 128, 128)]
    grid = [(N, T, 128, D) for N in (2, 4) for T in (256, 4096, 16384, 65536) for D in (128, 512)]
    return [g for g in grid if states_bytes(*g) <= MAX_BYTES]


def tasks(mode: str) -> list[Task]:
    out = [
        Task("merge", f"merge_state {key} T={T} H={H} D={D}", partial(run_merge_state, key, T, H, D))
        for key, T, H, D in merge_grid(mode)
    ]
    out += [
        Task("merge", f"merge_states N={N} bf16 T={T} H={H} D={D}", partial(run_merge_states, N, T, H, D))
        for N, T, H, D in states_grid(mode)
    ]
    return out


# --- implementations ------------------------------------------------------------------------


def _zerokv_merge_state(va, sa, vb, sb, out, out_lse):
    return zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=out_lse)


def implementations(b: Bench, same_dtype: bool) -> list[tuple[str, Any, str]]:
    """(name, fn(v_a, s_a, v_b, s_b, out, out_lse) -> (out, lse), LSE base) of what is importable."""
    impls: list[tuple[str, Any, str]] = [
        ("zerokv", _zerokv_merge_state, "e"),
        ("torch", eager.merge_state, "e"),
    ]
    if not b.dry or os.environ.get("TRITON_INTERPRET") == "1":
        try:
            from . import triton_merge

            impls.append(("triton", triton_merge.merge_state, "e"))
        except Exception:  # triton missing or broken: that column is left out
            pass
    if not b.dry and same_dtype:
        try:
            import flashinfer

            def fi(va, sa, vb, sb, out, out_lse):  # base-2 LSE; allocates its outputs
                return flashinfer.merge_state(va, sa, vb, sb)

            impls.append(("flashinfer", fi, "2"))
        except Exception:
            pass
    return impls


# --- tasks ----------------------------------------------------------------------------------


def run_merge_state(key: str, T: int, H: int, D: int, b: Bench) -> list[Row]:
    torch = b.torch
    tin, tout = (getattr(torch, n) for n in DTYPES[key])
    nbytes = merge_bytes(key, T, H, D)
    K = b.n_sets(nbytes)
    dev = b.device
    va = torch.randn(K, T, H, D, device=dev, dtype=tin)
    vb = torch.randn(K, T, H, D, device=dev, dtype=tin)
    sa = torch.randn(K, T, H, device=dev) * 3
    sb = torch.randn(K, T, H, device=dev) * 3
    out = torch.empty(K, T, H, D, device=dev, dtype=tout)
    out_lse = torch.empty(K, T, H, device=dev)
    sets = Sets(K, lambda k: (va[k], sa[k], vb[k], sb[k], out[k], out_lse[k]))
    ti, hi = sample_rows(torch, T, H, dev)
    ins = [to_np(x[0][ti, hi]) for x in (va, sa, vb, sb)]
    want = {
        base: reference.merge_state(ins[0][:, None], ins[1][:, None], ins[2][:, None], ins[3][:, None], base)
        for base in ("e", "2")
    }

    def check(base: str, fn: Any) -> float:
        s = sets[0]
        s[4].fill_(NAN)
        s[5].fill_(NAN)
        o, lse = fn(*s)
        b.sync()
        ro, rl = want[base]
        return max_err([to_np(o[ti, hi])[:, None], to_np(lse[ti, hi])[:, None]], [ro, rl])

    rows = []
    for name, fn, base in implementations(b, tin == tout):
        params = {"lse_base": base} if base != "e" else {}
        rows.append(
            b.measure(
                "merge_state",
                name,
                fn,
                sets,
                nbytes,
                partial(check, base),
                dtype=key,
                T=T,
                H=H,
                D=D,
                params=params,
            )  # fmt: skip
        )
    return rows


def _zerokv_merge_states(v, s, out, out_lse):
    return zerokv.merge_states(v, s, out=out, out_lse=out_lse)


def run_merge_states(N: int, T: int, H: int, D: int, b: Bench) -> list[Row]:
    torch = b.torch
    nbytes = states_bytes(N, T, H, D)
    K = b.n_sets(nbytes)
    dev = b.device
    v = torch.randn(K, N, T, H, D, device=dev, dtype=torch.bfloat16)
    s = torch.randn(K, N, T, H, device=dev) * 3
    out = torch.empty(K, T, H, D, device=dev, dtype=torch.bfloat16)
    out_lse = torch.empty(K, T, H, device=dev)
    sets = Sets(K, lambda k: (v[k], s[k], out[k], out_lse[k]))
    ti, hi = sample_rows(torch, T, H, dev)
    ro, rl = reference.merge_states(to_np(v[0][:, ti, hi])[:, :, None], to_np(s[0][:, ti, hi])[:, :, None])

    def check(fn: Any) -> float:
        st = sets[0]
        st[2].fill_(NAN)
        st[3].fill_(NAN)
        o, lse = fn(*st)
        b.sync()
        return max_err([to_np(o[ti, hi])[:, None], to_np(lse[ti, hi])[:, None]], [ro, rl])

    return [
        b.measure(
            "merge_states",
            name,
            fn,
            sets,
            nbytes,
            check,
            dtype="bf16",
            T=T,
            H=H,
            D=D,
            params={"N": N},
        )  # fmt: skip
        for name, fn in (("zerokv", _zerokv_merge_states), ("torch", eager.merge_states))
    ]
