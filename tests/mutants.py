"""Mutation run: plausible bugs put one at a time into the float64 reference, the CPU path, the
planner and cp_merge's CPU path; for each, the number of CPU tests that fail. A mutant that fewer than 3 tests catch is a hole in the
suite. Not collected by pytest (no ``test_`` prefix); run from the repository root:

    python tests/mutants.py [--only NAME,...] [-- extra pytest arguments]

Each mutant is a single textual replacement (it must match exactly once); the file is restored
afterwards whatever happens. Left out as equivalent: dropping the CPU path's clamp of fp8 output
to +-448 (torch's cast to float8_e4m3fn saturates, +-inf included, so no output changes).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
REF = "zerokv/reference.py"
CPU = "zerokv/core/cpu_path.py"
PLAN = "zerokv/plan.py"
CPM = "zerokv/cp_merge/cpu_path.py"


class Mutant(NamedTuple):
    name: str
    path: str
    old: str
    new: str
    what: str


MUTANTS = [
    Mutant("plus_inf_usable", REF, "usable = np.isfinite(s)", "usable = ~np.isnan(s) & (s != -np.inf)",
           "a +inf LSE counted as usable"),
    Mutant("v_swapped", REF, "np.stack([v_a, v_b])", "np.stack([v_b, v_a])", "V of a and b swapped"),
    Mutant("empty_v_times_zero", REF,
           "contrib = np.where(w[..., None] > 0, w[..., None] * np.where(w[..., None] > 0, v, 0.0), 0.0)",
           "contrib = w[..., None] * v", "an empty input's V multiplied by 0, not selected away"),
    Mutant("base_ignored", REF, 'return np.e if str(lse_base) == "e" else 2.0', "return np.e",
           "lse_base=2 read as natural logs"),
    Mutant("nan_hidden", REF, "nan = np.isnan(s).any(axis=0)", "nan = np.zeros(s.shape[1:], dtype=bool)",
           "a NaN LSE treated as empty (hidden)"),
    Mutant("all_empty_lse_zero", REF, "np.log(base), -np.inf)", "np.log(base), 0.0)",
           "an all-empty row gets LSE 0 instead of -inf"),
    Mutant("prefix_off_by_one", REF, "use_a = np.arange(T) < (T", "use_a = np.arange(T) <= (T",
           "prefix_rows keeps state a on row k too"),
    Mutant("sink_not_rescaling_v", REF, "out = np.where(factor[..., None] == 0.0, 0.0, out * factor[..., None])",
           "out = np.where(factor[..., None] == 0.0, 0.0, out)", "a sink folds the LSE but leaves V unscaled"),
    Mutant("verbatim_lse_by_rule", REF, "        lse[prefix_rows:] = s_b[prefix_rows:]\n", "",
           "the verbatim suffix copies V but not the LSE"),
    Mutant("a_empty_search", REF, "(cu[np.minimum(mid, B)] <= t)", "(cu[np.minimum(mid, B)] < t)",
           "a_empty's binary search finds the previous request at a boundary"),
    Mutant("spans_unclipped", REF, "cu = np.clip(np.asarray(cu_seqlens_q, dtype=np.int64), 0, T)",
           "cu = np.asarray(cu_seqlens_q, dtype=np.int64)", "request spans not clipped to [0, T)"),
    Mutant("mask_rule_strict", REF, "np.diff(np.asarray(cu_seqlens_kv, dtype=np.int64)) <= 0",
           "np.diff(np.asarray(cu_seqlens_kv, dtype=np.int64)) < 0", "a context span with end == start not empty"),
    Mutant("fixup_negative_empty", REF, "return np.asarray(kv_lens) == 0", "return np.asarray(kv_lens) <= 0",
           "a negative kv_len counted as empty"),
    Mutant("fp8_scale_multiplied", CPU, "np.clip(res / s, -448.0, 448.0)", "np.clip(res * s, -448.0, 448.0)",
           "fp8 out_scale multiplied instead of divided (CPU path)"),
    Mutant("row_mask_ignored", CPU, 'write(o, scaled(res, v["scale"]), rows)', 'write(o, scaled(res, v["scale"]))',
           "the merge's row mask ignored for V (CPU path)"),
    Mutant("lse_row_mask_ignored", CPU, "write(ol, lse, rows)", "write(ol, lse)",
           "the merge's row mask ignored for the LSE (CPU path)"),
    Mutant("n_way_sinks_dropped", CPU, 'sinks = None if v["sinks"] is None else to_f64(v["sinks"])', "sinks = None",
           "merge_states drops its sinks (CPU path)"),
    Mutant("a_empty_dropped", CPU, "a_empty_rows=a_empty_rows,", "a_empty_rows=None,",
           "a_empty not passed to the merge (CPU path)"),
    Mutant("empty_rules_swapped", CPU, "if rule_offsets else reference.zero_kv_requests(lens)",
           "if not rule_offsets else reference.zero_kv_requests(lens)", "fixup and mask rules swapped (CPU path)"),
    Mutant("base_swapped", REF, 'return np.e if str(lse_base) == "e" else 2.0',
           'return 2.0 if str(lse_base) == "e" else np.e', "every LSE read in the other base"),
    Mutant("lse_off_1e-3", REF, "lse = np.where(live, m_safe +", "lse = 1e-3 + np.where(live, m_safe +",
           "the merged LSE 1e-3 too large"),
    Mutant("verbatim_one_row_late", REF,
           "out[prefix_rows:] = np.asarray(v_b, dtype=np.float64)[prefix_rows:]\n        lse[prefix_rows:] = s_b[prefix_rows:]",
           "out[prefix_rows + 1:] = np.asarray(v_b, dtype=np.float64)[prefix_rows + 1:]\n"
           "        lse[prefix_rows + 1:] = s_b[prefix_rows + 1:]", "the verbatim suffix starts one row past the cutoff"),
    Mutant("a_empty_first_row_kept", REF, "return (start <= t) & (t < end)", "return (start < t) & (t < end)",
           "a_empty misses the first row of each empty request"),
    Mutant("sinks_natural_log", REF, "    base = _base(lse_base)\n    sink = ", "    base = np.e\n    sink = ",
           "sinks folded in natural logs whatever the LSE base"),
    Mutant("ue8m0_rounds_down", REF, "up = np.where(m == 0.5, scale, np.ldexp(1.0, e))",
           "up = np.where(m == 0.5, scale, np.ldexp(1.0, e - 1))", "a UE8M0 scale rounded down, not up"),
    Mutant("ue8m0_ignored", CPU, 'v["scale_format"] == "ue8m0"', "False",
           "scale_format='ue8m0' ignored (CPU path)"),
    Mutant("plan_width_all_requests", PLAN, "(chunk_tokens // max(with_context, 1))", "(chunk_tokens // q.shape[0])",
           "the chunk width divides the budget by every request, not those with context"),
    Mutant("plan_chunks_floor", PLAN, "num_chunks = -(-longest // width)", "num_chunks = longest // width",
           "the chunk count rounded down (the last partial chunk lost)"),
    Mutant("plan_empty_requests", PLAN, "num_empty = ((lens == 0) * q[None, :]).sum(axis=1)",
           "num_empty = (lens == 0).sum(axis=1)", "num_empty_rows counts requests, not their rows"),
    Mutant("cp_plus_inf_share", CPM, "usable = np.isfinite(lses)", "usable = ~np.isnan(lses) & (lses != -np.inf)",
           "a +inf shard counted in the shares (cp_merge's CPU path)"),
    Mutant("cp_base_ignored", CPM, 'base = np.e if lse_base == "e" else 2.0', "base = np.e",
           "lse_base=2 read as natural logs (cp_merge's CPU path)"),
]  # fmt: skip


def run(mutant: Mutant, pytest_args: list[str]) -> tuple[int, Counter, str]:
    path = ROOT / mutant.path
    original = path.read_text()
    if original.count(mutant.old) != 1:
        raise SystemExit(f"{mutant.name}: the text to replace occurs {original.count(mutant.old)} times")
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=no", "-rf", *pytest_args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    finally:
        path.write_text(original)
    failed = re.findall(r"^FAILED (tests/[\w.]+)::", proc.stdout, re.M)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    return len(failed), Counter(failed), summary


def main(argv: list[str]) -> int:
    only, extra = None, []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    if argv[:1] == ["--only"]:
        only = set(argv[1].split(","))
    rows = []
    for m in MUTANTS:
        if only and m.name not in only:
            continue
        n, by_file, summary = run(m, extra or ["tests"])
        files = ", ".join(f"{f.removeprefix('tests/')} {c}" for f, c in by_file.most_common())
        rows.append((m, n))
        print(f"| {m.name} | {m.path} | {m.what} | {n} | {files} |", flush=True)
        print(f"    ({summary})", flush=True)
    weak = [m.name for m, n in rows if n < 3]
    print("every mutant failed >= 3 tests" if not weak else f"caught by fewer than 3 tests: {weak}")
    return 1 if weak else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
