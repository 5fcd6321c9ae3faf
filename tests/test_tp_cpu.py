"""Tensor parallelism on the CPU: shard plans, error messages, vocabulary padding, and a numpy
simulation of the sharded forward pass (replicas.tp_prefill.ShardedPrefill on shards cut by
replicas.tp_shard, packed by the single-GPU packer) against the unsharded path, the reference
engine and the transformers goldens."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

from replicas.checkpoint import preset_config
from replicas.layout import KernelLayout
from replicas.model import ModelConfig
from replicas.monokernel_weights import pack_weights, rope_tables, to_bf16_bits, to_f32
from replicas.reference import ReferenceEngine
from replicas.tp_prefill import ShardedPrefill
from replicas.tp_shard import (
    TensorParallelError,
    check_tp,
    shard_config,
    shard_plan,
    shard_tensors,
)
from replicas.weights import expected_tensors, load_weights

GOLDENS = Path(__file__).parent / "goldens"
# Sharded vs unsharded (same bf16 weights, same bf16 KV rounding): only the fp32 summation order
# of the matvecs and of the all-reduce differs (measured max |Δ| / max |logit| up to 2.7e-5: an
# order change now and then flips a cached K/V value by one bf16 ulp).
FP32_TOL = 1e-4
# vs the fp32 reference engine / transformers: the monokernel rounds K/V to bf16 (and the weights
# to bf16 where the checkpoint is fp32), as test_monokernel_cpu.py's prefill check allows.
REF_TOL = 5e-3
# vs transformers on an fp32 golden checkpoint: the monokernel also rounds the weights to bf16
# (the tolerance of tests/test_monokernel_gpu.py).
GOLDEN_TOL = 2e-2


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def cfg_with(base: ModelConfig, **kw) -> ModelConfig:
    return ModelConfig(**{**base.model_dump(), **kw})


# ---- plans and errors ----------------------------------------------------------------------
def test_plan_splits_heads_rows_and_vocab():
    c = preset_config("llama-3.2-1b")  # 32 q heads, 8 kv heads, inter 8192, vocab 128256
    p = shard_plan(c, 2, 1)
    assert p.q_heads == (16, 32) and p.kv_heads == (4, 8) and p.inter == (4096, 8192)
    assert p.vocab == (64128, 128256) and p.vocab_rows == 64128 and p.vocab_base == 64128
    local = shard_config(c, 8)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (4, 1, 1024)
    assert local.vocab_size == 16032 and not local.tie_word_embeddings and local.hidden_size == 2048


def test_more_gpus_than_kv_heads_replicates_the_needed_kv_head():
    c = preset_config("tiny")  # 4 q heads, 2 kv heads (group 2)
    plans = [shard_plan(c, 4, r) for r in range(4)]
    assert [p.q_heads for p in plans] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # q head h reads kv head h // 2


def test_last_vocab_shard_is_zero_padded():
    c = preset_config("tiny")
    c3 = cfg_with(c, vocab_size=2045)
    t = {k: np.random.default_rng(0).standard_normal(s).astype(np.float32) for k, s in expected_tensors(c3).items()}
    plans = [shard_plan(c3, 4, r) for r in range(4)]
    assert [p.vocab for p in plans] == [(0, 512), (512, 1024), (1024, 1536), (1536, 2045)]
    last = shard_tensors(c3, t, 4, 3)["lm_head.weight"]
    assert last.shape == (512, c3.hidden_size)
    assert np.array_equal(last[:509], t["lm_head.weight"][1536:]) and not last[509:].any()


def test_tied_embedding_becomes_a_sliced_head_and_whole_embedding():
    c = cfg_with(preset_config("tiny"), tie_word_embeddings=True)
    t = {k: np.random.default_rng(1).standard_normal(s).astype(np.float32) for k, s in expected_tensors(c).items()}
    s = shard_tensors(c, t, 2, 1)
    assert s["model.embed_tokens.weight"] is t["model.embed_tokens.weight"]
    assert np.array_equal(s["lm_head.weight"], t["model.embed_tokens.weight"][1024:])
    assert set(s) == set(expected_tensors(shard_config(c, 2)))  # exactly the local model's tensors


@pytest.mark.parametrize("n, field, match", [
    (3, None, "not supported; use one of 1, 2, 4, 8"),
    (16, None, "not supported"),
    (8, None, "do not divide num_attention_heads=4"),
    (2, {"intermediate_size": 385}, "do not divide intermediate_size=385"),
    (4, {"num_attention_heads": 12, "num_key_value_heads": 6}, "num_key_value_heads=6: one must divide"),
])
def test_unsplittable_models_are_refused_clearly(n, field, match):
    c = cfg_with(preset_config("tiny"), **(field or {}))
    with pytest.raises(TensorParallelError, match=match):
        check_tp(c, n)
    with pytest.raises(TensorParallelError):
        shard_tensors(c, {}, n, 0)


# ---- the sharded forward pass (numpy) -----------------------------------------------------
def packing_layout(cfg: ModelConfig) -> KernelLayout:
    """The packed shapes of `cfg` (built directly: goldens use head dims the kernel refuses)."""
    return KernelLayout(hidden=cfg.hidden_size, inter=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                        heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        vocab=cfg.vocab_size, eps=cfg.rms_norm_eps, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                        qk_norm=cfg.qk_norm, max_ctx=64, num_sms=132)


def sharded_logits(cfg: ModelConfig, tensors, n: int, ids) -> np.ndarray:
    """The GPU loader's steps on numpy: cut shards, pack each, run the sharded prefill."""
    local = shard_config(cfg, n)
    models = []
    for r in range(n):
        m = types.SimpleNamespace(config=local)
        m.weights = pack_weights(np, packing_layout(local), local, shard_tensors(cfg, tensors, n, r))
        m.rope_cos, m.rope_sin = rope_tables(local, 64)
        shape = (local.num_hidden_layers, local.num_key_value_heads, 64, local.head_dim)
        m.k_cache, m.v_cache = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
        models.append(m)
    xs, logits = ShardedPrefill(models, cfg.vocab_size, np).run(ids, all_logits=True)
    for x in xs[1:]:
        assert np.array_equal(x, xs[0])  # the residual stream is bitwise identical on every rank
    assert logits.shape == (len(ids), cfg.vocab_size)
    return logits


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 24).tolist()
    ref = ReferenceEngine.from_pretrained(tiny_checkpoint).forward_logits(ids)
    return cfg, load_weights(tiny_checkpoint, cfg, dtype="raw"), ids, ref


