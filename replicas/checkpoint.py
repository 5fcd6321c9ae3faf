"""Synthetic Hugging Face checkpoints: real model shapes, random weights, a working tokenizer.

`make_checkpoint("llama-3.1-8b", "ckpt/")` writes config.json, generation_config.json, the
weights (one model.safetensors, or 4 GB shards plus model.safetensors.index.json above 4 GB),
tokenizer.json and tokenizer_config.json (with a chat template). Weights stream to disk one
chunk at a time (bounded memory) from a per-tensor seeded RNG, so a seed reproduces a checkpoint.

Initialisation keeps activations O(1) through every layer and makes logits clearly peaked:
projections ~ N(0, 1/fan_in); the residual-branch outputs (o_proj, down_proj) are further scaled
by 1/sqrt(2 * layers) so the residual stream's RMS stays bounded (near 1; 16 with tied
embeddings, see _init_spec); norm weights ~ 1 + N(0, 0.1²); the LM head (or the tied embedding)
gives logits of standard deviation ~LOGIT_STD.
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from pathlib import Path
from statistics import NormalDist
from typing import Any

import ml_dtypes
import numpy as np

from replicas.model import ModelConfig
from replicas.presets import GENERATION, PRESETS, TOKENIZER_STYLE
from replicas.tokenizer_gen import write_tokenizer
from replicas.weights import INDEX_FILE, SINGLE_FILE, expected_tensors

__all__ = ["DTYPES", "PRESETS", "make_checkpoint", "preset_config", "write_metadata"]

# --dtype spelling -> (safetensors tag, config.json torch_dtype, numpy dtype written)
DTYPES = {
    "bf16": ("BF16", "bfloat16", np.dtype(ml_dtypes.bfloat16)),
    "fp16": ("F16", "float16", np.dtype(np.float16)),
    "fp32": ("F32", "float32", np.dtype(np.float32)),
}
SHARD_BYTES = 4 * 10**9  # checkpoints above this are split into shards of at most this size
CHUNK_ELEMENTS = 32 * 2**20  # elements generated at a time: bounds memory to ~300 MB
LOGIT_STD = 4.0  # target std of the logits over the vocabulary (peaked, not one-hot)
TIED_RESIDUAL_RMS = 4 * LOGIT_STD  # input token's own logit ~ LOGIT_STD² / this: no echo
NORM_JITTER = 0.1  # norm weights are 1 + N(0, NORM_JITTER²): exercises them without scaling away
BIAS_STD = 0.1


def preset_config(preset: str) -> ModelConfig:
    """The `ModelConfig` of a preset (no files written)."""
    _check_preset(preset)
    return ModelConfig.from_hf_dict(PRESETS[preset], GENERATION[preset], source=f"preset {preset!r}")


def make_checkpoint(preset: str, out_dir: str | Path, seed: int = 0, dtype: str = "bf16",
                    overwrite: bool = True, progress: bool | None = None) -> Path:
    """Write a complete HF-format checkpoint of `preset` into `out_dir`; returns its path.

    Existing weight files in `out_dir` are replaced (overwrite=False refuses a non-empty dir).
    progress: None = a bar when the weights exceed 1 GB; True/False forces it.
    """
    _check_preset(preset)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of: {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out}: directory is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        stale.unlink(missing_ok=True)  # a leftover single file would shadow new shards

    tag, _, np_dtype = DTYPES[dtype]
    config = write_metadata(preset, out, dtype)
    tensors = expected_tensors(config)
    shards = _plan_shards(tensors, np_dtype.itemsize)
    total = sum(math.prod(s) for s in tensors.values()) * np_dtype.itemsize
    show = total > 2**30 if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {preset}")
    try:
        names = [SINGLE_FILE] if len(shards) == 1 else [
            f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
        for name, shard in zip(names, shards):
            _write_safetensors(out / name, {n: tensors[n] for n in shard}, tag, np_dtype,
                               lambda n: _init_spec(n, tensors[n], config), seed, bar)
    finally:
        if bar is not None:
            bar.close()
    if len(shards) > 1:
        _write_json(out / INDEX_FILE, {
            "metadata": {"total_size": total},
            "weight_map": {n: file for file, shard in zip(names, shards) for n in shard},
        })
    return out


def write_metadata(preset: str, out_dir: str | Path, dtype: str = "bf16") -> ModelConfig:
    """Write everything but the weights (configs, tokenizer) into `out_dir` (created if needed)."""
    _check_preset(preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = dict(PRESETS[preset], torch_dtype=DTYPES[dtype][1], transformers_version="4.46.0")
    config = ModelConfig.from_hf_dict(raw, GENERATION[preset], source=f"preset {preset!r}")
    _write_json(out / "config.json", raw)
    _write_json(out / "generation_config.json", dict(GENERATION[preset], transformers_version="4.46.0"))
    write_tokenizer(out, config.vocab_size, TOKENIZER_STYLE[preset], config.max_position_embeddings)
    return config


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n")


def _plan_shards(tensors: dict[str, tuple[int, ...]], itemsize: int) -> list[list[str]]:
    """Group tensors (in order) into shards of at most SHARD_BYTES; one shard if it all fits."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in tensors.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _init_spec(name: str, shape: tuple[int, ...], config: ModelConfig) -> tuple[float, float]:
    """(mean, std) of the normal distribution tensor `name` is drawn from."""
    if name.endswith("norm.weight"):  # input/post_attention/final norms and q/k norms
        return 1.0, NORM_JITTER
    if name.endswith(".bias"):
        return 0.0, BIAS_STD
    if name == "lm_head.weight" or (name == "model.embed_tokens.weight" and config.tie_word_embeddings):
        # final RMSNorm output has unit RMS, so a logit is a sum of hidden_size unit terms
        return 0.0, LOGIT_STD / math.sqrt(config.hidden_size)
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    std = 1.0 / math.sqrt(shape[1])  # [out, in]: fan_in = in
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        # 2 * layers branches add up to a residual stream of RMS ~residual_rms. With tied
        # embeddings the stream must dwarf the (small) embedding row, or each position's logits
        # peak at its own input token (the model would only echo).
        residual_rms = TIED_RESIDUAL_RMS if config.tie_word_embeddings else 1.0
        std *= residual_rms / math.sqrt(2 * config.num_hidden_layers)
    return 0.0, std


