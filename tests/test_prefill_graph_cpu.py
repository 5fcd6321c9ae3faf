"""The prefill's CUDA-graph path without a GPU (replicas/prefill_graph.py, replicas/monokernel_prefill.py).

- which prompts get a graph and of what shape (padded rows, a key count covering every position);
- the replay's input buffer;
- the two kernels whose positions a graph reads at replay (RoPE, the KV store) on the CPU emulator
  (csrc/emu/cuda_on_cpu.h) from the real source: given the start / count in device memory they write
  exactly what the eager pass's arguments write, and the KV store leaves padding rows out;
- Prefill on numpy (the CPU engines) never builds graphs, and the eager pass is unchanged by the refactor
  (the emulated engines' tests compare it against the reference engine).
The graphs themselves (capture, replay, output equal to the eager pass) are tested on the GPU:
tests/test_prefill_graph_gpu.py.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from replicas import monokernel_prefill as mp
from replicas import prefill_graph as pgr
from tests.emu_cpp import build_emulated


def test_graph_shapes_pad_rows_to_a_bucket_and_cover_every_position_with_keys():
    ctx, heads = 4096, 8  # (few heads: the scores' size bound never applies here)
    for new in (1, 15, 16, 17, 100, 512):
        for start in (0, 1, 63, 64, 1000, 3000):
            s = pgr.graph_shape(new, start, ctx, heads)
            if start + max(new, 16) > ctx:
                continue
            assert s is not None
            assert s.rows in pgr.GRAPH_ROWS and s.rows >= new
            assert s.rows == min(r for r in pgr.GRAPH_ROWS if r >= new)
            assert start + s.rows <= s.keys <= ctx  # padded queries' positions exist in the cache
            assert s.keys == ctx or (s.keys & (s.keys - 1)) == 0 and s.keys >= pgr.MIN_KEYS
    assert pgr.graph_shape(5, 0, ctx, heads) == pgr.GraphShape(16, 64)
    assert pgr.graph_shape(40, 100, ctx, heads) == pgr.GraphShape(64, 256)


def test_prompts_without_a_graph_run_eagerly():
    assert pgr.graph_shape(513, 0, 4096, 32) is None  # longer than the largest bucket
    assert pgr.graph_shape(10, 4090, 4096, 32) is None  # the padded rows would pass the context's end
    assert pgr.graph_shape(10, 4080, 4096, 32) == pgr.GraphShape(16, 4096)  # keys clamp to the context
    # scores of 512 rows x 4096 keys x 32 heads are 256 MiB > GRAPH_SCORE_BYTES
    assert pgr.graph_shape(500, 3000, 8192, 32) is None
    assert pgr.graph_shape(500, 3000, 8192, 8) is not None
    with pytest.raises(ValueError, match="new_tokens"):
        pgr.graph_shape(0, 0, 4096, 32)


@pytest.mark.parametrize("ctx,heads", [(2048, 32), (3000, 32), (8192, 32), (700, 4), (16, 2)])
def test_capture_all_enumerates_exactly_the_shapes_any_prompt_can_get(ctx, heads):
    # a resident engine captures these before its first launch, so a join never captures beside it: a shape
    # missing here would be captured at its first join; an extra one costs start-up time and memory
    want = set()
    for start in range(ctx):
        for new in {1, *pgr.GRAPH_ROWS, *(r + 1 for r in pgr.GRAPH_ROWS)}:
            if start + new <= ctx and (s := pgr.graph_shape(new, start, ctx, heads)) is not None:
                want.add(s)
    got = pgr.graph_shapes(ctx, heads)
    assert len(got) == len(set(got)) and set(got) == want
    assert all(heads * s.rows * s.keys * 4 <= pgr.GRAPH_SCORE_BYTES for s in got)


def test_replay_inputs_hold_start_count_and_padded_ids():
    ids = [5, 6, 7, 8, 9]
    got = pgr.pack_inputs(ids, 2, 16)
    assert got.dtype == np.int32 and got.shape == (18,)
    assert got[:2].tolist() == [2, 3] and got[2:5].tolist() == [7, 8, 9] and not got[5:].any()
    with pytest.raises(ValueError, match="do not fit"):
        pgr.pack_inputs(list(range(40)), 0, 32)
    with pytest.raises(ValueError, match="token ids"):
        pgr.pack_inputs([1, -3], 0, 16)


def test_numpy_prefill_has_no_graphs():
    from types import SimpleNamespace

    pre = mp.Prefill(SimpleNamespace(config=None), xp=np)
    assert pre.graphs is None


# -- the kernels on the CPU emulator ----------------------------------------------------------------------

_WRAP = r"""
struct RopeArgs { const float *x, *cs, *sn; float* y; int heads, d; long long total; const int* dyn; int start; };
struct StoreArgs { const unsigned short* src; unsigned short* dst; int nkv, d, ctx; long long total; const int* dyn;
                   int start, count; };
