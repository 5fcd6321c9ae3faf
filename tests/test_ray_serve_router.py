"""The Serve request router's ranking as a pure function (the live router runs in test_ray_serve)."""

import warnings

from replicas.engine import SamplingParams
from router.policy import RequestShape

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from deploy.serve_router import Candidate, rank, request_shape

SHAPE = RequestShape(prompt_tokens=10, max_tokens=100)


def cand(key, busy=0, capacity=1, in_flight=None, **stats):
    return Candidate(key, capacity, in_flight, {"busy": busy, "reported_at": 100.0, **stats})


def test_idle_replica_first_then_soonest_free():
    ranks = rank([cand("busy-long", busy=1, tokens_remaining=500, tpot_s=0.01),
                  cand("idle"),
                  cand("busy-short", busy=1, tokens_remaining=5, tpot_s=0.01)], SHAPE, now=100.0)
    assert ranks == [["idle"], ["busy-short"], ["busy-long"]]


def test_own_in_flight_requests_count_even_before_the_replica_reports_them():
    ranks = rank([cand("a", in_flight=1), cand("b")], SHAPE, now=100.0)
    assert ranks[0] == ["b"]


def test_faster_replica_wins_among_busy_ones_with_free_slots():
    ranks = rank([cand("slow", busy=1, capacity=2, tpot_s=0.05, tokens_remaining=10),
                  cand("fast", busy=1, capacity=2, tpot_s=0.01, tokens_remaining=10)], SHAPE, now=100.0)
    assert ranks == [["fast"], ["slow"]]


def test_unhealthy_replicas_are_skipped_unless_none_is_healthy():
    assert rank([cand("sick", healthy=False), cand("ok", busy=1)], SHAPE, now=100.0) == [["ok"]]
    assert rank([cand("sick", healthy=False)], SHAPE, now=100.0) == [["sick"]]


def test_request_shape_from_generate_args():
    class Pending:
        args = ([1, 2, 3], SamplingParams(max_tokens=7))

    assert request_shape(Pending()) == RequestShape(prompt_tokens=3, max_tokens=7)
    assert request_shape(None).max_tokens == 16
