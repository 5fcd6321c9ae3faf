"""`monoserve router` and `monoserve generate --router` as a user runs them (real processes)."""

import os
import re
import subprocess
import sys

import pytest

ENV = {**os.environ, "PYTHONPATH": ".:proto"}


def start(args):
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=ENV)
    line = proc.stdout.readline()
    match = re.search(r"ready on (\S+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"{args[0]} did not start: {line!r}")
    return proc, match.group(1)


@pytest.fixture
def router_address(tiny_checkpoint):
    procs = []
    try:
        replica, replica_addr = start(["replica", "--engine", "paced", "--model", str(tiny_checkpoint),
                                       "--port", "0", "--tokens-per-s", "500"])
        procs.append(replica)
        router, addr = start(["router", "--replica", replica_addr, "--port", "0", "--model", str(tiny_checkpoint)])
        procs.append(router)
        yield addr
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_generate_through_the_router_streams_text_and_reports_speed(router_address):
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--router", router_address,
                          "hello world", "--max-tokens", "12", "--tokens"],
                         capture_output=True, text=True, env=ENV, timeout=30)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) == 12
    assert re.search(r"12 generated .* TTFT [\d.]+ ms, [\d.]+ tokens/s decode", out.stderr), out.stderr


def test_generate_errors_are_clear(router_address):
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--router", router_address,
                          "hi", "--max-tokens", "0"], capture_output=True, text=True, env=ENV, timeout=30)
    assert out.returncode == 2 and "INVALID_ARGUMENT" in out.stderr and "max_tokens" in out.stderr


def test_router_refuses_a_bad_replica_address():
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "router", "--replica", "nonsense", "--port", "0"],
                         capture_output=True, text=True, env=ENV, timeout=30)
    assert out.returncode == 2 and "not host:port" in out.stderr
