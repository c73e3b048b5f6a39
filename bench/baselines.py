"""Every implementation zerokv is measured against, in one file.

* torch eager: the ops as a careful user writes them (empty state by ``torch.where``, math in
  float32, no host sync). Baselines, not references: ``zerokv.reference`` is the specification.
* A Triton merge in the design of vLLM's Triton merge: one program per (token, head), the LSE
  and V loads issued together.
* A CUDA merge in the design of vLLM's CUDA merge, compiled through zerokv's runtime
  (bench-only, not shipped): one thread per 16-byte pack of V, the two LSE loads and the two V
  loads issued before any arithmetic, LSE ``[H, T]`` contiguous, V ``[T, H, D]`` contiguous;
  bf16, fp16, fp32.
* FlashInfer's ``merge_state`` (base-2 LSE) when it is importable.
* An empty kernel launched the way zerokv launches: the floor of any launch.

Every merge here takes ``(v_a, s_a, v_b, s_b, out, out_lse)`` with ``[T, H]``-shaped LSE views,
writes ``out``/``out_lse`` and returns them. The math of the merges is zerokv's: ``m`` = the
larger LSE, ``+inf`` counted as ``-inf`` (empty), an input of weight 0 selected away (never
multiplied), two empty inputs give ``(0, -inf)``, NaN propagates.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerokv.core.kernels import Kernel

INF = float("inf")

# --- torch eager --------------------------------------------------------------------------------


def eager_merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """``V [T, H, D]``, ``LSE [T, H]`` natural log."""
    s_a = torch.where(s_a == INF, -INF, s_a)  # FA2 writes +inf for empty rows
    s_b = torch.where(s_b == INF, -INF, s_b)
    m = torch.maximum(s_a, s_b)
    m = torch.where(m == -INF, 0.0, m)  # both empty: keep (-inf) - m finite
    w_a = torch.exp(s_a - m)
    w_b = torch.exp(s_b - m)
    total = w_a + w_b
    inv = torch.where(total == 0, 0.0, 1.0 / total)  # a NaN total stays NaN
    w_a, w_b, inv = w_a.unsqueeze(-1), w_b.unsqueeze(-1), inv.unsqueeze(-1)
    out.copy_(
        torch.where(w_a == 0, 0.0, v_a.float() * (w_a * inv))
        + torch.where(w_b == 0, 0.0, v_b.float() * (w_b * inv))
    )
    out_lse.copy_(torch.where(total == 0, -INF, m + torch.log(total)))
    return out, out_lse


def eager_merge_states(v: Any, s: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """``v [N, T, H, D]``, ``s [N, T, H]``; writes ``out [T, H, D]`` and ``out_lse [T, H]``."""
    s = torch.where(s == INF, -INF, s)
    m = s.amax(dim=0)
    m = torch.where(m == -INF, 0.0, m)
    w = torch.exp(s - m)
    total = w.sum(dim=0)
    inv = torch.where(total == 0, 0.0, 1.0 / total)
    w = w.unsqueeze(-1)
    out.copy_(torch.where(w == 0, 0.0, v.float() * (w * inv.unsqueeze(-1))).sum(dim=0))
    out_lse.copy_(torch.where(total == 0, -INF, m + torch.log(total)))
    return out, out_lse


def _rows_of(empty_requests: Any, cu_seqlens_q: Any, T: int) -> Any:
    """``[T]`` bool from per-request flags; ``output_size`` given, so no device sync."""
    return torch.repeat_interleave(empty_requests, cu_seqlens_q[1:] - cu_seqlens_q[:-1], output_size=T)


def eager_fixup_zero_kv_rows(out: Any, lse: Any, kv_lens: Any, cu_seqlens_q: Any) -> tuple[Any, Any]:
    """Rows of requests with ``kv_lens == 0`` get ``(0, -inf)``: a boolean index with a scalar
    is a ``masked_fill_`` (no sync), which reads and writes the whole tensor."""
    rows = _rows_of(kv_lens == 0, cu_seqlens_q, out.shape[0])
    out[rows] = 0.0
    lse[rows] = -INF
    return out, lse


def eager_mask_empty_context(out: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any) -> tuple[Any, Any]:
    """The LSE of rows with an empty context span set to -inf, then the output zeroed by a
    ``masked_fill_`` over the whole tensor, driven by the LSE."""
    rows = _rows_of(cu_seqlens_kv[1:] == cu_seqlens_kv[:-1], cu_seqlens_q, out.shape[0])
    lse.masked_fill_(rows.unsqueeze(1), -INF)
    out.masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0.0)
    return out, lse


# --- Triton merge in vLLM's design --------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # the Triton column is left out
    triton = None

if triton is not None:

    @triton.jit
    def _triton_merge_kernel(
        va, sa, vb, sb, out, olse,
        va_st, va_sh, vb_st, vb_sh, o_st, o_sh,
        sa_st, sa_sh, sb_st, sb_sh, ol_st, ol_sh,
        D, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        inside = offs < D
        # The loads do not depend on each other: all four go out together.
        la = tl.load(sa + t * sa_st + h * sa_sh)
        lb = tl.load(sb + t * sb_st + h * sb_sh)
        xa = tl.load(va + t * va_st + h * va_sh + offs, mask=inside, other=0.0).to(tl.float32)
        xb = tl.load(vb + t * vb_st + h * vb_sh + offs, mask=inside, other=0.0).to(tl.float32)
        la = tl.where(la == float("inf"), float("-inf"), la)
        lb = tl.where(lb == float("inf"), float("-inf"), lb)
        m = tl.maximum(la, lb)
        m = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - m)
        wb = tl.exp(lb - m)
        total = wa + wb
        inv = tl.where(total == 0.0, 0.0, 1.0 / total)
        res = tl.where(wa == 0.0, 0.0, xa * (wa * inv)) + tl.where(wb == 0.0, 0.0, xb * (wb * inv))
        tl.store(out + t * o_st + h * o_sh + offs, res.to(out.dtype.element_ty), mask=inside)
        tl.store(olse + t * ol_st + h * ol_sh, tl.where(total == 0.0, float("-inf"), m + tl.log(total)))


if triton is not None:

    @triton.jit
    def _triton_group_fp8_kernel(
        va, sa, vb, sb, out, olse, obs,
        va_st, va_sh, vb_st, vb_sh, o_st, o_sh,
        sa_st, sa_sh, sb_st, sb_sh, ol_st, ol_sh, bs_st, bs_sg,
        D: tl.constexpr, G: tl.constexpr, UE8M0: tl.constexpr,
    ):  # fmt: skip
        # vLLM's per-group fp8 merge design: one program per (token, head), the row in registers,
        # a group's absmax by a reduction over a [D / G, G] view, the scales through their strides
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        offs = tl.arange(0, D)
        la = tl.load(sa + t * sa_st + h * sa_sh)
        lb = tl.load(sb + t * sb_st + h * sb_sh)
        xa = tl.load(va + t * va_st + h * va_sh + offs).to(tl.float32)
        xb = tl.load(vb + t * vb_st + h * vb_sh + offs).to(tl.float32)
        la = tl.where(la == float("inf"), float("-inf"), la)
        lb = tl.where(lb == float("inf"), float("-inf"), lb)
        m = tl.maximum(la, lb)
        m = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - m)
        wb = tl.exp(lb - m)
        total = wa + wb
        inv = tl.where(total == 0.0, 0.0, 1.0 / total)
        res = tl.where(wa == 0.0, 0.0, xa * (wa * inv)) + tl.where(wb == 0.0, 0.0, xb * (wb * inv))
        g = tl.reshape(res, (D // G, G))
        amax = tl.maximum(tl.max(tl.abs(g), axis=1), 1e-10)
        scale = amax / 448.0
        if UE8M0:
            scale = tl.exp2(tl.ceil(tl.log2(scale)))
        q = tl.clamp(g / scale[:, None], -448.0, 448.0)
        tl.store(out + t * o_st + h * o_sh + tl.reshape(offs, (D // G, G)), q.to(out.dtype.element_ty))
        gi = tl.arange(0, D // G)
        tl.store(obs + t * bs_st + (h * (D // G) + gi) * bs_sg, scale)
        tl.store(olse + t * ol_st + h * ol_sh, tl.where(total == 0.0, float("-inf"), m + tl.log(total)))


def triton_group_fp8_merge(
    v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any, block_scale: Any, group: int, ue8m0: bool
) -> tuple[Any, Any]:
    """Per-group fp8 merge of vLLM's design: ``out`` fp8 e4m3 ``[T, H, D]`` (D a power of two),
    ``block_scale`` float32 ``[T, H * D / group]`` any strides."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    T, H, D = v_a.shape
    if T * H == 0:
        return out, out_lse
    _triton_group_fp8_kernel[(T, H)](
        v_a, s_a, v_b, s_b, out, out_lse, block_scale,
        v_a.stride(0), v_a.stride(1), v_b.stride(0), v_b.stride(1), out.stride(0), out.stride(1),
        s_a.stride(0), s_a.stride(1), s_b.stride(0), s_b.stride(1), out_lse.stride(0), out_lse.stride(1),
        block_scale.stride(0), block_scale.stride(1), D=D, G=group, UE8M0=ue8m0,
    )  # fmt: skip
    return out, out_lse