extern "C" int emu_rope(const float* x, const float* cs, const float* sn, float* y, int heads, int d,
                        long long total, const int* dyn, int start) {
  const RopeArgs a{x, cs, sn, y, heads, d, total, dyn, start};
  auto run = [](const void* q) {
    const RopeArgs& r = *static_cast<const RopeArgs*>(q);
    mk_rope_rows(r.x, r.cs, r.sn, r.y, r.heads, r.d, r.total, r.dyn, r.start);
  };
  return mk_emu::run(run, &a, (unsigned)((total + 63) / 64), 64, 0, 64 << 10, 1ull << 40);
}
extern "C" int emu_store(const unsigned short* src, unsigned short* dst, int nkv, int d, int ctx, long long total,
                         const int* dyn, int start, int count) {
  const StoreArgs a{src, dst, nkv, d, ctx, total, dyn, start, count};
  auto run = [](const void* q) {
    const StoreArgs& s = *static_cast<const StoreArgs*>(q);
    mk_store_kv(s.src, s.dst, s.nkv, s.d, s.ctx, s.total, s.dyn, s.start, s.count);
  };
  return mk_emu::run(run, &a, (unsigned)((total + 63) / 64), 64, 0, 64 << 10, 1ull << 40);
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    # (__shared__: only the RMSNorm kernel has any, and it is not run here)
    lib = build_emulated(tmp_path_factory.mktemp("prefill_emu"), "prefill_emu",
                         "#define __shared__ static\n" + mp._FUSED + _WRAP)
    P, I, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.emu_rope.argtypes = [P, P, P, P, I, I, LL, P, I]
    lib.emu_store.argtypes = [P, P, I, I, I, LL, P, I, I]
    return lib


def _p(a: np.ndarray) -> int:
    return a.ctypes.data


def rope_ref(x, cos, sin):
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


@pytest.mark.parametrize("start", [0, 7, 29])
def test_rope_reads_its_start_from_device_memory_like_the_argument(emu, start):
    rng = np.random.default_rng(start)
    T, heads, d, ctx = 5, 3, 8, 40
    x = rng.standard_normal((T, heads, d), dtype=np.float32)
    cos = rng.standard_normal((ctx, d // 2), dtype=np.float32)
    sin = rng.standard_normal((ctx, d // 2), dtype=np.float32)
    by_arg, by_mem = np.full_like(x, np.nan), np.full_like(x, np.nan)
    dyn = np.array([start, T], np.int32)
    assert emu.emu_rope(_p(x), _p(cos), _p(sin), _p(by_arg), heads, d, x.size, None, start) == 0
    assert emu.emu_rope(_p(x), _p(cos), _p(sin), _p(by_mem), heads, d, x.size, _p(dyn), 999) == 0
    want = rope_ref(x, cos[start:start + T][:, None, :], sin[start:start + T][:, None, :])
    np.testing.assert_allclose(by_arg, want, rtol=1e-6, atol=1e-6)  # fp32, same products: rounding only
    assert np.array_equal(by_mem, by_arg)


@pytest.mark.parametrize("start,count", [(0, 6), (3, 4), (10, 1)])
def test_kv_store_writes_count_rows_at_start_and_leaves_padding_out(emu, start, count):
    rng = np.random.default_rng(count)
    rows, nkv, d, ctx = 6, 2, 8, 16
    src = rng.integers(1, 1 << 15, (rows, nkv, d)).astype(np.uint16)
    sentinel = rng.integers(1, 1 << 15, (nkv, ctx, d)).astype(np.uint16)
    want = sentinel.copy()
    want[:, start:start + count] = src[:count].transpose(1, 0, 2)
    by_arg, by_mem = sentinel.copy(), sentinel.copy()
    dyn = np.array([start, count], np.int32)
    assert emu.emu_store(_p(src), _p(by_arg), nkv, d, ctx, src.size, None, start, count) == 0
    assert emu.emu_store(_p(src), _p(by_mem), nkv, d, ctx, src.size, _p(dyn), 0, rows) == 0
    assert np.array_equal(by_arg, want) and np.array_equal(by_mem, want)


def test_run_replays_a_graph_where_there_is_one_and_falls_back_to_the_eager_pass():
    from types import SimpleNamespace

    pre = mp.Prefill(SimpleNamespace(config=None), xp=np)
    calls, eager = [], []

    class Graphs:
        def __init__(self, answer):
            self.answer = answer

        def run(self, ids, start):
            calls.append((list(ids), start))
            return self.answer

    def forward(ids_d, pos):
        eager.append((ids_d.tolist(), pos))
        return np.arange(len(ids_d) * 3, dtype=np.float32).reshape(len(ids_d), 3)

    pre.forward = forward
    pre.graphs = Graphs(np.full(3, 7.0, np.float32))
    x, logits = pre.run([4, 5, 6], start=1)
    assert x.tolist() == [7.0, 7.0, 7.0] and logits is None
    assert calls == [([4, 5, 6], 1)] and not eager
    pre.graphs = Graphs(None)  # no graph for this shape: the eager pass, with the same positions
    x, _ = pre.run([4, 5, 6], start=1)
    assert eager == [([5, 6], mp.Positions(start=1, count=2, rows=2))] and x.tolist() == [3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="start=3"):
        pre.run([4, 5, 6], start=3)  # nothing left to compute: refused before any graph or GPU work
    assert len(calls) == 2
