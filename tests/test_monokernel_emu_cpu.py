"""The monokernel's own CUDA source, run on the CPU (replicas/monokernel_emu.py, csrc/emu/cuda_on_cpu.h):
the tiny model on a 4-block grid, teacher-forced and greedy, against the numpy reference engine.

What it catches without a GPU: wrong indices, a phase reading a buffer another phase laid out
differently, a missing barrier between blocks' hand-offs (the fibers interleave at every sync point).
Tolerances: the default layout keeps fp32 activations and bf16 weights/KV like the reference's bf16
checkpoint path, so the kernel matches the reference to 5e-3 of the largest logit (measured 1e-3);
layout option mma rounds every matvec input to bf16 as well (measured 2.3e-3; the GPU tests allow 2e-2).
"""

from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or platform.machine() not in ("x86_64", "AMD64"),
                                reason="the CPU emulation needs g++ on x86-64 (its fiber switch is x86-64 assembly)")

TOL = 5e-3


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    from replicas.model import ModelConfig
    from replicas.reference import ReferenceEngine
    from replicas.weights import load_weights

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    return cfg, load_weights(tiny_checkpoint, cfg, dtype="raw"), ReferenceEngine.from_pretrained(tiny_checkpoint)


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def logits_pair(cfg, tensors, ids, batch: int, options: dict, num_sms: int = 4, base_options: dict | None = None):
    """Teacher-forced logits of the default build (+ `base_options`) and of the default + `options` (batch > 1:
    three slots of one launch, stacked), both emulated on `num_sms` blocks; then the second model."""
    from replicas.monokernel_emu import EmuModel

    opts = {"batch": batch} if batch > 1 else {}
    base = EmuModel(cfg, tensors, layout_options={**opts, **(base_options or {})} or None, num_sms=num_sms)
    other = EmuModel(cfg, tensors, layout_options={**opts, **options}, num_sms=num_sms)
    if batch == 1:
        return base.forward_logits(ids), other.forward_logits(ids), other
    seqs = [ids, ids[::-1], ids[3:] + ids[:3]]
    return np.stack(base.forward_logits_slots(seqs)), np.stack(other.forward_logits_slots(seqs)), other


@pytest.mark.parametrize("options", [None, {"mma": True}], ids=["default", "mma"])
def test_teacher_forced_logits_and_greedy_tokens_match_the_reference(tiny, options):
    from replicas.engine import SamplingParams
    from replicas.monokernel_emu import EmuModel

    cfg, tensors, ref = tiny
    m = EmuModel(cfg, tensors, layout_options=options)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, 28).tolist()
    got, want = m.forward_logits(ids), ref.forward_logits(ids)
    assert got.shape == want.shape == (28, cfg.vocab_size) and np.abs(want).max() > 0
    assert rel(got[16:], want[16:]) <= TOL  # the positions the kernel decoded (the rest: the prefill)
    prompt = ids[:12]
    toks = m.generate_greedy(prompt, 10)
    oracle = list(ref.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
    # greedy tokens equal the oracle's wherever its top-2 margin is clear of the tolerance
    seq = list(prompt)
    for mine, theirs in zip(toks, oracle):
        logits = ref.forward_logits(seq)[-1]
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] > 2 * TOL * np.abs(logits).max():
            assert mine == theirs, (len(seq), mine, theirs)
        if mine != theirs:
            break
        seq.append(mine)
    assert len(toks) == 10


@pytest.mark.parametrize("batch", [1, 4])
def test_div32_param_value_and_gu_il_builds_compute_the_default_builds_numbers(batch):
    """div32 (32-bit unit ranges) must deal every warp the same units and gu_il (gate/up chunks
    interleaved, one input load per pair) sums in the same order, so the logits are bit-identical;
    param_value only changes how the block reaches the kernel (the emulation passes a pointer either
    way, so here it checks that the flag compiles and changes nothing else)."""

    # hidden 512: two chunks per gate row, so the interleaved order really differs from the plain one
    cfg, tensors, _ = small_family("llama-3.2-1b", hidden_size=512, intermediate_size=256, num_attention_heads=8)
    assert cfg.hidden_size // 256 == 2
    ids = np.random.default_rng(11).integers(0, cfg.vocab_size, 24).tolist()
    on = {"div32": True, "param_value": True, "gu_il": True}  # (div32 and param_value are engine defaults)
    want, got, _ = logits_pair(cfg, tensors, ids, batch, on, base_options={k: False for k in on})
    assert np.abs(want).max() > 0 and np.array_equal(want, got)


