"""Model configuration read from a Hugging Face checkpoint directory.

One `ModelConfig` is the single source of truth for shapes: the reference engine, the weight
loader, the monokernel's compile flags and the synthetic checkpoints all derive from it.
Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, in the
transformers 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`,
`dtype`) spellings.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


class ConfigError(ValueError):
    """A checkpoint's config.json asks for something monoserve does not support, or is malformed."""


class RopeScaling(BaseModel):
    model_config = ConfigDict(frozen=True)

    rope_type: Literal["linear", "llama3"]
    factor: float = Field(gt=0)
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelConfig(BaseModel):
    """Shapes and options of a decoder-only transformer (Llama family)."""

    model_config = ConfigDict(frozen=True)

    architecture: str
    family: Literal["llama", "mistral", "qwen2", "qwen3"]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = Field(gt=0)
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        return self

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:  # width of the q projection output
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:  # width of each of the k and v projection outputs
        return self.num_key_value_heads * self.head_dim

    @property
    def group_size(self) -> int:  # query heads per kv head (GQA)
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def max_context(self) -> int:
        """Most positions one sequence may use; a sliding window caps it so attention stays exact."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        attn += (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + h * self.o_bias + 2 * self.head_dim * self.qk_norm
        layer = attn + 3 * h * i + 2 * h
        return self.num_hidden_layers * layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    def decode_bytes_per_token(self, bytes_per_weight: int = 2) -> int:
        """Weight bytes one decode step reads (embedding row excluded, LM head included)."""
        h, v = self.hidden_size, self.vocab_size
        return (self.num_parameters() - v * h * (0 if self.tie_word_embeddings else 1)) * bytes_per_weight

    def rope_inv_freq(self) -> np.ndarray:
        """Rotary inverse frequencies [head_dim // 2] float64, scaling applied (HF semantics)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        s = self.rope_scaling
        if s is None:
            return inv
        if s.rope_type == "linear":
            return inv / s.factor
        # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        blended = (1 - smooth) * inv / s.factor + smooth * inv
        out = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return np.where(mid, blended, out)

    # ---- reading a checkpoint -------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` (and `generation_config.json` if present) from a checkpoint dir."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise ConfigError(f"{path}: not a directory; give a Hugging Face checkpoint directory")
        if not cfg_file.is_file():
            raise ConfigError(f"{path}: no config.json; is this a Hugging Face checkpoint directory?")
        raw = _read_json(cfg_file)
        gen_file = path / "generation_config.json"
        gen = _read_json(gen_file) if gen_file.is_file() else {}
        return cls.from_hf_dict(raw, gen, source=str(cfg_file))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None,
                     source: str = "config.json") -> "ModelConfig":
        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{source}: missing required field '{key}'")
            return raw[key]

        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: architectures={archs!r} is not supported; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported; supported: 'silu'")
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported; supported: false")
        if family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported; supported: false")

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = raw.get("head_dim") or hidden // heads
        rope_theta, scaling = _read_rope(raw, source)
        # Bias on attention projections differs by family (as in transformers' modeling code):
        # Llama/Qwen3 honour `attention_bias` on q, k, v and o; Qwen2 always biases q, k, v and
        # never o; Mistral has no attention bias.
        attention_bias = bool(raw.get("attention_bias", False)) and family in ("llama", "qwen3")
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        if dtype_name not in DTYPES:
            raise ConfigError(f"{source}: dtype={dtype_name!r} is not supported; supported: bfloat16, float16, float32")

        eos: list[int] = []
        for src in (generation or {}, raw):
            v = src.get("eos_token_id")
            for e in (v if isinstance(v, list) else [v] if v is not None else []):
                if int(e) not in eos:
                    eos.append(int(e))
        window = raw.get("sliding_window") if family == "mistral" else None
        try:
            return cls(
                architecture=arch,
                family=family,
                vocab_size=need("vocab_size"),
                hidden_size=hidden,
                intermediate_size=need("intermediate_size"),
                num_hidden_layers=need("num_hidden_layers"),
                num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                max_position_embeddings=raw.get("max_position_embeddings", 4096),
                sliding_window=window,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=attention_bias or family == "qwen2",
                o_bias=attention_bias,
                qk_norm=family == "qwen3",
                eos_token_ids=tuple(eos),
                bos_token_id=(generation or {}).get("bos_token_id", raw.get("bos_token_id")),
                dtype=DTYPES[dtype_name],
            )
        except ConfigError:
            raise
        except ValidationError as e:  # name each bad field, without pydantic's boilerplate
            parts = [": ".join(filter(None, (".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, "))))
                     for err in e.errors()]
            raise ConfigError(f"{source}: " + "; ".join(parts)) from None


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object at the top level")
    return data


def _read_rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either the 4.x or the 5.x spelling."""
    params = raw.get("rope_parameters")
    if params is not None:  # transformers 5.x
        field = "rope_parameters"
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = params
    else:
        field = "rope_scaling"
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: {field}.rope_type={rope_type!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ROPE_TYPES)
        )
    if rope_type == "default":
        return float(theta), None
    if "factor" not in scaling:
        raise ConfigError(f"{source}: {field} of type {rope_type!r} needs a 'factor'")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), RopeScaling(rope_type=rope_type, **{k: scaling[k] for k in keys if k in scaling})
