"""Run by bench/bench_compile.py in a fresh process (its own ``CUPY_CACHE_DIR``): how long the
zerokv ops take to become usable. Prints one JSON line.

    python -m bench.compile_child engine   # first call of each op, bf16 vector path
    python -m bench.compile_child all      # compile + load every registered instantiation

Tensors are made (and torch's CUDA context is up) before ``import zerokv``; the clock starts
after that import, as an engine sees it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compile_child")
    parser.add_argument("mode", choices=("engine", "all"))
    parser.add_argument("--cpu", action="store_true", help="the CPU path (checks the harness only)")
    args = parser.parse_args(argv)

    import torch

    dev = torch.device("cpu" if args.cpu else "cuda")

    def sync() -> None:
        if not args.cpu:
            torch.cuda.synchronize()

    T, H, D, bf = 4, 2, 64, torch.bfloat16
    va, vb, out = (torch.randn(T, H, D, device=dev, dtype=bf) for _ in range(3))
    sa, sb, lse = (torch.randn(T, H, device=dev) for _ in range(3))
    v, s = torch.randn(2, T, H, D, device=dev, dtype=bf), torch.randn(2, T, H, device=dev)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=dev)
    kv = torch.tensor([0, 3], dtype=torch.int32, device=dev)
    cu_kv = torch.tensor([0, 0, 3], dtype=torch.int32, device=dev)
    sync()

    t = time.perf_counter()
    import zerokv
    from zerokv import _runtime

    result = {"mode": args.mode, "import_s": time.perf_counter() - t, "items": {}}
    result["cupy_imported_by_import"] = "cupy" in sys.modules
    t0 = time.perf_counter()
    if args.mode == "engine":
        ops = [
            ("merge_state bf16", lambda: zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse)),
            ("merge_states bf16", lambda: zerokv.merge_states(v, s, out=out, out_lse=lse)),
            ("fixup_zero_kv_rows bf16", lambda: zerokv.fixup_zero_kv_rows(out, lse, kv, cu)),
            ("mask_empty_context bf16", lambda: zerokv.mask_empty_context(out, lse, cu, cu_kv)),
        ]
        for name, fn in ops:
            t = time.perf_counter()
            fn()
            sync()
            result["items"][name] = time.perf_counter() - t
    elif not args.cpu:
        device = torch.cuda.current_device()
        count = 0
        for stem, exprs in _runtime.INSTANTIATIONS.items():
            t = time.perf_counter()
            for expr in exprs:
                _runtime.function(stem, expr, device)
            result["items"][f"{stem} ({len(exprs)} instantiations)"] = time.perf_counter() - t
            count += len(exprs)
        result["instantiations"] = count
    result["total_s"] = time.perf_counter() - t0
    result["modules_built"] = _runtime._modules_built
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