if triton is not None:

    @triton.jit
    def _triton_mask_lse_kernel(
        lse, row_mask, qsl, ctx, T, H, B, lse_sh, lse_st, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr
    ):
        # vLLM's mask_empty_context design: a block of tokens finds each token's request by a
        # vector compare over query_start_loc, sets the LSE of rows with an empty context to -inf
        # and leaves the output to a masked_fill_ (here through the row mask it writes)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        b = tl.arange(0, BLOCK_B)
        starts = tl.load(qsl + 1 + b, mask=b < B, other=2**30)
        req = tl.sum((starts[None, :] <= t[:, None]).to(tl.int32), axis=1)
        c0 = tl.load(ctx + req, mask=t < T, other=0)
        c1 = tl.load(ctx + req + 1, mask=t < T, other=1)
        empty = (c1 <= c0) & (t < T)
        tl.store(row_mask + t, empty, mask=t < T)
        for h in range(H):
            tl.store(lse + h * lse_sh + t * lse_st, float("-inf"), mask=empty)


def vllm_seed_pipeline(
    v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any, qsl: Any, ctx: Any, row_mask: Any
) -> tuple[Any, Any]:
    """vLLM's path for a chunk with empty-context requests: the LSE mask (Triton), the output's
    masked_fill_ over the whole tensor, then the vLLM-design CUDA merge (LSE laid [H, T])."""
    T, H, _ = v_a.shape
    B = qsl.shape[0] - 1
    _triton_mask_lse_kernel[(triton.cdiv(T, 64),)](
        s_a, row_mask, qsl, ctx, T, H, B, s_a.stride(1), s_a.stride(0),
        BLOCK_T=64, BLOCK_B=max(32, triton.next_power_of_2(B)),
    )  # fmt: skip
    v_a.masked_fill_(row_mask[:, None, None], 0.0)
    return vllm_design_merge(v_a, s_a, v_b, s_b, out, out_lse)


