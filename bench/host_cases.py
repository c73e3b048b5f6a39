"""What the host table calls, and on what: every op, option and adapter of zerokv beside
``torch.mul(a, b, out=c)``, the Triton merge and the check-free launch floor (``launch_floor``,
which ``compiled_op`` times too), each with how its arguments are sliced for a token count T;
and the buffers they slice, made once per run. ``bench_host`` times them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from .common import Bench  # nothing that imports zerokv: the compile child times that

H, D = 16, 128  # (2, 8) in a dry run: the CPU path computes in float64
T_REPEATED = 256
T_VALUES = 4000  # distinct token counts per round of mode (a)
LAYERS = 60
WARMUP = 64

Args = tuple[tuple, dict]
ArgsAt = Callable[[SimpleNamespace, int], Args]  # (buffers, T) -> (args, kwargs) of one call


@dataclass
class Case:
    label: str
    kind: str  # "reference" (torch.mul), "baseline" or "zerokv"
    given: tuple[Callable[..., Any], ArgsAt] | None  # outputs given: modes (a) and (b)
    alloc: tuple[Callable[..., Any], ArgsAt] | None = None  # outputs allocated by the op: mode (c)
    skip: str = ""  # why it cannot run here
    modes: str = "abc"  # the modes measured
    inference: bool = False  # rounds run under torch.inference_mode(), outputs inference tensors (engines)


def cases(b: Bench) -> list[Case]:
    import zerokv
    from zerokv.compat import flashinfer as fi
    from zerokv.compat import sglang, vllm

    from . import baselines_triton

    torch = b.torch
    ops = torch.ops.zerokv

    def merge6(t, T):
        return (t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T]), {"out": t.out[:T], "out_lse": t.ol[:T]}

    def merge4(t, T):
        return (t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T]), {}

    def option(args_at, **extra):
        def at(t, T):
            a, kw = args_at(t, T)
            return a, {**kw, **{k: (f(t, T) if callable(f) else f) for k, f in extra.items()}}

        return at

    def ht(t, T):  # vLLM's [H, T] LSE buffers, as the [T, H] views merge_state takes
        return (t.va[:T], t.sa_ht[:, :T].T, t.vb[:T], t.sb_ht[:, :T].T), {
            "out": t.out[:T],
            "out_lse": t.ol_ht[:, :T].T,
        }

    def fp8(t, T):
        return (t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T]), {"out": t.o8[:T], "out_scale": t.scale}

    ms = zerokv.merge_state
    out = [
        Case("torch.mul(a, b, out=c)", "reference",
             (torch.mul, lambda t, T: ((t.a[:T], t.b[:T]), {"out": t.c[:T]})),
             (torch.mul, lambda t, T: ((t.a[:T], t.b[:T]), {}))),
        Case("Triton merge (vLLM design)", "baseline",
             (baselines_triton.triton_merge_state,
              lambda t, T: ((t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T], t.out[:T], t.ol[:T]), {})),
             skip="" if baselines_triton.triton is not None and not b.dry else "skipped: needs Triton on a GPU"),
        Case("merge_state", "zerokv", (ms, merge6), (ms, merge4)),
        Case("floor: read six tensors, pack, cuLaunchKernel (no check)", "floor",
             (launch_floor(b), merge6), modes="ab",
             skip="" if not b.dry else "skipped: needs a GPU"),
        Case("merge_state under inference_mode()", "zerokv",
             (ms, lambda t, T: ((t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T]), {"out": t.i_out[:T], "out_lse": t.i_ol[:T]})),
             modes="ab", inference=True),
        Case("merge_state, [H, T] LSE (three .T views)", "zerokv", (ms, ht), modes="a"),
        Case("merge_state a_empty=", "zerokv", (ms, option(merge6, a_empty=lambda t, T: (t.cu, t.kv))), modes="ab"),
        Case("merge_state sinks=", "zerokv", (ms, option(merge6, sinks=lambda t, T: t.sinks)), modes="ab"),
        Case("merge_state prefix_rows=", "zerokv", (ms, option(merge6, prefix_rows=lambda t, T: T // 2)), modes="ab"),
        Case("merge_state fp8 out, out_scale=", "zerokv", (ms, fp8), modes="ab"),
        Case("merge_states N = 2", "zerokv",
             (zerokv.merge_states, lambda t, T: ((t.v[:, :T], t.s[:, :T]), {"out": t.out[:T], "out_lse": t.ol[:T]})),
             (zerokv.merge_states, lambda t, T: ((t.v[:, :T], t.s[:, :T]), {}))),
        Case("fixup_zero_kv_rows", "zerokv",
             (zerokv.fixup_zero_kv_rows, lambda t, T: ((t.fo[:T], t.fl[:T], t.kv, t.cu), {}))),
        Case("mask_empty_context", "zerokv",
             (zerokv.mask_empty_context, lambda t, T: ((t.fo[:T], t.fl[:T], t.cu, t.cukv), {}))),
        Case("torch.ops.zerokv.merge_state_out", "zerokv",
             (ops.merge_state_out, lambda t, T: ((t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T], t.out[:T], t.ol[:T]), {})),
             (ops.merge_state, merge4)),
        Case("torch.ops.zerokv.fixup_zero_kv_rows", "zerokv",
             (ops.fixup_zero_kv_rows, lambda t, T: ((t.fo[:T], t.fl[:T], t.kv, t.cu), {})), modes="ab"),
        Case("compat.vllm.merge_attn_states", "zerokv",
             (vllm.merge_attn_states,
              lambda t, T: ((t.out[:T], t.va[:T], t.sa_ht[:, :T], t.vb[:T], t.sb_ht[:, :T], t.ol_ht[:, :T]), {}))),
        Case("compat.vllm.mask_empty_context", "zerokv",
             (vllm.mask_empty_context, lambda t, T: ((t.fl_ht[:, :T], t.fo[:T], t.cu, t.cukv), {}))),
        Case("compat.sglang.merge_state_v2", "zerokv",
             (sglang.merge_state_v2, lambda t, T: ((t.va[:T], t.sa[:T], t.vb[:T], t.sb[:T], t.out[:T], t.ol[:T]), {})),
             (sglang.merge_state_v2, merge4)),
        Case("compat.sglang.fixup_zero_kv_rows", "zerokv",
             (sglang.fixup_zero_kv_rows, lambda t, T: ((t.fo[:T], t.fl[:T], t.kv, t.cu, 2), {}))),
        Case("compat.flashinfer.merge_state", "zerokv", None, (fi.merge_state, merge4)),
        Case("compat.flashinfer.merge_state_in_place", "zerokv",
             (fi.merge_state_in_place, lambda t, T: ((t.ip_v[:T], t.ip_s[:T], t.vb[:T], t.sb[:T]), {}))),
        Case("compat.flashinfer.merge_states", "zerokv",
             None, (fi.merge_states, lambda t, T: ((t.v_tn[:T], t.s_tn[:T]), {}))),
        Case("cp_merge, one rank (its local part: no collective at N = 1), bf16 wire", "zerokv",
             (one_rank_cp_merge(b), lambda t, T: ((t.va[:T], t.sa[:T]), {"out": t.out[:T]})),
             skip="" if not b.dry else "skipped: needs a GPU"),
    ]  # fmt: skip
    return out


def one_rank_cp_merge(b: Bench) -> Callable[..., Any]:
    """``cp_merge`` in a process group of one rank (gloo, made here when none is): its
    validation, kernels and launches without a collective (N = 1 calls none)."""
    if b.dry:
        return lambda *a, **k: None
    import socket

    import zerokv

    dist = b.torch.distributed
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    bf16 = b.torch.bfloat16
    return lambda v, s, out: zerokv.cp_merge(v, s, None, wire_dtype=bf16, out=out)


def launch_floor(b: Bench) -> Callable[..., None]:
    """The floor of a pure-Python launch of the plain merge: read each of the six tensors'
    pointer, shape, strides, dtype and device once, the stream, one ``pack_into`` of the flat
    kernel's arguments and one ``cuLaunchKernel``; no check, no plan, no form choice (one
    instantiation for every T). What any Python path pays before it checks anything."""
    if b.dry:
        return lambda *a, **k: None
    from zerokv.core import dtypes, kernels, launch, plans

    torch = b.torch
    k = kernels.MERGE_STATE_FLAT
    bf = dtypes.ctype("bfloat16")
    dev = torch.cuda.current_device()
    handle = plans.launcher(k, (bf, bf, 8, 0), dev).handle
    arena, cu_launch, stream_of = launch._arena, launch.driver().launch, torch._C._cuda_getCurrentRawStream
    pack_into, buf, extra, size, nbytes = (
        k.packer.pack_into,
        arena.buf,
        arena.extra_ptr,
        arena.size,
        k.packer.size,
    )
    H, D = hd_of(b)
    (pm, ps), (hm, hs) = kernels.fast_divisor(D // 8), kernels.fast_divisor(H)

    # the flat kernel's parameters by name: the reads below, the form's divisors, the constants
    values = {
        "va": "pa", "vb": "pb", "sa": "psa", "sb": "psb", "out": "po", "olse": "pl", "rows": "rows",
        "H": "H", "packs": "packs", "packs_mul": "pm", "packs_shr": "ps", "H_mul": "hm", "H_shr": "hs",
        "sa_st": "sa0", "sa_sh": "sa1", "sb_st": "sb0", "sb_sh": "sb1", "va_st": "a0", "va_sh": "a1",
        "vb_st": "b0", "vb_sh": "b1", "out_st": "o0", "out_sh": "o1", "ol_st": "l0", "ol_sh": "l1",
        "prefix_rows": "T", "k": "1.4426950408889634", "inv_k": "0.6931471805599453",
    }  # fmt: skip
    args = ", ".join(values.get(n, "0") for n, _ in k.params)
    src = f"""def floor(v_a, s_a, v_b, s_b, out=None, out_lse=None):
    pa, (T, H, D), (a0, a1, _), _, da = v_a.data_ptr(), v_a.shape, v_a.stride(), v_a.dtype, v_a.get_device()
    pb, _, (b0, b1, _), _, _ = v_b.data_ptr(), v_b.shape, v_b.stride(), v_b.dtype, v_b.get_device()
    psa, _, (sa0, sa1), _, _ = s_a.data_ptr(), s_a.shape, s_a.stride(), s_a.dtype, s_a.get_device()
    psb, _, (sb0, sb1), _, _ = s_b.data_ptr(), s_b.shape, s_b.stride(), s_b.dtype, s_b.get_device()
    po, _, (o0, o1, _), _, _ = out.data_ptr(), out.shape, out.stride(), out.dtype, out.get_device()
    pl, _, (l0, l1), _, _ = out_lse.data_ptr(), out_lse.shape, out_lse.stride(), out_lse.dtype, out_lse.get_device()
    rows, packs = T * H, D >> 3
    pack_into(buf, 0, {args})
    size.value = nbytes  # the arena is shared with zerokv's launches of other sizes
    cu_launch(handle, -(-rows * packs // 128), 1, 1, 128, 1, 1, 0, stream_of(da), 0, extra)
"""
    scope = {
        "pack_into": pack_into, "buf": buf, "size": size, "nbytes": nbytes, "cu_launch": cu_launch,
        "handle": handle, "stream_of": stream_of, "extra": extra, "pm": pm, "ps": ps, "hm": hm, "hs": hs,
    }  # fmt: skip
    exec(compile(src, "<floor>", "exec"), scope)  # packed by name, as zerokv's bound calls
    floor = scope["floor"]
    return floor


def buffers(b: Bench) -> SimpleNamespace:
    """Round sizes and the buffers every case slices (made once per run)."""
    p = b.shared.get("host_plan")
    if p is not None:
        return p
    per_round, rounds = (16, 1) if b.dry else (T_VALUES, 1 if b.quick else 3)
    t_max = per_round + WARMUP
    torch, dev, bf = b.torch, b.device, b.torch.bfloat16
    H, D = hd_of(b)
    g = torch.Generator().manual_seed(7)

    def v(*shape):
        return torch.randn(*shape, dtype=bf).to(dev)

    def s(*shape):
        return torch.randn(*shape).to(dev)

    t = SimpleNamespace(
        a=v(t_max, H, D), b=v(t_max, H, D), c=v(t_max, H, D),
        va=v(t_max, H, D), vb=v(t_max, H, D), out=v(t_max, H, D), sa=s(t_max, H), sb=s(t_max, H), ol=s(t_max, H),
        sa_ht=s(H, t_max), sb_ht=s(H, t_max), ol_ht=s(H, t_max), o8=v(t_max, H, D).to(torch.float8_e4m3fn),
        v=v(2, t_max, H, D), s=s(2, t_max, H), v_tn=v(t_max, 2, H, D), s_tn=s(t_max, 2, H),
        fo=v(t_max, H, D), fl=s(t_max, H), fl_ht=s(H, t_max), ip_v=v(t_max, H, D), ip_s=s(t_max, H),
        cu=torch.tensor([0, 2, 4], dtype=torch.int32, device=dev),
        kv=torch.tensor([0, 3], dtype=torch.int32, device=dev),
        cukv=torch.tensor([0, 0, 3], dtype=torch.int32, device=dev),
        sinks=s(H), scale=torch.tensor([0.5], device=dev),
    )  # fmt: skip
    with torch.inference_mode():  # outputs as an engine's model runner allocates them
        t.i_out, t.i_ol = v(t_max, H, D), s(t_max, H)
    n_layers = 4 if b.dry else LAYERS
    t_same = min(T_REPEATED, t_max)
    layers = [tuple(f(t_same, *shape) for f, shape in ((v, (H, D)), (s, (H,)), (v, (H, D)), (s, (H,)), (v, (H, D)), (s, (H,)))) for _ in range(n_layers)]  # fmt: skip
    p = SimpleNamespace(
        bufs=t,
        layers=layers,
        t_same=t_same,
        rounds=[(torch.randperm(per_round, generator=g) + 1).tolist() for _ in range(rounds)],
        warmup=_warmup_tokens(per_round, t_max),
    )
    b.shared["host_plan"] = p
    return p


def _warmup_tokens(per_round: int, t_max: int) -> list[int]:
    """T values of the warm-up: a geometric sweep over the rounds' range, so that every kernel
    form those T take is compiled and loaded before the timing (a form first met inside a
    round costs its NVRTC compile there), then T values no round uses."""
    sweep = sorted({int(1.15**k) for k in range(80) if 1 <= int(1.15**k) <= per_round})
    return sweep + list(range(t_max - WARMUP + 1, t_max + 1))


def hd_of(b: Bench) -> tuple[int, int]:
    return (2, 8) if b.dry else (H, D)