@pytest.mark.parametrize("n", [2, 4])  # 4 > 2 kv heads: replicated kv heads
def test_tiny_sharded_matches_unsharded_and_reference(tiny, n):
    cfg, t, ids, ref = tiny
    one = sharded_logits(cfg, t, 1, ids)
    got = sharded_logits(cfg, t, n, ids)
    assert rel(got, one) < FP32_TOL
    assert rel(got, ref) < REF_TOL and rel(one, ref) < REF_TOL


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_eight_way_model_with_two_kv_heads_and_ragged_vocab(n):
    """8 q heads / 2 kv heads (N=4, 8 replicate kv heads), tied head, q/k/v + o bias, qk-norm,
    a vocabulary N does not divide (padded last shard)."""
    base = preset_config("tiny")
    cfg = cfg_with(base, num_attention_heads=8, num_key_value_heads=2, head_dim=32, hidden_size=128,
                   intermediate_size=256, vocab_size=1001, tie_word_embeddings=True, qkv_bias=True,
                   o_bias=True, qk_norm=True, num_hidden_layers=2)
    rng = np.random.default_rng(7)
    t = {}
    for k, s in expected_tensors(cfg).items():
        scale = 1.0 if "embed" in k or "norm" in k else (1.0 / s[-1]) ** 0.5
        w = (rng.standard_normal(s) * scale + (1.0 if "norm" in k else 0.0)).astype(np.float32)
        t[k] = to_f32(np, to_bf16_bits(np, w))  # bf16-exact, so the reference sees the kernel's weights
    ids = rng.integers(0, cfg.vocab_size, 20).tolist()
    ref = ReferenceEngine(cfg, dict(t)).forward_logits(ids)
    got = sharded_logits(cfg, t, n, ids)
    assert rel(got, sharded_logits(cfg, t, 1, ids)) < FP32_TOL
    assert rel(got, ref) < REF_TOL


