"""The tensor-parallel kernel build on the CPU side: layout flags and exchange-region offsets,
the parameter block, and (where nvcc exists) that csrc/ compiles for sm_90a with MK_TP = 1, 2, 4,
8 and the timing-only variant without all-reduces."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from replicas import layout as L
from replicas.checkpoint import preset_config
from replicas.layout import KernelLayout, LayoutError, params_header
from replicas.monokernel_build import kernel_source, nvcc_command
from replicas.tp_shard import shard_config


def tp_layout(preset: str, n: int, **kw) -> KernelLayout:
    c = preset_config(preset)
    if n == 1:
        return KernelLayout.from_config(c, max_ctx=2048, **kw)
    return KernelLayout.from_config(shard_config(c, n), max_ctx=2048, tp=n, vocab_total=c.vocab_size, **kw)


def flags(lay: KernelLayout) -> dict[str, str]:
    return dict(f[2:].split("=", 1) for f in lay.compile_flags())


def test_single_gpu_build_sees_no_tp_flags_or_fields():
    """TP=1 keeps its exact flags (same NVRTC cache key, same code: the TP blocks are #if'd out)."""
    lay = tp_layout("llama-3.2-1b", 1)
    assert not [k for k in flags(lay) if k.startswith("MK_TP") or k == "MK_V_ALL"]
    assert lay.param_fields() == L.PARAM_FIELDS


def test_tp_flags_describe_the_shard_and_the_exchange_region():
    lay = tp_layout("llama-3.2-1b", 2)
    f = flags(lay)
    assert (f["MK_TP"], f["MK_NH"], f["MK_NKV"], f["MK_I"], f["MK_V"], f["MK_V_ALL"]) == \
        ("2", "16", "4", "4096", "64128", "128256")
    off = lay.tp_offsets()
    assert off["RECV_DN"] - off["RECV_O"] == 2048 * 2 and off["LOGITS"] - off["RECV_DN"] == 2048 * 2
    assert off["WORDS"] == off["LOGITS"] + 2 * 64128
    assert all(f[f"MK_TP_OFF_{k}"] == str(v) for k, v in off.items())
    assert lay.param_fields()[-len(L.TP_PARAM_FIELDS):] == L.TP_PARAM_FIELDS
    assert tp_layout("llama-3.2-1b", 8).group == 4  # 4 local q heads on the GPU's one kv head


def test_params_header_guards_the_tp_fields():
    h = params_header()
    assert "#if defined(MK_TP) && MK_TP > 1\n  float* tp_local;" in h
    assert f"sizeof(MkParams) == {8 * (len(L.PARAM_FIELDS) + len(L.TP_PARAM_FIELDS))}" in h


def test_bad_tp_layouts_are_refused():
    c = preset_config("tiny")
    with pytest.raises(LayoutError, match="tp=3"):
        KernelLayout.from_config(c, max_ctx=64, tp=3)
    with pytest.raises(LayoutError, match="needs tp > 1"):
        KernelLayout.from_config(c, max_ctx=64, tp_skip_allreduce=True)
    with pytest.raises(LayoutError, match="vocab_total"):
        KernelLayout.from_config(shard_config(c, 2), max_ctx=64, tp=2, vocab_total=5000)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot check the sm_90a TP builds")
@pytest.mark.parametrize("preset, n, skip", [("llama-3.2-1b", 2, False),
                                             ("llama-3.2-1b", 2, True), ("qwen3-1.7b", 8, False)])
def test_tp_kernel_compiles_for_sm90a(preset, n, skip, tmp_path):
    lay = tp_layout(preset, n, tp_skip_allreduce=skip)
    src = tmp_path / "mk.cu"
    src.write_text(kernel_source())
    r = subprocess.run(nvcc_command(lay, src, tmp_path / "mk.cubin"), check=False, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "spill" in r.stderr
