"""The command line of zerokv.

  python -m zerokv                  the self-check (every op against the float64 reference)
  python -m zerokv compile ...      build kernels through NVRTC for a named arch, no GPU needed;
                                    with --out DIR, keep the binaries for ZEROKV_KERNEL_DIR=DIR
  python -m zerokv --version        zerokv's version and those of what it runs on (NVRTC, CuPy)

Long compiles show their progress on a terminal (one line per arch when piped); --quiet
silences it. --version and --help import neither torch nor CuPy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_ARCH = "sm_90"
ARCH_HELP = (
    "target arch(s), comma-separated (default: %(default)s). Accepted with NVRTC 13: sm_80, sm_86, "
    "sm_87, sm_88, sm_89, sm_90, sm_90a, sm_100, sm_100a, sm_100f, sm_103, sm_103a, sm_103f, "
    "sm_107, sm_107a, sm_107f, sm_110, sm_110a, sm_110f, sm_120, sm_120a, sm_120f, sm_121, sm_121a, sm_121f (NVRTC 12 "
    "accepts its own set); --list-archs prints the names the NVRTC installed here accepts"
)
OPS_NAMES = "merge_state, merge_states, fixup_zero_kv_rows, mask_empty_context, cp_merge"
DTYPE_NAMES = "float16, bfloat16, float32, float8_e4m3fn"


class _Version(argparse.Action):
    """``--version``: zerokv's version, then one line of what it runs on (package metadata:
    imports neither torch nor CuPy), so that an NVRTC or CuPy problem can be reported whole."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: object) -> None:
        super().__init__(
            option_strings, dest, nargs=0, help="print the versions of zerokv and what it runs on"
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from .versions import report

        print(report())
        parser.exit()


def _cache_help() -> str:
    """Where the compile cache is here, and the rule that put it there."""
    from .core import disk_cache as _cache

    return (
        f"Results are cached in {_cache.cache_dir()} (ZEROKV_CACHE_DIR, else $XDG_CACHE_HOME/zerokv, "
        "else ~/.cache/zerokv)."
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zerokv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action=_Version)
    p.add_argument(
        "--quiet", "-q", action="store_true", help="no progress lines while the self-check compiles"
    )
    sub = p.add_subparsers(dest="command")
    comp = sub.add_parser(
        "compile",
        help="compile kernel instantiations for an arch through NVRTC (no GPU needed)",
        description="Compile every kernel instantiation (or those of --ops and --dtypes) for each "
        f"arch through NVRTC, without a GPU. {_cache_help()} With --out DIR the binaries are "
        "written to DIR: a process with ZEROKV_KERNEL_DIR=DIR loads them on a GPU of that arch "
        "with no NVRTC work; a later --out into the same DIR adds to what it holds.",
    )
    comp.add_argument("--arch", default=DEFAULT_ARCH, help=ARCH_HELP)
    comp.add_argument(
        "--list-archs", action="store_true", help="print the arch names this NVRTC accepts, and exit"
    )
    comp.add_argument(
        "--dtypes", help=f"comma-separated element types to build for (default: all of {DTYPE_NAMES})"
    )
    comp.add_argument("--ops", help=f"comma-separated ops to build for (default: all of {OPS_NAMES})")
    comp.add_argument(
        "--out", type=Path, help="a directory to write the binaries into (for ZEROKV_KERNEL_DIR)"
    )
    comp.add_argument(
        "--verbose", "-v", action="store_true", help="every instantiation, and NVRTC's log on failure"
    )
    comp.add_argument(
        "--no-cache", action="store_true", help="compile again even when the cache has the result"
    )
    comp.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        default=argparse.SUPPRESS,  # `python -m zerokv --quiet compile` stays quiet
        help="no progress and no line per arch; errors and the result only",
    )
    check = sub.add_parser("check", help="the self-check (the default)")
    check.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        default=argparse.SUPPRESS,
        help="no progress lines while compiling",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "compile":
        return compile_command(args)
    import contextlib

    with contextlib.suppress(ImportError):  # torch.ops.zerokv.*, which `python -m zerokv` left out
        from . import torch_ops  # noqa: F401
    from . import selfcheck

    return selfcheck.main(quiet=args.quiet)