@pytest.mark.parametrize("case, n", [("llama_mha_bias_tied", 4), ("qwen3_qknorm_headdim", 4),
                                     ("qwen2_bias_tied", 2), ("llama_gqa_llama3", 2)])
def test_goldens_sharded_match_transformers(case, n):
    path = GOLDENS / case
    cfg = ModelConfig.from_pretrained(path)
    golden = np.load(path / "golden.npz")
    ids = golden["logits_ids"].tolist()
    t = load_weights(path, cfg, dtype="raw")
    got = sharded_logits(cfg, t, n, ids)
    assert rel(got, sharded_logits(cfg, t, 1, ids)) < FP32_TOL
    assert rel(got, golden["logits"]) < GOLDEN_TOL


def test_engine_refuses_an_unsplittable_gpu_count_before_loading(tiny_checkpoint):
    from replicas.monokernel import MonokernelEngine

    with pytest.raises(TensorParallelError, match="3 GPUs is not supported"):
        MonokernelEngine.from_pretrained(tiny_checkpoint, devices=[0, 1, 2])
    with pytest.raises(TensorParallelError, match="do not divide num_attention_heads=4"):
        MonokernelEngine.from_pretrained(tiny_checkpoint, devices=list(range(8)))


# ---- one-GPU emulation (monokernel_tp emulate_on_one_gpu): what needs no GPU ---------------------
def test_repeated_devices_are_refused_without_the_emulation_flag(tiny_checkpoint):
    from replicas.monokernel import MonokernelEngine
    from replicas.monokernel_tp import TpMonokernelEngine

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    with pytest.raises(ValueError, match=r"devices=\[0, 0\] repeats a GPU; .* pass emulate_on_one_gpu=True"):
        TpMonokernelEngine(cfg, {}, devices=[0, 0])  # refused before any GPU work (CI has none)
    with pytest.raises(ValueError, match=r"devices=\[1, 0, 1, 2\] repeats a GPU"):
        MonokernelEngine.from_pretrained(tiny_checkpoint, devices=[1, 0, 1, 2])


@pytest.mark.parametrize("devices, error, match", [
    ([0], ValueError, r"needs at least 2 ranks, got devices=\[0\]"),
    ([0, 1], ValueError, r"names 2; use devices=\[0\] \* 2"),
    ([1, 1, 0, 0], ValueError, r"names 2; use devices=\[1\] \* 4"),
    ([0, 0, 0], TensorParallelError, "3 GPUs is not supported"),
    ([0] * 8, TensorParallelError, "do not divide num_attention_heads=4"),
])
def test_bad_emulation_arguments_are_refused_clearly(tiny_checkpoint, devices, error, match):
    from replicas.monokernel import MonokernelEngine
    from replicas.monokernel_tp import TpMonokernelEngine

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    with pytest.raises(error, match=match):
        TpMonokernelEngine(cfg, {}, devices=devices, emulate_on_one_gpu=True)
    with pytest.raises(error, match=match):
        MonokernelEngine.from_pretrained(tiny_checkpoint, devices=devices, emulate_on_one_gpu=True)


def test_grid_override_and_emulated_grid_sizes():
    from replicas.monokernel_gpu import grid_blocks
    from replicas.monokernel_tp import emulated_sms

    assert grid_blocks(132, None) == 132 and grid_blocks(132, 66) == 66 and grid_blocks(132, 132) == 132
    for bad in (0, 133):
        with pytest.raises(ValueError, match=f"num_sms={bad}: the grid must be 1..132 blocks"):
            grid_blocks(132, bad)
    assert [emulated_sms(132, n) for n in (2, 4, 8)] == [66, 33, 16]  # H200: N grids side by side fit


