"""The replica server with the reference engine on a real checkpoint, and as a separate process."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from monoserve.v1 import common_pb2, replica_pb2, replica_pb2_grpc

from replicas.engine import SamplingParams
from replicas.server import ReplicaServer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 17, 42, 99, 7]


def collect(stream):
    tokens, final = [], None
    for msg in stream:
        if msg.HasField("chunk"):
            tokens.extend(msg.chunk.token_ids)
        else:
            final = msg.final
    return tokens, final


@pytest.fixture(scope="module")
def reference_replica(tiny_checkpoint):
    from replicas.reference import ReferenceEngine

    engine = ReferenceEngine.from_pretrained(tiny_checkpoint, max_batch=2)
    server = ReplicaServer(engine, model_path=str(tiny_checkpoint))
    server.start()
    channel = grpc.insecure_channel(server.address)
    yield engine, replica_pb2_grpc.ReplicaStub(channel)
    channel.close()
    server.stop(grace=0.5)


@pytest.mark.parametrize("sampling", [dict(max_tokens=24, ignore_eos=True),
                                      dict(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=7)],
                         ids=["greedy", "seeded"])
def test_reference_engine_stream_equals_engine_output(reference_replica, sampling):
    engine, stub = reference_replica
    expected_gen = engine.generate(PROMPT, SamplingParams(**sampling))
    expected = list(expected_gen)
    expected_gen.close()
    req = replica_pb2.ReplicaGenerateRequest(prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(**sampling))
    tokens, final = collect(stub.Generate(req))
    assert tokens == expected
    assert final.usage.completion_tokens == len(expected)
    assert common_pb2.FinishReason.Name(final.finish_reason) == f"FINISH_REASON_{expected_gen.finish_reason.name}"


def test_reference_engine_two_concurrent_requests_each_equal_solo(reference_replica):
    _, stub = reference_replica
    prompts = [PROMPT, [1, 5, 5, 5]]
    sampling = common_pb2.SamplingParams(max_tokens=16, ignore_eos=True)
    solo = [collect(stub.Generate(replica_pb2.ReplicaGenerateRequest(prompt_token_ids=p, sampling=sampling)))[0]
            for p in prompts]
    results = [None, None]

    def run(i):
        req = replica_pb2.ReplicaGenerateRequest(prompt_token_ids=prompts[i], sampling=sampling)
        results[i] = collect(stub.Generate(req))[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == solo


def test_replica_cli_process_serves_and_drains_on_sigterm(tiny_checkpoint):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "replicas.cli_replica", "--model", str(tiny_checkpoint), "--engine", "paced",
         "--port", "0", "--tokens-per-s", "500", "--replica-id", "cli-1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.startswith("replica cli-1 ready on "), line + proc.stderr.read()
        address = line.split()[4]
        with grpc.insecure_channel(address) as channel:
            stub = replica_pb2_grpc.ReplicaStub(channel)
            info = stub.GetInfo(replica_pb2.GetInfoRequest())
            assert info.engine_kind == "paced" and info.model_name == tiny_checkpoint.name
            call = stub.Generate(replica_pb2.ReplicaGenerateRequest(
                prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=50)))
            first = next(call)  # (a chunk: one token, or more when the server coalesced them under load)
            proc.send_signal(signal.SIGTERM)  # drains: the running request still completes
            tokens, final = collect(call)
            assert len(first.chunk.token_ids) + len(tokens) == 50 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("args,message", [
    (["--engine", "reference"], "--model DIR is required"),
    pytest.param(["--engine", "monokernel", "--model", "."], "needs CuPy and an NVIDIA GPU",
                 marks=pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy present")),
    (["--engine", "reference", "--model", "/nonexistent/ckpt"], "not a directory"),
])
def test_replica_cli_bad_setup_exits_2_with_a_message(args, message, capsys):
    from replicas.cli_replica import main

    assert main(args + ["--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_monoserve_cli_has_the_replica_subcommand(capsys):
    from cluster.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["replica", "--model", "ckpt", "--port", "0", "--engine", "paced", "--devices", "0,1"])
    assert (args.engine, args.port, args.devices, args.func.__module__) == ("paced", 0, [0, 1], "replicas.cli_replica")
    with pytest.raises(SystemExit):
        parser.parse_args(["replica", "--devices", "zero"])
    assert "--devices must be comma-separated GPU ordinals" in capsys.readouterr().err


# ---- --engine monokernel --max-batch: which engine, and what is refused (no GPU needed) -----------
# (fixtures `fake_cupy` and `monokernel_builds`: tests/conftest.py)
def _replica_args(*argv):
    import argparse

    from replicas.cli_replica import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--engine", "monokernel", "--model", "ckpt", *argv])


def test_max_batch_above_one_builds_the_batched_monokernel_on_one_gpu(monokernel_builds):
    from replicas.cli_replica import make_engine

    assert make_engine(_replica_args("--max-batch", "4", "--devices", "1")).max_batch == 4
    assert make_engine(_replica_args("--max-batch", "8", "--max-sessions", "0")).max_batch == 8
    assert make_engine(_replica_args("--max-batch", "2", "--max-sessions", "8", "--session-cache-mb", "512",
                                     "--resident")).max_batch == 2
    assert monokernel_builds == [  # the session settings size the batched engine's session cache
        ("BatchedMonokernelEngine", {"batch": 4, "devices": [1], "resident": False, "session_cache_bytes": 2**30,
                                     "max_sessions": 64}),
        ("BatchedMonokernelEngine", {"batch": 8, "devices": [0], "resident": False, "session_cache_bytes": 2**30,
                                     "max_sessions": 0}),
        ("BatchedMonokernelEngine", {"batch": 2, "devices": [0], "resident": True, "session_cache_bytes": 2**29,
                                     "max_sessions": 8})]


def test_max_batch_one_keeps_the_single_sequence_monokernel_with_sessions(monokernel_builds):
    from replicas.cli_replica import make_engine

    make_engine(_replica_args())
    make_engine(_replica_args("--max-batch", "1", "--devices", "0,1", "--max-sessions", "3",
                              "--session-cache-mb", "0.5"))
    assert monokernel_builds == [
        ("MonokernelEngine", {"devices": [0], "session_cache_bytes": 2**30, "max_sessions": 64}),
        ("MonokernelEngine", {"devices": [0, 1], "session_cache_bytes": 2**19, "max_sessions": 3})]


@pytest.mark.parametrize("argv, message", [
    (["--max-batch", "9"], "--max-batch 9: the monokernel decodes at most 8 sequences together on one GPU "
                           "(the kernel's limit, replicas.layout.MAX_BATCH); use --max-batch 2..8"),
    (["--max-batch", "2", "--devices", "0,1"],
     "--max-batch 2 with --devices 0,1: tensor parallelism and batching are not supported together (the "
     "tensor-parallel monokernel decodes one sequence at a time); give one GPU (e.g. --devices 0) and run one "
     "replica per GPU behind the router, or keep --max-batch 1 for one engine over several GPUs"),
])
def test_max_batch_refusals_exit_2_before_any_gpu_work(argv, message, monkeypatch, capsys):
    from replicas.cli_replica import main

    # no CuPy at all: a refusal must come before the CuPy check (and so before the GPU and the weights)
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert main(["--engine", "monokernel", "--model", "ckpt", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("monoserve replica: error: ") and message in err


def test_max_batch_is_not_limited_for_the_reference_engine(tiny_checkpoint):
    from replicas.cli_replica import make_engine

    args = _replica_args("--max-batch", "12", "--max-sessions", "5")
    args.engine, args.model = "reference", str(tiny_checkpoint)
    engine = make_engine(args)
    assert (engine.kind, engine.max_batch, engine.session_stats().max_sessions) == ("reference", 12, 5)


def test_batched_monokernel_without_cupy_says_how_to_fix(tiny_checkpoint, monkeypatch, capsys):
    from replicas.cli_replica import main

    monkeypatch.setitem(sys.modules, "cupy", None)  # as on a CPU machine without CuPy
    assert main(["--engine", "monokernel", "--max-batch", "4", "--model", str(tiny_checkpoint), "--port", "0"]) == 2
    assert ("--engine monokernel needs CuPy and an NVIDIA GPU: install `monoserve[gpu]` (cupy-cuda13x) on a GPU "
            "machine, or use --engine reference") in capsys.readouterr().err


@pytest.mark.parametrize("device_count, message", [
    (0, "no CUDA device found; use --engine reference"),
    (RuntimeError("cudaErrorNoDevice"), "no usable CUDA device: cudaErrorNoDevice; use --engine reference"),
])
def test_batched_monokernel_with_cupy_but_no_gpu_is_a_clear_error(tiny_checkpoint, monkeypatch, capsys, fake_cupy,
                                                                  device_count, message):
    """The real BatchedMonokernelEngine.from_pretrained path: MonokernelUnavailable, shown like the
    CLI's other errors (exit 2, no traceback), before any weights are read."""
    import replicas.weights
    from replicas.cli_replica import main

    fake_cupy(device_count)
    monkeypatch.setattr(replicas.weights, "load_weights", lambda *a, **k: pytest.fail("weights loaded"))
    assert main(["--engine", "monokernel", "--max-batch", "4", "--model", str(tiny_checkpoint), "--port", "0"]) == 2
    assert f"monoserve replica: error: {message}" in capsys.readouterr().err
