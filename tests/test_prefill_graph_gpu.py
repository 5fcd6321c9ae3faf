"""CUDA graphs of the monokernel prefill on a GPU (replicas/prefill_graph.py): a replayed prefill equals the
eager pass on the same weights and cache, for fresh prompts and session suffixes, in both GEMM modes the
engine prefills with (tensor: cuBLAS; mma: replicas/prefill_gemm.py, the resident joins').

Tolerance: a graph computes its bucket's padded rows, so cuBLAS may pick another kernel for the taller
GEMMs; the same bf16 products are then summed in another order and an activation's bf16 re-rounding can
land one ulp apart (the join modes' argument, replicas/monokernel_resident.JOIN_MODE_TOL = 1e-2 of the
largest value). Cache rows past the prompt (the padding) must stay untouched, exactly. The engine's
generation tests against transformers (tests/test_monokernel_gpu.py) run with graphs on (the default).
Marked `gpu`; the CPU side is tests/test_prefill_graph_cpu.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from replicas.monokernel_resident import JOIN_MODE_TOL


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=["tiny", "llama-3.2-1b"])
def engine(request, tmp_path_factory):
    pytest.importorskip("cupy")
    from replicas.checkpoint import make_checkpoint
    from replicas.monokernel import MonokernelEngine

    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=0, dtype="bf16")
    return MonokernelEngine.from_pretrained(path, max_context=2048)


def _bf16(bits) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("mode", ["tensor", "mma"])
@pytest.mark.parametrize("new,start", [(1, 0), (7, 0), (32, 0), (100, 0), (300, 0), (40, 700), (1, 1500)])
def test_a_replayed_prefill_equals_the_eager_pass(engine, mode, new, start):
    from replicas.monokernel_blas import load_gemm_mode, use_gemm_mode
    from replicas.monokernel_prefill import Prefill
    from replicas.prefill_graph import graph_shape

    gpu = engine.gpu
    cp = gpu.cp
    graphed = engine._prefill
    eager = Prefill(gpu, graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    rng = np.random.default_rng(new * 7 + start)
    ids = rng.integers(0, engine.config.vocab_size, start + new).tolist()
    shape = graph_shape(new, start, gpu.k_cache.shape[2], engine.config.num_attention_heads)
    assert shape is not None
    with cp.cuda.Device(gpu.device), gpu.stream:
        load_gemm_mode(cp, mode)
        use_gemm_mode(mode)
        try:
            if start:
                eager.run(ids[:start])  # the session's earlier rows
            gpu.k_cache[:, :, start:] = 0x3f80  # bf16 1.0: rows a graph must not write past the prompt
            gpu.v_cache[:, :, start:] = 0x3f80
            before_k, before_v = cp.asnumpy(gpu.k_cache), cp.asnumpy(gpu.v_cache)
            x_graph, _ = graphed.run(ids, start=start)
            k_graph, v_graph = cp.asnumpy(gpu.k_cache), cp.asnumpy(gpu.v_cache)
            gpu.k_cache[...] = cp.asarray(before_k)
            gpu.v_cache[...] = cp.asarray(before_v)
            x_eager, _ = eager.run(ids, start=start)
            k_eager, v_eager = cp.asnumpy(gpu.k_cache), cp.asnumpy(gpu.v_cache)
            x_graph, x_eager = cp.asnumpy(x_graph), cp.asnumpy(x_eager)
        finally:
            use_gemm_mode("tensor")
    assert (mode, shape.rows, shape.keys) in graphed.graphs.graphs  # it did replay a graph
    assert np.isfinite(x_graph).all()
    assert rel(x_graph, x_eager) <= JOIN_MODE_TOL
    end = start + new
    for got, want, before in ((k_graph, k_eager, before_k), (v_graph, v_eager, before_v)):
        assert rel(_bf16(got[:, :, start:end]), _bf16(want[:, :, start:end])) <= JOIN_MODE_TOL
        assert np.array_equal(got[:, :, :start], before[:, :, :start])  # earlier rows untouched
        assert np.array_equal(got[:, :, end:], before[:, :, end:])  # padding rows never stored


def test_replays_reuse_their_graph_and_skip_the_host_cost(engine):
    """The point of the graphs: a short prompt's prefill without ~20 host operations per layer."""
    gpu = engine.gpu
    cp = gpu.cp
    from replicas.monokernel_prefill import Prefill

    eager = Prefill(gpu, graphs=False)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, engine.config.vocab_size, 20 + i).tolist() for i in range(5)]  # one bucket (32)

    def timed(pre):
        times = []
        with cp.cuda.Device(gpu.device), gpu.stream:
            pre.run(prompts[0])
            gpu.stream.synchronize()
            for p in prompts:
                t = time.perf_counter()
                pre.run(p)
                gpu.stream.synchronize()
                times.append(time.perf_counter() - t)
        return float(np.median(times))

    graphs_before = len(engine._prefill.graphs.graphs)
    graphed_s, eager_s = timed(engine._prefill), timed(eager)
    assert len(engine._prefill.graphs.graphs) <= graphs_before + 1  # one bucket: at most one new capture
    print(f"32-token bucket: graphed {graphed_s * 1e3:.2f} ms, eager {eager_s * 1e3:.2f} ms")
    assert graphed_s < eager_s / 2


