"""The vLLM-design CUDA merge as a compiled torch op, and its host cost beside zerokv's calls.

An engine's own merge is a C++ torch op: a dtype dispatch, a divisibility check, the current
stream, one launch. This module builds the bench's merge of vLLM's design
(``baselines_cuda.VLLM_DESIGN_SOURCE``) the same way, with nvcc through
``torch.utils.cpp_extension`` into a temporary directory (nothing is written into the source
tree), as ``torch.ops.zerokv_bench.merge_attn_states(output, output_lse, prefix_output,
prefix_lse, suffix_output, suffix_lse)`` (V ``[T, H, D]`` contiguous, LSE ``[H, T]``
contiguous, natural log). Then, in one process and in the interleaved rounds of
``profile_call``: ``torch.mul(out=)``, zerokv's ``merge_state`` through each executor, the
compiled op and the check-free launch floor of ``host_cases``, with the same tensors and with a
new T every call::

    python -m bench.compiled_op --build DIR --json FILE       # nvcc and ninja; prints the library
    python -m bench.compiled_op --time --library LIB --json FILE [--cpu] [--rounds N]

``--cpu``: CPU tensors, zerokv's launches counted (``zerokv.testing``); the compiled op and the
floor need a GPU and are listed as not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

OP = "zerokv_bench::merge_attn_states"
NAME = "zerokv_bench_merge_attn_states"
SUSPICIOUS_ERR = 0.1  # bf16 outputs of unit-scale data are off by ~1e-2 at most

WRAPPER = r"""
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

template <typename S>
static void launch_merge(at::Tensor& out, at::Tensor& out_lse, const at::Tensor& va, const at::Tensor& sa,
                         const at::Tensor& vb, const at::Tensor& sb) {
  const int T = static_cast<int>(out.size(0));
  const int H = static_cast<int>(out.size(1));
  const int D = static_cast<int>(out.size(2));
  constexpr int pack = 16 / sizeof(S);
  TORCH_CHECK(D % pack == 0, "head size ", D, " is not a multiple of ", pack);
  const long long threads = static_cast<long long>(T) * H * (D / pack);
  if (threads == 0) return;
  const unsigned blocks = static_cast<unsigned>((threads + BLOCK - 1) / BLOCK);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  bench_merge_vllm_design<S><<<blocks, BLOCK, 0, stream>>>(
      static_cast<const S*>(va.data_ptr()), static_cast<const float*>(sa.data_ptr()),
      static_cast<const S*>(vb.data_ptr()), static_cast<const float*>(sb.data_ptr()),
      static_cast<S*>(out.data_ptr()), static_cast<float*>(out_lse.data_ptr()), T, H, D);
}

// The argument order of vLLM's op: outputs first, then prefix and suffix states.
void merge_attn_states(at::Tensor& output, at::Tensor& output_lse, const at::Tensor& prefix_output,
                       const at::Tensor& prefix_lse, const at::Tensor& suffix_output,
                       const at::Tensor& suffix_lse) {
  switch (output.scalar_type()) {
    case at::ScalarType::BFloat16:
      return launch_merge<bench_bf16>(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse);
    case at::ScalarType::Half:
      return launch_merge<bench_half>(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse);
    case at::ScalarType::Float:
      return launch_merge<float>(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse);
    default:
      TORCH_CHECK(false, "unsupported dtype ", output.scalar_type());
  }
}

TORCH_LIBRARY(zerokv_bench, m) {
  m.def("merge_attn_states(Tensor(a!) output, Tensor(b!) output_lse, Tensor prefix_output, "
        "Tensor prefix_lse, Tensor suffix_output, Tensor suffix_lse) -> ()");
}

