"""Weight loading: formats (bf16/fp16/fp32, single/sharded), and a clear error per malformed case."""

import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from replicas import checkpoint
from replicas.checkpoint import make_checkpoint
from replicas.model import ModelConfig
from replicas.weights import CheckpointError, expected_tensors, load_weights

EMBED = "model.embed_tokens.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def tiny_config(tiny_checkpoint):
    return ModelConfig.from_pretrained(tiny_checkpoint)


def clone(src, dst, mutate=None, config_update=None):
    """Copy a checkpoint dir, re-saving its weights as fp32 after `mutate(dict)`."""
    shutil.copytree(src, dst)
    if config_update:
        raw = json.loads((dst / "config.json").read_text())
        raw.update(config_update)
        (dst / "config.json").write_text(json.dumps(raw))
    if mutate:
        tensors = {k: np.array(v) for k, v in load_weights(src, ModelConfig.from_pretrained(src)).items()}
        mutate(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_expected_tensors_cover_every_option():
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "attention_bias": True, "tie_word_embeddings": True})
    want = expected_tensors(cfg)
    assert want["model.layers.1.self_attn.q_proj.weight"] == (64, 32)
    assert want["model.layers.1.self_attn.k_proj.bias"] == (32,)
    assert want["model.layers.1.self_attn.o_proj.weight"] == (32, 64)
    assert want["model.layers.1.self_attn.o_proj.bias"] == (32,)
    assert want["model.layers.1.self_attn.q_norm.weight"] == (16,)
    assert want["model.layers.0.mlp.down_proj.weight"] == (32, 48)
    assert "lm_head.weight" not in want  # tied
    assert sum(np.prod(s) for s in want.values()) == cfg.num_parameters()


def test_bf16_loads_exactly_as_float32_and_raw(tiny_checkpoint, tiny_config):
    f32 = load_weights(tiny_checkpoint, tiny_config)
    raw = load_weights(tiny_checkpoint, tiny_config, dtype="raw")
    assert set(f32) == set(expected_tensors(tiny_config))
    assert raw[Q0].dtype == np.uint16 and f32[Q0].dtype == np.float32
    assert not raw[Q0].flags.writeable  # a memory-mapped view, not a copy
    exact = raw[Q0].view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(f32[Q0], exact)


@pytest.mark.parametrize("dtype,np_dtype", [("fp16", np.float16), ("fp32", np.float32)])
def test_fp16_and_fp32_checkpoints(tmp_path, tiny_checkpoint, tiny_config, dtype, np_dtype):
    path = make_checkpoint("tiny", tmp_path / dtype, seed=0, dtype=dtype)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.dtype == dtype
    raw = load_weights(path, cfg, dtype="raw")
    assert raw[Q0].dtype == np_dtype
    f32 = load_weights(path, cfg)
    assert f32[Q0].dtype == np.float32
    # same seed => same underlying values, only rounded differently
    bf16 = load_weights(tiny_checkpoint, tiny_config)
    np.testing.assert_allclose(f32[Q0], bf16[Q0], rtol=1e-2, atol=1e-3)


