"""A CUDA merge in the design of vLLM's CUDA merge, as a baseline, compiled through zerokv's
runtime (bench-only, not shipped): one thread per 16-byte pack of V, the two LSE loads and the
two V loads issued before any arithmetic, LSE ``[H, T]`` contiguous, V ``[T, H, D]`` contiguous;
bf16, fp16, fp32. Its stand-in for the dry run on the CPU, and an offline NVRTC compile of any
bench kernel (no GPU needed). The conventions every baseline merge keeps are in ``baselines``.
"""

from __future__ import annotations

from typing import Any

import torch

from zerokv.core.kernels import Kernel

from .baselines import eager_merge_state

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
