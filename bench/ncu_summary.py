"""Summarise bench/ncu_profile.py's stall reports by kernel function: where a B = 1 and a B = 4 launch spend
their warp samples, and what the extra slots add.

    python3 bench/ncu_summary.py --source kernel_source.cu stalls_b1.json [stalls_b4.json] [--top 25]

PC sampling takes one sample per SM sub-partition at a fixed interval, so a function's sample count is
proportional to the warp-time spent in it; two reports of launches with the same step count compare
directly (the second table: samples added per function, and the stall reasons of the additions). Lines
are mapped to the enclosing function of the assembled kernel source (replicas.monokernel_build
.kernel_source(), which the profile script writes next to the reports); inlined code counts where it
is written, so `dot8` is the matvec's arithmetic wherever it is called from.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

# a device function's first line (methods indented, the kernel after its __launch_bounds__(...))
_DEF = re.compile(r"^\s*(?:template\s*<[^>]*>\s*)?(?:MK_DEVICE|__device__|extern \"C\" __global__|__global__)"
                  r"(?:[^(]*__launch_bounds__\([^)]*\))?[^(]*?\b(\w+)\s*\(")
_REASON = "smsp__pcsamp_warps_issue_stalled_"


def functions(source: str) -> tuple[list[int], list[str]]:
    """Sorted first lines (1-based) of the source's device functions and their names."""
    starts, names = [], []
    for i, line in enumerate(source.splitlines(), 1):
        m = _DEF.match(line)
        if m:
            starts.append(i)
            names.append(m.group(1))
    return starts, names


def by_function(report: dict, starts: list[int], names: list[str]) -> dict[str, Counter]:
    """{function: Counter(samples=..., <stall reason>=...)} over one report's per-PC counts."""
    out: dict[str, Counter] = defaultdict(Counter)
    for info in report["per_pc"].values():
        line = info.get("line")
        k = bisect.bisect_right(starts, line) - 1 if isinstance(line, int) else -1
        fn = names[k] if k >= 0 else "(no line)"
        c = out[fn]
        c["samples"] += info.get("smsp__pcsamp_sample_count", 0)
        c["inst"] += info.get("inst_executed", 0)
        for m, v in info.items():
            if m.startswith(_REASON) and not m.endswith("_not_issued") and isinstance(v, int):
                c[m[len(_REASON):]] += v
    return out


def top_reasons(c: Counter, n: int = 3) -> str:
    rs = [(k, v) for k, v in c.items() if k not in ("samples", "inst")]
    rs.sort(key=lambda kv: -kv[1])
    tot = max(1, sum(v for _, v in rs))
    return ", ".join(f"{k} {100 * v / tot:.0f}%" for k, v in rs[:n])


def table(fns: dict[str, Counter], top: int) -> list[str]:
    total = max(1, sum(c["samples"] for c in fns.values()))
    rows = ["| function | samples | share | instructions | top stalls |", "|---|---|---|---|---|"]
    for fn, c in sorted(fns.items(), key=lambda kv: -kv[1]["samples"])[:top]:
        rows.append(f"| {fn} | {c['samples']:,} | {100 * c['samples'] / total:.1f}% | {c['inst']:,} | "
                    f"{top_reasons(c)} |")
    return rows


def compare(a: dict[str, Counter], b: dict[str, Counter], top: int, ratio: float | None = None) -> list[str]:
    """B's samples in A's units, minus A's. `ratio`: B's launch time over A's. Without it the sampling interval is
    taken as equal (samples proportional to time); with it, B's samples are rescaled to A's rate, which is needed
    when ncu capped both reports at the same sample count (session 10: 3,262,184 each for 49.7 and 103.9 ms)."""
    ta, tb = sum(c["samples"] for c in a.values()), sum(c["samples"] for c in b.values())
    scale = 1.0 if ratio is None else ratio * ta / max(1, tb)
    rows = [f"samples: {ta:,} -> {tb:,}" + (f", B scaled by {scale:.3f} (launch-time ratio {ratio})" if ratio else ""), ""]
    if ratio is None and ta == tb:
        rows += ["(equal sample counts: ncu capped the buffer; pass --ratio B_time/A_time to compare)", ""]
    rows += ["| function | samples A | samples B (A units) | added | share of the addition | top stalls of the addition |",
             "|---|---|---|---|---|---|"]
    b_in_a = {fn: round(c["samples"] * scale) for fn, c in b.items()}
    added = {fn: b_in_a.get(fn, 0) - a.get(fn, Counter())["samples"] for fn in set(a) | set(b)}
    grow = max(1, sum(d for d in added.values() if d > 0))
    for fn, d in sorted(added.items(), key=lambda kv: -kv[1])[:top]:
        diff = Counter({k: v * scale for k, v in b.get(fn, Counter()).items()})
        diff.subtract(a.get(fn, Counter()))
        diff = Counter({k: v for k, v in diff.items() if v > 0})
        rows.append(f"| {fn} | {a.get(fn, Counter())['samples']:,} | {b_in_a.get(fn, 0):,} | {d:+,} | "
                    f"{100 * d / grow:.1f}% | {top_reasons(diff)} |")
    return rows


def launch_seconds(details_csv: Path) -> float:
    """The first kernel launch's Duration from `ncu --import R --page details --csv` (SpeedOfLight section)."""
    import csv
    units = {"ns": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3, "s": 1.0, "second": 1.0}
    for row in csv.reader(details_csv.read_text().splitlines()):
        if "Duration" in row:
            i = row.index("Duration")
            return float(row[i + 2].replace(",", "")) * units[row[i + 1]]
    raise ValueError(f"{details_csv}: no Duration metric (was the SpeedOfLight section collected?)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("reports", nargs="+", type=Path, help="one or two stalls JSON files (ncu_profile.py --report)")
    ap.add_argument("--source", type=Path, required=True, help="the assembled kernel source the lines refer to")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--ratio", type=float, default=None,
                    help="the second launch's duration over the first's (ncu's gpu__time_duration), to compare "
                         "reports whose sample counts ncu capped alike")
    ap.add_argument("--details", nargs=2, type=Path, default=None, metavar=("A_CSV", "B_CSV"),
                    help="the two reports' `ncu --page details --csv` exports: --ratio from their Durations")
    args = ap.parse_args()
    if args.details:
        args.ratio = launch_seconds(args.details[1]) / launch_seconds(args.details[0])
    if len(args.reports) > 2:
        ap.error("one report (a table) or two (a table each and their difference)")
    starts, names = functions(args.source.read_text())
    fns = []
    for path in args.reports:
        (report,) = json.loads(path.read_text())[:1]
        fns.append(by_function(report, starts, names))
        print(f"## {path.name}\n")
        print("\n".join(table(fns[-1], args.top)), "\n")
    if len(fns) == 2:
        print(f"## {args.reports[1].name} minus {args.reports[0].name}\n")
        print("\n".join(compare(fns[0], fns[1], args.top, args.ratio)))


if __name__ == "__main__":
    main()