TORCH_LIBRARY_IMPL(zerokv_bench, CUDA, m) { m.impl("merge_attn_states", &merge_attn_states); }
"""


def source() -> str:
    """The extension's one CUDA file: the bench's kernel, then the op around it."""
    from . import baselines_cuda

    kernel = baselines_cuda.VLLM_DESIGN
    block = f"#define ZK_BLOCK_{kernel.name} {kernel.block}\n#define BLOCK {kernel.block}\n"
    return block + baselines_cuda.VLLM_DESIGN_SOURCE + WRAPPER


def build(directory: str) -> str:
    """Compile and load the op (nvcc, ninja); return the shared library's path."""
    import torch
    from torch.utils import cpp_extension

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    os.makedirs(directory, exist_ok=True)
    return cpp_extension.load_inline(
        name=NAME,
        cpp_sources="",
        cuda_sources=source(),
        extra_cuda_cflags=["-O3"],
        build_directory=directory,
        is_python_module=False,
        verbose=False,
    )  # the library's path (loaded here too)


def _vllm_new_t(op: Any, torch: Any, dev: str, H: int, D: int) -> Any:
    """The compiled op over 64 token counts, cycled, as profile_call's ``_new_t`` calls zerokv:
    V as slices of preallocated buffers, each T's ``[H, T]`` LSEs made beforehand (the op reads
    them contiguous)."""
    n, bf = 512, torch.bfloat16
    vs = [torch.randn(n, H, D, device=dev).to(bf) for _ in range(3)]
    args = []
    for t in range(n - 63, n + 1):
        sa, sb, ol = (torch.randn(H, t, device=dev) for _ in range(3))
        args.append((vs[2][:t], ol, vs[0][:t], sa, vs[1][:t], sb))
    state = [0]

    def call() -> None:
        i = state[0] = (state[0] + 1) & 63
        a = args[i]
        op(a[0], a[1], a[2], a[3], a[4], a[5])

    return call


def _check_op(op: Any, torch: Any, T: int, H: int, D: int) -> float:
    """Max abs error of the op against the eager merge on fresh random inputs (NaN outputs
    before the call)."""
    from . import baselines

    bf = torch.bfloat16
    va, vb = (torch.randn(T, H, D, device="cuda").to(bf) for _ in range(2))
    sa, sb = (torch.randn(H, T, device="cuda") * 3 for _ in range(2))
    out, ol = (
        torch.full((T, H, D), float("nan"), device="cuda").to(bf),
        torch.full((H, T), float("nan"), device="cuda"),
    )
    op(out, ol, va, sa, vb, sb)
    want, want_lse = torch.empty_like(out), torch.empty(T, H, device="cuda")
    baselines.eager_merge_state(va, sa.T, vb, sb.T, want, want_lse)
    torch.cuda.synchronize()
    errors = torch.stack([(out.float() - want.float()).abs().max(), (ol.T - want_lse).abs().max()])
    return errors.max().item()  # NaN where the op left an element unwritten


@contextlib.contextmanager
def _launches_counted(module: Any):
    """The compiled executor's calls inside the block count their launches and make none."""
    from zerokv.core import executor

    saved = executor.run
    executor.run = executor.runner("c")
    module.set_recorder(None, False)
    try:
        yield
    finally:
        module.set_recorder(None, True)
        executor.run = saved