def triton_runs(dry: bool) -> bool:
    """Triton is installed and, for the dry run on the CPU, runs in its interpreter."""
    return triton is not None and (not dry or os.environ.get("TRITON_INTERPRET") == "1")


def triton_merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """``V [T, H, D]`` (unit stride on D), ``LSE [T, H]`` any strides, natural log."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    T, H, D = v_a.shape
    if T * H == 0 or D == 0:
        return out, out_lse
    _triton_merge_kernel[(T, H)](
        v_a, s_a, v_b, s_b, out, out_lse,
        v_a.stride(0), v_a.stride(1), v_b.stride(0), v_b.stride(1), out.stride(0), out.stride(1),
        s_a.stride(0), s_a.stride(1), s_b.stride(0), s_b.stride(1), out_lse.stride(0), out_lse.stride(1),
        D, BLOCK_D=triton.next_power_of_2(D),
    )  # fmt: skip
    return out, out_lse


# --- CUDA merge in vLLM's design (bench-only, through zerokv's runtime) -------------------------

VLLM_DESIGN_SOURCE = r"""
// Merge of two attention states in the design of vLLM's CUDA merge, as a baseline: one thread
// per 16-byte pack of V; the two LSE loads and the two V loads issued before any arithmetic
// (one round trip to memory); V [T, H, D] contiguous, LSE [H, T] contiguous.

