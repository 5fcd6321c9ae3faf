"""The engines' default layout (replicas/layout_tuned.py) and the tuning options it uses: which
options each model gets, that every preset builds with them, that explicit choices win, that
tensor-parallel builds keep the plain layout, and that the option flags reach the compiler only
when set (the plain kernel's flags are unchanged)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from replicas.checkpoint import PRESETS, preset_config
from replicas.layout import KernelLayout, LayoutError
from replicas.layout_tuned import TUNED_SINGLE_GPU, engine_options
from replicas.monokernel_build import kernel_source, nvcc_command
from replicas.tp_shard import shard_config


def flags(lay: KernelLayout) -> dict[str, str]:
    return dict(f[2:].split("=", 1) for f in lay.compile_flags())


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_with_the_engine_default(preset):
    c = preset_config(preset)
    opts = engine_options(c)
    lay = KernelLayout.from_config(c, 4096, **opts)
    assert lay.fused_attn_o and lay.x_perm and lay.split_pos == 16
    # fused_mlp needs hidden/256 chunk columns to tile the 16 streaming warps (3072 -> 12 and 1536 -> 6 do not)
    assert lay.fused_mlp == (preset not in ("llama-3.2-3b", "qwen2.5-1.5b"))
    f = flags(lay)
    assert f["MK_XPERM"] == "1" and f["MK_SPLIT_POS"] == "16" and f["MK_ATTN_O"] == "1"
    assert f["MK_O_ALIGN"] == "1" and f["MK_ZERO_SPREAD"] == "1"


def test_explicit_choices_win_and_tp_keeps_the_plain_layout():
    c = preset_config("llama-3.2-1b")
    assert engine_options(c) == TUNED_SINGLE_GPU
    plain = engine_options(c, {"fused_mlp": False, "fused_attn_o": False, "x_perm": False, "split_pos": 64})
    assert not any(k in flags(KernelLayout.from_config(c, 4096, **plain)) for k in ("MK_FUSED_MLP", "MK_ATTN_O", "MK_XPERM", "MK_SPLIT_POS"))
    assert engine_options(c, {"qkv_flags": True}).get("fused_attn_o") is None  # it needs the QKV barrier
    # o_align / zero_spread refine the fused paths: they leave with them, unless asked for (then refused)
    assert "o_align" not in plain and "zero_spread" not in plain
    assert "o_align" not in engine_options(c, {"qkv_flags": True})
    with pytest.raises(LayoutError, match="o_align .* needs fused_attn_o"):
        KernelLayout.from_config(c, 4096, **engine_options(c, {"fused_attn_o": False, "o_align": True}))
    with pytest.raises(LayoutError, match="zero_spread .* needs fused_mlp or fused_attn_o"):
        KernelLayout.from_config(c, 4096, **{**plain, "zero_spread": True})
    tp = engine_options(shard_config(c, 2), {"tp": 2, "vocab_total": c.vocab_size})
    assert tp == {"tp": 2, "vocab_total": c.vocab_size}
    KernelLayout.from_config(shard_config(c, 2), 4096, **tp)


def test_fused_builds_give_the_unused_staging_to_the_weight_ring():
    c = preset_config("llama-3.2-1b")
    plain = KernelLayout.from_config(c, 4096)
    tuned = KernelLayout.from_config(c, 4096, **engine_options(c))
    assert plain.act_floats == c.intermediate_size and plain.ring_slots == 24
    assert tuned.act_floats < plain.act_floats and tuned.ring_slots == 26
    assert tuned.smem_bytes <= 227 * 1024
    assert KernelLayout.from_config(c, 4096, max_ring=16, **engine_options(c)).ring_slots == 16


@pytest.mark.parametrize("bad, match", [({"split_pos": 0}, "split_pos=0"), ({"max_ring": 2}, "max_ring=2"),
                                        ({"max_ring": 64}, "max_ring=64"),
                                        ({"dn_passes": 2}, "dn_passes=2: .* needs fused_mlp"),
                                        ({"dn_passes": 5, "fused_mlp": True}, "dn_passes=5"),
                                        ({"dn_passes": 2, "fused_mlp": True, "fused_attn_o": True, "batch": 4}, "dn_passes=2: .* batch=1"),
                                        ({"ao_preload": True}, "ao_preload .* needs fused_attn_o and batch=1"),
                                        ({"ao_preload": True, "fused_mlp": True, "fused_attn_o": True, "batch": 2},
                                         "ao_preload .* batch=1"),
                                        ({"best_max": True}, "best_max .* needs batch > 1 and not block_best"),
                                        ({"best_max": True, "block_best": True, "batch": 4, "fused_mlp": True, "fused_attn_o": True},
                                         "best_max .* not block_best")])
def test_bad_tuning_values_are_refused(bad, match):
    with pytest.raises(LayoutError, match=match):
        KernelLayout.from_config(preset_config("tiny"), 64, **bad)


def test_batched_engines_default_to_the_tensor_core_set_where_shapes_allow():
    from replicas.layout_tuned import TUNED_BATCH, TUNED_BATCH_CUDA_CORES, batch_options
    from replicas.model import ModelConfig

    for preset in ("tiny", "llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b"):
        c = preset_config(preset)
        wide = c.hidden_size >= 4096  # pair_norm: on 8B, not on 1B (bench/RESULTS.md session 13)
        # pair_dn on every even grid (session 15), pair_norm where the prologues read wide vectors
        paired = {**TUNED_BATCH, "pair_dn": True}
        assert batch_options(c) == ({**paired, "pair_norm": True} if wide else paired)
        assert batch_options(c, grid_sms=131) == TUNED_BATCH  # an odd grid cannot pair its blocks
        assert batch_options(c, {"tp": 2}).get("pair_dn") is None  # the pairs are tp = 1 only
        assert batch_options(c, {"pair_dn": False})["pair_dn"] is False  # explicit choices win
        # pair_norm by slots x hidden (session 14): on for 1B at B = 8, not at B = 4; 8B at every B
        assert batch_options(c, batch=8).get("pair_norm", False) is (c.hidden_size * 8 >= 16384)
        assert batch_options(c, batch=4).get("pair_norm", False) is wide
        lay = KernelLayout.from_config(c, 2048, **engine_options(c, {**batch_options(c), "batch": 4}))
        assert lay.mma_mlp and lay.mma_lm and lay.norm_once and lay.ao_slots and not lay.gu_il
        assert lay.mma_qkv and lay.mma_o
    c = preset_config("llama-3.2-1b")
    assert batch_options(c, {"gu_il": True}) == {**TUNED_BATCH_CUDA_CORES, "gu_il": True}  # asked for: CUDA cores
    assert batch_options(c, {"mma_mlp": False}) == {**TUNED_BATCH_CUDA_CORES, "mma_mlp": False}
    assert batch_options(c, {"mma": True}) == {"mma": True}
    assert "best_max" not in batch_options(c, {"block_best": True})  # (one merge of the LM head's bests or the other)
    assert batch_options(c, {"norm_once": False}) == {**paired, "norm_once": False}  # explicit choices win
    # turning off what mma_qkv / mma_o build on leaves them out instead of refusing the layout
    for off, dropped in (({"qkv_flags": True}, {"mma_qkv", "mma_o", "fx_pack"}), ({"o_align": False}, {"mma_o", "fx_pack"}),
                         ({"fused_attn_o": False}, {"mma_o", "fx_pack"}), ({"fold_x": False}, {"fx_pack"})):
        opts = batch_options(c, off)
        assert opts == {**{k: v for k, v in paired.items() if k not in dropped}, **off}
    lay = KernelLayout.from_config(c, 2048, **engine_options(c, {**batch_options(c, {"o_align": False}), "batch": 4}))
    assert lay.mma_qkv and not lay.mma_o
    c8 = preset_config("llama-3.1-8b")
    assert batch_options(c8, {"pair_norm": False}) == {**paired, "pair_norm": False}
    assert not {"pair_norm", "pair_dn"} & set(batch_options(c8, {"mma_mlp": False}))  # (the CUDA-core set keeps its measured form)
    lay = KernelLayout.from_config(c8, 2048, **engine_options(c8, {**batch_options(c8, grid_sms=116), "batch": 8,
                                                                   "num_sms": 116}))
    assert lay.pair_norm and lay.pair_dn and "-DMK_PAIR_NORM=1" in lay.compile_flags()
    odd = ModelConfig.from_hf_dict({**PRESETS["llama-3.2-1b"], "vocab_size": 128_250}, source="odd vocab")
    assert batch_options(odd) == TUNED_BATCH_CUDA_CORES  # (the LM head's tiles need a multiple of 16)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot check the sm_90a build")
@pytest.mark.parametrize("preset", ["tiny", "qwen3-0.6b", "llama-3.2-3b"])
def test_engine_default_compiles_for_sm90a(preset, tmp_path):
    c = preset_config(preset)
    src = tmp_path / "mk.cu"
    src.write_text(kernel_source())
    lay = KernelLayout.from_config(c, 2048, **engine_options(c))
    r = subprocess.run(nvcc_command(lay, src, tmp_path / "mk.cubin"), check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
