"""Loading and validating safetensors weights (one file or sharded) against a `ModelConfig`.

Tensors keep their Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, shape
[out, in]). Files are memory-mapped: `dtype="raw"` returns zero-copy read-only views (bf16 as
uint16 bit patterns, fp16/fp32 as stored) for GPU upload; `dtype="float32"` converts bf16/fp16
exactly to fp32 (fp32 tensors stay zero-copy views).

We read the safetensors container ourselves (8-byte little-endian header length, JSON header,
raw data) because `safetensors.numpy` has no bf16 and copies every tensor into RAM, while an
8B model must be mapped, not copied; reading the header ourselves also lets every malformed
case name the file, the tensor and what was expected.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from replicas.model import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype tag -> numpy dtype of the stored bits
STORED_DTYPES = {"BF16": np.dtype(np.uint16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors spec's own limit
PROGRESS_ABOVE_BYTES = 2**30  # show a progress bar for checkpoints larger than this
# Buffers some exporters save although they are derived from the config; safe to skip.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The checkpoint's weight files are missing, malformed or do not match its config."""


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by Hugging Face name, with its shape."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv, d = config.q_dim, config.kv_dim, config.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        if config.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if config.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
    out["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: file, safetensors dtype tag, shape, absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Parse and check one safetensors file's header (no tensor data is read)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(
                    f"{file}: corrupt safetensors header: header length {n} bytes but the file has "
                    f"{size} bytes; the file is truncated or not safetensors"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (expected a JSON object)")
    base = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(file, name, info, base, size)
    return entries


def _entry(file: Path, name: str, info: object, base: int, size: int) -> TensorEntry:
    try:
        tag, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{file}: corrupt safetensors header entry for tensor '{name}': {info!r}") from None
    if tag not in STORED_DTYPES:
        kind = "integer" if tag[:1] in "IU" or tag == "BOOL" else "unsupported"
        raise CheckpointError(
            f"{file}: tensor '{name}' has {kind} dtype {tag}; weights must be BF16, F16 or F32 "
            "(quantized checkpoints are not supported)"
        )
    nbytes = math.prod(shape) * STORED_DTYPES[tag].itemsize
    if end - begin != nbytes or begin < 0:
        raise CheckpointError(
            f"{file}: corrupt safetensors header: tensor '{name}' {tag}{list(shape)} needs {nbytes} bytes "
            f"but data_offsets {[begin, end]} span {end - begin}"
        )
    if base + end > size:
        raise CheckpointError(
            f"{file}: truncated: tensor '{name}' ends at byte {base + end} but the file has only {size} "
            "bytes (data shorter than the header says); re-download or re-create the checkpoint"
        )
    return TensorEntry(file, tag, shape, base + begin, base + end)


def locate_tensors(path: str | Path) -> dict[str, TensorEntry]:
    """Index every tensor of a checkpoint dir (or a single .safetensors file) by name."""
    path = Path(path)
    if path.is_file():
        return read_header(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if (path / SINGLE_FILE).is_file():
        return read_header(path / SINGLE_FILE)
    index_file = path / INDEX_FILE
    if not index_file.is_file():
        present = sorted(p.name for p in path.iterdir())
        hint = " (PyTorch .bin weights must be converted to safetensors)" if any(
            p.endswith((".bin", ".pt")) for p in present) else ""
        raise CheckpointError(
            f"{path}: no weights: neither {SINGLE_FILE} nor {INDEX_FILE} is there{hint}; found: "
            + (", ".join(present[:20]) or "nothing")
        )
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_file}: corrupt index (need a JSON object with a 'weight_map'): {e!r}") from None
    headers: dict[str, dict[str, TensorEntry]] = {}
    out: dict[str, TensorEntry] = {}
    for name, shard in weight_map.items():
        if shard not in headers:
            shard_file = path / shard
            if not shard_file.is_file():
                raise CheckpointError(
                    f"{path}: missing shard '{shard}' (named in {INDEX_FILE} for tensor '{name}')"
                )
            headers[shard] = read_header(shard_file)
        if name not in headers[shard]:
            raise CheckpointError(f"{path / shard}: {INDEX_FILE} says this shard holds tensor '{name}' but it does not")
        out[name] = headers[shard][name]
    return out


def validate(entries: dict[str, TensorEntry], config: ModelConfig, where: str) -> dict[str, TensorEntry]:
    """Check names and shapes against the config; returns the entries to load (by name)."""
    want = expected_tensors(config)
    extra = {n for n in entries if n not in want and not n.endswith(IGNORED_SUFFIXES)}
    if config.tie_word_embeddings and "lm_head.weight" in extra:
        # Some exporters store the tied head anyway; fine if it has the embedding's shape.
        extra.discard("lm_head.weight")
        found = entries["lm_head.weight"].shape
        if found != want["model.embed_tokens.weight"]:
            raise CheckpointError(
                f"{entries['lm_head.weight'].file}: tensor 'lm_head.weight' has shape {list(found)}, expected "
                f"{list(want['model.embed_tokens.weight'])} (tied to the embedding)"
            )
    missing = [n for n in want if n not in entries]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{where}: missing tensor '{missing[0]}'{more}, expected shape {list(want[missing[0]])}; "
            "the weights do not match config.json"
        )
    if extra:
        first = min(extra)
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(
            f"{entries[first].file}: unexpected tensor '{first}'{more} that config.json "
            f"({config.architecture}, {config.num_hidden_layers} layers) does not use"
        )
    for name, shape in want.items():
        if entries[name].shape != shape:
            raise CheckpointError(
                f"{entries[name].file}: tensor '{name}' has shape {list(entries[name].shape)}, "
                f"expected {list(shape)} from config.json"
            )
    return {n: entries[n] for n in want}


def load_weights(path: str | Path, config: ModelConfig, dtype: Literal["float32", "raw"] = "float32",
                 progress: bool | None = None) -> dict[str, np.ndarray]:
    """Load and validate all weights of a checkpoint, keyed by Hugging Face tensor name.

    dtype="float32": fp32 arrays (bf16/fp16 converted exactly; fp32 ones are read-only mmaps).
    dtype="raw": read-only memory-mapped views as stored (bf16 -> uint16 bit patterns).
    progress: None = a bar when converting over 1 GiB to float32; True/False forces it.
    A tied `lm_head.weight` is not returned (use `model.embed_tokens.weight`).
    """
    if dtype not in ("float32", "raw"):
        raise ValueError(f"dtype={dtype!r}: use 'float32' or 'raw'")
    entries = validate(locate_tensors(path), config, str(path))
    total = sum(e.end - e.start for e in entries.values())
    # raw views read nothing up front, so only a conversion is worth a bar
    show = dtype == "float32" and total > PROGRESS_ABOVE_BYTES if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {Path(path).name}")
    maps: dict[Path, np.memmap] = {}
    out: dict[str, np.ndarray] = {}
    try:
        for name, e in entries.items():
            if e.file not in maps:
                maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
            stored = maps[e.file][e.start:e.end].view(STORED_DTYPES[e.dtype]).reshape(e.shape)
            out[name] = stored if dtype == "raw" else to_float32(stored, e.dtype)
            if bar is not None:
                bar.update(e.end - e.start)
    finally:
        if bar is not None:
            bar.close()
    return out


def to_float32(stored: np.ndarray, tag: str) -> np.ndarray:
    """Stored bits -> fp32. bf16 is the top half of an fp32, so the conversion is exact."""
    if tag == "BF16":
        bits = stored.astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32)
    if tag == "F16":
        return stored.astype(np.float32)
    return stored
