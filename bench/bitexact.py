"""How closely zerokv's merge matches the engines' merges, bit for bit.

For random non-empty states of engine shapes (bf16, fp16, fp32; LSE ``[H, T]`` as vLLM lays it
out), the share of output elements that are bitwise equal and the largest difference in units
in the last place (ulp) of the output dtype, zerokv against: the CUDA merge in the design of
vLLM's CUDA kernel, the Triton merge in the design of vLLM's Triton kernel, FlashInfer's
``merge_state`` when it is installed (base 2), and the float64 reference rounded once.

    PYTHONPATH=. python bench/bitexact.py --out DIR     (needs a CUDA GPU; writes bitexact.json)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

import numpy as np
import torch

import zerokv
from bench import baselines, baselines_cuda, baselines_triton
from zerokv import reference

SHAPES = ((1, 16, 512), (64, 32, 128), (4096, 128, 128), (1000, 8, 72))
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between the two in representable values of their dtype."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    ia, ib = a.contiguous().view(bits).long(), b.contiguous().view(bits).long()
    # ordered integers: negative floats mapped below positive ones
    top = 1 << (8 * a.element_size() - 1)
    ia = torch.where(ia < 0, -(ia + top), ia)
    ib = torch.where(ib < 0, -(ib + top), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    finite = torch.isfinite(ours) & torch.isfinite(theirs)
    a, b = ours[finite], theirs[finite]
    equal = (
        a.contiguous().view(torch.uint8).view(-1, a.element_size())
        == b.contiguous().view(torch.uint8).view(-1, b.element_size())
    ).all(1)
    return {
        "elements": int(a.numel()),
        "bitwise_equal": float(equal.float().mean()) if a.numel() else 1.0,
        "max_ulp": ulps(a, b),
        "max_abs": float((a.float() - b.float()).abs().max()) if a.numel() else 0.0,
    }


def states(T: int, H: int, D: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    v_a = torch.randn(T, H, D, device="cuda", generator=g).to(dtype)
    v_b = torch.randn(T, H, D, device="cuda", generator=g).to(dtype)
    s_a = (torch.randn(H, T, device="cuda", generator=g) * 4).T  # vLLM's [H, T] buffer, viewed [T, H]
    s_b = (torch.randn(H, T, device="cuda", generator=g) * 4).T
    return v_a, s_a, v_b, s_b


def run() -> list[dict]:
    rows = []
    flashinfer = baselines.flashinfer_merge_state()
    for dtype in DTYPES:
        for T, H, D in SHAPES:
            v_a, s_a, v_b, s_b = states(T, H, D, dtype, seed=T * 7 + D)
            ours, ours_lse = zerokv.merge_state(v_a, s_a, v_b, s_b)
            others = {}
            out = torch.full_like(v_a, math.nan)
            out_lse = torch.full((H, T), math.nan, device="cuda").T
            if D % (16 // v_a.element_size()) == 0:
                others["vllm-design CUDA"] = baselines_cuda.vllm_design_merge(
                    v_a, s_a, v_b, s_b, out.clone(), out_lse.clone()
                )
            if baselines_triton.triton_runs(dry=False):
                others["vllm-design Triton"] = baselines_triton.triton_merge_state(
                    v_a, s_a, v_b, s_b, out.clone(), out_lse.clone()
                )
            if flashinfer is not None and dtype != torch.float32:
                l2 = 1 / math.log(2)
                fi_out, fi_lse = flashinfer(
                    v_a, (s_a * l2).contiguous(), v_b, (s_b * l2).contiguous(), None, None
                )
                others["FlashInfer merge_state"] = (fi_out, fi_lse / l2)
            ref_v, ref_s = reference.merge_state(*(x.double().cpu().numpy() for x in (v_a, s_a, v_b, s_b)))
            others["float64 reference, rounded once"] = (
                torch.from_numpy(np.ascontiguousarray(ref_v)).to("cuda").to(dtype),
                torch.from_numpy(np.ascontiguousarray(ref_s)).to("cuda").float(),
            )
            torch.cuda.synchronize()
            for name, (v, s) in others.items():
                rows.append(
                    {"against": name, "dtype": str(dtype).removeprefix("torch."), "shape": [T, H, D],
                     "v": compare(ours, v), "lse": compare(ours_lse, s.float())}
                )  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    rows = run()
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "zerokv": zerokv.__version__,
        "python": platform.python_version(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bitexact.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(
        f"{'against':34s} {'dtype':9s} {'shape':16s} {'V equal':>8s} {'V ulp':>6s} {'LSE equal':>9s} {'LSE ulp':>7s}"
    )
    for r in rows:
        print(
            f"{r['against']:34s} {r['dtype']:9s} {str(tuple(r['shape'])):16s} {r['v']['bitwise_equal']:8.4f}"
            f" {r['v']['max_ulp']:6d} {r['lse']['bitwise_equal']:9.4f} {r['lse']['max_ulp']:7d}"
        )


if __name__ == "__main__":
    main()
