"""Batch builds on the CPU (layout option batch = B, csrc/mk_batch.cuh): flags, per-slot buffer sizes,
shared memory, refusals, the generated parameter block and slot table, which build a launch picks; where
nvcc exists, batch builds compile for sm_90a. The batched engine's scheduler is
tests/test_monokernel_batch_cpu.py; the CUDA side tests/test_monokernel_batch_gpu.py.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from replicas import layout as L
from replicas.checkpoint import preset_config
from replicas.layout import KernelLayout, LayoutError, params_header
from replicas.monokernel_build import kernel_source, nvcc_command
from tests.test_monokernel_cpu import flags

FUSED = {"fused_mlp": True, "fused_attn_o": True}
PRESETS = ["tiny", "llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b"]
BATCH_FLAGS = ("MK_BATCH", "MK_ACT_VEC", "MK_FX_SLICE")
# work buffers with one copy per slot (layout.buffer_sizes); h_buf and attn_out are shared
PER_SLOT = ("xbuf", "qkv_part", "o_part", "dn_part", "attn_m", "attn_l", "attn_o", "best_val")


@pytest.mark.parametrize("preset", PRESETS)
def test_batch_layouts_flags_buffers_and_shared_memory(preset):
    cfg = preset_config(preset)
    one = KernelLayout.from_config(cfg, 4096, batch=1, **FUSED)
    assert flags(one).keys().isdisjoint(BATCH_FLAGS)
    assert one.compile_flags() == KernelLayout.from_config(cfg, 4096, **FUSED).compile_flags()
    assert one.param_fields() == L.PARAM_FIELDS
    for b in (2, 4, 8):
        lay = KernelLayout.from_config(cfg, 4096, batch=b, **FUSED)
        f = flags(lay)
        assert (f["MK_BATCH"], f["MK_ACT_VEC"]) == (str(b), str(lay.act_vec))
        assert int(f["MK_FX_SLICE"]) > 0
        assert lay.smem_bytes <= L.SMEM_LIMIT and lay.ring_slots >= 4, (preset, b)
        got, base = lay.buffer_sizes(), one.buffer_sizes()
        for name in PER_SLOT:
            assert got[name] == b * base[name], (preset, b, name)
        assert (got["h_buf"], got["attn_out"]) == (base["h_buf"], base["attn_out"])
        assert lay.param_fields()[-len(L.BATCH_PARAM_FIELDS):] == L.BATCH_PARAM_FIELDS
        assert len(lay.param_fields()) == len(L.PARAM_FIELDS) + len(L.BATCH_PARAM_FIELDS)


def test_bad_batches_are_refused_clearly():
    cfg = preset_config("llama-3.2-1b")
    for b in (0, 9):
        with pytest.raises(LayoutError, match=f"batch={b}: .*1..{L.MAX_BATCH}"):
            KernelLayout.from_config(cfg, 4096, batch=b, **FUSED)
    for opts in ({"fused_mlp": True}, {"fused_attn_o": True}, {}):
        with pytest.raises(LayoutError, match="batch=4 needs the fused layout"):
            KernelLayout.from_config(cfg, 4096, batch=4, **opts)
    with pytest.raises(LayoutError, match="ao_slots .* needs batch > 1"):
        KernelLayout.from_config(cfg, 4096, ao_slots=True, **FUSED)


def test_ao_slots_is_a_batch_only_flag():
    cfg = preset_config("llama-3.2-1b")
    on = KernelLayout.from_config(cfg, 4096, batch=4, ao_slots=True, **FUSED).compile_flags()
    off = KernelLayout.from_config(cfg, 4096, batch=4, **FUSED).compile_flags()
    assert "-DMK_AO_SLOTS=1" in on and not any("MK_AO_SLOTS" in f for f in off)
    assert sorted(set(on) - set(off)) == ["-DMK_AO_SLOTS=1"]


def test_a_launch_uses_the_smallest_build_holding_its_highest_slot():
    from replicas.monokernel_batch import pick_build

    x = object()
    assert pick_build([8, 2, 4], [x, x, None, None, None, None, None, None]) == 2
    assert pick_build([8, 2, 4], [None, None, x, None, None, None, None, None]) == 4  # slot 2 needs B >= 3
    assert pick_build([8, 2, 4], [x] * 5 + [None] * 3) == 8
    assert pick_build([8], [x, x, None, None, None, None, None, None]) == 8  # no sub-builds
    with pytest.raises(ValueError, match="slot 4 is occupied but the largest build has 4 slots"):
        pick_build([2, 4], [None] * 4 + [x])
    # a resident launch keeps `room` free slots above the highest occupied one, as far as the builds go
    assert pick_build([8, 2, 4], [x, None, None, None, None, None, None, None], room=1) == 2
    assert pick_build([8, 2, 4], [x, x, None, None, None, None, None, None], room=1) == 4
    assert pick_build([8, 2, 4], [x] * 7 + [None], room=2) == 8


def test_params_header_declares_the_slot_table_and_guards_batch_fields():
    lines = params_header().splitlines()
    i = lines.index("struct __align__(8) MkSlot {")
    assert lines[i + 1:i + 1 + len(L.SLOT_FIELDS)] == [f"  {ct} {n};" for n, ct in L.SLOT_FIELDS]
    assert lines[i + 1 + len(L.SLOT_FIELDS)] == "};"
    g = lines.index("#if defined(MK_BATCH) && MK_BATCH > 1")
    assert g > lines.index("struct __align__(8) MkParams {")
    nb, nr = len(L.BATCH_PARAM_FIELDS), len(L.RESIDENT_PARAM_FIELDS)
    assert lines[g + 1:g + 1 + nb] == [f"  {ct} {n};" for n, ct in L.BATCH_PARAM_FIELDS]
    # resident builds' fields nested inside the batch ones, after them
    assert lines[g + 1 + nb:g + 3 + nb + nr + 1] == \
        ["#if defined(MK_RESIDENT) && MK_RESIDENT"] + [f"  {ct} {n};" for n, ct in L.RESIDENT_PARAM_FIELDS] + \
        ["#endif", "#endif"]
    size = 8 * (len(L.PARAM_FIELDS) + nb)
    assert f"sizeof(MkParams) == {size}" in params_header()
    assert f"sizeof(MkParams) == {size + 8 * nr}" in params_header()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot check the sm_90a build")
@pytest.mark.parametrize("preset,extra", [("tiny", {}),  # (the CUDA-core batch set; the defaults: test_layout_mma_mlp_cpu)
                                          ("llama-3.2-1b", {"ao_slots": True, "resident": True, "num_sms": 116})])
def test_batch_kernel_compiles_for_sm90a(preset, extra, tmp_path):
    lay = KernelLayout.from_config(preset_config(preset), max_ctx=2048, batch=4, **FUSED, **extra)
    src = tmp_path / "mk.cu"
    src.write_text(kernel_source())
    r = subprocess.run(nvcc_command(lay, src, tmp_path / "mk.cubin"), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "spill" in r.stderr  # ptxas -v resource report was produced


# ---- the scheduler on a stand-in GPU -------------------------------------------------------------
