"""CUDA graphs of the monokernel prefill (replicas/monokernel_prefill.py) for short prompts.

A short prompt's prefill is bound by the host: ~20 CuPy / cuBLAS operations per layer at 10-30 µs of
Python each (measured on the H200, llama-3.2-1b: 32 tokens take 18 ms on the host for 1.9 ms of GPU
work; bench/prefill_probe.py). A graph replays the whole pass with one launch.

One graph per (GEMM mode, padded rows, key rows): the prompt is padded up to the next of GRAPH_ROWS (the
padding rows compute on token 0 and are never stored: causal attention keeps them out of the real rows),
and attention scores a power-of-two number of cache rows, masked per query. The start position, the real
row count and the token ids live in one device buffer that the host fills before each replay, so a graph
serves every start position (agent sessions' suffixes) whose rows fit its key count.

Memory: the graphs' temporaries come from a private CuPy pool (a GraphArena), so no other allocation can
take an address a graph writes. Each replay rewrites its temporaries before reading them, so graphs may
share that memory as long as no two replays overlap on the GPU: the arena orders every replay after the one
before it, whatever stream each runs on. The residual stream a graph leaves is its own (held, not shared)
and copied out right after its replay. A batched engine's slots share one arena: one slot's worth of
temporaries instead of one per slot (llama-3.1-8b: 470 MB per slot with every join shape captured).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

GRAPH_ROWS = (16, 32, 64, 128, 256, 512)  # padded prompt rows a graph is captured for (longer: eager)
MIN_KEYS = 64  # fewest cache rows a graph's attention scores
GRAPH_SCORE_BYTES = 128 << 20  # one graph's fp32 attention scores [heads, rows, keys]; larger: eager


@dataclass(frozen=True)
class GraphShape:
    rows: int  # rows computed (the prompt's new tokens, padded)
    keys: int  # cache rows the attention scores (>= start + rows)


def _scores_fit(heads: int, rows: int, keys: int) -> bool:
    """A graph's fp32 attention scores [heads, rows, keys] stay within GRAPH_SCORE_BYTES (larger: eager)."""
    return heads * rows * keys * 4 <= GRAPH_SCORE_BYTES


def graph_shape(new_tokens: int, start: int, max_context: int, heads: int) -> GraphShape | None:
    """The graph that prefills `new_tokens` at positions start.. of a cache of `max_context` rows with
    `heads` query heads, or None where the prompt runs eagerly (too long, too close to the context's end,
    or scores larger than GRAPH_SCORE_BYTES)."""
    if new_tokens < 1 or start < 0:
        raise ValueError(f"new_tokens={new_tokens}, start={start}: need new_tokens >= 1 and start >= 0")
    rows = next((r for r in GRAPH_ROWS if r >= new_tokens), None)
    if rows is None or start + rows > max_context:
        return None
    keys = min(max_context, max(MIN_KEYS, 1 << (start + rows - 1).bit_length()))
    if not _scores_fit(heads, rows, keys):
        return None
    return GraphShape(rows, keys)


def graph_shapes(max_context: int, heads: int) -> list[GraphShape]:
    """Every shape graph_shape returns for some (new_tokens, start) at this context and head count: per row
    bucket, the key counts of its possible last positions (rows - 1 .. max_context - 1), within the scores' bound."""
    shapes = []
    for rows in GRAPH_ROWS:
        if rows > max_context:
            break
        bits = range((rows - 1).bit_length(), (max_context - 1).bit_length() + 1)
        for keys in sorted({min(max_context, max(MIN_KEYS, 1 << b)) for b in bits}):
            if _scores_fit(heads, rows, keys):
                shapes.append(GraphShape(rows, keys))
    return shapes


def pack_inputs(ids, start: int, rows: int) -> np.ndarray:
    """The host side of a replay's input buffer: [start, count, ids[start:] padded with 0 to rows] int32."""
    new = np.asarray(ids[start:], dtype=np.int64)
    if len(new) > rows:
        raise ValueError(f"{len(new)} new tokens do not fit a graph of {rows} rows")
    if len(new) and (new.min() < 0 or new.max() >= 2**31):
        raise ValueError("token ids must be in [0, 2^31)")
    out = np.zeros(2 + rows, np.int32)
    out[0], out[1] = start, len(new)
    out[2:2 + len(new)] = new
    return out


@dataclass
class _Graph:
    graph: object  # cupy.cuda.Graph
    x: object  # the residual stream it leaves, [rows, H] fp32 (graph-pool memory)


class GraphArena:
    """What the prefill graphs of one or more Prefills share (GPU only): the pool their temporaries come from,
    the capture stream (CuPy's pool reuses a freed block only on the stream that freed it, so captures that
    are to share temporaries must run on one stream), a lock for capture and replay, and the replays' order:
    each replay waits on the GPU for the one before it, so graphs whose temporaries overlap never run at once,
    even from two streams (a batched engine admits on its launch stream, joins on its prefill stream)."""

    def __init__(self, cp):
        self.cp = cp
        self.pool = cp.cuda.MemoryPool()
        self.lock = threading.RLock()
        self._stream = None  # the capture stream (made on first capture, on the current device)
        self._last = None  # event recorded after the last replay, on its stream

    @property
    def stream(self):
        if self._stream is None:
            self._stream = self.cp.cuda.Stream(non_blocking=True)
        return self._stream

    def launch(self, graph) -> None:
        """Replay `graph` on the current stream after the arena's previous replay (caller holds the lock)."""
        cp = self.cp
        stream = cp.cuda.get_current_stream()
        if self._last is not None:
            stream.wait_event(self._last)  # (a no-op on the GPU once that replay is done)
        graph.launch(stream)
        done = cp.cuda.Event(disable_timing=True)
        done.record(stream)
        self._last = done


