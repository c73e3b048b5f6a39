"""``python -m zerokv``: the self-check. ``python -m zerokv compile --arch sm_80,sm_90``: build
every kernel instantiation for the named archs through NVRTC (no GPU needed).
``python -m zerokv --version``."""

from __future__ import annotations

import argparse
import sys
import time

from . import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerokv", description=__doc__)
    parser.add_argument("--version", action="version", version=f"zerokv {__version__}")
    sub = parser.add_subparsers(dest="command")
    comp = sub.add_parser("compile", help="compile every kernel instantiation for an arch (no GPU needed)")
    comp.add_argument(
        "--arch",
        default="sm_90",
        help="target(s), comma-separated: sm_80, sm_86, sm_89, sm_90, sm_100, sm_120, ...",
    )
    comp.add_argument(
        "--verbose", "-v", action="store_true", help="every instantiation, and NVRTC's log on failure"
    )
    comp.add_argument(
        "--no-cache", action="store_true", help="compile again even when the cache has the result"
    )
    sub.add_parser("check", help="the self-check (the default)")
    args = parser.parse_args(argv)

    if args.command == "compile":
        return compile_command(
            [a.strip() for a in args.arch.split(",") if a.strip()], args.verbose, not args.no_cache
        )
    from . import selfcheck

    return selfcheck.main()


def compile_command(archs: list[str], verbose: bool, cache: bool) -> int:
    from .core import offline as _offline

    try:  # every name first, before anything is compiled
        for arch in archs or ["(none)"]:
            _offline.check_arch(arch)
        major, minor = _offline.nvrtc_version()
    except (_offline.ArchError, ImportError) as e:
        print(f"python -m zerokv compile: {e}", file=sys.stderr)
        return 2
    failures = 0
    for arch in archs:
        total, cached, start = 0, 0, time.perf_counter()
        for stem, results in _offline.compile_arch(arch, cache=cache):
            if isinstance(results, _offline.CompileError):
                failures += len(results.failing)
                print(results.summary())
                if verbose:
                    print(results.log)
                continue
            total += len(results)
            cached += sum(r.cached for r in results)
            how = "from the cache" if results[0].cached else f"{results[0].seconds:.2f} s"
            print(f"{arch:7s} {stem:12s} {len(results):4d} instantiations  {how}")
            if verbose:
                for r in results:
                    print(f"    {r.expression:60s} {r.lowered_name}")
        took = time.perf_counter() - start
        print(
            f"{arch}: {total} instantiations compiled by NVRTC {major}.{minor} ({cached} from the cache), {took:.2f} s"
        )
    if failures:
        print(f"FAILED: {failures} instantiations" + ("" if verbose else " (--verbose shows NVRTC's log)"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
