"""Layout option `fused_attn_o` (off by default): O-projection fused into the attention phase.

Without it a layer runs `... | attention | O |`: every block combines every head's split-KV partials
after a grid barrier, then streams its O rows. With it, O is packed by kv group,
w_o [L][NKV][H][GDp] (GDp = group·D padded to 256), one *unit* = (group g, output row) of GDp
elements. Units are dealt to warps in contiguous ranges as before, so a block's units fall in one
or two groups; the block waits only for those groups' attention (a per-kv-group counter in
attn_cnt that each split block bumps after publishing its partial), combines just those groups,
and adds every unit's dot product as int64 fixed point (value·2^32, `red.add`: integer adds
commute, so the sum over groups is bitwise deterministic) into one accumulator (o_part, int64
[Hp]). The next prologue reads it; the next layer's QKV phase zeroes it. One grid barrier fewer
per layer (5 -> 4; 4 -> 3 with fused_mlp).
"""

from __future__ import annotations

import numpy as np

CHUNK = 256
FX_SHIFT = 32  # same fixed point as fused_mlp's down accumulators (range ±2^31)


def group_len(lay) -> int:
    """GDp: one kv group's attention output (group·D), padded to a whole chunk."""
    gd = lay.group * lay.head_dim
    return (gd + CHUNK - 1) // CHUNK * CHUNK


def attn_o_error(lay) -> str | None:
    if not lay.fused_attn_o:
        return None
    if lay.tp != 1:
        return ("fused_attn_o is single-GPU only (tp=1): with tp > 1 the O output is all-reduced across "
                "GPUs from the k-split partials; drop fused_attn_o or use tp=1")
    if lay.qkv_flags:
        return ("fused_attn_o zeroes its O accumulator in the QKV phase and needs the QKV grid barrier after it; "
                "drop qkv_flags (measured slower anyway) or fused_attn_o")
    return None


def act_floats(lay) -> int:
    """Shared floats: every group's staged attention output, then the split weights of one group."""
    from replicas.layout import MAX_ATTN_SPLITS
    return lay.kv_heads * group_len(lay) + 2 * lay.group * MAX_ATTN_SPLITS


def pack_o_by_group(xp, lay, o):
    """o_proj [hidden, q_dim] (bf16 bits) -> [NKV, hidden, GDp]: unit (g, row) = row's group-g columns."""
    gd, gdp = lay.group * lay.head_dim, group_len(lay)
    out = xp.zeros((lay.kv_heads, lay.hidden, gdp), xp.uint16)
    for g in range(lay.kv_heads):
        out[g, :, :gd] = xp.asarray(o)[:, g * gd:(g + 1) * gd]
    return out


def num_splits(lay, ctx: int) -> int:
    """mk_attention.cuh:num_splits on a grid of lay.num_sms blocks."""
    return max(1, min(lay.attn_splits_max, (ctx + 63) // 64))


def simulate_attn_o(lay, packed_o: np.ndarray, q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """What the kernel computes for the newest position: q [NH, D] (roped, unscaled), keys/values
    [T, NKV, D] fp32 (the cache incl. the new row). Split-KV partials (max, sum, unnormalised output)
    per (group, split), the group's combine in the kernel's order, then every (group, row) unit's fp32
    dot with the packed O, rounded to int64 fixed point and summed over groups as integers. [hidden]"""
    G, D, T = lay.group, lay.head_dim, keys.shape[0]
    gdp = group_len(lay)
    f32 = (packed_o.astype(np.uint32) << 16).view(np.float32)  # [NKV, H, GDp]
    ns = num_splits(lay, T)
    chunk = -(-T // ns)
    total = np.zeros(lay.hidden, np.int64)
    qs = (q * np.float32(D ** -0.5)).astype(np.float32)
    for g in range(lay.kv_heads):
        m, l, o = [], [], []
        for s in range(ns):
            t0, t1 = s * chunk, min(T, (s + 1) * chunk)
            sc = qs[g * G:(g + 1) * G] @ keys[t0:t1, g].T  # [G, n]
            mx = sc.max(axis=1) if t1 > t0 else np.full(G, -np.inf, np.float32)
            e = np.exp(sc - mx[:, None]).astype(np.float32)
            m.append(mx)
            l.append(e.sum(axis=1))
            o.append(e @ values[t0:t1, g])
        m, l, o = np.array(m, np.float32), np.array(l, np.float32), np.array(o, np.float32)  # [ns, G(, D)]
        M = m.max(axis=0)
        w = np.exp(m - M) / (np.exp(m - M) * l).sum(axis=0)  # [ns, G]
        x = np.zeros(gdp, np.float32)
        x[:G * D] = (w[:, :, None] * o).sum(axis=0).reshape(-1)
        unit = f32[g] @ x  # [H] fp32 dots
        total += np.rint(unit.astype(np.float64) * 2.0 ** FX_SHIFT).astype(np.int64)
    return (total.astype(np.float64) * 2.0 ** -FX_SHIFT).astype(np.float32)
