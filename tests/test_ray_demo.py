"""`monoserve demo` end to end: local Ray, router, two reference replicas, streamed text requests."""

import re

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(180)


def test_demo_streams_text_from_both_replicas_and_shuts_down(tmp_path, monkeypatch, capsys):
    import ray

    from cluster.cli import main

    monkeypatch.setenv("MONOSERVE_CACHE", str(tmp_path))
    assert main(["demo", "--requests", "4", "--max-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "tiny" / "config.json").is_file()  # the model was made into the cache
    rows = re.findall(r"^\s+(\d)\s+(replica-\w+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+length$", out, re.MULTILINE)
    assert len(rows) == 4, out
    assert {r[1] for r in rows} and len({r[1] for r in rows}) == 2  # both replicas served
    assert all(int(r[3]) == 64 and float(r[2]) > 0 and float(r[4]) > 0 for r in rows)
    assert all(f"[{i}] '" in out for i in range(4))  # streamed text was printed for each request
    assert out.rstrip().endswith("done")
    assert not ray.is_initialized()
