"""Layout option `fused_mlp` (gate/up -> down with a block-local split-K, off by default) on the
CPU: the packed down is a permutation of down^T that gives every warp one contiguous run; a numpy
model of the kernel's reduction order (per-warp fp32, row groups in order, int64 fixed point over
blocks) through the loader's packing matches the reference engine's MLP; bad combinations are
refused; default builds keep their flags; the variant compiles for sm_90a (where nvcc exists)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from replicas import layout_fused as F
from replicas.checkpoint import preset_config
from replicas.layout import KernelLayout, LayoutError
from replicas.monokernel_build import kernel_source, nvcc_command
from replicas.monokernel_weights import pack_weights, to_f32
from replicas.reference import ReferenceEngine, rms_norm, silu
from replicas.tp_shard import shard_config
from replicas.weights import load_weights


def fused(preset: str, num_sms: int = 132, **kw) -> KernelLayout:
    return KernelLayout.from_config(preset_config(preset), max_ctx=256, num_sms=num_sms, fused_mlp=True, **kw)


@pytest.mark.parametrize("preset, sms", [("tiny", 132), ("tiny", 7), ("llama-3.2-1b", 132), ("qwen3-0.6b", 132)])
def test_every_warp_run_is_contiguous_and_the_runs_tile_the_layer(preset, sms):
    lay = fused(preset, sms)
    covered = np.zeros(lay.inter * lay.hp // F.CHUNK, np.int32)
    for b in range(lay.num_sms):
        js, je = F.block_rows(lay.inter, lay.num_sms, b)
        rows = 0
        for w in range(lay.warps_per_block):
            a, n, col0, ncols, off = F.warp_down_share(lay, b, w)
            assert 0 <= a and a + n <= je - js and off % F.CHUNK == 0
            covered[off // F.CHUNK:off // F.CHUNK + n * ncols] += 1
            rows += n * ncols
        assert rows == (je - js) * lay.hp // F.CHUNK  # each block streams exactly its slice's columns
    assert (covered == 1).all()


def test_packing_places_each_down_column_slice_where_its_warp_reads_it():
    lay = fused("tiny", 7)
    rng = np.random.default_rng(0)
    down = rng.integers(0, 2**16, (lay.hidden, lay.inter), dtype=np.uint16)
    packed = F.pack_down_fused(np, lay, down)
    dt = np.zeros((lay.inter, lay.hp), np.uint16)
    dt[:, :lay.hidden] = down.T
    for b in range(lay.num_sms):
        js, _ = F.block_rows(lay.inter, lay.num_sms, b)
        for w in range(lay.warps_per_block):
            a, n, col0, ncols, off = F.warp_down_share(lay, b, w)
            run = packed[off:off + n * ncols * F.CHUNK].reshape(ncols, n, F.CHUNK)
            for k in range(ncols):
                c = (col0 + k) * F.CHUNK
                np.testing.assert_array_equal(run[k], dt[js + a:js + a + n, c:c + F.CHUNK])


@pytest.mark.parametrize("sms", [132, 5])
def test_simulated_fused_mlp_matches_the_reference_engine(tiny_checkpoint, sms):
    """Through pack_weights (the GPU loader's code) on the tiny preset, every layer, 3 vectors."""
    config = preset_config("tiny")
    lay = KernelLayout.from_config(config, max_ctx=64, num_sms=sms, fused_mlp=True)
    packed = pack_weights(np, lay, config, load_weights(tiny_checkpoint, config, dtype="raw"))
    ref = ReferenceEngine.from_pretrained(tiny_checkpoint)
    assert packed["w_dn"].shape == (config.num_hidden_layers, config.intermediate_size * lay.hp)
    rng = np.random.default_rng(1)
    inter = config.intermediate_size
    worst = 0.0
    for li, w in enumerate(ref.layers):
        for _ in range(3):
            x = rms_norm(rng.standard_normal(config.hidden_size).astype(np.float32) * 3, w.mlp_norm, config.rms_norm_eps)
            want = (silu(x @ w.gate_up[:inter].T) * (x @ w.gate_up[inter:].T)) @ w.down.T
            gu = to_f32(np, packed["w_gu"][li])[:, :, :config.hidden_size]  # the kernel's gate/up units
            h = (silu(gu[:, 0] @ x) * (gu[:, 1] @ x)).astype(np.float32)
            got = F.simulate_fused_down(lay, packed["w_dn"][li], h)
            worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
    assert worst < 1e-5, worst  # fp32 reordering + 2^-32 fixed point: far below the 2e-2 budget


def test_prefill_keeps_plain_down_rows_under_fused_mlp(tiny_checkpoint):
    """The prompt's GEMMs read w_dn_prefill (plain rows), so prefill is unchanged by the option."""
    import types

    from replicas.monokernel_prefill import Prefill
    from replicas.monokernel_weights import rope_tables

    cfg = preset_config("tiny")
    lay = KernelLayout.from_config(cfg, max_ctx=64, num_sms=132, fused_mlp=True)
    m = types.SimpleNamespace(config=cfg, weights=pack_weights(np, lay, cfg, load_weights(tiny_checkpoint, cfg, dtype="raw")))
    m.rope_cos, m.rope_sin = rope_tables(cfg, 64)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, 64, cfg.head_dim)
    m.k_cache, m.v_cache = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 24).tolist()
    _, logits = Prefill(m, np).run(ids, all_logits=True)
    ref = ReferenceEngine.from_pretrained(tiny_checkpoint).forward_logits(ids)
    assert np.max(np.abs(logits - ref)) / np.max(np.abs(ref)) < 5e-3


def test_bad_combinations_are_refused_clearly():
    c = preset_config("tiny")
    with pytest.raises(LayoutError, match="single-GPU only"):
        KernelLayout.from_config(shard_config(c, 2), max_ctx=64, tp=2, vocab_total=c.vocab_size, fused_mlp=True)
    # an L2 budget goes to gate/up alone: the fused down's block tiles are not the rows l2_prefetch walks
    lay = KernelLayout.from_config(preset_config("llama-3.2-1b"), max_ctx=64, l2_budget=32 << 20, fused_mlp=True)
    gu, dn = lay.l2_prefetch_per_warp()
    assert gu > 0 and dn == 0
    with pytest.raises(LayoutError, match="chunk columns"):  # hidden 3072 = 12 columns vs 16 warps
        KernelLayout.from_config(preset_config("llama-3.2-3b"), max_ctx=64, fused_mlp=True)


def test_default_builds_see_no_fused_flags():
    lay = KernelLayout.from_config(preset_config("llama-3.2-1b"), max_ctx=4096, num_sms=132)
    assert not [f for f in lay.compile_flags() if "FUSED" in f or "MK_FX" in f]
    assert lay.packed_shapes()["w_dn"] == (16, 2048, 8192)
    f = dict(x[2:].split("=", 1) for x in fused("llama-3.2-1b").compile_flags())
    assert (f["MK_FUSED_MLP"], f["MK_FX_R"], f["MK_FX_WC"], f["MK_FX_M"]) == ("1", "2", "8", "1")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot check the sm_90a fused build")
@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b"])
def test_fused_kernel_compiles_for_sm90a(preset, tmp_path):
    src = tmp_path / "mk.cu"
    src.write_text(kernel_source())
    r = subprocess.run(nvcc_command(fused(preset), src, tmp_path / "mk.cubin"), check=False,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "spill" in r.stderr