struct bench_half { unsigned short bits; };
struct bench_bf16 { unsigned short bits; };

__device__ __forceinline__ float bench_float(float x) { return x; }
__device__ __forceinline__ float bench_float(bench_half x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float bench_float(bench_bf16 x) { return __uint_as_float(((unsigned)x.bits) << 16); }

template <typename S> __device__ __forceinline__ S bench_store(float f);
template <> __device__ __forceinline__ float bench_store<float>(float f) { return f; }
template <> __device__ __forceinline__ bench_half bench_store<bench_half>(float f) {
  bench_half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
template <> __device__ __forceinline__ bench_bf16 bench_store<bench_bf16>(float f) {
  bench_bf16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}

template <typename S> struct __align__(16) bench_pack { S e[16 / sizeof(S)]; };

template <typename S>
__global__ void __launch_bounds__(ZK_BLOCK_bench_merge_vllm_design)
bench_merge_vllm_design(const S* __restrict__ va, const float* __restrict__ sa,
                        const S* __restrict__ vb, const float* __restrict__ sb,
                        S* __restrict__ out, float* __restrict__ olse, int T, int H, int D) {
  constexpr int P = 16 / sizeof(S);
  const unsigned packs = (unsigned)D / P;
  const unsigned i = blockIdx.x * (unsigned)ZK_BLOCK_bench_merge_vllm_design + threadIdx.x;
  if (i >= (unsigned)T * (unsigned)H * packs) return;  // the host keeps this product below 2^32
  const unsigned row = i / packs;  // t * H + h
  const unsigned p = i - row * packs;
  const unsigned t = row / (unsigned)H;
  const unsigned h = row - t * (unsigned)H;
  const size_t at_lse = (size_t)h * (unsigned)T + t;
  const size_t at_v = (size_t)row * (unsigned)D + (size_t)p * P;

  float la = sa[at_lse];
  float lb = sb[at_lse];
  const bench_pack<S> xa = *reinterpret_cast<const bench_pack<S>*>(va + at_v);
  const bench_pack<S> xb = *reinterpret_cast<const bench_pack<S>*>(vb + at_v);

  const float ninf = __int_as_float(0xff800000);
  la = fabsf(la) == -ninf ? ninf : la;  // +inf (an empty row) counts as -inf
  lb = fabsf(lb) == -ninf ? ninf : lb;
  float m = fmaxf(la, lb);
  m = m == ninf ? 0.f : m;  // both empty: keep the exponents finite
  const float wa = expf(la - m), wb = expf(lb - m);
  const float total = wa + wb;  // NaN when an LSE is NaN: it reaches V and the LSE
  const float inv = total == 0.f ? 0.f : 1.f / total;
  const float ca = wa * inv, cb = wb * inv;

  bench_pack<S> r;
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const float x = (wa == 0.f ? 0.f : bench_float(xa.e[j]) * ca) + (wb == 0.f ? 0.f : bench_float(xb.e[j]) * cb);
    r.e[j] = bench_store<S>(x);
  }
  *reinterpret_cast<bench_pack<S>*>(out + at_v) = r;
  if (p == 0) olse[at_lse] = total == 0.f ? ninf : m + logf(total);
}
"""

VLLM_DESIGN_TYPES = {torch.bfloat16: "bench_bf16", torch.float16: "bench_half", torch.float32: "float"}

VLLM_DESIGN = Kernel(
    stem="bench_vllm_design",
    name="bench_merge_vllm_design",
    instances=tuple((t,) for t in VLLM_DESIGN_TYPES.values()),
    block=128,
    params=(
        ("va", "ptr"),
        ("sa", "ptr"),
        ("vb", "ptr"),
        ("sb", "ptr"),
        ("out", "ptr"),
        ("olse", "ptr"),
        ("T", "i32"),
        ("H", "i32"),
        ("D", "i32"),
    ),  # fmt: skip
    code=VLLM_DESIGN_SOURCE,
)

_launchers: dict[tuple[Any, int], Any] = {}


def vllm_design_args(
    v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any
) -> tuple[dict[str, int], int]:
    """The kernel's arguments by name and its grid, after checking the layout it is built for."""
    if v_a.dtype not in VLLM_DESIGN_TYPES or not v_a.dtype == v_b.dtype == out.dtype:
        raise TypeError(f"vLLM-design merge: V dtypes {v_a.dtype}, {v_b.dtype} -> {out.dtype} not supported")
    T, H, D = v_a.shape
    pack = 16 // v_a.element_size()
    for name, x in (("v_a", v_a), ("v_b", v_b), ("out", out)):
        if tuple(x.shape) != (T, H, D) or not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError(f"vLLM-design merge: {name} must be a contiguous, 16-byte aligned [T, H, D]")
    for name, s in (("s_a", s_a), ("s_b", s_b), ("out_lse", out_lse)):
        if tuple(s.shape) != (T, H) or s.dtype != torch.float32 or not s.T.is_contiguous():
            raise ValueError(f"vLLM-design merge: {name} must be the .T of a contiguous float32 [H, T]")
    if D % pack:
        raise ValueError(f"vLLM-design merge: D={D} is not a multiple of {pack}")
    threads = T * H * (D // pack)
    if threads >= 2**32:
        raise ValueError(f"vLLM-design merge: {threads} threads do not fit its 32-bit index")
    ptr = {n: x.data_ptr() for n, x in (("va", v_a), ("sa", s_a), ("vb", v_b), ("sb", s_b), ("out", out))}
    args = {**ptr, "olse": out_lse.data_ptr(), "T": T, "H": H, "D": D}
    return args, -(-threads // VLLM_DESIGN.block)


def vllm_design_merge(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """One launch on torch's current stream."""
    args, grid = vllm_design_args(v_a, s_a, v_b, s_b, out, out_lse)
    if grid:
        from zerokv.core.launch import Launcher

        device = v_a.device.index
        launch = _launchers.get((v_a.dtype, device))
        if launch is None:
            targs = (VLLM_DESIGN_TYPES[v_a.dtype],)
            launch = _launchers[(v_a.dtype, device)] = Launcher(VLLM_DESIGN, targs, device)
        stream = torch.cuda.current_stream(v_a.device).cuda_stream
        launch(grid, stream, *(args[n] for n, _ in VLLM_DESIGN.params))
    return out, out_lse


def vllm_design_stand_in(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """For the dry run on the CPU: the same checks and argument packing, then the eager merge."""
    args, _ = vllm_design_args(v_a, s_a, v_b, s_b, out, out_lse)
    VLLM_DESIGN.pack(**args)
    return eager_merge_state(v_a, s_a, v_b, s_b, out, out_lse)


def compile_offline(kernel: Kernel = VLLM_DESIGN, arch: str = "sm_90") -> dict[str, str]:
    """Compile every instantiation of a bench kernel with NVRTC through cuda-bindings (no GPU
    needed), from the text the runtime compiles (its block size defined on top). Returns name
    expression -> lowered name; a failed compile raises ``RuntimeError`` with the log."""
    from cuda.bindings import nvrtc

    def check(result: tuple, what: str, prog: Any = None) -> tuple:
        err, *rest = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            log = ""
            if prog is not None:
                _, size = nvrtc.nvrtcGetProgramLogSize(prog)
                buf = b" " * size
                nvrtc.nvrtcGetProgramLog(prog, buf)
                log = buf.decode(errors="replace").rstrip("\x00 ")
            raise RuntimeError(f"NVRTC {what} of {kernel.name} failed: {err}\n{log}")
        return tuple(rest)

    code = f"#define ZK_BLOCK_{kernel.name} {kernel.block}\n" + (kernel.code or "")
    (prog,) = check(
        nvrtc.nvrtcCreateProgram(code.encode(), f"{kernel.stem}.cu".encode(), 0, [], []), "create"
    )
    try:
        for e in kernel.expressions:
            check(nvrtc.nvrtcAddNameExpression(prog, e.encode()), f"name {e}")
        opts = [f"-arch={arch}".encode(), b"-ftz=true", b"--std=c++17"]
        check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "compile", prog)
        return {
            e: check(nvrtc.nvrtcGetLoweredName(prog, e.encode()), e)[0].decode() for e in kernel.expressions
        }
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# --- FlashInfer -----------------------------------------------------------------------------------


def flashinfer_merge_state() -> Any:
    """FlashInfer's ``merge_state`` (base-2 LSE, allocates its outputs) in the common signature,
    or None when FlashInfer is not importable."""
    try:
        import flashinfer
    except Exception:
        return None

    def merge(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
        return flashinfer.merge_state(v_a, s_a, v_b, s_b)

    return merge


# --- an empty kernel: the floor of one launch ---------------------------------------------------

EMPTY = Kernel(
    stem="bench_empty",
    name="bench_empty_kernel",
    instances=((0,),),
    block=32,
    params=(("x", "i32"),),
    code="template <int N>\n__global__ void __launch_bounds__(ZK_BLOCK_bench_empty_kernel) bench_empty_kernel(int x) {}\n",
)


def empty_launch(device: int) -> Any:
    """A call that launches one block of the empty kernel on torch's current stream."""
    from zerokv.core.launch import Launcher

    launch = Launcher(EMPTY, (0,), device)

    def call() -> None:
        launch(1, torch.cuda.current_stream(device).cuda_stream, 0)

    return call


# --- the copy that "% of copy" divides by ------------------------------------------------------

# An SM-driven copy of 16-byte words (grid-stride, 8 blocks of 256 per SM), as the kernels under
# test move their bytes. torch's `copy_` inside a CUDA graph becomes a copy-engine memcpy node,
# which runs ~35 % slower on an H200 than the SMs can copy: it would overstate every "% of copy".
COPY = Kernel(
    stem="bench_copy",
    name="bench_copy_kernel",
    instances=((0,),),
    block=256,
    params=(("dst", "ptr"), ("src", "ptr"), ("words", "i64")),
    code=(
        "template <int N>\n"
        "__global__ void __launch_bounds__(ZK_BLOCK_bench_copy_kernel) "
        "bench_copy_kernel(uint4* dst, const uint4* src, long long words) {\n"
        "  const long long stride = (long long)gridDim.x * blockDim.x;\n"
        "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride)\n"
        "    dst[i] = __ldg(src + i);\n"
        "}\n"
    ),
)


def copy_launch(dst: Any, src: Any) -> Any:
    """A call that copies ``src`` into ``dst`` (byte tensors, sizes a multiple of 16) with
    :data:`COPY` on torch's current stream."""
    from zerokv.core.device import sm_count
    from zerokv.core.launch import Launcher

    device = src.device.index
    launch = Launcher(COPY, (0,), device)
    blocks = 8 * sm_count(device)
    words = src.numel() // 16

    def call(d: Any = dst, s: Any = src) -> None:
        launch(blocks, torch.cuda.current_stream(device).cuda_stream, d.data_ptr(), s.data_ptr(), words)

    return call