def test_the_grid_may_come_as_a_layout_option():
    """bench A/Bs give `num_sms=124` (a grid leaving SMs free) like any layout option."""
    from replicas.monokernel_gpu import grid_option

    assert grid_option(None, None) == (None, None) and grid_option({"mma": True}, 66) == ({"mma": True}, 66)
    assert grid_option({"num_sms": 124, "mma": True}, None) == ({"mma": True}, 124)
    assert grid_option({"num_sms": 124}, 124) == ({}, 124)
    with pytest.raises(ValueError, match="num_sms=66 and layout option num_sms=124 disagree"):
        grid_option({"num_sms": 124}, 66)


class _Log(list):
    """What the stand-in GPU saw, in order: ("prep", rank, defer), ("sync", rank), ("start", rank), ..."""


class _Buf:
    """What GpuGroup touches of a CuPy array: .data.ptr and [:] = 0."""

    _next = 0x10000

    def __init__(self, *_, **__):
        _Buf._next += 0x10000
        self.data = types.SimpleNamespace(ptr=_Buf._next)

    def __setitem__(self, key, value):
        pass


def _fake_group(monkeypatch, cfg, n: int, emulate: bool, sms: int = 132):
    """GpuGroup over a stand-in CuPy and GpuModel (which builds the real KernelLayout of its rank)."""
    import replicas.monokernel_tp as tp
    from replicas.layout_tuned import engine_options
    from replicas.monokernel_gpu import grid_blocks

    log, peer = _Log(), []

    class Device:
        def __init__(self, d):
            self.id, self.attributes = d, {"MultiProcessorCount": sms}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Stream(Device):
        def synchronize(self):
            log.append(("sync", self.id))

    class Model:
        def __init__(self, config, tensors, device, max_context, progress, layout_options, num_sms, cooperative):
            self.rank, self.device, self.num_sms_arg, self.cooperative = len(models), device, num_sms, cooperative
            self.layout = KernelLayout.from_config(config, 512, num_sms=grid_blocks(sms, num_sms),
                                                   **engine_options(config, layout_options))
            self.max_context, self.compile_seconds, self.stream = 512, 0.0, Stream(len(models))
            self.host_ctrl = self.host_tokens = None
            self.tp_params: dict = {}
            models.append(self)

        def launch(self, x_last, start_pos, max_steps, *, logits=None, profile=None, defer=False, **kw):
            log.append(("prep", self.rank, defer))

        def start_kernel(self):
            log.append(("start", self.rank))

        def synchronize(self):
            self.stream.synchronize()

    models: list = []
    runtime = types.SimpleNamespace(deviceCanAccessPeer=lambda a, b: peer.append((a, b)) or True,
                                    deviceEnablePeerAccess=lambda b: None, CUDARuntimeError=RuntimeError)
    cp = types.SimpleNamespace(float32=np.float32, ndarray=type("NotHere", (), {}), zeros=_Buf, asarray=_Buf,
                               cuda=types.SimpleNamespace(Device=Device, runtime=runtime))
    monkeypatch.setattr(tp, "import_cupy", lambda: cp)
    monkeypatch.setattr(tp, "GpuModel", Model)
    # zero-stride stand-ins: shard_tensors only slices them (no gigabytes for the larger presets)
    tensors = {k: np.broadcast_to(np.zeros((), np.uint16), s) for k, s in expected_tensors(cfg).items()}
    devices = [0] * n if emulate else list(range(n))
    return tp.GpuGroup(cfg, tensors, devices, max_context=512, emulate_on_one_gpu=emulate), log, peer