def test_slots_sharing_one_arena_replay_in_order_from_two_streams(tmp_path_factory):
    """A batched engine's slots share one pool of graph temporaries (prefill_graph.GraphArena): one slot's worth
    of memory, not one per slot. Safe only if no two replays overlap on the GPU, also when one slot prefills on
    the launch stream and another on the prefill stream (admission vs join): here two slots replay the same
    shape alternately from two streams with no host sync between them, and each slot's hidden state and KV rows
    must still equal its own eager prefill."""
    pytest.importorskip("cupy")
    from replicas.checkpoint import make_checkpoint
    from replicas.monokernel_batched import BatchedMonokernelEngine
    from replicas.monokernel_prefill import Prefill

    path = make_checkpoint("tiny", tmp_path_factory.mktemp("arena"), seed=1, dtype="bf16")
    eng = BatchedMonokernelEngine.from_pretrained(path, batch=2, max_context=2048)
    try:
        gpu, cp = eng.gpu, eng.gpu.cp
        a, b = eng._prefill[0].graphs, eng._prefill[1].graphs
        assert a.arena is b.arena and a.pool is b.pool
        with cp.cuda.Device(gpu.device), gpu.stream:
            a.capture_all()
            before, held = a.pool.total_bytes(), set(b.graphs)
            b.capture_all()
            grown = a.pool.total_bytes() - before
        # slot 1's captures reuse slot 0's temporaries: the pool grows by the outputs its new graphs hold (each
        # graph's residual stream), not by another set of temporaries (fragmentation slack: 1.5x + 4 MiB)
        outputs = sum(g.x.data.mem.size for k, g in b.graphs.items() if k not in held)
        print(f"arena: slot 1's {len(b.graphs) - len(held)} new graphs grew the pool by {grown / 1e6:.1f} MB, "
              f"their outputs {outputs / 1e6:.1f} MB, the pool {before / 1e6:.1f} MB before")
        assert outputs > 0 and grown <= 1.5 * outputs + (4 << 20)
        rng = np.random.default_rng(11)
        vocab = eng.config.vocab_size
        rounds = [[rng.integers(0, vocab, 200).tolist() for _ in range(2)] for _ in range(4)]  # bucket 256 each
        streams = (gpu.stream, gpu.prefill_stream)
        x_last = [None, None]
        with cp.cuda.Device(gpu.device):
            for k, prompts in enumerate(rounds):
                for slot in (0, 1):
                    with streams[(slot + k) % 2]:  # each slot on both streams over the rounds
                        x_last[slot], _ = eng._prefill[slot].run(prompts[slot])
            cp.cuda.Device(gpu.device).synchronize()
            got = [(cp.asnumpy(x_last[s]), cp.asnumpy(gpu.k_cache[s][:, :, :200]), cp.asnumpy(gpu.v_cache[s][:, :, :200]))
                   for s in (0, 1)]
            for slot in (0, 1):
                with gpu.stream:
                    x_eager, _ = Prefill(gpu.slot_view(slot), graphs=False).run(rounds[-1][slot])
                gpu.stream.synchronize()
                want = (cp.asnumpy(x_eager), cp.asnumpy(gpu.k_cache[slot][:, :, :200]),
                        cp.asnumpy(gpu.v_cache[slot][:, :, :200]))
                assert rel(got[slot][0], want[0]) <= JOIN_MODE_TOL
                for g_kv, w_kv in zip(got[slot][1:], want[1:]):
                    assert rel(_bf16(g_kv), _bf16(w_kv)) <= JOIN_MODE_TOL
    finally:
        eng.close()
