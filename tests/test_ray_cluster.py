"""End-to-end on a real local Ray cluster with logical GPUs: replica actors, router, supervisor.

One Ray cluster for the module; each test brings monoserve up with its own config and takes it
down again. Requests go through the real router over loopback gRPC.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

ray = pytest.importorskip("ray")

from monoserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

from cluster import launcher
from cluster.config import ClusterConfig

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def ray_cluster():
    launcher.init_local_ray(num_cpus=8, num_gpus=24, include_dashboard=False, namespace="monoserve",
                            runtime_env=launcher.worker_runtime_env(), log_to_driver=False, configure_logging=False)
    yield
    launcher.down()
    ray.shutdown()


def make_config(model, engine="reference", replicas=(2, 2), **autoscaling) -> ClusterConfig:
    return ClusterConfig.parse({
        "model": str(model), "engine": engine,
        "replicas": {"min": replicas[0], "max": replicas[1], "cpus_per_replica": 0.1, "paced_tokens_per_s": 100},
        "router": {"host": "127.0.0.1", "port": 0, "cpus": 0.1},
        "autoscaling": {"interval_s": 0.2, "health_timeout_s": 5, "enabled": replicas[0] != replicas[1],
                        **autoscaling},
    })


@pytest.fixture
def bring_up(ray_cluster):
    started = []

    def up(config):
        launcher.up(config, timeout_s=60)
        started.append(config)
        s = launcher.status()
        return s, inference_pb2_grpc.InferenceStub(grpc.insecure_channel(s["router"]["grpc"]))

    yield up
    if started:
        launcher.down()


def generate(stub, prompt, max_tokens, on_chunk=None):
    req = inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens = []
    for msg in stub.Generate(req, timeout=60):
        if msg.HasField("chunk"):
            tokens += msg.chunk.token_ids
            if on_chunk:
                on_chunk(len(tokens))
        else:
            return tokens, msg.final


def run_concurrently(fn, n):
    results, errors = [None] * n, []

    def worker(i):
        try:
            results[i] = fn(i)
        except Exception as e:  # noqa: BLE001 -- surfaced by the callers' `assert not errors`
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results, errors


def wait_for(predicate, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; status: {launcher.status()}")


def ready_replicas(s):
    return [r for r in s["replicas"] if r["phase"] == "ready" and r["router_state"] == "ready"]


def test_two_replicas_own_disjoint_gpus_and_both_serve(bring_up, tiny_checkpoint):
    status, stub = bring_up(make_config(tiny_checkpoint))
    replicas = ready_replicas(status)
    assert len(replicas) == 2 and all(r["engine"] == "reference" for r in replicas)
    gpu_sets = [set(r["gpu_ids"]) for r in replicas]
    assert all(len(g) == 8 for g in gpu_sets) and not gpu_sets[0] & gpu_sets[1]

    # the reference engine has one slot: concurrent requests must spread over both replicas
    # long enough (~0.5 s each) that all four overlap even on a loaded 2-core CI machine
    threads, results, errors = run_concurrently(lambda i: generate(stub, [10 + i, 11, 12], 1000), 4)
    for t in threads:
        t.join()
    assert not errors
    assert all(len(tokens) == 1000 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH
               for tokens, final in results)
    served_by = {final.replica_id for _, final in results}
    assert served_by == {r["name"].removeprefix("monoserve-") for r in replicas}


def test_killed_replica_is_replaced_and_in_flight_requests_fail_over(bring_up, tiny_checkpoint):
    _, stub = bring_up(make_config(tiny_checkpoint, engine="paced"))
    prompt, n = [7, 8, 9], 150  # 1.5 s per request at 100 tokens/s
    expected, _ = generate(stub, prompt, 5)  # paced tokens depend only on the context

    started = threading.Barrier(3)

    def request(i):
        def on_chunk(count):
            if count == 20:
                started.wait(timeout=10)
        return generate(stub, prompt, n, on_chunk)

    threads, results, errors = run_concurrently(request, 2)
    started.wait(timeout=20)  # both replicas are mid-stream
    victim = ready_replicas(launcher.status())[0]["name"]
    ray.kill(ray.get_actor(victim, namespace="monoserve"))
    for t in threads:
        t.join()
    assert not errors, errors
    for tokens, final in results:  # nothing lost, nothing repeated across the failover
        assert len(tokens) == n and tokens[:5] == expected
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    # each replica was serving one of the two: the victim's request finished elsewhere
    assert victim.removeprefix("monoserve-") not in {final.replica_id for _, final in results}

    replaced = wait_for(lambda: [r for r in ready_replicas(launcher.status()) if r["name"] != victim]
                        if len(ready_replicas(launcher.status())) == 2 and
                        victim not in {r["name"] for r in launcher.status()["replicas"]} else None,
                        timeout=30, what="the killed replica to be replaced")
    assert len(replaced) == 2
    # new requests keep succeeding, on the replacement too
    threads, results, errors = run_concurrently(lambda i: generate(stub, prompt, 10), 2)
    for t in threads:
        t.join()
    assert not errors and all(len(tokens) == 10 for tokens, _ in results)
    assert any("removed (died)" in e for e in launcher.status()["events"])


def test_scales_up_under_queued_load_and_down_when_idle_without_cutting_requests(bring_up, tiny_checkpoint):
    config = make_config(tiny_checkpoint, engine="paced", replicas=(1, 2), scale_up_after_s=0.3,
                         scale_down_idle_s=1.0)
    status, stub = bring_up(config)
    assert len(status["replicas"]) == 1
    counts = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            counts.add(len(ready_replicas(launcher.status())))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # 8 requests of 0.8 s on one single-slot replica: the queue stays busy -> a second replica
        threads, results, errors = run_concurrently(lambda i: generate(stub, [3, 4, i], 80), 8)
        wait_for(lambda: len(ready_replicas(launcher.status())) == 2, timeout=30, what="scale-up to 2")
        # 4 more once it is ready: with the first replica busy (or both idle, where starting the second took
        # longer than the queue on a loaded machine) some of them must go to the new one
        more, more_results, more_errors = run_concurrently(lambda i: generate(stub, [3, 5, i], 80), 4)
        for t in threads + more:
            t.join()
        assert not errors and not more_errors, errors + more_errors
        assert all(len(tokens) == 80 for tokens, _ in results + more_results)
        assert len({final.replica_id for _, final in results + more_results}) == 2  # the new replica serves

        # keep a trickle of requests flowing while the idle replica is drained and removed
        trickle_results = []

        def trickle():
            while not stop.is_set():
                trickle_results.append(generate(stub, [5, 6], 10))

        t = threading.Thread(target=trickle)
        t.start()
        wait_for(lambda: len(launcher.status()["replicas"]) == 1, timeout=30, what="scale-down to 1")
        time.sleep(0.5)
        stop.set()
        t.join()
        assert trickle_results and all(len(tokens) == 10 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH
                                       for tokens, final in trickle_results)
        assert any("removed (drained)" in e for e in launcher.status()["events"])
    finally:
        stop.set()
        watcher.join()
    assert {1, 2} <= counts


def test_crashed_router_is_restarted_and_replicas_re_registered(bring_up, tiny_checkpoint):
    config = make_config(tiny_checkpoint, engine="paced", replicas=(1, 1)).with_overrides(
        **{"replicas.metrics_port": 0})
    status, _ = bring_up(config)
    import httpx

    (replica,) = status["replicas"]  # each replica serves Prometheus metrics when asked to
    assert "monoserve" in httpx.get(replica["metrics"], timeout=10).text
    router = ray.get_actor("monoserve-router", namespace="monoserve")
    ray.kill(router, no_restart=False)  # a crash: Ray restarts the actor
    wait_for(lambda: any("router restarted" in e for e in launcher.status()["events"]) and
             len(ready_replicas(launcher.status())) == 1, timeout=60, what="router restart + re-registration")
    s = launcher.status()
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(s["router"]["grpc"]))
    tokens, final = generate(stub, [1, 2, 3], 5)
    assert len(tokens) == 5 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_crashed_supervisor_is_restarted_and_adopts_the_running_replicas(bring_up, tiny_checkpoint):
    status, stub = bring_up(make_config(tiny_checkpoint, engine="paced"))
    names = {r["name"] for r in status["replicas"]}
    ray.kill(ray.get_actor("monoserve-supervisor", namespace="monoserve"), no_restart=False)
    tokens, _ = generate(stub, [1, 2], 5)  # the router keeps serving meanwhile
    assert len(tokens) == 5

    def adopted_both():
        s = launcher.status()
        return s if {r["name"] for r in ready_replicas(s)} == names else None

    s = wait_for(adopted_both, timeout=60, what="the restarted supervisor to adopt both replicas")
    assert sum("adopted" in e for e in s["events"]) == 2
    victim = min(names)  # supervision works again: a killed replica is replaced
    ray.kill(ray.get_actor(victim, namespace="monoserve"))
    wait_for(lambda: len(ready_replicas(launcher.status())) == 2 and
             victim not in {r["name"] for r in launcher.status()["replicas"]}, timeout=60, what="replacement")


def test_up_fails_fast_with_the_replica_error_and_cleans_up(ray_cluster, tmp_path, tiny_checkpoint):
    # the router (tokenizer.json) or a replica (config.json) is the first to notice
    with pytest.raises(launcher.ClusterError, match=r"failed to start: .*no-such-checkpoint/\w+\.json"):
        launcher.up(make_config(tmp_path / "no-such-checkpoint", replicas=(1, 1)), timeout_s=60)
    with pytest.raises(launcher.ClusterError, match="not up"):
        launcher.status()
    # tokenizer present (router starts), config.json missing: the replica's own error is shown
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_checkpoint / name).read_bytes())
    with pytest.raises(launcher.ClusterError, match=r"replica failed to start: monoserve-replica-\w+: .*broken: no config\.json"):
        launcher.up(make_config(broken, replicas=(1, 1)), timeout_s=60)
    with pytest.raises(launcher.ClusterError, match="not up"):
        launcher.status()


def test_cli_up_status_down(ray_cluster, tiny_checkpoint, capsys):
    from cluster.cli import main

    gcs = ray.get_runtime_context().gcs_address
    assert main(["up", "--address", gcs, "--model", str(tiny_checkpoint), "--engine", "paced",
                 "--replicas", "1", "--port", "0", "--http-port", "0"]) == 0
    out = capsys.readouterr().out
    assert "monoserve is up" in out and "paced" in out
    http = launcher.status()["router"]["http"]  # the router's OpenAI-compatible front
    import httpx

    models = httpx.get(f"{http}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [tiny_checkpoint.name]
    assert main(["status", "--address", gcs, "--events"]) == 0
    out = capsys.readouterr().out
    assert "replicas  target 1 (min 1, max 1)" in out and "registered with the router" in out
    assert main(["up", "--address", gcs, "--model", str(tiny_checkpoint)]) == 1  # already up
    assert "already up" in capsys.readouterr().err
    assert main(["down", "--address", gcs]) == 0
    assert "monoserve stopped" in capsys.readouterr().out
    assert main(["status", "--address", gcs]) == 1
    assert "not up" in capsys.readouterr().err