class PrefillGraphs:
    """Captures and replays a Prefill's graphs (GPU only; one caller thread at a time per arena)."""

    def __init__(self, prefill, arena: GraphArena | None = None):
        cp = prefill.cp
        self.pre, self.cp = prefill, cp
        self.arena = arena if arena is not None else GraphArena(cp)
        self.pool = self.arena.pool
        self.inputs = cp.zeros(2 + GRAPH_ROWS[-1], cp.int32)  # [start, count, ids...], outside the pool
        self.graphs: dict[tuple, _Graph] = {}
        self.failed: set[tuple] = set()  # shapes whose capture failed: eager from then on
        m = prefill.m
        self.max_context = int(m.k_cache.shape[2])
        self.heads = int(m.config.num_attention_heads)

    def run(self, ids, start: int):
        """Prefill ids[start:] from a graph: the last row's hidden state [H] (a fresh array), or None when
        this shape runs eagerly (the caller then runs Prefill.forward itself)."""
        from replicas.monokernel_blas import gemm_mode

        shape = graph_shape(len(ids) - start, start, self.max_context, self.heads)
        if shape is None:
            return None
        key = (gemm_mode(), shape.rows, shape.keys)
        if key in self.failed:
            return None
        with self.arena.lock:
            g = self.graphs.get(key) or self._capture(key, shape)
            return None if g is None else self._replay(g, ids, start, shape.rows)

    def replay_captured(self, ids, start: int, mode: str):
        """As run, for GEMM mode `mode`, but only from a graph captured already (None otherwise: nothing is
        captured or run). Everything it does is queued on the current stream, so a caller that must not block
        (the resident engine's scheduler) waits on an event instead."""
        shape = graph_shape(len(ids) - start, start, self.max_context, self.heads)
        g = None if shape is None else self.graphs.get((mode, shape.rows, shape.keys))
        if g is None:
            return None
        with self.arena.lock:
            return self._replay(g, ids, start, shape.rows)

    def _replay(self, g: _Graph, ids, start: int, rows: int):
        self.inputs[:2 + rows].set(pack_inputs(ids, start, rows))  # stream-ordered
        self.arena.launch(g.graph)
        return g.x[len(ids) - start - 1].copy()

    def _capture(self, key: tuple, shape: GraphShape) -> _Graph | None:
        from replicas.monokernel_prefill import Positions

        cp = self.cp
        s = self.arena.stream
        pos = Positions(start=0, count=shape.rows, rows=shape.rows, keys=shape.keys, dyn=self.inputs[:2])
        try:
            with cp.cuda.using_allocator(self.pool.malloc), s:
                s.begin_capture()
                try:
                    x = self.pre.forward(self.inputs[2:2 + shape.rows], pos)
                finally:
                    graph = s.end_capture()
        except Exception as e:  # noqa: BLE001 - a shape that cannot be captured runs eagerly (correct, slower)
            self.failed.add(key)
            log.warning("prefill CUDA graph for %s (mode, rows, keys) failed to capture, running it eagerly: "
                        "%s: %s", key, type(e).__name__, e)
            return None
        g = self.graphs[key] = _Graph(graph, x)
        return g

    def capture_all(self) -> int:
        """Capture every graph this Prefill can replay (graph_shapes) in the current GEMM mode, without running
        them; returns how many were new. For a resident engine before its first launch: a session suffix's
        shape (start > 0) is otherwise captured at its first join, beside the launch, where the capture has
        been seen to wait for the launch (csrc/NOTES.md "Joins after session 19"); with every shape captured,
        each join of up to GRAPH_ROWS[-1] new tokens is a replay the scheduler queues itself."""
        from replicas.monokernel_blas import gemm_mode

        t, new = time.perf_counter(), 0
        for shape in graph_shapes(self.max_context, self.heads):
            key = (gemm_mode(), shape.rows, shape.keys)
            with self.arena.lock:
                if key not in self.graphs and key not in self.failed:
                    g = self._capture(key, shape)
                    if g is not None:  # (a graph's first launch uploads it: done here, not beside a launch)
                        g.graph.upload(self.arena.stream)
                        new += 1
        self.arena.stream.synchronize()
        log.info("prefill graphs: %d captured in %.1f s (%d held, %.0f MB in their arena's pool)", new,
                 time.perf_counter() - t, len(self.graphs), self.pool.total_bytes() / 1e6)
        return new

    def warm(self, lengths=GRAPH_ROWS) -> None:
        """Capture the graphs of fresh prompts of these lengths (start 0) now, not at their first request
        (a capture costs about one eager prefill's host time)."""
        for n in lengths:
            self.run([0] * n, 0)  # (a length without a graph runs nothing)
        log.info("prefill graphs: %d captured, %.0f MB held by their pool", len(self.graphs),
                 self.pool.total_bytes() / 1e6)
