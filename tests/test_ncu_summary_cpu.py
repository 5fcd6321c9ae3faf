"""bench/ncu_summary.py on a hand-made report: lines map to the enclosing device function (indented methods and
the __launch_bounds__ kernel included), samples and stall reasons add up per function, and the comparison
reports what the second launch adds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import ncu_summary as ns

SOURCE = """#define X 1
MK_DEVICE float dot8(uint4 w, const float* x) {
  return 0.f;
}
struct WeightStream {
  MK_DEVICE void issue(const MkParams& p) {
    left--;
  }
};
template <int MAT, class Epi>
MK_DEVICE void run_phase(WeightStream& st) {
  st.issue(p);
}
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1) monokernel(const MkParams p) {
  grid();
}
"""


def report(counts: dict[int, tuple[int, int]]) -> list[dict]:
    """{line: (samples, of which long_scoreboard)} -> a stalls report as ncu_profile.py --report writes it."""
    per_pc = {}
    for i, (line, (n, ls)) in enumerate(counts.items()):
        per_pc[str(1000 + i)] = {"line": line, "inst_executed": 10 * n, "smsp__pcsamp_sample_count": n,
                                 "smsp__pcsamp_warps_issue_stalled_long_scoreboard": ls,
                                 "smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued": ls,
                                 "smsp__pcsamp_warps_issue_stalled_barrier": n - ls}
    per_pc["1"] = {"smsp__pcsamp_sample_count": 2}  # no source line
    return [{"kernel": "monokernel", "metrics": {}, "per_pc": per_pc}]


def test_lines_map_to_their_enclosing_functions():
    starts, names = ns.functions(SOURCE)
    assert names == ["dot8", "issue", "run_phase", "monokernel"]
    fns = ns.by_function(report({3: (5, 5), 7: (7, 1), 12: (11, 0), 15: (13, 13)})[0], starts, names)
    assert {f: c["samples"] for f, c in fns.items()} == {"dot8": 5, "issue": 7, "run_phase": 11, "monokernel": 13,
                                                          "(no line)": 2}
    assert fns["issue"]["long_scoreboard"] == 1 and fns["issue"]["barrier"] == 6  # _not_issued not counted twice
    assert fns["issue"]["inst"] == 70


def test_the_comparison_ranks_what_the_second_launch_adds(tmp_path: Path):
    src = tmp_path / "k.cu"
    src.write_text(SOURCE)
    a, b = tmp_path / "stalls_b1.json", tmp_path / "stalls_b4.json"
    a.write_text(json.dumps(report({3: (5, 5), 7: (7, 1), 12: (11, 0)})))
    b.write_text(json.dumps(report({3: (50, 45), 7: (9, 1), 12: (11, 0)})))
    out = subprocess.run([sys.executable, "bench/ncu_summary.py", "--source", str(src), str(a), str(b)],
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent, check=True).stdout
    tail = out.split("minus")[1]
    rows = [r for r in tail.splitlines() if r.startswith("| ") and "samples A" not in r]
    assert rows[0].startswith("| dot8 | 5 | 50 | +45 |") and "long_scoreboard 89%" in rows[0]
    assert rows[1].startswith("| issue | 7 | 9 | +2 |")
    assert "samples: 25 -> 72" in tail and "| +45 | 95.7% |" in rows[0]  # 45 of the 47 added


def test_capped_reports_compare_through_the_launch_time_ratio(tmp_path: Path):
    """ncu capped both launches at the same sample count (session 10): the raw difference says nothing, so the
    summary asks for --ratio; with it, B's samples count at A's rate (B lasted twice as long: each counts twice)."""
    src = tmp_path / "k.cu"
    src.write_text(SOURCE)
    a, b = tmp_path / "stalls_b1.json", tmp_path / "stalls_b4.json"
    a.write_text(json.dumps(report({3: (10, 5), 7: (10, 1)})))
    b.write_text(json.dumps(report({3: (15, 12), 7: (5, 1)})))
    run = lambda *extra: subprocess.run([sys.executable, "bench/ncu_summary.py", "--source", str(src), str(a), str(b),
                                         *extra], capture_output=True, text=True,
                                        cwd=Path(__file__).parent.parent, check=True).stdout.split("minus")[1]
    assert "ncu capped the buffer; pass --ratio" in run()
    tail = run("--ratio", "2")
    rows = [r for r in tail.splitlines() if r.startswith("| ") and "samples A" not in r]
    assert rows[0].startswith("| dot8 | 10 | 30 | +20 | 90.9% |")  # 15 of B = 30 of A; (+2 more without a line)
    assert rows[1].startswith("| (no line) | 2 | 4 | +2 |") and rows[2].startswith("| issue | 10 | 10 | +0 |")
