"""Tensor-parallel (Megatron) sharding of a checkpoint over N GPUs, at load.

Each GPU (rank r of N) holds:
  q/k/v  its q heads' rows (N | heads), and the kv heads those q heads read: a 1/N slice of the
         kv heads when N | kv_heads, else (N > kv_heads, kv_heads | N) the one kv head, replicated
  o      the input columns of its q heads            -> a partial of the full hidden vector
  gate/up  a 1/N slice of the intermediate rows
  down   the matching input columns               -> a partial of the full hidden vector
  lm head  a contiguous vocabulary slice of ceil(V/N) rows (the last one zero-padded)
  embedding, norms, o bias: replicated (the o bias is added once, after the all-reduce).

The result is an ordinary HF-named tensor dict of a smaller "local" model (`shard_config`), so
the single-GPU packer (replicas/monokernel_weights.py) and kernel build run unchanged on it.
These functions are the only place shards are cut: the GPU loader and the CPU simulation in
tests/test_tp_cpu.py both call them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from replicas.model import ModelConfig

TP_SIZES = (1, 2, 4, 8)


class TensorParallelError(ValueError):
    """The model cannot be split over this many GPUs."""


@dataclass(frozen=True)
class ShardPlan:
    """Which global rows rank `rank` of `n` holds; ranges are [start, end)."""

    n: int
    rank: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]  # real vocabulary rows; the shard has `vocab_rows` rows (zero padded)
    vocab_rows: int

    @property
    def vocab_base(self) -> int:
        """Global token id of the shard's first row (rank * vocab_rows)."""
        return self.rank * self.vocab_rows


def check_tp(config: ModelConfig, n: int) -> None:
    """Raise TensorParallelError naming the first reason `config` cannot be split over `n` GPUs."""
    if n not in TP_SIZES:
        raise TensorParallelError(f"tensor parallelism over {n} GPUs is not supported; use one of "
                                  f"{', '.join(map(str, TP_SIZES))} GPUs (devices=[0..N-1])")
    nh, nkv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if nh % n:
        raise TensorParallelError(f"{n} GPUs do not divide num_attention_heads={nh}: each GPU must hold "
                                  f"whole query heads; use a GPU count that divides {nh}")
    if nkv % n and n % nkv:
        raise TensorParallelError(f"{n} GPUs and num_key_value_heads={nkv}: one must divide the other "
                                  "(kv heads are split, or replicated when there are more GPUs than kv heads)")
    if inter % n:
        raise TensorParallelError(f"{n} GPUs do not divide intermediate_size={inter}; use a GPU count "
                                  f"that divides {inter}")


def shard_plan(config: ModelConfig, n: int, rank: int) -> ShardPlan:
    check_tp(config, n)
    if not 0 <= rank < n:
        raise TensorParallelError(f"rank {rank} outside [0, {n})")
    nh, nkv, inter, v = (config.num_attention_heads, config.num_key_value_heads,
                         config.intermediate_size, config.vocab_size)
    qh = nh // n
    q0 = rank * qh
    if nkv % n == 0:
        kv0, kv1 = rank * (nkv // n), (rank + 1) * (nkv // n)
    else:  # more GPUs than kv heads: this GPU's q heads all read one kv head
        kv0 = q0 // config.group_size
        kv1 = kv0 + 1
    rows = math.ceil(v / n)
    return ShardPlan(n=n, rank=rank, q_heads=(q0, q0 + qh), kv_heads=(kv0, kv1),
                     inter=(rank * inter // n, (rank + 1) * inter // n),
                     vocab=(min(v, rank * rows), min(v, (rank + 1) * rows)), vocab_rows=rows)


def shard_config(config: ModelConfig, n: int) -> ModelConfig:
    """The per-GPU model: its heads, kv heads, intermediate rows and vocabulary slice.

    The embedding stays whole (tokens are global ids) but the LM head becomes the untied slice
    `lm_head.weight`, so the local config is never tied.
    """
    p = shard_plan(config, n, 0)
    return config.model_copy(update={
        "num_attention_heads": p.q_heads[1] - p.q_heads[0],
        "num_key_value_heads": p.kv_heads[1] - p.kv_heads[0],
        "intermediate_size": p.inter[1] - p.inter[0],
        "vocab_size": p.vocab_rows,
        "tie_word_embeddings": False,
    })


def shard_tensors(config: ModelConfig, tensors: Mapping[str, Any], n: int, rank: int, xp=np) -> dict[str, Any]:
    """HF-named tensors of rank `rank`'s local model (see shard_config). Slices are views where
    possible; the padded LM head is a new array. `xp`: numpy or cupy (for padding)."""
    p = shard_plan(config, n, rank)
    D = config.head_dim
    qs = slice(p.q_heads[0] * D, p.q_heads[1] * D)
    kvs = slice(p.kv_heads[0] * D, p.kv_heads[1] * D)
    ins = slice(*p.inter)
    out: dict[str, Any] = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
                           "model.norm.weight": tensors["model.norm.weight"]}
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[pre + name] = tensors[pre + name]
        out[a + "q_proj.weight"] = tensors[a + "q_proj.weight"][qs]
        out[a + "k_proj.weight"] = tensors[a + "k_proj.weight"][kvs]
        out[a + "v_proj.weight"] = tensors[a + "v_proj.weight"][kvs]
        out[a + "o_proj.weight"] = tensors[a + "o_proj.weight"][:, qs]
        if config.qkv_bias:
            out[a + "q_proj.bias"] = tensors[a + "q_proj.bias"][qs]
            out[a + "k_proj.bias"] = tensors[a + "k_proj.bias"][kvs]
            out[a + "v_proj.bias"] = tensors[a + "v_proj.bias"][kvs]
        if config.o_bias:
            out[a + "o_proj.bias"] = tensors[a + "o_proj.bias"]
        if config.qk_norm:
            out[a + "q_norm.weight"] = tensors[a + "q_norm.weight"]
            out[a + "k_norm.weight"] = tensors[a + "k_norm.weight"]
        out[pre + "mlp.gate_proj.weight"] = tensors[pre + "mlp.gate_proj.weight"][ins]
        out[pre + "mlp.up_proj.weight"] = tensors[pre + "mlp.up_proj.weight"][ins]
        out[pre + "mlp.down_proj.weight"] = tensors[pre + "mlp.down_proj.weight"][:, ins]
    head = tensors["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    part = head[p.vocab[0]:p.vocab[1]]
    if part.shape[0] == p.vocab_rows:
        out["lm_head.weight"] = part
    else:  # last shard: zero rows up to the common shard size (their ids >= V are never chosen)
        padded = xp.zeros((p.vocab_rows, head.shape[1]), dtype=head.dtype)
        padded[:part.shape[0]] = part
        out["lm_head.weight"] = padded
    return out