def _split(text: str | None, arg: str) -> list[str] | None:
    """A comma-separated list; None when the option is absent; ValueError when it names nothing."""
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"{arg}: {text!r} names nothing; leave {arg} out to build for all")
    return names


def compile_command(args: argparse.Namespace) -> int:
    from .core import offline as _offline
    from .progress import Progress

    try:  # every name first, before anything is compiled
        if args.list_archs:
            print(" ".join(_offline.accepted_archs()))
            return 0
        archs = _split(args.arch, "--arch") or []
        for arch in archs:
            _offline.check_arch(arch)
        exprs = _selection(_split(args.dtypes, "--dtypes"), _split(args.ops, "--ops"))
        major, minor = _offline.nvrtc_version()
    except (_offline.ArchError, ImportError, TypeError, ValueError) as e:
        message = str(e).replace("precompile: dtypes:", "--dtypes:").replace("precompile: ops:", "--ops:")
        print(f"python -m zerokv compile: {message}", file=sys.stderr)
        return 2
    failures = 0
    progress = Progress(quiet=args.quiet)
    size = sum(len(e) for e in _offline.selected(exprs).values())
    for arch in archs:
        total, cached, kept, start = 0, 0, 0, time.perf_counter()
        progress.start(arch, size)
        for stem, results in _offline.compile_arch(
            arch,
            cache=not args.no_cache,
            exprs=exprs,
            out=args.out,
            before=lambda stem, n: progress.stage(stem),
        ):
            if isinstance(results, _offline.CompileError):
                progress.finish()
                failures += len(results.failing)
                print(results.summary(), flush=True)
                if args.verbose:
                    print(results.log)
                continue
            asked = [r for r in results if not r.kept]
            progress.advance(len(asked))
            total += len(asked)
            cached += sum(r.cached for r in asked)
            kept += len(results) - len(asked)
            if args.verbose:
                progress.finish()
                how = "from the cache" if results[0].cached else f"{results[0].seconds:.2f} s"
                print(f"{arch:7s} {stem:12s} {len(results):4d} instantiations  {how}")
                for r in results:
                    print(f"    {r.expression:60s} {r.lowered_name}{'  (kept)' if r.kept else ''}")
        progress.finish()
        took = time.perf_counter() - start
        more = f"; {kept} more kept from the earlier build in {args.out}" if kept else ""
        if not args.quiet:
            print(
                f"{arch}: {total} instantiations compiled by NVRTC {major}.{minor} ({cached} from the cache)"
                f"{more}, {took:.2f} s",
                flush=True,
            )
    if failures:
        print(
            f"FAILED: {failures} instantiations" + ("" if args.verbose else " (--verbose shows NVRTC's log)")
        )
        return 1
    if args.out is not None:
        _launcher_into(args.out, args.quiet)
        print(f"wrote {args.out}: set ZEROKV_KERNEL_DIR={args.out} where zerokv runs")
    return 0


def _launcher_into(out: str, quiet: bool) -> None:
    """The compiled executor built into ``out`` beside the kernels, for a runtime image without a
    C compiler; where this machine cannot build it, one line says so (the image then runs the
    Python executor, or builds it at its first call where it has a compiler)."""
    from .core import cexec

    try:
        path = cexec.build_into(out)
    except cexec.BuildError as e:
        print(
            f"launcher: not built ({' '.join(str(e).split())}); the image runs the Python executor",
            flush=True,
        )
        return
    if not quiet:
        print(f"launcher: {path.name} (the compiled executor for this Python and platform)", flush=True)


def _selection(dtypes: list[str] | None, ops: list[str] | None) -> dict[str, list[str]] | None:
    """stem -> name expressions for --dtypes / --ops (precompile's selection); None: all."""
    if dtypes is None and ops is None:
        return None
    from .precompile import _dtype_names, _op_names, selection

    chosen: dict[str, list[str]] = {}
    for kernel, targs in selection(_dtype_names(dtypes), _op_names(ops)):
        chosen.setdefault(kernel.stem, []).append(kernel.expr(*targs))
    return chosen


if __name__ == "__main__":
    sys.exit(main())