def test_sharded_checkpoint_loads_like_single_file(tmp_path, monkeypatch, tiny_checkpoint, tiny_config):
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 1_000_000)
    path = make_checkpoint("tiny", tmp_path / "sharded", seed=0)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (path / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    sharded = load_weights(path, tiny_config)
    single = load_weights(tiny_checkpoint, tiny_config)
    assert set(sharded) == set(single)
    for name in single:
        np.testing.assert_array_equal(sharded[name], single[name])


def test_missing_tensor(tmp_path, tiny_checkpoint):
    path = clone(tiny_checkpoint, tmp_path / "c", lambda t: t.pop(Q0))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.self_attn\.q_proj\.weight'.*\[128, 128\]"):
        load_weights(path, ModelConfig.from_pretrained(path))


def test_unexpected_tensor(tmp_path, tiny_checkpoint):
    path = clone(tiny_checkpoint, tmp_path / "c", lambda t: t.update({"model.layers.9.mlp.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.9\.mlp\.extra\.weight'"):
        load_weights(path, ModelConfig.from_pretrained(path))


def test_wrong_shape(tmp_path, tiny_checkpoint):
    path = clone(tiny_checkpoint, tmp_path / "c",
                 lambda t: t.update({"model.layers.1.mlp.up_proj.weight": np.zeros((128, 384), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
                                              r"has shape \[128, 384\], expected \[384, 128\]"):
        load_weights(path, ModelConfig.from_pretrained(path))


def test_integer_dtype(tmp_path, tiny_checkpoint):
    path = clone(tiny_checkpoint, tmp_path / "c", lambda t: t.update({Q0: t[Q0].astype(np.int32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' "
                                              r"has integer dtype I32; weights must be BF16, F16 or F32"):
        load_weights(path, ModelConfig.from_pretrained(path))


def test_truncated_file(tmp_path, tiny_checkpoint, tiny_config):
    path = clone(tiny_checkpoint, tmp_path / "c")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor 'lm_head\.weight' ends at byte "
                                              rf"{len(data)} but the file has only {len(data) - 1000} bytes"):
        load_weights(path, tiny_config)


def test_file_shorter_than_its_header(tmp_path, tiny_checkpoint, tiny_config):
    path = clone(tiny_checkpoint, tmp_path / "c")
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:500])
    with pytest.raises(CheckpointError, match=r"corrupt safetensors header: header length \d+ bytes but the file has 500 bytes"):
        load_weights(path, tiny_config)
    (path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=r"truncated: 2 bytes, too short for a safetensors header"):
        load_weights(path, tiny_config)


def test_header_not_json(tmp_path, tiny_checkpoint, tiny_config):
    path = clone(tiny_checkpoint, tmp_path / "c")
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 8) + b"{not js}" + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header \(not JSON"):
        load_weights(path, tiny_config)


def test_header_offsets_disagree_with_shape(tmp_path, tiny_checkpoint, tiny_config):
    path = clone(tiny_checkpoint, tmp_path / "c")
    header = json.dumps({Q0: {"dtype": "F32", "shape": [128, 128], "data_offsets": [0, 100]}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 100)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' F32\[128, 128\] "
                                              r"needs 65536 bytes but data_offsets \[0, 100\] span 100"):
        load_weights(path, tiny_config)


@pytest.fixture
def sharded(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 1_000_000)
    return make_checkpoint("tiny", tmp_path / "sharded", seed=0)


def test_missing_shard(sharded, tiny_config):
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing shard 'model-00002-of-00003\.safetensors' \(named in "
                                              r"model\.safetensors\.index\.json for tensor '.+'\)"):
        load_weights(sharded, tiny_config)


def test_index_names_a_shard_without_the_tensor(sharded, tiny_config):
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00003\.safetensors: model\.safetensors\.index\.json says "
                                              r"this shard holds tensor 'lm_head\.weight' but it does not"):
        load_weights(sharded, tiny_config)


def test_corrupt_index(sharded, tiny_config):
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"index\.json: corrupt index \(need a JSON object with a 'weight_map'\)"):
        load_weights(sharded, tiny_config)


def test_no_weights_file(tmp_path, tiny_checkpoint, tiny_config):
    path = clone(tiny_checkpoint, tmp_path / "c")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no weights: neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_weights(path, tiny_config)
    (path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"PyTorch \.bin weights must be converted to safetensors"):
        load_weights(path, tiny_config)
    with pytest.raises(CheckpointError, match=r"no such checkpoint directory"):
        load_weights(tmp_path / "nowhere", tiny_config)


def test_tied_embeddings_with_or_without_a_stored_head(tmp_path, tiny_checkpoint):
    tied = {"tie_word_embeddings": True}
    without = clone(tiny_checkpoint, tmp_path / "without", lambda t: t.pop("lm_head.weight"), tied)
    loaded = load_weights(without, ModelConfig.from_pretrained(without))
    assert "lm_head.weight" not in loaded and EMBED in loaded

    stored = clone(tiny_checkpoint, tmp_path / "stored", lambda t: t.update({"lm_head.weight": t[EMBED]}), tied)
    assert "lm_head.weight" not in load_weights(stored, ModelConfig.from_pretrained(stored))

    bad = clone(tiny_checkpoint, tmp_path / "bad", lambda t: t.update({"lm_head.weight": t[EMBED][:10]}), tied)
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head\.weight' has shape \[10, 128\], expected \[2048, 128\] "
                                              r"\(tied to the embedding\)"):
        load_weights(bad, ModelConfig.from_pretrained(bad))


def test_untied_config_needs_the_head(tmp_path, tiny_checkpoint):
    path = clone(tiny_checkpoint, tmp_path / "c", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head\.weight'"):
        load_weights(path, ModelConfig.from_pretrained(path))


def test_derived_rotary_buffers_are_ignored(tmp_path, tiny_checkpoint):
    inv = "model.layers.0.self_attn.rotary_emb.inv_freq"
    path = clone(tiny_checkpoint, tmp_path / "c", lambda t: t.update({inv: np.ones(16, np.float32)}))
    assert inv not in load_weights(path, ModelConfig.from_pretrained(path))


def test_progress_bar(tiny_checkpoint, tiny_config, capsys):
    load_weights(tiny_checkpoint, tiny_config)  # small: no bar by default
    assert "loading" not in capsys.readouterr().err
    load_weights(tiny_checkpoint, tiny_config, progress=True)
    assert f"loading {tiny_checkpoint.name}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="use 'float32' or 'raw'"):
        load_weights(tiny_checkpoint, tiny_config, dtype="bf16")