def time_beside(library: str | None, cpu: bool, rounds: int, T: int) -> dict[str, Any]:
    """µs per call, interleaved rounds (``profile_call``'s timing), each step's × torch.mul."""
    import torch

    import zerokv
    from zerokv.core import executor

    from . import host_cases, profile_call

    H, D = profile_call.H, profile_call.D
    dev = "cpu" if cpu else "cuda"
    if cpu:
        torch.set_num_threads(1)
    shape = (64,) if cpu else (T, H, D)
    a, b, c = torch.randn(shape, device=dev), torch.randn(shape, device=dev), torch.empty(shape, device=dev)
    steps: dict[str, Any] = {"torch.mul(out=)": lambda: torch.mul(a, b, out=c)}
    names = ["c", "python"] if executor.module_of_safe("c") is not None else ["python"]
    for name in names:
        label = "C" if name == "c" else "Python"
        steps[f"merge_state, new T, {label} executor"] = (
            name,
            profile_call._new_t(zerokv.merge_state, torch, dev),
        )
    notes: dict[str, str] = {}
    meta: dict[str, Any] = {"executors": names, "T": T, "H": H, "D": D, "cpu": cpu}
    if not cpu and "c" in names:  # the launch's own share: the same calls, launches counted
        steps["merge_state, new T, C executor, launch left out"] = (
            lambda: _launches_counted(executor.module_of_safe("c")),
            profile_call._new_t(zerokv.merge_state, torch, dev),
        )
    if cpu:
        notes["vLLM-design compiled op"] = "not run: no GPU"
        notes["launch floor"] = "not run: no GPU"
    else:
        bf = torch.bfloat16
        va, vb, out = (torch.randn(T, H, D, device=dev).to(bf) for _ in range(3))
        sa, sb, ol = (torch.randn(H, T, device=dev) for _ in range(3))
        try:
            if library is None:
                raise RuntimeError("not built (see the build step)")
            torch.ops.load_library(library)
            op = torch.ops.zerokv_bench.merge_attn_states
            meta["vllm_op_max_error"] = err = _check_op(op, torch, 300, H, D)
            if not err <= SUSPICIOUS_ERR:
                notes["vLLM-design compiled op"] = f"its output is off the eager merge's by {err}"
            steps["vLLM-design compiled op"] = lambda: op(out, ol, va, sa, vb, sb)
            steps["vLLM-design compiled op, new T"] = _vllm_new_t(op, torch, dev, H, D)
        except Exception as e:
            notes["vLLM-design compiled op"] = f"failed: {type(e).__name__}: {e}"[:600]
        try:
            floor = host_cases.launch_floor(_FloorBench(torch))
            sa_th, sb_th, ol_th = sa.T.contiguous(), sb.T.contiguous(), ol.T.contiguous()
            floor(va, sa_th, vb, sb_th, out=out, out_lse=ol_th)
            steps["launch floor (no check)"] = lambda: floor(va, sa_th, vb, sb_th, out=out, out_lse=ol_th)
            steps["launch floor (no check), new T"] = profile_call._new_t(floor, torch, dev)
        except Exception as e:
            notes["launch floor"] = f"failed: {type(e).__name__}: {e}"[:600]
    got = profile_call._time(steps, cpu, rounds)
    mul = statistics.median(got["torch.mul(out=)"])
    rows = []
    for k, v in got.items():
        us = statistics.median(v)
        rows.append({"step": k, "us": us, "x_mul": us / mul, "rounds": v})
        print(f"{k:58s} {us:7.2f} µs  {us / mul:5.2f} x torch.mul")
    return {**meta, "rows": rows, "notes": notes, "rounds": rounds}


class _FloorBench:
    """What ``host_cases.launch_floor`` reads of a bench: the torch module, a GPU run."""

    dry = False

    def __init__(self, torch: Any) -> None:
        self.torch = torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compiled_op")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--build", metavar="DIR", help="compile the op into DIR (outside the source tree)")
    what.add_argument("--time", action="store_true", help="time the op beside zerokv's calls")
    parser.add_argument("--library", help="the op's shared library (--build's output)")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors, launches counted (no GPU)")
    parser.add_argument("--rounds", type=int, default=profile_rounds())
    parser.add_argument("-T", type=int, default=256)
    parser.add_argument("--json", required=True, help="write the result here")
    args = parser.parse_args(argv)
    if args.build:
        t = time.perf_counter()
        result: dict[str, Any] = {"library": build(args.build), "build_s": time.perf_counter() - t}
        print(result["library"])
    else:
        result = time_beside(args.library, args.cpu, args.rounds, args.T)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def profile_rounds() -> int:
    from . import profile_call

    return profile_call.ROUNDS


if __name__ == "__main__":
    sys.exit(main())
