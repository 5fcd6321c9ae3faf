"""Prefill over N tensor-parallel shards, with the decode kernel's all-reduce order.

Each rank runs the single-GPU prefill math (replicas/monokernel_prefill.py) on its own shard
(local q/kv heads, intermediate rows, vocabulary slice; KV cache of its kv heads). After the
O-projection and after the down-projection every rank receives all N partial hidden vectors and
adds them to its residual stream one by one in rank order 0..N-1, exactly as the kernel's
all-reduce does, so the residual stream is bitwise identical on every rank. Logits are the
ranks' vocabulary slices side by side, padding dropped.

With xp=numpy this is the CPU simulation of the sharded forward pass (tests/test_tp_cpu.py);
on the GPU `to(a, r)` copies a partial to rank r's device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

from replicas.monokernel_prefill import Prefill


class ShardedPrefill:
    def __init__(self, models: Sequence[Any], vocab_size: int, xp=None,
                 on: Callable[[int], Any] | None = None, to: Callable[[Any, int], Any] | None = None):
        """models[r]: rank r's shard (config = local config, weights = packed local weights,
        k_cache/v_cache, rope_cos/rope_sin). vocab_size: the full model's vocabulary.
        on(r): context manager making rank r's device current; to(a, r): a on rank r's device."""
        self.models = list(models)
        self.parts = [Prefill(m, xp, graphs=False) for m in self.models]  # (its run is its own, eager)
        self.xp = self.parts[0].cp
        self.vocab_size = vocab_size
        self.on = on or (lambda r: nullcontext())
        self.to = to or (lambda a, r: a)

    def _all_reduce(self, xs: list, partials: list, bias=None) -> None:
        """xs[r] += partials[0] + ... + partials[N-1] (in that order, on every rank) (+ bias)."""
        for r, x in enumerate(xs):
            with self.on(r):
                for q, part in enumerate(partials):
                    x += part if q == r else self.to(part, r)
                if bias is not None:
                    x += bias[r]

    def run(self, ids: Sequence[int], all_logits: bool = False):
        """Prompt -> (per-rank last hidden state [H] (identical values), logits [T, V] on rank 0 or None)."""
        c0 = self.models[0].config
        T = len(ids)
        xs, cos, sin = [], [], []
        for r, (pf, m) in enumerate(zip(self.parts, self.models)):
            with self.on(r):
                ids_d = pf.cp.asarray(list(ids), dtype=pf.cp.int64)
                xs.append(pf._f32(m.weights["embed"][ids_d]))
                cos.append(m.rope_cos[:T][:, None, :])
                sin.append(m.rope_sin[:T][:, None, :])
        for layer in range(c0.num_hidden_layers):
            o_parts = []
            for r, (pf, m) in enumerate(zip(self.parts, self.models)):
                with self.on(r):
                    o_parts.append(self._attention_partial(pf, m, layer, xs[r], cos[r], sin[r]))
            bias = [m.weights["o_bias"][layer] for m in self.models] if c0.o_bias else None
            self._all_reduce(xs, o_parts, bias)
            dn_parts = []
            for r, (pf, m) in enumerate(zip(self.parts, self.models)):
                with self.on(r):
                    dn_parts.append(self._mlp_partial(pf, m, layer, xs[r]))
            self._all_reduce(xs, dn_parts)
        logits = None
        if all_logits:
            shards = []
            for r, (pf, m) in enumerate(zip(self.parts, self.models)):
                with self.on(r):
                    shards.append(self.to(pf._linear(pf._rms(xs[r], m.weights["lnf"]), m.weights["w_lm"],
                                                     c0.hidden_size), 0))
            with self.on(0):
                logits = self.xp.concatenate(shards, axis=1)[:, :self.vocab_size]
        last = []
        for r, x in enumerate(xs):
            with self.on(r):
                last.append(x[-1].copy())
        return last, logits

    @staticmethod
    def _attention_partial(pf: Prefill, m, n: int, x, cos, sin):
        """This rank's heads: QKV, RoPE, KV-cache write, attention, O-projection (no bias)."""
        c, w = m.config, m.weights
        T = x.shape[0]
        H, Q, KV, D = c.hidden_size, c.q_dim, c.kv_dim, c.head_dim
        qkv = pf._linear(pf._rms(x, w["ln1"][n]), w["w_qkv"][n], H)
        if c.qkv_bias:
            qkv += w["qkv_bias"][n]
        q = qkv[:, :Q].reshape(T, c.num_attention_heads, D)
        k = qkv[:, Q:Q + KV].reshape(T, c.num_key_value_heads, D)
        v = qkv[:, Q + KV:].reshape(T, c.num_key_value_heads, D)
        if c.qk_norm:
            q = pf._rms(q, w["q_norm"][n])
            k = pf._rms(k, w["k_norm"][n])
        k_bits = pf.narrow(pf._rope(k, cos, sin))
        v_bits = pf.narrow(v)
        m.k_cache[n, :, :T, :] = k_bits.transpose(1, 0, 2)
        m.v_cache[n, :, :T, :] = v_bits.transpose(1, 0, 2)
        attn = pf._attention(pf._rope(q, cos, sin), k_bits, v_bits, n)
        return pf._linear(attn, w["w_o"][n], Q)

    @staticmethod
    def _mlp_partial(pf: Prefill, m, n: int, x):
        """This rank's intermediate rows: gate/up, SiLU, down-projection partial."""
        cp, c, w = pf.cp, m.config, m.weights
        T, I = x.shape[0], c.intermediate_size
        gu = pf._linear(pf._rms(x, w["ln2"][n]), w["w_gu"][n].reshape(2 * I, -1), c.hidden_size).reshape(T, I, 2)
        g, u = gu[..., 0], gu[..., 1]
        return pf._linear(g / (1.0 + cp.exp(-g)) * u, w["w_dn"][n], I)
