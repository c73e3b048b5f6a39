"""The two kernels every figure is read against, launched through zerokv's runtime as zerokv
launches its own: an empty kernel (the floor of any launch) and an SM copy of 16-byte words
(the bandwidth that "% of copy" divides by).
"""

from __future__ import annotations

from typing import Any

import torch

from zerokv.core.kernels import Kernel

# --- an empty kernel: the floor of one launch -------------------------------------------------

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