@pytest.mark.parametrize("batch", [1, 4])
def test_o_align_and_zero_spread_builds_compute_the_default_builds_numbers(batch):
    """o_align deals the O units per kv group to whole blocks and zero_spread zeroes the accumulators
    from every block: only who does the work changes, and the O / MLP results are int64 fixed-point sums
    (exact in any order), so the logits must be bit-identical. 6 blocks and 4 kv groups: evenly dealt,
    blocks 1 and 4 straddle a group boundary, so the aligned dealing really differs."""
    cfg, tensors, _ = small_family("llama-3.2-1b", hidden_size=256, intermediate_size=512,
                                   num_attention_heads=8, num_key_value_heads=4)
    warps, units = 6 * 16, 4 * 256  # streaming warps, O units (kv group-major: 256 rows per group)
    straddle = [b for b in range(6) if (units * 16 * b // warps) // 256 != (units * 16 * (b + 1) // warps - 1) // 256]
    assert straddle == [1, 4]
    ids = np.random.default_rng(12).integers(0, cfg.vocab_size, 24).tolist()
    # (the default build has o_align and zero_spread since session 6: compare against both off)
    on = {"o_align": True, "zero_spread": True}
    want, got, aligned = logits_pair(cfg, tensors, ids, batch, on, num_sms=6, base_options={k: False for k in on})
    assert aligned.layout.o_align and "-DMK_O_ALIGN=1" in aligned.layout.compile_flags()
    assert np.abs(want).max() > 0 and np.array_equal(want, got)


@pytest.mark.parametrize("passes", [2, 3])
def test_dn_passes_builds_add_the_down_in_parts_and_keep_the_numbers(passes):
    """dn_passes: each block adds its down partial in parts (each part's int64 atomics as soon as it is
    done). Every part is rounded to fixed point on its own, so logits move at the 2^-32 level only: within
    1e-5 of the default (measured below 1e-6), same greedy tokens."""
    from replicas.monokernel_emu import EmuModel

    cfg, tensors, _ = small_family("llama-3.2-1b", hidden_size=256, intermediate_size=512,
                                   num_attention_heads=8, num_key_value_heads=4)
    ids = np.random.default_rng(15).integers(0, cfg.vocab_size, 24).tolist()
    base = EmuModel(cfg, tensors, num_sms=6)
    parts = EmuModel(cfg, tensors, layout_options={"dn_passes": passes}, num_sms=6)
    assert f"-DMK_DN_PASSES={passes}" in parts.layout.compile_flags()
    want, got = base.forward_logits(ids), parts.forward_logits(ids)
    assert np.abs(want).max() > 0 and rel(got, want) <= 1e-5 and not np.array_equal(got, want)
    assert base.generate_greedy(ids[:8], 6) == parts.generate_greedy(ids[:8], 6)


@pytest.mark.parametrize("batch", [1, 4])
def test_norm_early_builds_compute_the_default_builds_numbers(batch):
    """norm_early only moves the RMSNorm weight loads of the residual prologues (QKV, MLP, LM head, the
    embedding's) before the block reduction: the same arithmetic, so bit-identical logits."""
    cfg, tensors, _ = small_family("llama-3.2-1b", hidden_size=512, intermediate_size=256, num_attention_heads=8)
    ids = np.random.default_rng(16).integers(0, cfg.vocab_size, 24).tolist()
    want, got, early = logits_pair(cfg, tensors, ids, batch, {"norm_early": True})
    assert "-DMK_NORM_EARLY=1" in early.layout.compile_flags()
    assert np.abs(want).max() > 0 and np.array_equal(want, got)


@pytest.mark.parametrize("dims, parts", [
    ({"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2}, 2),  # GDp 256: 2 threads per element
    ({"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 1}, 1),  # GDp 512: 1
])
def test_ao_preload_builds_stage_the_same_o_inputs(dims, parts):
    """ao_preload loads the attention splits' outputs before their statistics' round trip. With two threads per
    element (even / odd splits) the sum's order changes once a position has 3+ splits: an fp32 reordering that
    the bf16 K/V cache of later layers amplifies where a value sits on a rounding boundary (measured 7.7e-5 of
    the largest logit; the batch slots' split-count change gives the same kind, the GPU tests allow 1e-4), so:
    within 2e-4 of the default and exactly as far from the fp32 reference as the default is. With one thread
    per element the order is the default's: bit-identical. 48 tokens: up to 3 KV splits on 8 blocks."""
    from replicas.reference import ReferenceEngine

    cfg, tensors, f32 = small_family("llama-3.2-1b", intermediate_size=512, **dims)
    ids = np.random.default_rng(17).integers(0, cfg.vocab_size, 48).tolist()
    want, got, pre = logits_pair(cfg, tensors, ids, 1, {"ao_preload": True}, num_sms=8)
    assert "-DMK_AO_PRELOAD=1" in pre.layout.compile_flags() and pre.layout.attn_splits_max >= 3
    assert np.abs(want).max() > 0 and rel(got, want) <= 2e-4
    ref = ReferenceEngine(cfg, dict(f32)).forward_logits(ids)
    assert abs(rel(got[16:], ref[16:]) - rel(want[16:], ref[16:])) <= 0.01 * rel(want[16:], ref[16:])
    if parts == 1:
        assert np.array_equal(got, want)


def test_the_kernel_writes_the_prefills_kv_rows(tiny):
    """K/V rows the kernel appends equal what a prefill of the whole sequence computes for them (within
    bf16 rounding: 1e-2, mma 2e-2), rows it was given stay, and nothing else is written."""
    from replicas.monokernel_emu import EmuModel
    from replicas.monokernel_weights import to_f32

    cfg, tensors, _ = tiny
    ids = np.random.default_rng(8).integers(0, cfg.vocab_size, 20).tolist()
    full = EmuModel(cfg, tensors)
    full.prefill(ids)
    for options, tol in ((None, 1e-2), ({"mma": True}, 2e-2)):
        m = EmuModel(cfg, tensors, layout_options=options)
        x_last, _ = m.prefill(ids[:16])
        before = m.k_cache[:, :, :16].copy(), m.v_cache[:, :, :16].copy()
        m.launch(x_last, 16, 5, forced=ids[16:20], logits=np.zeros((5, cfg.vocab_size), np.float32))
        for cache, want, kept in ((m.k_cache, full.k_cache, before[0]), (m.v_cache, full.v_cache, before[1])):
            got, exp = to_f32(np, cache[:, :, 16:20]), to_f32(np, want[:, :, 16:20])
            assert rel(got, exp) <= tol, options
            assert np.array_equal(cache[:, :, :16], kept)  # the prefill's rows are left alone
            assert not cache[:, :, 20:].any()  # and nothing past the last fed position is written


@pytest.mark.parametrize("options", [{}, {"mma": True}], ids=["default", "mma"])
def test_batch_slots_equal_the_single_sequence_kernel(tiny, options):
    """A B = 4 build decoding 3 sequences of different lengths in one launch (one slot left empty, one
    finishing before the others): each slot's logits are the B = 1 kernel's of the same layout to fp32
    rounding (1e-4, as tests/test_monokernel_batch_gpu.py; measured up to 1.1e-5: with several slots live
    each gets fewer attention splits). With mma that difference can flip one bf16 rounding of an O input
    (5e-3; 0 here, up to 1.2e-3 seen at B = 8)."""
    from replicas.monokernel_emu import EmuModel

    cfg, tensors, _ = tiny
    rng = np.random.default_rng(12)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (30, 21, 26)]
    one = EmuModel(cfg, tensors, layout_options=options or None)
    many = EmuModel(cfg, tensors, layout_options={"batch": 4, **options})
    for got, seq in zip(many.forward_logits_slots(seqs), seqs):
        want = one.forward_logits(seq)
        assert got.shape == want.shape == (len(seq), cfg.vocab_size)
        assert rel(got, want) <= (5e-3 if options else 1e-4)


def small_family(preset: str, **dims):
    """`preset`'s architecture (its flags: q/k norm, q/k/v bias, tied head, rope) at tiny dims, with
    fresh random bf16 weights: (config, raw tensors for the kernel, fp32 tensors for the reference)."""
    from replicas.model import ModelConfig
    from replicas.monokernel_weights import to_bf16_bits
    from replicas.presets import GENERATION, PRESETS
    from replicas.weights import expected_tensors

    raw = {**PRESETS[preset], "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, **dims}
    cfg = ModelConfig.from_hf_dict(raw, GENERATION[preset], source=f"small {preset}")
    rng = np.random.default_rng(21)
    bits = {}
    for name, shape in expected_tensors(cfg).items():
        scale = 1.0 if name.endswith("norm.weight") else 0.08
        base = 1.0 if name.endswith("norm.weight") else 0.0
        bits[name] = to_bf16_bits(np, (base + scale * rng.standard_normal(shape)).astype(np.float32))
    f32 = {k: (v.astype(np.uint32) << 16).view(np.float32) for k, v in bits.items()}
    return cfg, bits, f32


@pytest.mark.parametrize("preset,dims", [("qwen3-0.6b", {"head_dim": 32}), ("qwen2.5-1.5b", {})],
                         ids=["qwen3-qknorm-headdim", "qwen2-qkv-bias-tied"])
def test_other_families_match_the_reference(preset, dims):
    """q/k RMSNorm with an explicit head_dim (Qwen3), q/k/v bias with a tied LM head (Qwen2), on the default
    and the mma layout: the kernel's teacher-forced logits vs the reference engine's (fp32 throughout) within
    the GPU tests' 2e-2 (measured 5.1e-3 / 6.2e-3: these random weights feel the bf16 KV cache more than
    tiny's), and the default kernel vs the numpy prefill path of the same bf16 conventions within 1e-3
    (measured 4.7e-4 / 8e-5)."""
    from replicas.monokernel_emu import EmuModel
    from replicas.reference import ReferenceEngine

    cfg, bits, f32 = small_family(preset, **dims)
    assert (cfg.qk_norm, cfg.qkv_bias) == ((True, False) if preset.startswith("qwen3") else (False, True))
    ref = ReferenceEngine(cfg, dict(f32))
    ids = np.random.default_rng(22).integers(0, cfg.vocab_size, 24).tolist()
    want = ref.forward_logits(ids)
    for options in (None, {"mma": True}):
        m = EmuModel(cfg, dict(bits), layout_options=options)
        got = m.forward_logits(ids)
        assert rel(got[16:], want[16:]) <= 2e-2, options
        if options is None:
            assert rel(got[16:], m.forward_logits(ids, prefill_len=len(ids))[16:]) <= 1e-3


def test_act_bf16_batch_builds_compute_with_bf16_inputs():
    """act_bf16 keeps a batch build's matvec inputs in shared memory as bf16 (half the per-slot input reads).
    The mma build has bf16 inputs too (other summation order): the two agree to 5e-3 (measured <= 2.0e-3).
    Both sit as far from the fp32-input B = 1 kernel as bf16 rounding puts them on these random weights
    (measured 0.7-1.7e-2 of the largest logit; bound 3e-2, the same order as the transformers tolerance)."""
    from replicas.layout import KernelLayout, LayoutError
    from replicas.monokernel_emu import EmuModel

    cfg, tensors, _ = small_family("llama-3.2-1b", hidden_size=512, intermediate_size=256, num_attention_heads=8)
    rng = np.random.default_rng(17)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (28, 19, 24)]
    bf = EmuModel(cfg, tensors, layout_options={"batch": 4, "act_bf16": True})
    assert "-DMK_ACT_BF16=1" in bf.layout.compile_flags()
    mma = EmuModel(cfg, tensors, layout_options={"batch": 4, "mma": True})
    one = EmuModel(cfg, tensors)
    for s, got, other in zip(seqs, bf.forward_logits_slots(seqs), mma.forward_logits_slots(seqs)):
        want = one.forward_logits(s)
        assert rel(got, other) <= 5e-3
        assert 1e-5 < rel(got, want) <= 3e-2  # (not the fp32 path)
    for bad in ({"batch": 1}, {"batch": 4, "mma": True}):
        with pytest.raises(LayoutError, match="act_bf16 .* needs batch > 1 and not mma"):
            KernelLayout.from_config(cfg, 256, act_bf16=True, fused_mlp=True, fused_attn_o=True, **bad)
