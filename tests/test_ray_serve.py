"""The Ray Serve application on a real local Ray cluster: streaming gRPC through Serve's proxy,
engine replicas in 8-GPU placement groups, our latency-aware request router."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

ray = pytest.importorskip("ray")

from monoserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

from cluster.launcher import init_local_ray, worker_runtime_env

# Ray Serve's own pydantic models emit deprecation warnings on import; not ours to fix.
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::DeprecationWarning")]
METADATA = (("application", "monoserve"),)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_app(tiny_checkpoint):
    from ray import serve
    from ray.serve.config import gRPCOptions

    from deploy.serve_app import APP_NAME, GRPC_SERVICER, build_app

    init_local_ray(num_cpus=4, num_gpus=16, include_dashboard=False, runtime_env=worker_runtime_env(),
                   log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()},
                grpc_options=gRPCOptions(port=port, grpc_servicer_functions=[GRPC_SERVICER]))
    app = build_app({"model": str(tiny_checkpoint), "engine": "reference", "num_replicas": 2,
                     "cpus_per_replica": 0.1, "ingress_cpus": 0.1, "routing_stats_period_s": 0.2})
    serve.run(app, name=APP_NAME, route_prefix="/monoserve")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    yield inference_pb2_grpc.InferenceStub(channel)
    channel.close()
    serve.shutdown()
    ray.shutdown()


def stream(stub, **fields):
    req = inference_pb2.GenerateRequest(**fields)
    chunks, final = [], None
    for msg in stub.Generate(req, metadata=METADATA, timeout=60):
        if msg.HasField("chunk"):
            chunks.append(msg.chunk)
        else:
            final = msg.final
    return chunks, final


def test_streams_the_reference_engines_greedy_tokens_and_text(serve_app, tiny_checkpoint):
    from replicas.engine import SamplingParams
    from replicas.reference import ReferenceEngine
    from router.detokenizer import TextTokenizer

    tok = TextTokenizer.from_pretrained(tiny_checkpoint)
    prompt = "Hello from Ray Serve"
    chunks, final = stream(serve_app, text=prompt, sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True))
    ids = [t for c in chunks for t in c.token_ids]
    expected = list(ReferenceEngine.from_pretrained(tiny_checkpoint).generate(
        tok.encode(prompt), SamplingParams(max_tokens=12, ignore_eos=True)))
    assert len(chunks) >= 12 and ids == expected  # one chunk per token: it streams
    assert "".join(c.text for c in chunks) == tok.decode(expected)
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 12 and final.usage.prompt_tokens == len(tok.encode(prompt))
    assert final.replica_id and final.timings.ttft_ms > 0


def test_concurrent_requests_go_to_idle_replicas(serve_app):
    results = []

    def one(i):
        results.append(stream(serve_app, token_ids=inference_pb2.TokenIds(ids=[5, 6, i]),
                              sampling=common_pb2.SamplingParams(max_tokens=800, ignore_eos=True)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and all(f.usage.completion_tokens == 800 for _, f in results)
    assert len({f.replica_id for _, f in results}) == 2  # one each: idle replicas first


def test_replica_killed_mid_stream_is_resumed_on_another_without_losing_tokens(serve_app, tiny_checkpoint):
    from replicas.engine import SamplingParams
    from replicas.reference import ReferenceEngine

    n = 1500
    prompts = [[7, 8, 9], [9, 8, 7]]
    engine = ReferenceEngine.from_pretrained(tiny_checkpoint)
    expected = [list(engine.generate(p, SamplingParams(max_tokens=n, ignore_eos=True))) for p in prompts]
    both_streaming = threading.Barrier(3)
    results = [None, None]

    def one(i):
        req = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompts[i]),
                                            sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True))
        ids = []
        for msg in serve_app.Generate(req, metadata=METADATA, timeout=120):
            if msg.HasField("chunk"):
                ids += msg.chunk.token_ids
                if len(ids) == 20:
                    both_streaming.wait(timeout=30)
            else:
                results[i] = (ids, msg.final)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    both_streaming.wait(timeout=60)  # each replica is mid-stream on one request
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]))
    for t in threads:
        t.join()
    for (ids, final), want in zip(results, expected):
        assert ids == want  # nothing lost or repeated across the failover
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH and final.usage.completion_tokens == n


def test_stop_string_cuts_the_text_and_is_reported(serve_app):
    prompt = "stop strings"
    chunks, _ = stream(serve_app, text=prompt, sampling=common_pb2.SamplingParams(max_tokens=40, ignore_eos=True))
    full = "".join(c.text for c in chunks)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert len(stop) == 3
    chunks, final = stream(serve_app, text=prompt, stop=[stop],
                           sampling=common_pb2.SamplingParams(max_tokens=40, ignore_eos=True))
    assert "".join(c.text for c in chunks) == full[:full.index(stop)]
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP and final.matched_stop == stop


def test_cancelled_stream_frees_the_replica_for_the_next_requests(serve_app):
    req = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=[4, 4]),
                                        sampling=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True))
    call = serve_app.Generate(req, metadata=METADATA, timeout=60)
    for i, _ in enumerate(call):
        if i == 10:
            call.cancel()
            break
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        stream(serve_app, token_ids=inference_pb2.TokenIds(ids=[1, 2]), sampling=common_pb2.SamplingParams(max_tokens=20, ignore_eos=True))))
        for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and all(f.usage.completion_tokens == 20 for _, f in results)


def test_abort_ends_the_stream_with_cancelled(serve_app):
    req = inference_pb2.GenerateRequest(request_id="abort-me", token_ids=inference_pb2.TokenIds(ids=[3, 3]),
                                        sampling=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True))
    tokens, final = 0, None
    for msg in serve_app.Generate(req, metadata=METADATA, timeout=60):
        if msg.HasField("chunk"):
            tokens += len(msg.chunk.token_ids)
            if tokens == 5:
                reply = serve_app.Abort(inference_pb2.AbortRequest(request_id="abort-me"), metadata=METADATA,
                                        timeout=10)
                assert reply.found
        else:
            final = msg.final
    assert final.finish_reason == common_pb2.FINISH_REASON_CANCELLED and 5 <= tokens < 1500
    assert not serve_app.Abort(inference_pb2.AbortRequest(request_id="abort-me"), metadata=METADATA,
                               timeout=10).found


def test_bad_request_is_invalid_argument_naming_the_problem(serve_app):
    with pytest.raises(grpc.RpcError) as err:
        stream(serve_app, token_ids=inference_pb2.TokenIds(ids=[1, 999999]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in err.value.details()


def test_list_models(serve_app, tiny_checkpoint):
    reply = serve_app.ListModels(inference_pb2.ListModelsRequest(), metadata=METADATA, timeout=10)
    assert [m.id for m in reply.models] == [tiny_checkpoint.name]
    assert reply.models[0].vocab_size == 2048
