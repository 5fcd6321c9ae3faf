"""Re-laying a checkpoint's tensors out once, at load, in the monokernel's packed order.

Written against an array module `xp` (numpy in CPU tests, cupy on the GPU) so the same code
that the unit tests check is the code that fills GPU memory. See replicas/layout.py for the
packed shapes and why rows are padded and gate/up interleaved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from replicas import layout_mma, layout_mma_mlp
from replicas.layout import CHUNK, KernelLayout
from replicas.layout_attn_o import pack_o_by_group
from replicas.layout_fused import pack_down_fused
from replicas.model import ModelConfig

Array = Any  # numpy.ndarray or cupy.ndarray


def to_bf16_bits(xp, a: Array) -> Array:
    """Any stored weight (bf16 bits as uint16, fp16, fp32) -> bf16 bit patterns (uint16), RNE."""
    a = xp.asarray(a)
    if a.dtype == xp.uint16:
        return a
    u = a.astype(xp.float32).view(xp.uint32)
    return ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)


def to_f32(xp, a: Array) -> Array:
    """Stored weight (bf16 bits as uint16, fp16, fp32) -> float32 (exact)."""
    a = xp.asarray(a)
    if a.dtype == xp.uint16:
        return (a.astype(xp.uint32) << 16).view(xp.float32)
    return a.astype(xp.float32)


def pack_weights(xp, layout: KernelLayout, config: ModelConfig, tensors: Mapping[str, Array],
                 progress: Callable[[int], None] | None = None) -> dict[str, Array]:
    """Packed bf16 matrices + fp32 small tensors, keyed by MkParams field name.

    `tensors` are HF-named arrays as `replicas.weights.load_weights(..., dtype="raw")` returns.
    progress(nbytes) is called after each big tensor is placed.
    """
    c, lay = config, layout
    H, Q, KV, I, D, L = c.hidden_size, c.q_dim, c.kv_dim, c.intermediate_size, c.head_dim, c.num_hidden_layers
    shapes = lay.packed_shapes()
    out: dict[str, Array] = {}
    done = progress or (lambda n: None)

    def big(name: str) -> Array:
        a = to_bf16_bits(xp, tensors[name])
        done(int(a.nbytes))
        return a

    out["w_qkv"] = xp.zeros(shapes["w_qkv"], xp.uint16)
    out["w_o"] = xp.zeros(shapes["w_o"], xp.uint16)
    out["w_gu"] = xp.zeros(shapes["w_gu"], xp.uint16)
    out["w_dn"] = xp.zeros(shapes["w_dn"], xp.uint16)
    if lay.fused_mlp:
        out["w_dn_prefill"] = xp.zeros((L, H, lay.ip), xp.uint16)
    if lay.fused_attn_o:
        out["w_o_prefill"] = xp.zeros((L, H, lay.qp), xp.uint16)
    small = {k: xp.zeros(s, xp.float32) for k, s in {
        "ln1": (L, H), "ln2": (L, H), "lnf": (H,), "qkv_bias": (L, lay.qkv_rows), "o_bias": (L, H),
        "q_norm": (L, D), "k_norm": (L, D)}.items()}
    for n in range(L):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        out["w_qkv"][n, :Q, :H] = big(a + "q_proj.weight")
        out["w_qkv"][n, Q:Q + KV, :H] = big(a + "k_proj.weight")
        out["w_qkv"][n, Q + KV:, :H] = big(a + "v_proj.weight")
        if lay.fused_attn_o:  # by kv group for the kernel (replicas/layout_attn_o.py), plain rows for the prefill
            o = big(a + "o_proj.weight")
            out["w_o"][n] = pack_o_by_group(xp, lay, o)
            out["w_o_prefill"][n, :, :Q] = o
        else:
            out["w_o"][n, :, :Q] = big(a + "o_proj.weight")
        out["w_gu"][n, :, 0, :H] = big(p + "mlp.gate_proj.weight")
        out["w_gu"][n, :, 1, :H] = big(p + "mlp.up_proj.weight")
        if lay.fused_mlp:  # block-slice tiles of down^T (replicas/layout_fused.py) for the kernel,
            dn = big(p + "mlp.down_proj.weight")  # plain rows for the prefill's GEMM
            out["w_dn"][n] = pack_down_fused(xp, lay, dn)
            out["w_dn_prefill"][n, :, :I] = dn
        else:
            out["w_dn"][n, :, :I] = big(p + "mlp.down_proj.weight")
        small["ln1"][n] = to_f32(xp, tensors[p + "input_layernorm.weight"])
        small["ln2"][n] = to_f32(xp, tensors[p + "post_attention_layernorm.weight"])
        if c.qkv_bias:
            small["qkv_bias"][n] = xp.concatenate([to_f32(xp, tensors[a + f"{x}_proj.bias"]) for x in "qkv"])
        if c.o_bias:
            small["o_bias"][n] = to_f32(xp, tensors[a + "o_proj.bias"])
        if c.qk_norm:
            small["q_norm"][n] = to_f32(xp, tensors[a + "q_norm.weight"])
            small["k_norm"][n] = to_f32(xp, tensors[a + "k_norm.weight"])
    small["lnf"][:] = to_f32(xp, tensors["model.norm.weight"])
    out.update(small)

    embed = xp.ascontiguousarray(big("model.embed_tokens.weight"))
    out["embed"] = embed
    head = embed if c.tie_word_embeddings else big("lm_head.weight")
    if lay.gu_il:  # gate and up chunks alternate within a row's unit (one input load serves both)
        out["w_gu_prefill"] = out["w_gu"]
        out["w_gu"] = interleave_gate_up(xp, out["w_gu"])
    if lay.mma_mlp:  # the fused MLP's tensor-core tiles (layout_mma_mlp.py); plain copies for the prefill
        layout_mma_mlp.repack(xp, lay, out)
    if lay.mma_qkv:
        layout_mma_mlp.repack_qkv(xp, lay, out)
    if lay.mma_o:
        layout_mma_mlp.repack_o(xp, lay, out)
    if lay.mma:  # the kernel's tensor-core tiles (layout_mma.py); the prefill keeps the plain rows
        _repack_mma(xp, lay, out, head)
    elif lay.mma_lm:  # the LM head alone in tiles; the prefill and the single-sequence build read the plain rows
        out[layout_mma_mlp.plain_copies(lay)["w_lm"]] = _plain_lm(xp, lay, head)
        out["w_lm"] = layout_mma.pack_lm(xp, lay, head).reshape(shapes["w_lm"])
    elif lay.hp == H:
        out["w_lm"] = xp.ascontiguousarray(head)  # tied + unpadded: the embedding is the LM head
    else:
        out["w_lm"] = xp.zeros(shapes["w_lm"], xp.uint16)
        out["w_lm"][:, :H] = head
    return out


def interleave_gate_up(xp, gu: Array) -> Array:
    """[L][I][2][Hp] (row i: gate row, then up row) -> the same shape with each row's 256-element
    chunks alternating gate c, up c (layout option gu_il): the kernel takes a gate and an up chunk
    and loads their shared input once. The plain matrix stays the prefill's (w_gu_prefill)."""
    L_, I_, two, hp = gu.shape
    return xp.ascontiguousarray(gu.reshape(L_, I_, two, hp // CHUNK, CHUNK).transpose(0, 1, 3, 2, 4)).reshape(gu.shape)


def _repack_mma(xp, lay: KernelLayout, out: dict[str, Array], head: Array) -> None:
    """Layout option mma: w_qkv, w_o, w_gu and w_lm in mma A-fragment tiles; the plain matrices the
    prefill's GEMMs read move to w_qkv_prefill / w_gu_prefill / w_lm_prefill (w_o_prefill exists)."""
    out["w_qkv_prefill"], out["w_gu_prefill"] = out["w_qkv"], out["w_gu"]
    qkv, gu, o = out["w_qkv"], out["w_gu"], out["w_o"]
    out["w_qkv"], out["w_gu"], out["w_o"] = xp.empty_like(qkv), xp.empty_like(gu), xp.empty_like(o)
    for n in range(lay.layers):
        out["w_qkv"][n] = layout_mma.pack_rows(xp, qkv[n], lay.splits["qkv"]).reshape(qkv.shape[1:])
        out["w_gu"][n] = layout_mma.pack_gate_up(xp, gu[n, :, 0], gu[n, :, 1]).reshape(gu.shape[1:])
        out["w_o"][n] = layout_mma.pack_o_groups(xp, o[n]).reshape(o.shape[1:])
    out["w_lm_prefill"] = _plain_lm(xp, lay, head)
    out["w_lm"] = layout_mma.pack_lm(xp, lay, head).reshape(lay.packed_shapes()["w_lm"])


def _plain_lm(xp, lay: KernelLayout, head: Array) -> Array:
    """The LM head in plain padded rows [V, Hp] (the embedding itself when Hp == hidden)."""
    if lay.hp == head.shape[1]:
        return head
    plain = xp.zeros((head.shape[0], lay.hp), xp.uint16)
    plain[:, :head.shape[1]] = head
    return plain


def rope_tables(config: ModelConfig, max_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_ctx, head_dim/2] float32, computed as HF does (fp32 angle = pos * inv_freq)."""
    inv = config.rope_inv_freq().astype(np.float32)
    ang = np.arange(max_ctx, dtype=np.float32)[:, None] * inv[None, :]
    return np.cos(ang.astype(np.float64)).astype(np.float32), np.sin(ang.astype(np.float64)).astype(np.float32)
