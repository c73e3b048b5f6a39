"""The quick bench of a GPU run against the last runs kept in ``bench/h200/``: the merge
grid's zerokv / best baseline and each option's ratio to the plain merge, per shape, with the
spread of the interleaved replays, and the shapes whose ratio grew by more than the noise.
Reads bench JSON only (rows as ``python -m bench`` writes them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _rows(raw: list[dict]) -> list[Any]:
    from .common import Row

    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in r.items() if k in fields}) for r in raw]


def _spread(row: Any) -> float:
    """The relative spread of a row's interleaved replays."""
    lo_hi = (row.stats or {}).get("replay_spread_us")
    if not lo_hi or not row.us:
        return 0.0
    try:
        return (float(lo_hi[1]) - float(lo_hi[0])) / float(row.us)
    except (TypeError, ValueError, IndexError):
        return 0.0


def grid_ratios(raw: list[dict]) -> dict[tuple, tuple[float, float]]:
    """(dtype, T, H, D, layout) -> (zerokv / best baseline, spread of that ratio)."""
    from .compare import merge_lines

    out = {}
    for x in merge_lines(_rows([r for r in raw if r.get("op") == "merge_state"])):
        if x["ratio"] is not None:
            out[(*x["key"], x["layout"])] = (x["ratio"], _spread(x["zerokv"]) + _spread(x["best"]))
    return out


def option_ratios(raw: list[dict]) -> dict[tuple, tuple[float, float]]:
    """(T, layout, option, empty, requests, offsets, scale_format) -> (zerokv option / zerokv plain
    merge of the same T and layout, spread of that ratio)."""
    rows = [r for r in _rows(raw) if r.op == "merge_options" and r.impl == "zerokv" and r.us]
    plain = {(r.T, r.params.get("layout")): r for r in rows if r.params.get("option") == "none"}
    out = {}
    for r in rows:
        p = r.params
        base = plain.get((r.T, p.get("layout")))
        if p.get("option") == "none" or base is None:
            continue
        key = (
            r.T,
            p.get("layout"),
            p.get("option"),
            p.get("empty"),
            p.get("requests"),
            p.get("offsets"),
            p.get("scale_format"),
        )
        out[key] = (r.us / base.us, _spread(r) + _spread(base))
    return out


def compare(
    new: dict[tuple, tuple[float, float]], last: dict[tuple, tuple[float, float]], floor: float
) -> dict[str, Any]:
    """Ratios of the keys both runs have: the worst of each, and the keys whose ratio grew by
    more than the noise (both runs' replay spreads, at least ``floor``)."""
    common = sorted(set(new) & set(last), key=str)
    if not common:
        return {"common": 0, "worst_new": None, "worst_last": None, "beyond_noise": []}
    beyond = []
    for k in common:
        (rn, sn), (rl, sl) = new[k], last[k]
        noise = max(floor, sn + sl)
        if rn - rl > noise:
            beyond.append({"key": list(k), "last": rl, "new": rn, "diff": rn - rl, "noise": noise})
    worst_new = max(common, key=lambda k: new[k][0])
    worst_last = max(common, key=lambda k: last[k][0])
    return {
        "common": len(common),
        "only_new": len(set(new) - set(last)),
        "worst_new": {"key": list(worst_new), "ratio": new[worst_new][0]},
        "worst_last": {"key": list(worst_last), "ratio": last[worst_last][0]},
        "worst_diff": new[worst_new][0] - last[worst_last][0],
        "max_diff": max(new[k][0] - last[k][0] for k in common),
        "min_diff": min(new[k][0] - last[k][0] for k in common),
        "noise_floor": floor,
        "beyond_noise": sorted(beyond, key=lambda b: -b["diff"]),
    }


def last_run_with(history: Path, op: str) -> tuple[Path | None, list[dict]]:
    """The newest bench JSON in ``history`` holding rows of ``op`` (file names carry the date)."""
    for path in sorted(history.glob("zerokv-bench-*.json"), reverse=True):
        try:
            rows = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError):
            continue
        if any(r.get("op") == op for r in rows):
            return path, rows
    return None, []


def compare_with_history(rows: list[dict], history: Path, floor: float) -> dict[str, Any]:
    out = {}
    for what, op, ratios in (
        ("grid", "merge_state", grid_ratios),
        ("options", "merge_options", option_ratios),
    ):
        path, last = last_run_with(history, op)
        got = compare(ratios(rows), ratios(last), floor) if path else {"common": 0}
        got["last_run"] = (
            path.relative_to(ROOT).as_posix()
            if path and path.is_relative_to(ROOT)
            else (str(path) if path else None)
        )
        out[what] = got
    return out
