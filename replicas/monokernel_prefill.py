"""Prefill for the monokernel engine: the prompt through whole-matrix GEMMs, KV in kernel layout.

A prompt's rows go through each layer as matrix products on the packed bf16 weights (cuBLAS bf16 tensor
cores with fp32 accumulation, replicas/monokernel_blas.py; inside a resident launch's joins the GEMM
mode the engine checked at start), rather than through the decode kernel. Keys and values are rounded
to bf16 exactly as the decode kernel stores them, written into the cache [L][kv_heads][max_ctx][D],
and the attention here uses those rounded values too. Prompts of up to 512 new tokens replay a CUDA
graph of this pass (replicas/prefill_graph.py): issued op by op, a short prompt is bound by the host.

`run(ids, start=P)` continues a sequence whose positions 0..P-1 are already in the cache (an
agent session's earlier turns): only ids[P:] are computed, attending to the cached keys too.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from replicas.monokernel_blas import NULL_ARG

QUERY_BLOCK = 1024  # query rows per attention block: bounds the score buffer


@dataclass(frozen=True)
class Positions:
    """Where one prefill pass's rows go: positions start..start+count-1 of the sequence, computed as `rows`
    rows (a CUDA graph pads count up to its bucket; eager passes have rows == count), attending over `keys`
    cache rows (None: each query block's own causal extent). `dyn`: a device int32 array holding
    {start, count}, which the kernels read when they run (a graph's replay); None: the ints here."""

    start: int
    count: int
    rows: int
    keys: int | None = None
    dyn: object = None


_BF16_RNE = "unsigned int u = __float_as_uint(v); y = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);"

# The prefill's small kernels (RMSNorm, RoPE, KV store and the MK_PREFILL_FUSED passes): one CUDA source.
FUSED_SOURCE = Path(__file__).parent.parent / "csrc" / "prefill_fused.cu"
_FUSED = FUSED_SOURCE.read_text()


@functools.cache  # one set per process: every slot's Prefill launches the same loaded kernels
def _kernels(cp):
    """The prefill's CuPy kernels, made once: each kernel object loads its CUDA module on first use, and a
    module loaded while a resident batch launch runs waits for that launch to end (measured on the H200: a
    join's first prefill into slot 3 took 1,731 ms instead of 9 ms), so every slot shares the ones the
    engine loaded before its first launch."""
    return dict(
        widen=cp.ElementwiseKernel("uint16 x", "float32 y", "y = __uint_as_float(((unsigned int)x) << 16)",
                                   "mk_bf16_to_f32"),
        narrow=cp.ElementwiseKernel("float32 v", "uint16 y", _BF16_RNE, "mk_f32_to_bf16"),
        silu_mul=cp.ElementwiseKernel("float32 gate, float32 up", "uint16 y",  # gu -> bf16 SiLU(gate) * up
                                      "float v = gate / (1.0f + expf(-gate)) * up; " + _BF16_RNE,
                                      "mk_silu_mul_bf16"),
        functions=_loaded_functions(cp))


def _no_work_args() -> dict:
    """Per _FUSED kernel: arguments under which every thread returns before touching memory."""
    i32, i64, null = np.int32, np.int64, NULL_ARG
    return {
        "mk_rms_rows": (null, null, null, i32(0), np.float32(1.0)),
        "mk_rms_rows_bits": (null, null, null, i32(0), np.float32(1.0)),
        "mk_rope_rows": (null, null, null, null, i32(1), i32(2), i64(0), null, i32(0)),
        "mk_store_kv": (null, null, i32(1), i32(1), i32(1), i64(0), null, i32(0), i32(0)),
        "mk_rope_bits": (null, i64(0), null, null, null, i32(1), i32(1), i32(2), i64(0), null, i32(0)),
        "mk_store_kv_f32": (null, i64(0), null, null, null, i32(1), i32(1), i32(1), i64(0), null, i32(0), i32(0)),
        "mk_add_parts": (null, null, i32(1), i64(0)),
    }


def _loaded_functions(cp) -> dict:
    """The _FUSED module's kernels by name, each launched once (doing nothing). Under CUDA's lazy loading each
    function loads at its first launch, and a load during a resident launch waits for it to end: a kernel
    that only some prompt shapes use (mk_add_parts: only split-K linears) would first load inside a join."""
    module = cp.RawModule(code=_FUSED)
    functions = {}
    for name, args in _no_work_args().items():
        functions[name] = module.get_function(name)
        functions[name]((1,), (32,), args)
    return functions


class Prefill:
    """Runs prompts through the packed weights of one `GpuModel` (see monokernel_gpu.py)."""

    def __init__(self, model, xp=None, graphs: bool | None = None, graph_arena=None):
        """xp: the array module (cupy by default; numpy runs the same math on the CPU for tests).
        graphs: replay prompts of up to prefill_graph.GRAPH_ROWS[-1] tokens from CUDA graphs (GPU only;
        default on unless MK_PREFILL_GRAPHS=0): a short prompt's prefill is otherwise bound by the host
        issuing ~20 CuPy / cuBLAS operations per layer (measured on the H200: 32 tokens of llama-3.2-1b,
        18 ms on the host for 1.9 ms of GPU work). graph_arena: a prefill_graph.GraphArena shared with other
        Prefills (a batched engine's slots: one pool of graph temporaries for all); None: one of its own."""
        if xp is None:
            import cupy as xp
        self.cp = xp
        self.m = model
        self.blas = None
        self.graphs = None
        # Fused passes (GPU; on by default, MK_PREFILL_FUSED=0 turns them off): the norm's, RoPE's and KV store's
        # outputs written as the bf16 bits their readers take, and split-K parts summed into the residual: 337 ->
        # 177 ops; a 32-token join prefill beside a resident launch 8.98 -> 8.29 ms, join cost beyond the prefill
        # +0.82 -> +0.43 ms median (bench/RESULTS.md session 20), idle -13%. A graph captured beside a running
        # resident launch with them once waited ~0.5 s in the driver's end capture (cause not found, csrc/NOTES.md
        # "Joins after session 19"); resident engines capture every graph shape before their first launch.
        self.fused_ops = frozenset()  # the fused passes that run (rms, kv, add); empty: none (the CPU always)
        if xp.__name__ == "numpy":
            from replicas.monokernel_weights import to_bf16_bits, to_f32

            self.widen, self.narrow = (lambda a: to_f32(xp, a)), (lambda a: to_bf16_bits(xp, a))
        else:
            from replicas.monokernel_blas import Blas

            k = _kernels(xp)
            self.widen, self.narrow, self._silu_mul = k["widen"], k["narrow"], k["silu_mul"]
            self.blas = Blas(xp)
            f = k["functions"]
            self._rms_k, self._rope_k, self._store_k = f["mk_rms_rows"], f["mk_rope_rows"], f["mk_store_kv"]
            self._rms_bits_k, self._rope_bits_k = f["mk_rms_rows_bits"], f["mk_rope_bits"]
            self._store_f32_k, self._add_parts_k = f["mk_store_kv_f32"], f["mk_add_parts"]
            # MK_PREFILL_FUSED_OPS (diagnosis): which of the fused passes run (unless MK_PREFILL_FUSED=0); default all
            ops = frozenset(o for o in os.environ.get("MK_PREFILL_FUSED_OPS", "rms,kv,add").split(",") if o)
            if not ops <= {"rms", "kv", "add"}:
                raise ValueError(f"MK_PREFILL_FUSED_OPS={os.environ['MK_PREFILL_FUSED_OPS']!r}: a comma list of "
                                 "rms, kv, add (the fused passes to run; default all)")
            fused = os.environ.get("MK_PREFILL_FUSED", "1")
            if fused not in ("0", "1"):
                raise ValueError(f"MK_PREFILL_FUSED={fused!r}: 1 (the default) runs the fused prefill passes, 0 the "
                                 "unfused ones")
            if fused == "1":
                self.fused_ops = ops
            if graphs is None:
                graphs = os.environ.get("MK_PREFILL_GRAPHS", "1") != "0"
            if graphs:
                from replicas.prefill_graph import PrefillGraphs

                self.graphs = PrefillGraphs(self, graph_arena)

    def _linear(self, x, w, k: int):
        """x fp32 [T, K] (or bf16 bits) @ w[:, :K]^T (w: packed bf16 rows) -> fp32; bf16 tensor cores on the GPU."""
        if self.blas is None:
            return (self.widen(x) if x.dtype == self.cp.uint16 else x) @ self.widen(w[:, :k]).T
        xb = x if x.dtype == self.cp.uint16 else self.narrow(x)
        return self.blas.linear(self.cp.ascontiguousarray(xb), w, k)

    def _linear_add(self, x, inp, w, k: int) -> None:
        """x += inp @ w[:, :K]^T (x fp32 [T, N] contiguous); GPU fused: split-K parts summed into x by one kernel."""
        if "add" not in self.fused_ops:
            x += self._linear(inp, w, k)
            return
        cp = self.cp
        xb = cp.ascontiguousarray(inp if inp.dtype == cp.uint16 else self.narrow(inp))
        parts = self.blas.linear_parts(xb, w, k)  # [splits, T, N]
        if parts.shape[0] == 1:
            x += parts[0]
            return
        assert x.flags.c_contiguous and parts.flags.c_contiguous and parts[0].shape == x.shape
        self._add_parts_k(((x.size + 255) // 256,), (256,), (x, parts, np.int32(parts.shape[0]), np.int64(x.size)))

    def _rms_bits(self, x, w):
        """A GEMM's input: RMSNorm of contiguous rows, fused: as the bf16 bits (= narrow(_rms(x, w)), which
        _linear would do, in one kernel); otherwise _rms's fp32 (the CPU's GEMMs take fp32 unrounded)."""
        if "rms" not in self.fused_ops or not x.flags.c_contiguous:
            return self._rms(x, w)
        cp = self.cp
        n = x.shape[-1]
        y = cp.empty(x.shape, cp.uint16)
        self._rms_bits_k((x.size // n,), (256,), (x, cp.ascontiguousarray(w, cp.float32), y, np.int32(n),
                                                  np.float32(self.m.config.rms_norm_eps)))
        return y

    @staticmethod
    def _row_stride(x) -> int:
        """Row stride (elements) of x [T, heads, D] fp32 whose rows hold contiguous [heads][D] (a view into the
        QKV output, or a normed copy)."""
        if x.strides[2] != 4 or x.strides[1] != 4 * x.shape[2] or x.strides[0] % 4:
            raise ValueError(f"rows of [heads][D] must be contiguous, got strides {x.strides}")
        return x.strides[0] // 4

    def _rope_bits(self, q, pos: Positions):
        """Queries q [T, NH, D] fp32 -> RoPE at pos -> bf16 bits [NKV, T, G, D] (the GPU attention's layout)."""
        cp, c, m = self.cp, self.m.config, self.m
        T, NH, D = q.shape
        y = cp.empty((c.num_key_value_heads, T, c.group_size, D), cp.uint16)
        total = q.size
        self._rope_bits_k(((total + 255) // 256,), (256,), (q, np.int64(self._row_stride(q)), m.rope_cos, m.rope_sin, y,
                                                            np.int32(NH), np.int32(c.group_size), np.int32(D),
                                                            np.int64(total), NULL_ARG if pos.dyn is None else pos.dyn,
                                                            np.int32(pos.start)))
        return y

    def _store_kv_f32(self, n: int, k, v, pos: Positions) -> None:
        """Keys (RoPE at pos) and values [rows, NKV, D] fp32 -> bf16 bits into layer n's cache rows start..start+count-1."""
        m, cp = self.m, self.cp
        nkv, d, ctx = m.k_cache.shape[1], m.k_cache.shape[3], m.k_cache.shape[2]
        dyn = NULL_ARG if pos.dyn is None else pos.dyn
        for src, cache, cs, sn in ((k, m.k_cache[n], m.rope_cos, m.rope_sin), (v, m.v_cache[n], NULL_ARG, NULL_ARG)):
            total = src.size
            self._store_f32_k(((total + 255) // 256,), (256,), (src, np.int64(self._row_stride(src)), cs, sn, cache,
                                                                 np.int32(nkv), np.int32(d), np.int32(ctx),
                                                                 np.int64(total), dyn, np.int32(pos.start),
                                                                 np.int32(pos.count)))

    @property
    def fused(self) -> bool:
        """Whether any fused pass runs (on the GPU unless MK_PREFILL_FUSED=0)."""
        return bool(self.fused_ops)

    def _fused_kv(self) -> bool:
        """Whether the fused RoPE / KV-store passes run: they need contiguous per-layer KV caches and RoPE
        tables (as the graphs do)."""
        m = self.m
        return ("kv" in self.fused_ops and m.k_cache[0].flags.c_contiguous
                and m.v_cache[0].flags.c_contiguous and m.rope_cos.flags.c_contiguous and m.rope_sin.flags.c_contiguous)

    def _silu_up(self, gu):
        """gu fp32 [T, I, 2] (gate, up) -> SiLU(gate) * up [T, I]: fp32 on the CPU, on the GPU already
        as the bf16 bits its GEMM reads (one kernel)."""
        g, u = gu[..., 0], gu[..., 1]
        if self.blas is None:
            return g / (1.0 + self.cp.exp(-g)) * u
        return self._silu_mul(g, u)

    def _attention(self, q, k_bits, v_bits, n: int, start: int = 0, pos: Positions | None = None):
        """Causal GQA attention of q [T, NH, D] (roped, unscaled) at positions start..start+T-1 over the
        cache rows 0..start+T-1 of layer n (k_bits/v_bits: this pass's rows start.., as written).
        pos (GPU): a graph's dynamic start and fixed key count instead of `start`."""
        cp, c = self.cp, self.m.config
        NKV, G, D = c.num_key_value_heads, c.group_size, c.head_dim
        T = q.shape[1] if q.ndim == 4 else q.shape[0]  # (4-d: _rope_bits' [NKV, T, G, D] bits)
        scale = 1.0 / math.sqrt(D)
        if self.blas is not None:
            if q.ndim == 4:
                qb = q
            else:
                qb = cp.ascontiguousarray(self.narrow(q.reshape(T, NKV, G, D).transpose(1, 0, 2, 3)))
            dyn = None if pos is None else pos.dyn
            out = self.blas.causal_attention(qb, self.m.k_cache[n], self.m.v_cache[n], self.m.k_cache.shape[2], G, scale,
                                             q_offset=0 if dyn is not None else start,
                                             keys=None if pos is None else pos.keys, dyn_offset=dyn)
            return out.transpose(1, 0, 2, 3).reshape(T, NKV * G * D)
        if start:  # the earlier positions' keys/values exist only in the cache
            k_bits = self.m.k_cache[n, :, :start + T].transpose(1, 0, 2)
            v_bits = self.m.v_cache[n, :, :start + T].transpose(1, 0, 2)
        kf = self.widen(k_bits).transpose(1, 0, 2)  # [NKV, start+T, D]
        vf = self.widen(v_bits).transpose(1, 0, 2)
        qg = (q * scale).reshape(T, NKV, G, D).transpose(1, 2, 0, 3)  # [NKV, G, T, D]
        causal = cp.arange(start + T)[None, :] > (start + cp.arange(T))[:, None]  # [T, start+T] True = masked
        attn = cp.empty((NKV, G, T, D), cp.float32)
        for s in range(0, T, QUERY_BLOCK):
            e = min(T, s + QUERY_BLOCK)
            sc = qg[:, :, s:e] @ kf[:, None].transpose(0, 1, 3, 2)  # [NKV, G, b, T]
            sc = cp.where(causal[s:e][None, None], -cp.inf, sc)
            sc = cp.exp(sc - sc.max(axis=-1, keepdims=True))
            sc /= sc.sum(axis=-1, keepdims=True)
            attn[:, :, s:e] = sc @ vf[:, None]
        return attn.transpose(2, 0, 1, 3).reshape(T, NKV * G * D)

    def _f32(self, bits):
        return self.widen(bits)

    def _rms(self, x, w):
        cp = self.cp
        if self.blas is not None and x.flags.c_contiguous:
            n = x.shape[-1]
            y = cp.empty_like(x)
            self._rms_k((x.size // n,), (256,), (x, cp.ascontiguousarray(w, cp.float32), y, np.int32(n),
                                                 np.float32(self.m.config.rms_norm_eps)))
            return y
        ms = cp.mean(x * x, axis=-1, keepdims=True)
        return x * (1.0 / cp.sqrt(ms + self.m.config.rms_norm_eps)) * w

    def _rope(self, x, cos, sin):
        """x [T, heads, D] with cos / sin [T, 1, D/2] (row t's angles; the sharded prefill's path)."""
        h = x.shape[-1] // 2
        if self.blas is not None and cos.shape[0] == x.shape[0] and cos.flags.c_contiguous:
            return self._rope_table(x, cos, sin, None, 0)
        a, b = x[..., :h], x[..., h:]
        return self.cp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def _rope_at(self, x, pos: Positions):
        """x [rows, heads, D] at positions pos.start + t (read from pos.dyn on the GPU when given)."""
        m = self.m
        if self.blas is not None and m.rope_cos.flags.c_contiguous and m.rope_sin.flags.c_contiguous:
            return self._rope_table(x, m.rope_cos, m.rope_sin, pos.dyn, pos.start)
        if pos.dyn is not None:
            raise RuntimeError("a CUDA graph's prefill needs contiguous RoPE tables")
        end = pos.start + pos.rows
        return self._rope(x, m.rope_cos[pos.start:end][:, None, :], m.rope_sin[pos.start:end][:, None, :])

    def _rope_table(self, x, cos, sin, dyn, start: int):
        cp = self.cp
        xc = cp.ascontiguousarray(x)
        y = cp.empty_like(xc)
        total = xc.size
        self._rope_k(((total + 255) // 256,), (256,), (xc, cos, sin, y, np.int32(x.shape[1]), np.int32(x.shape[2]),
                                                        np.int64(total), NULL_ARG if dyn is None else dyn,
                                                        np.int32(start)))
        return y

    def _store_kv(self, n: int, k_bits, v_bits, pos: Positions) -> None:
        """This pass's K / V rows [rows, kv_heads, D] into layer n's cache rows start..start+count-1."""
        m = self.m
        if self.blas is None or not (m.k_cache[n].flags.c_contiguous and m.v_cache[n].flags.c_contiguous):
            if pos.dyn is not None:
                raise RuntimeError("a CUDA graph's prefill needs contiguous per-layer KV caches")
            end = pos.start + pos.count
            m.k_cache[n, :, pos.start:end, :] = k_bits[:pos.count].transpose(1, 0, 2)
            m.v_cache[n, :, pos.start:end, :] = v_bits[:pos.count].transpose(1, 0, 2)
            return
        cp = self.cp
        nkv, d, ctx = m.k_cache.shape[1], m.k_cache.shape[3], m.k_cache.shape[2]
        dyn = NULL_ARG if pos.dyn is None else pos.dyn
        for src, cache in ((k_bits, m.k_cache[n]), (v_bits, m.v_cache[n])):
            src = cp.ascontiguousarray(src)
            total = src.size
            self._store_k(((total + 255) // 256,), (256,), (src, cache, np.int32(nkv), np.int32(d), np.int32(ctx),
                                                             np.int64(total), dyn, np.int32(pos.start),
                                                             np.int32(pos.count)))

    def run(self, ids, all_logits: bool = False, start: int = 0):
        """Prompt `ids` -> (last hidden state [H] fp32, logits [len(ids) - start, V] or None).

        start=P > 0: the cache already holds valid K/V for positions 0..P-1; only ids[P:] are
        computed (positions P.., K/V written at rows P..), each attending to keys 0..its position."""
        cp = self.cp
        if isinstance(start, bool) or not isinstance(start, numbers.Integral) or not 0 <= start < len(ids):
            raise ValueError(f"start={start!r}: need 0 <= start < len(ids)={len(ids)} "
                             "(the cached positions, leaving at least one token to compute)")
        start, end = int(start), len(ids)
        if self.graphs is not None and not all_logits:
            x_last = self.graphs.run(ids, start)
            if x_last is not None:
                return x_last, None
        T = end - start  # rows computed in this pass
        x = self.forward(cp.asarray(ids[start:], dtype=cp.int64), Positions(start, T, T))
        logits = None
        if all_logits:
            w = self.m.weights
            logits = self._linear(self._rms(x, w["lnf"]), w.get("w_lm_prefill", w["w_lm"]), self.m.config.hidden_size)
        return x[-1].copy(), logits

    def forward(self, ids_d, pos: Positions):
        """Token ids on the device [pos.rows] -> the residual stream after the last layer [pos.rows, H] fp32,
        K/V of the first pos.count rows stored at positions pos.start.. (also what a CUDA graph captures)."""
        m = self.m
        c, w = m.config, m.weights
        T = pos.rows
        H, Q, KV, I, D = c.hidden_size, c.q_dim, c.kv_dim, c.intermediate_size, c.head_dim
        NH, NKV = c.num_attention_heads, c.num_key_value_heads
        x = self._f32(w["embed"][ids_d])  # [T, H]
        fused_kv = self._fused_kv()
        for n in range(c.num_hidden_layers):
            qkv = self._linear(self._rms_bits(x, w["ln1"][n]), w.get("w_qkv_prefill", w["w_qkv"])[n], H)  # mma: own copy
            if c.qkv_bias:
                qkv += w["qkv_bias"][n]
            q = qkv[:, :Q].reshape(T, NH, D)
            k = qkv[:, Q:Q + KV].reshape(T, NKV, D)
            v = qkv[:, Q + KV:].reshape(T, NKV, D)
            if c.qk_norm:
                q = self._rms(q, w["q_norm"][n])
                k = self._rms(k, w["k_norm"][n])
            if fused_kv:  # (the GPU attention reads keys and values from the cache)
                self._store_kv_f32(n, k, v, pos)
                attn = self._attention(self._rope_bits(q, pos), None, None, n, pos.start, pos)
            else:
                k_bits = self.narrow(self._rope_at(k, pos))
                v_bits = self.narrow(v)
                self._store_kv(n, k_bits, v_bits, pos)
                attn = self._attention(self._rope_at(q, pos), k_bits, v_bits, n, pos.start, pos)
            self._linear_add(x, attn, w.get("w_o_prefill", w["w_o"])[n], Q)  # fused_attn_o: own copy
            if c.o_bias:
                x += w["o_bias"][n]
            gu = self._linear(self._rms_bits(x, w["ln2"][n]), w.get("w_gu_prefill", w["w_gu"])[n].reshape(2 * I, -1), H
                              ).reshape(T, I, 2)
            self._linear_add(x, self._silu_up(gu), w.get("w_dn_prefill", w["w_dn"])[n], I)  # fused_mlp: own copy
        return x