def _write_safetensors(file: Path, tensors: dict[str, tuple[int, ...]], tag: str, np_dtype: np.dtype,
                       spec, seed: int, bar) -> None:
    """Stream one safetensors file: header first (offsets known from shapes), then each tensor."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        nbytes = math.prod(shape) * np_dtype.itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape in tensors.items():
            table = _normal_table(*spec(name), np_dtype)
            # seeded by (seed, name): a tensor's values do not depend on file layout or order
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            n = math.prod(shape)
            for start in range(0, n, CHUNK_ELEMENTS):
                count = min(CHUNK_ELEMENTS, n - start)
                index = rng.bit_generator.random_raw((count + 3) // 4).view(np.uint16)[:count]
                f.write(table[index])
                if bar is not None:
                    bar.update(count * np_dtype.itemsize)


@functools.lru_cache(maxsize=64)
def _normal_table(mean: float, std: float, np_dtype: np.dtype) -> np.ndarray:
    """Bit patterns of N(mean, std²) at the 65,536 quantiles (i + 0.5) / 65536, in `np_dtype`.

    Indexing it with random uint16s samples a normal distribution quantized to 65,536 levels
    (finer than bf16 resolves) about 4x faster than `standard_normal`; the 8B preset writes in
    well under a minute of CPU time.
    """
    return (mean + std * _STD_NORMAL_QUANTILES).astype(np_dtype).view(f"u{np_dtype.itemsize}")


_STD_NORMAL_QUANTILES = np.array([NormalDist().inv_cdf((i + 0.5) / 65536) for i in range(65536)])
