"""The all-to-all combine's kernels on one GPU, without the collective (part of ``--only cp``).

Two ranks simulated in one process: each rank's state packed into its send buffer, rank 0's
receive buffer built by copying chunk 0 of both, then merged. Per T in (1, 64, 1024, 8192),
H = 128, D = 512, bf16 partials, bf16 and float32 on the wire:

* ``zerokv pack``: the pack kernel (V and LSE into one chunk per peer); ``zerokv merge``:
  ``merge_states``' kernel over the two received partials of this rank's 64 heads.
* ``vLLM design pack`` / ``vLLM design combine``: the same steps in the design vLLM describes,
  in eager torch (``bench_cp.vllm_design_a2a``'s pack and combine, without its collective).

µs from a replayed CUDA graph of many calls; GB/s on the bytes each step must move; the error
of the merged output against the float64 merge of both ranks' inputs, on a sample of tokens.
"""

from __future__ import annotations

import importlib
from typing import Any

from .common import Bench, Row, Sets, Task, max_error

OP = "cp_merge a2a kernels"
N = 2
SAMPLE = 64  # tokens checked against the float64 reference


def tasks(b: Bench, part: str) -> list[Task]:
    Ts = grid(b.mode)[0]
    return [Task(part, f"{OP} on one GPU (T = {', '.join(map(str, Ts))})", run)]


def run(b: Bench) -> list[Row]:
    Ts, H, D = grid(b.mode)
    if b.dry:
        return [
            Row(op=OP, impl="zerokv pack", dtype="bf16", H=H, D=D, note="skipped: the kernels need a GPU")
        ]
    rows: list[Row] = []
    for T in Ts:
        for wire in ("bfloat16", "float32"):
            rows += _measure(b, T, H, D, wire)
    return rows


def _measure(b: Bench, T: int, H: int, D: int, wire_name: str) -> list[Row]:
    import zerokv
    from zerokv import reference

    torch, dev = b.torch, b.device
    cpm = importlib.import_module("zerokv.cp_merge")
    a2a = cpm.a2a
    wire = getattr(torch, wire_name)
    Hn, w = H // N, torch.finfo(wire).bits // 8
    lay = a2a.layout(N, T, Hn, D, wire_name)
    gen = torch.Generator(device=dev).manual_seed(T)
    V = torch.randn((N, T, H, D), generator=gen, device=dev).to(torch.bfloat16)
    S = torch.randn((N, T, H), generator=gen, device=dev) * 3
    sends = [torch.empty(lay.nbytes, dtype=torch.uint8, device=dev) for _ in range(N)]
    recv = torch.empty_like(sends[0])
    out = torch.empty((T, Hn, D), dtype=torch.bfloat16, device=dev)
    out_lse = torch.empty((T, Hn), device=dev)
    args = [
        cpm.validate(
            torch,
            V[r],
            S[r],
            N,
            "heads",
            "a2a",
            "e",
            wire,
            None,
            None,
            None,
            None,
            None,
            None,
            cpm.Names(None),
        )  # fmt: skip
        for r in range(N)
    ]
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

    def pack(r: int) -> None:
        a2a._pack(args[r], lay, sends[r].data_ptr(), False, stream())

    def exchange() -> None:  # rank 0's receive buffer: chunk 0 of every rank's send buffer
        recv.view(N, -1).copy_(torch.stack([s.view(N, -1)[0] for s in sends]))

    v_in, s_in = a2a.views(torch, recv, lay)

    def merge() -> None:
        zerokv.merge_states(v_in, s_in, out=out, out_lse=out_lse)

    P = 32 // torch.finfo(wire).bits
    vsend = torch.empty((N, T, Hn, D + P), dtype=wire, device=dev)

    def vllm_pack() -> None:
        vllm_a2a_pack(V[0], S[0], N, vsend)

    def vllm_combine() -> Any:
        return vllm_a2a_combine(torch, vsend, D, torch.bfloat16)

    for r in range(N):
        pack(r)
    exchange()
    merge()
    torch.cuda.synchronize()
    t = torch.randperm(T, generator=torch.Generator().manual_seed(7))[:SAMPLE].to(dev)  # tokens checked
    want, _ = reference.merge_states(
        V[:, t, :Hn].double().cpu().numpy(), S[:, t, :Hn].double().cpu().numpy()
    )  # fmt: skip
    err = max_error(out[t].double().cpu().numpy(), want)
    pack_bytes = T * H * (2 * D + 4) + T * H * (w * D + 4)
    merge_bytes = N * T * Hn * (w * D + 4) + T * Hn * (2 * D + 4)
    one = Sets(1, lambda k: ())
    entries = [
        ("zerokv pack", lambda: pack(0), pack_bytes, None),
        ("zerokv merge", merge, merge_bytes, err),
        ("vLLM design pack", vllm_pack, pack_bytes, None),
        ("vLLM design combine", vllm_combine, merge_bytes, None),
    ]
    times = b.timer.time_together([(call, one) for _, call, _, _ in entries])
    rows = []
    for (impl, _, nbytes, e), t in zip(entries, times, strict=True):
        if isinstance(t, Exception):
            rows.append(Row(op=OP, impl=impl, dtype="bf16", T=T, H=H, D=D, note=f"failed: {t}"[:200]))
            continue
        rows.append(b.row(OP, impl, nbytes, t.us, dtype="bf16", T=T, H=H, D=D, event_us=t.event_us, max_err=e,
                          params={"N": N, "wire": wire_name}, stats=t.stats, note=t.note))  # fmt: skip
    return rows


def grid(mode: str) -> tuple[tuple[int, ...], int, int]:
    """(T values, H, D)."""
    if mode == "dry":
        return (1, 5), 4, 8
    return (1, 64, 1024, 8192), 128, 512


def vllm_a2a_pack(v: Any, s: Any, N: int, send: Any) -> None:
    """``vllm_design_a2a``'s pack: ``v [T, H, D]`` and ``s [T, H]`` into ``send [N, T, H/N, D + P]``
    of the wire dtype, the float32 LSE bitcast into the last ``P`` columns."""
    T, H, D = v.shape
    send[..., :D] = v.view(T, N, H // N, D).transpose(0, 1)
    send[..., D:] = s.float().view(T, N, H // N).transpose(0, 1).contiguous().unsqueeze(-1).view(send.dtype)


def vllm_a2a_combine(torch: Any, recv: Any, D: int, dtype: Any) -> Any:
    """``vllm_design_a2a``'s combine of the received ``[N, T, H/N, D + P]``: ``[T, H/N, D]``."""
    lses = recv[..., D:].contiguous().view(torch.float32).squeeze(-1)  # [N, T, Hn]
    inf = float("inf")
    lses = torch.where(torch.isnan(lses) | (lses == inf), -inf, lses)
    m = lses.amax(0)
    m = torch.where(m == -inf, 0.0, m)
    lse = torch.log(torch.exp(lses - m).sum(0)) + m
    w = torch.exp(lses - lse)
    w = torch.where(torch.isnan(w), 0.0, w)
    return (recv[..., :D].float() * w.unsqueeze(-1)).sum(0).to(dtype)
