"""``python -m zerokv``: the self-check; ``python -m zerokv compile --arch sm_90``: build every
kernel for an arch through NVRTC (works without a GPU)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerokv", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    comp = sub.add_parser("compile", help="compile every kernel instantiation for an arch (no GPU needed)")
    comp.add_argument("--arch", default="sm_90", help="target, e.g. sm_80, sm_90 (default sm_90)")
    sub.add_parser("check", help="the self-check (the default)")
    args = parser.parse_args(argv)

    if args.command == "compile":
        import time

        from . import _offline

        t = time.perf_counter()
        results = _offline.compile_all(args.arch)
        for r in results:
            print(f"{r.stem:6s} {r.expression:60s} {r.lowered_name}")
        print(f"{len(results)} instantiations compiled for {args.arch} in {time.perf_counter() - t:.2f} s")
        return 0
    from . import selfcheck

    return selfcheck.main()


if __name__ == "__main__":
    sys.exit(main())
