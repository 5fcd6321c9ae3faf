"""The tensor-parallel monokernel's CUDA source (csrc/mk_tp.cuh, MK_TP = N) run on the CPU: N emulated ranks,
each its own OS thread, exchanging through host memory (replicas/monokernel_emu_tp.py). This is the only check
of the in-kernel all-reduces, the token merge and the stop/cancel agreement that runs without GPUs (the H200
pair was never lent; tests/test_tp_gpu.py holds the same checks for two GPUs).

Oracles: the same kernel at TP=1 on the same weights (the ranks' partials meet in fp32 in rank order instead of
one k-split sum: measured 4-6e-7 of the largest logit on tiny, 1.3e-5 on the eight-rank model; bound 1e-4,
test_tp_cpu.py's, since an order change can flip a cached K/V value by one bf16 ulp) and the numpy reference engine
(the emulation tests' 5e-3: bf16 weights and KV cache). Tokens: equal to TP=1's, greedy and seeded, exactly
(fp32-level logit differences part them only at an exact tie; these prompts have none: checked by the margin).
"""

from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest

from replicas import layout as L

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or platform.machine() not in ("x86_64", "AMD64"),
                                reason="the CPU emulation needs g++ on x86-64 (its fiber switch is x86-64 assembly)")

TP_TOL = 1e-4  # as tests/test_tp_cpu.py: fp32 order, now and then one bf16 ulp of a cached K/V value
REF_TOL = 5e-3


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    from replicas.model import ModelConfig
    from replicas.monokernel_emu import EmuModel
    from replicas.reference import ReferenceEngine
    from replicas.weights import load_weights

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    raw = load_weights(tiny_checkpoint, cfg, dtype="raw")
    return cfg, raw, EmuModel(cfg, raw), ReferenceEngine.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])  # tiny: 4 q heads, 2 kv heads (4: replicated)
def group(request, tiny):
    from replicas.monokernel_emu_tp import EmuTpGroup

    cfg, raw, _, _ = tiny
    return EmuTpGroup(cfg, raw, request.param)


def test_teacher_forced_logits_match_tp1_and_the_reference(tiny, group):
    cfg, _, one, ref = tiny
    ids = np.random.default_rng(11).integers(0, cfg.vocab_size, 30).tolist()
    got = group.forward_logits(ids)
    assert got.shape == (len(ids), cfg.vocab_size) and np.isfinite(got).all()
    assert rel(got, one.forward_logits(ids)) <= TP_TOL
    assert rel(got, ref.forward_logits(ids)) <= REF_TOL


def test_greedy_and_seeded_sampling_give_tp1s_tokens_on_every_rank(tiny, group):
    """generate() also asserts every rank emitted the same tokens, count and status."""
    cfg, _, one, _ = tiny
    prompt = np.random.default_rng(12).integers(0, cfg.vocab_size, 12).tolist()
    for kw in ({}, {"mode": L.MODE_GUMBEL, "temperature": 0.8, "seed": 1234},
               {"mode": L.MODE_TOPKP, "temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 99}):
        got = group.generate(prompt, 10, **kw)  # (10 sampled steps: a TP=4 emulated step costs ~0.5 s)
        x_last, _ = one.prefill(prompt)
        one.launch(x_last, len(prompt), 10, **kw)
        want = [int(t) for t in one.host_tokens[:int(one.host_ctrl[L.CTRL_COUNT])]]
        assert len(got) == 10 and got == want, kw
        assert group.status() == L.STATUS_LENGTH


def test_a_stop_token_and_a_cancel_stop_every_rank_at_the_same_step(tiny, group):
    cfg, _, _, _ = tiny
    prompt = np.random.default_rng(13).integers(0, cfg.vocab_size, 10).tolist()
    free = group.generate(prompt, 24)
    stop = free[9]
    k = free.index(stop)  # (its first appearance)
    assert group.generate(prompt, 24, stop_ids=[stop]) == free[:k]  # not yielded; every rank agrees (generate)
    assert group.status() == L.STATUS_STOP
    assert group.generate(prompt, 24, cancel=True) == []  # rank 0's flag, forwarded in the step's token message
    assert group.status() == L.STATUS_CANCELLED


def test_a_rank_whose_peer_never_starts_reports_it_and_stops(tiny):
    """Rank 1's kernel never runs (a dead GPU, a failed launch): rank 0 must not spin forever. After its
    tp_timeout_ns it writes STATUS_PEER_TIMEOUT and its done word (what the engine raises EngineFailed on) and
    traps, which ends its whole grid."""
    from replicas.monokernel_emu_tp import EmuTpGroup

    cfg, raw, _, _ = tiny
    group = EmuTpGroup(cfg, raw, 2, peer_timeout_ns=200_000)  # 200 emulated us: 200 spins
    prompt = np.random.default_rng(15).integers(0, cfg.vocab_size, 8).tolist()
    x_last, _ = group.prefill(prompt)
    with pytest.raises(RuntimeError, match=r"ranks \[0\] did not finish: rank 0: the emulated kernel trapped"):
        group.launch(x_last, len(prompt), 8, ranks=[0])
    ctrl = group.ranks[0].host_ctrl
    assert (ctrl[L.CTRL_STATUS], ctrl[L.CTRL_DONE], ctrl[L.CTRL_COUNT]) == (L.STATUS_PEER_TIMEOUT, 1, 0)
    for m in group.ranks:  # the emulation recovers from a trap (a GPU would need a new context)
        m.tp_params["tp_timeout_ns"] = 10**9
    assert len(group.generate(prompt, 8)) == 8


def test_eight_ranks_with_replicated_kv_heads_and_a_ragged_vocabulary():
    """8 q / 2 kv heads (each kv head on 4 ranks), tied head, q/k/v and o bias, q/k norm, 1,001-token vocabulary
    (the last rank's slice padded; tests/test_tp_cpu.py's eight-way model): the TP=8 kernel, 2 blocks per rank,
    against its TP=1 build and the reference engine."""
    from replicas.checkpoint import preset_config
    from replicas.model import ModelConfig
    from replicas.monokernel_emu import EmuModel
    from replicas.monokernel_emu_tp import EmuTpGroup
    from replicas.monokernel_weights import to_bf16_bits, to_f32
    from replicas.reference import ReferenceEngine
    from replicas.weights import expected_tensors

    cfg = ModelConfig(**{**preset_config("tiny").model_dump(), "num_attention_heads": 8, "num_key_value_heads": 2,
                         "head_dim": 32, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 1001,
                         "tie_word_embeddings": True, "qkv_bias": True, "o_bias": True, "qk_norm": True,
                         "num_hidden_layers": 2})
    rng = np.random.default_rng(14)
    bits = {}
    for k, shape in expected_tensors(cfg).items():
        scale = 1.0 if "embed" in k or "norm" in k else (1.0 / shape[-1]) ** 0.5
        bits[k] = to_bf16_bits(np, (rng.standard_normal(shape) * scale + (1.0 if "norm" in k else 0.0)).astype(np.float32))
    ids = rng.integers(0, cfg.vocab_size, 20).tolist()
    got = EmuTpGroup(cfg, dict(bits), 8, num_sms=2).forward_logits(ids)
    assert rel(got, EmuModel(cfg, dict(bits), num_sms=2).forward_logits(ids)) <= TP_TOL
    ref = ReferenceEngine(cfg, {k: to_f32(np, v) for k, v in bits.items()}).forward_logits(ids)
    assert rel(got, ref) <= REF_TOL