@pytest.mark.parametrize("preset, n", [("tiny", 2), ("tiny", 4), ("qwen3-0.6b", 8)])
def test_emulated_group_wiring(monkeypatch, preset, n):
    cfg = preset_config(preset)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    with pytest.warns(UserWarning, match="8 emulated ranks and CUDA_DEVICE_MAX_CONNECTIONS=8") if n == 8 \
            else contextlib.nullcontext():
        group, log, peer = _fake_group(monkeypatch, cfg, n, emulate=True)
    assert not peer  # the "peers" are the same GPU: no peer access to check or enable
    assert [m.device for m in group.models] == [0] * n and group.emulated
    assert all(m.num_sms_arg == 132 // n and m.layout.num_sms == 132 // n and not m.cooperative for m in group.models)
    assert group.layout.tp == n and n * group.layout.num_sms <= 132
    ptrs = [r.data.ptr for r in group.regions]
    assert len(set(ptrs)) == n and [m.tp_params["tp_local"] for m in group.models] == ptrs
    assert [m.tp_params["tp_rank"] for m in group.models] == list(range(n))
    assert len({m.stream for m in group.models}) == n  # one stream per rank: the kernels run concurrently

    group.launch([None] * n, 5, 10)
    # every rank prepared (deferred) and synchronized before any kernel starts; then only the kernels
    first_start = next(i for i, e in enumerate(log) if e[0] == "start")
    before, after = log[:first_start], log[first_start:]
    assert [e for e in before if e[0] == "prep"] == [("prep", r, True) for r in range(n)]
    last_prep = max(i for i, e in enumerate(before) if e[0] == "prep")
    assert sorted(before[last_prep + 1:]) == [("sync", r) for r in range(n)]
    assert after == [("start", r) for r in range(n)]

    log.clear()
    with group.on(1):
        pass
    assert log == [("sync", 1)]  # ranks sharing the GPU (one cuBLAS workspace, one pool) run one after another
    log.clear()
    a = types.SimpleNamespace(device=types.SimpleNamespace(id=0))
    assert group.to(a, n - 1) is a and sorted(log) == [("sync", r) for r in range(n)]


def test_eight_ranks_with_enough_hardware_queues_do_not_warn(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group, _, _ = _fake_group(monkeypatch, preset_config("qwen3-0.6b"), 8, emulate=True)
    assert group.layout.num_sms == 16


def test_real_group_keeps_whole_gpus_cooperative_launches_and_peer_access(monkeypatch):
    group, log, peer = _fake_group(monkeypatch, preset_config("tiny"), 2, emulate=False)
    assert peer == [(0, 1), (1, 0)] and not group.emulated
    assert all(m.num_sms_arg is None and m.layout.num_sms == 132 and m.cooperative for m in group.models)
    with group.on(0):
        pass
    assert not log


def test_tiny_emulated_build_is_the_real_tp_build():
    """tiny's flags do not depend on the grid: the emulation runs the N-GPU cubin itself; larger
    models get smaller k-split factors on SMs // N blocks (compiled below)."""
    from replicas.layout_tuned import engine_options

    c = preset_config("tiny")
    for n in (2, 4):
        local = shard_config(c, n)
        opts = engine_options(local, {"tp": n, "vocab_total": c.vocab_size})
        real = KernelLayout.from_config(local, 1024, num_sms=132, **opts)
        assert KernelLayout.from_config(local, 1024, num_sms=132 // n, **opts).compile_flags() == real.compile_flags()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot check the emulated sm_90a builds")
@pytest.mark.parametrize("preset, n", [("qwen3-0.6b", 2), ("llama-3.2-1b", 8)])
def test_emulated_tp_build_compiles_for_sm90a(monkeypatch, tmp_path, preset, n):
    from replicas.monokernel_build import kernel_source, nvcc_command

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    group, _, _ = _fake_group(monkeypatch, preset_config(preset), n, emulate=True)
    lay = group.layout  # exactly what GpuModel compiles for a rank (num_sms = 132 // n)
    assert lay.num_sms == 132 // n and lay.tp == n
    src = tmp_path / "mk.cu"
    src.write_text(kernel_source())
    r = subprocess.run(nvcc_command(lay, src, tmp_path / "mk.cubin"), check=False, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
