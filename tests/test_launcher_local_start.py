"""A local Ray start that misses Ray's fixed 30 s node-registration deadline is retried, and what
the failed attempt spawned is stopped first (CI's 2-core machine hit this on a cold virtualenv)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from cluster import launcher

TIMED_OUT = Exception("The current node timed out during startup. This could happen because ...")


def fake_init(monkeypatch, outcomes):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(launcher.ray, "init", init)
    return calls


def test_a_timed_out_start_is_retried_with_the_same_arguments(monkeypatch):
    calls = fake_init(monkeypatch, [TIMED_OUT, None])
    launcher.init_local_ray(num_cpus=2, namespace="x")
    assert calls == [{"num_cpus": 2, "namespace": "x"}] * 2


def test_a_gcs_that_misses_its_port_file_deadline_is_retried(monkeypatch):
    # seen on CI: the GCS of a 2-core machine took longer than Ray's 30 s to write its port file
    gcs_late = RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc")
    calls = fake_init(monkeypatch, [gcs_late, None])
    launcher.init_local_ray(num_cpus=2)
    assert len(calls) == 2


def test_the_gcs_port_wait_is_lengthened_unless_the_operator_set_it(monkeypatch):
    fake_init(monkeypatch, [None, None])
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    launcher.init_local_ray(num_cpus=2)
    assert launcher.os.environ["RAY_gcs_server_port_wait_time_s"] == launcher.GCS_PORT_WAIT_S
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "7")
    launcher.init_local_ray(num_cpus=2)
    assert launcher.os.environ["RAY_gcs_server_port_wait_time_s"] == "7"


def test_the_serve_proxy_gets_longer_to_start_unless_the_operator_set_it(monkeypatch):
    fake_init(monkeypatch, [None, None])
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", raising=False)
    launcher.init_local_ray(num_cpus=2)
    assert launcher.os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == launcher.SERVE_PROXY_READY_S == "30"
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "4")
    launcher.init_local_ray(num_cpus=2)
    assert launcher.os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "4"


def test_a_start_that_keeps_timing_out_says_what_to_check(monkeypatch):
    calls = fake_init(monkeypatch, [TIMED_OUT] * 3)
    with pytest.raises(launcher.ClusterError, match=r"did not start in 3 attempts.*raylet\.out.*--address"):
        launcher.init_local_ray(num_cpus=2)
    assert len(calls) == 3


def test_other_start_errors_are_not_retried(monkeypatch):
    calls = fake_init(monkeypatch, [ValueError("num_gpus must be >= 0"), None])
    with pytest.raises(ValueError, match="num_gpus"):
        launcher.init_local_ray(num_gpus=-1)
    assert len(calls) == 1


def test_stray_ray_children_are_stopped_and_other_children_kept():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    stray = subprocess.Popen([*sleeper, "raylet-stand-in"])
    bystander = subprocess.Popen([*sleeper, "unrelated"])
    try:
        time.sleep(0.2)  # let both exec so their command lines are readable
        launcher._stop_spawned_ray_processes()
        assert stray.wait(timeout=10) == -9
        assert bystander.poll() is None
    finally:
        for p in (stray, bystander):
            p.kill()
            p.wait()
