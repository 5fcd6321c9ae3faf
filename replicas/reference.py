"""The numpy reference engine: a readable fp32 decoder, the CPU default and the correctness oracle.

Every engine is checked against this one (and this one against Hugging Face transformers, see
tests/test_oracle.py). It favours clarity over speed but still uses whole-matrix matmuls, fused
QKV and gate/up projections, and a preallocated KV cache per generation.

Notation in shape comments: n = new tokens in this pass, T = tokens attended to (cache length),
H = query heads, KV = key/value heads, G = H // KV (GQA group), D = head_dim, V = vocab.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Generator as PyGenerator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from replicas.engine import (  # EngineBusy re-exported: callers may import it from here
    EngineBusy,
    FinishReason,
    Generation,
    InvalidRequest,
    SamplingParams,
    stop_ids,
    validate_prompt,
    validate_teacher_ids,
)
from replicas.model import ModelConfig
from replicas.sampling import make_rng, sample
from replicas.session_cache import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_SESSIONS,
    SessionCache,
    SessionStats,
)
from replicas.weights import load_weights

PREFILL_CHUNK = 512  # prompt tokens per batched pass; bounds the [H, n, T] score buffer
KV_FIRST_ROWS = 256  # decode rows reserved up front; the cache doubles when they run out


@dataclass
class LayerWeights:
    """One decoder layer, fp32, in HF [out, in] orientation (x @ w.T)."""

    attn_norm: np.ndarray  # [hidden]
    qkv: np.ndarray  # [q_dim + 2*kv_dim, hidden]  q, k, v projections stacked
    qkv_bias: np.ndarray | None  # [q_dim + 2*kv_dim]
    q_norm: np.ndarray | None  # [D] Qwen3 per-head RMSNorm weight
    k_norm: np.ndarray | None  # [D]
    o: np.ndarray  # [hidden, q_dim]
    o_bias: np.ndarray | None  # [hidden]
    mlp_norm: np.ndarray  # [hidden]
    gate_up: np.ndarray  # [2*intermediate, hidden]  gate rows first, then up
    down: np.ndarray  # [hidden, intermediate]


class KVCache:
    """Keys and values of one sequence. Preallocated; grows by doubling (up to `limit` rows) so
    a long max_tokens does not reserve the whole context window up front."""

    def __init__(self, config: ModelConfig, capacity: int, limit: int | None = None):
        shape = (config.num_hidden_layers, capacity, config.num_key_value_heads, config.head_dim)
        self.k = np.zeros(shape, np.float32)  # k_cache: [layers, seq, KV, D] f32 (after RoPE)
        self.v = np.zeros(shape, np.float32)  # v_cache: [layers, seq, KV, D] f32
        self.limit = max(limit or capacity, capacity)
        self.length = 0  # positions filled so far

    def reserve(self, rows: int) -> None:
        """Make room for `rows` positions (rows <= limit)."""
        have = self.k.shape[1]
        if rows <= have:
            return
        if rows > self.limit:
            raise RuntimeError(f"KV cache asked for {rows} rows beyond its limit of {self.limit}")
        grown = min(max(2 * have, rows), self.limit)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], grown, *old.shape[2:]), np.float32)
            new[:, :self.length] = old[:, :self.length]
            setattr(self, name, new)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, in fp32 (HF: x * rsqrt(mean(x^2) + eps) * weight)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(var + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class ReferenceEngine:
    """fp32 numpy implementation of the Engine protocol (replicas.engine.Engine)."""

    kind = "reference"

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], max_batch: int = 1, *,
                 session_cache_bytes: int = DEFAULT_MAX_BYTES, max_sessions: int = DEFAULT_MAX_SESSIONS):
        """`weights` (fp32 or castable, HF names) is consumed: entries are popped as they are
        fused, so a bf16 checkpoint's fp32 copies are freed layer by layer (peak ~1x, not 2x).
        Agent sessions' KV is kept between turns within `session_cache_bytes` / `max_sessions`
        (replicas.session_cache; max_sessions=0 turns reuse off)."""
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.config = config
        self.max_batch = max_batch
        self.max_context = config.max_context
        c = config
        f32 = lambda name: np.ascontiguousarray(weights.pop(name), dtype=np.float32)
        self.embed = f32("model.embed_tokens.weight")  # [V, hidden]
        # lm_head: [V, hidden]; tied models reuse the embedding matrix.
        self.lm_head = self.embed if c.tie_word_embeddings else f32("lm_head.weight")
        self.final_norm = f32("model.norm.weight")  # [hidden]
        self.layers: list[LayerWeights] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(LayerWeights(
                attn_norm=f32(p + "input_layernorm.weight"),
                qkv=np.concatenate([f32(a + f"{x}_proj.weight") for x in "qkv"]),
                qkv_bias=np.concatenate([f32(a + f"{x}_proj.bias") for x in "qkv"]) if c.qkv_bias else None,
                q_norm=f32(a + "q_norm.weight") if c.qk_norm else None,
                k_norm=f32(a + "k_norm.weight") if c.qk_norm else None,
                o=f32(a + "o_proj.weight"),
                o_bias=f32(a + "o_proj.bias") if c.o_bias else None,
                mlp_norm=f32(p + "post_attention_layernorm.weight"),
                gate_up=np.concatenate([f32(p + "mlp.gate_proj.weight"), f32(p + "mlp.up_proj.weight")]),
                down=f32(p + "mlp.down_proj.weight"),
            ))
        self._inv_freq = config.rope_inv_freq()  # [D/2] float64, scaling already applied
        self._slots_lock = threading.Lock()
        self._active = 0  # generations currently holding a slot
        self.sessions = SessionCache(session_cache_bytes, max_sessions)

    @classmethod
    def from_pretrained(cls, path: str | Path, max_batch: int = 1, **session_limits) -> ReferenceEngine:
        """Load a Hugging Face checkpoint directory (bf16/fp16/fp32 weights, upcast to fp32).
        `session_limits`: session_cache_bytes, max_sessions (see __init__)."""
        config = ModelConfig.from_pretrained(path)
        return cls(config, load_weights(path, config, dtype="float32"), max_batch=max_batch, **session_limits)

    # ---- the transformer --------------------------------------------------------------------
    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotary embedding, HF rotate-half convention. x: [n, heads, D], positions: [n]."""
        angles = positions[:, None].astype(np.float64) * self._inv_freq[None, :]  # [n, D/2]
        cos = np.cos(angles).astype(np.float32)[:, None, :]  # [n, 1, D/2]
        sin = np.sin(angles).astype(np.float32)[:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]  # [n, heads, D/2] each
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _attention(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int) -> np.ndarray:
        """Causal GQA attention of n new queries at positions start.. over T = start + n keys.

        q: [n, H, D]; keys, values: [T, KV, D]. Returns [n, H*D].
        """
        c = self.config
        n, T = q.shape[0], keys.shape[0]
        kv, g, d = c.num_key_value_heads, c.group_size, c.head_dim
        q4 = q.reshape(n, kv, g, d).transpose(1, 2, 0, 3)  # [KV, G, n, D]
        k_t = keys.transpose(1, 2, 0)[:, None]  # [KV, 1, D, T]
        scores = (q4 @ k_t) * np.float32(d ** -0.5)  # [KV, G, n, T]
        if n > 1:  # query i (position start+i) sees keys 0..start+i
            future = np.arange(T)[None, :] > (start + np.arange(n))[:, None]  # [n, T]
            scores[..., future] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)  # [KV, G, n, T]
        out = probs @ values.transpose(1, 0, 2)[:, None]  # [KV, G, n, D]
        return out.transpose(2, 0, 1, 3).reshape(n, c.q_dim)  # [n, H*D]

    def _layer(self, li: int, h: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        """One decoder layer over n new tokens at positions start..start+n-1. h: [n, hidden]."""
        c, w = self.config, self.layers[li]
        n = h.shape[0]
        x = rms_norm(h, w.attn_norm, c.rms_norm_eps)  # [n, hidden]
        qkv = x @ w.qkv.T  # [n, q_dim + 2*kv_dim]
        if w.qkv_bias is not None:
            qkv += w.qkv_bias
        q = qkv[:, :c.q_dim].reshape(n, c.num_attention_heads, c.head_dim)  # [n, H, D]
        k = qkv[:, c.q_dim:c.q_dim + c.kv_dim].reshape(n, c.num_key_value_heads, c.head_dim)  # [n, KV, D]
        v = qkv[:, c.q_dim + c.kv_dim:].reshape(n, c.num_key_value_heads, c.head_dim)  # [n, KV, D]
        if w.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            q = rms_norm(q, w.q_norm, c.rms_norm_eps)
            k = rms_norm(k, w.k_norm, c.rms_norm_eps)
        positions = np.arange(start, start + n)
        cache.k[li, start:start + n] = self._rope(k, positions)
        cache.v[li, start:start + n] = v
        attn = self._attention(self._rope(q, positions), cache.k[li, :start + n], cache.v[li, :start + n], start)
        o = attn @ w.o.T  # [n, hidden]
        if w.o_bias is not None:
            o += w.o_bias
        h = h + o
        x = rms_norm(h, w.mlp_norm, c.rms_norm_eps)
        gu = x @ w.gate_up.T  # [n, 2*intermediate]
        inter = c.intermediate_size
        return h + (silu(gu[:, :inter]) * gu[:, inter:]) @ w.down.T  # [n, hidden]

    def _forward(self, ids: Sequence[int], cache: KVCache, all_logits: bool) -> np.ndarray:
        """Run new tokens `ids` after the cache's contents; logits [n or 1, V] f32."""
        start = cache.length
        cache.reserve(start + len(ids))
        h = self.embed[np.asarray(ids, dtype=np.int64)]  # [n, hidden]
        for li in range(len(self.layers)):
            h = self._layer(li, h, cache, start)
        cache.length = start + len(ids)
        if not all_logits:
            h = h[-1:]
        return rms_norm(h, self.final_norm, self.config.rms_norm_eps) @ self.lm_head.T  # [n, V]

    def _prefill(self, ids: list[int], cache: KVCache, all_logits: bool,
                 cancel: threading.Event | None = None) -> np.ndarray | None:
        """The prompt in batched chunks (one pass when short); last-position or all logits.
        None if `cancel` was set between chunks (a long prompt stops within one chunk)."""
        parts = []
        for s in range(0, len(ids), PREFILL_CHUNK):
            if cancel is not None and cancel.is_set():
                return None
            parts.append(self._forward(ids[s:s + PREFILL_CHUNK], cache, all_logits))
        return np.concatenate(parts) if all_logits else parts[-1]

    # ---- the Engine protocol ----------------------------------------------------------------
    def forward_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits [len(token_ids), V] float32 (does not take a generation slot)."""
        ids = validate_teacher_ids(token_ids, self.config, self.max_context)
        cache = KVCache(self.config, len(ids))
        return self._prefill(ids, cache, all_logits=True).astype(np.float32, copy=False)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 session_id: str | None = None) -> Generation:
        """Start a generation; raises InvalidRequest (bad input) or EngineBusy (no free slot).
        With `session_id`, the KV that session's previous turn left is reused for the common
        prefix (only the rest is prefilled) and this turn's KV is kept for the next one."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        ids = validate_prompt(prompt_ids, params, self.config, self.max_context)
        slot = self._take_slot()
        info = _GenerationInfo()
        return _SlotGeneration(lambda cancel: self._steps(ids, params, cancel, slot, session_id, info), slot, info)

    def session_stats(self) -> SessionStats:
        """Session KV reuse counters and what is resident now."""
        return self.sessions.stats()

    def _take_slot(self) -> _Slot:
        with self._slots_lock:
            if self._active >= self.max_batch:
                raise EngineBusy(
                    f"all {self.max_batch} generation slots of this reference engine are busy; "
                    "wait for one to finish or create the engine with a larger max_batch"
                )
            self._active += 1
        return _Slot(self)

    def _free_slot(self) -> None:
        with self._slots_lock:
            self._active -= 1

    def _steps(self, ids: list[int], params: SamplingParams, cancel: threading.Event, slot: _Slot,
               session_id: str | None,
               info: _GenerationInfo) -> PyGenerator[int, None, tuple[FinishReason, int | None]]:
        """The decode loop: prefill, then sample / yield / feed back one token per step."""
        lease = cache = None
        fed = list(ids)  # the tokens whose KV the cache holds (once computed): prompt + fed-back output
        try:
            stops = stop_ids(self.config, params)
            rng = make_rng(params.seed)
            budget = min(params.max_tokens, self.max_context - len(ids))  # tokens we may emit
            # The last emitted token is never fed back, so the cache needs len + budget - 1 rows.
            needed = len(ids) + budget - 1
            lease = self.sessions.acquire(session_id, ids) if session_id else None
            if lease is not None and lease.kv is not None:  # continue the session's KV from the shared prefix
                cache, info.reused_tokens = lease.kv, lease.reused
                cache.length, cache.limit = lease.reused, max(cache.limit, needed)
            else:
                cache = KVCache(self.config, min(needed, len(ids) + KV_FIRST_ROWS), limit=needed)
            logits = self._prefill(ids[cache.length:], cache, all_logits=False, cancel=cancel)  # [1, V]
            if logits is None:
                return FinishReason.CANCELLED, None
            logits = logits[0]  # [V]
            for produced in range(1, budget + 1):
                if cancel.is_set():
                    return FinishReason.CANCELLED, None
                token = sample(logits, params, rng)
                if token in stops:
                    return FinishReason.STOP, token
                yield token
                if produced == budget:  # max_tokens reached or the context window is full
                    break
                if cancel.is_set():
                    return FinishReason.CANCELLED, None
                fed.append(token)
                logits = self._forward([token], cache, all_logits=False)[0]
            return FinishReason.LENGTH, None
        except Exception:
            if lease is not None:
                self.sessions.discard(lease)
            raise
        finally:
            if lease is not None and cache is not None:  # also on cancel/close: the KV computed is valid
                self.sessions.release(lease, cache, fed[:cache.length], cache.k.nbytes + cache.v.nbytes)
            slot.release()


class _Slot:
    """One taken generation slot; release() is idempotent (generator end, close(), or GC)."""

    def __init__(self, engine: ReferenceEngine):
        self._engine = engine
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._engine._free_slot()


@dataclass
class _GenerationInfo:
    """What the decode loop tells its Generation (shared object: no reference cycle)."""

    reused_tokens: int = 0


class _SlotGeneration(Generation):
    """A Generation that frees its slot even if it is closed or dropped before it started."""

    def __init__(self, steps, slot: _Slot, info: _GenerationInfo):
        super().__init__(steps)
        self.info = info
        self._slot = slot
        weakref.finalize(self, slot.release)

    @property
    def reused_tokens(self) -> int:
        return self.info.reused_tokens

    def close(self) -> None:
        super().close()
        self._slot.release()
