"""Layout option `mma_mlp` (batch builds): the fused MLP's gate/up and down on tensor cores.

Why: on CUDA cores each extra slot of a batch build pays its own FMAs and shared-memory input reads for
every weight; at B = 4 that cost ~350 µs a step per slot on llama-3.2-1b, and the fused down alone was
31% of what B = 4 adds to the profile (csrc/NOTES.md "Batch speed"). One `mma.m16n8k16` multiplies a
16 x 16 weight tile by all 8 slot columns at once. The MLP is 83% of a layer's weights, so it goes first.
Layout option `mma` (all matvecs, 16-row tiles over the whole k range) lost 29% at B = 1 to its work split:
gate/up had 512 tiles for 2,112 warps. Here the split stays as fine as the CUDA-core one:

  gate/up  block b owns whole tiles [t0, t1) (layout_fused.block_rows with 16-row units); their
           (tile, 16-k step) pairs, a gate and an up chunk each (layout_mma.pack_gate_up's order), are cut
           into equal contiguous ranges, one per warp (`gu_share`): a k-split within the block. Each
           warp stores a partial tile ("piece" w + t) per tile it touched; the block adds a tile's pieces
           in warp order, then h = SiLU(gate)·up, rounded to bf16, in mma B-fragment order.
  down     block b's columns of down (its h rows [js, je)) as A tiles of 16 hidden rows x 16 h rows,
           (output tile, k-step) order from element js·H of the layer (`pack_down`); warp w owns output
           tiles [o0, o1) over every k-step (`dn_share`) and adds each tile's int64 fixed-point sums to
           the accumulator straight from its registers (no partials pass, no barrier per slot).
           pair_dn: blocks 2p and 2p + 1 run as one cluster, each writes its h slice into both blocks'
           shared memory, and each downs half the output tiles over the pair's h rows: half the atomics
           (the L2's atomic units, not the warps issuing them, are the batch down's cost: csrc/NOTES.md).

The single-sequence build keeps the CUDA-core MLP (mma_mlp is a batch-only option), so the batched
engine gives it its own plain gate/up and fused-down packing (monokernel_batch.regrid_weights).
Numerics: the gate/up input and h are bf16 (the CUDA-core path keeps them fp32): logits differ from the
B = 1 kernel at bf16-rounding level, checked within the transformers tolerance.
"""

from __future__ import annotations

import numpy as np

from replicas import layout_attn_o, layout_fused, layout_mma

TILE = layout_mma.TILE


def mma_mlp_error(lay) -> str | None:
    if not lay.mma_mlp:
        return None
    if lay.batch < 2:
        return "mma_mlp is a batch-build option (batch >= 2): the single-sequence build keeps the CUDA-core MLP"
    if lay.mma or lay.gu_il:
        return "mma_mlp orders gate/up its own way: drop mma and gu_il (mma already puts the whole MLP's gate/up on tensor cores)"
    if lay.tp != 1 or not lay.fused_mlp:
        return "mma_mlp changes the fused MLP of one GPU: it needs fused_mlp and tp=1"
    if lay.l2_budget:
        return "mma_mlp streams gate/up by block tiles, not the row ranges the L2 prefetch walks: use l2_budget=0"
    for name, rows in (("hidden", lay.hidden), ("intermediate", lay.inter)):
        if rows % TILE:
            return f"mma_mlp tiles rows by {TILE}: {name}={rows} is not a multiple of {TILE}; drop mma_mlp"
    return None


def mma_qkv_error(lay) -> str | None:
    if not lay.mma_qkv:
        return None
    if lay.batch < 2 or lay.mma or lay.tp != 1 or not lay.fused_mlp or lay.qkv_flags:
        return ("mma_qkv puts a batch build's QKV on tensor cores: it needs batch >= 2, tp=1, fused_mlp and the QKV "
                "barrier (not qkv_flags), and not mma (which has it already)")
    if lay.qkv_rows % TILE:
        return f"mma_qkv tiles rows by {TILE}: q/k/v rows={lay.qkv_rows}; drop mma_qkv"
    return None


def mma_o_error(lay) -> str | None:
    if not lay.mma_o:
        return None
    if lay.batch < 2 or lay.mma or lay.tp != 1 or not (lay.fused_attn_o and lay.o_align and lay.ao_slots):
        return ("mma_o puts a batch build's O-proj on tensor cores: it needs batch >= 2, tp=1, fused_attn_o with "
                "o_align and ao_slots (the batch defaults), and not mma (which has it already)")
    if lay.hidden % TILE or lay.num_sms < lay.kv_heads:
        return (f"mma_o tiles O rows by {TILE} per kv group over whole blocks: hidden={lay.hidden}, "
                f"{lay.num_sms} blocks for {lay.kv_heads} kv heads; drop mma_o")
    return None


def o_block_units(lay, b: int) -> tuple[int, int]:
    """Block b's O tiles [v0, v1) (unit g * hidden/16 + t, layout_mma.pack_o_groups): o_align gives kv group g the
    blocks [g nb / NKV, (g + 1) nb / NKV), which share its tiles evenly (csrc/mk_stream.cuh o_block_units)."""
    nb, nkv, tiles = lay.num_sms, lay.kv_heads, lay.hidden // TILE
    g = next(g for g in range(nkv) if (g + 1) * nb // nkv > b)
    b0, n = g * nb // nkv, (g + 1) * nb // nkv - g * nb // nkv
    return g * tiles + tiles * (b - b0) // n, g * tiles + tiles * (b - b0 + 1) // n


def o_share(lay, b: int, w: int) -> tuple[int, int, int]:
    """Warp w of block b: (block's first O tile, first pair, end pair) of its (tile, 16-k step) pairs."""
    v0, v1 = o_block_units(lay, b)
    n, W = (v1 - v0) * (layout_attn_o.group_len(lay) // TILE), lay.warps_per_block
    return v0, n * w // W, n * (w + 1) // W


def k_steps(lay) -> int:
    return lay.hp // TILE


def block_units(units: int, num_sms: int, b: int) -> tuple[int, int]:
    """Block b's units [v0, v1) of a block-tiled matrix of `units` (csrc/mk_stream.cuh tile_share)."""
    return units * b // num_sms, units * (b + 1) // num_sms


def tile_share(lay, units: int, steps: int, b: int, w: int) -> tuple[int, int, int]:
    """Warp w of block b: (block's first unit, first pair, end pair), its (unit, 16-k step) pairs counted from
    the block's first (csrc/mk_stream.cuh tile_share)."""
    v0, v1 = block_units(units, lay.num_sms, b)
    n, W = (v1 - v0) * steps, lay.warps_per_block
    return v0, n * w // W, n * (w + 1) // W


def block_tiles(lay, b: int) -> tuple[int, int]:
    """Block b's gate/up tiles [t0, t1) (csrc/mk_stream.cuh gu_row0 / 16; layout_fused.block_rows in tiles)."""
    return block_units(lay.inter // TILE, lay.num_sms, b)


def gu_share(lay, b: int, w: int) -> tuple[int, int, int]:
    """Warp w of block b: (block's first tile, first pair, end pair), pairs counted from the block's first
    (csrc/mk_stream.cuh gu_share; a pair is a gate and an up chunk)."""
    return tile_share(lay, lay.inter // TILE, k_steps(lay), b, w)


def qkv_split(qkv_rows: int, hp: int, num_sms: int) -> int:
    """mma_qkv's k-split S: units are (16-row tile, one of S k parts), dealt to blocks; the smallest S whose most
    loaded block is within 10% of the mean (layout_mma.choose_split_tiles over blocks; 1B, 132 blocks: S = 2)."""
    return layout_mma.choose_split_tiles(qkv_rows // TILE, hp, num_sms)


def qkv_units(lay) -> tuple[int, int]:
    """(units, 16-k steps per unit) of the mma_qkv QKV matrix."""
    s = lay.splits["qkv"]
    return lay.qkv_rows // TILE * s, k_steps(lay) // s


def dn_block(lay, b: int) -> tuple[int, int, int, int]:
    """Block b's down: (first h row js, k-steps nt, first output tile, end output tile). Its h rows are its own
    gate/up tiles; with pair_dn those of its pair (blocks 2p, 2p + 1, one cluster), whose output tiles it splits
    with its peer: rank r takes half r of them, so each block adds half the rows to the accumulators."""
    tiles = lay.hidden // TILE
    if not lay.pair_dn:
        t0, t1 = block_tiles(lay, b)
        return t0 * TILE, t1 - t0, 0, tiles
    t0, t1 = block_tiles(lay, b & ~1)[0], block_tiles(lay, b | 1)[1]
    r = b & 1
    return t0 * TILE, t1 - t0, tiles * r // 2, tiles * (r + 1) // 2


def dn_share(lay, b: int, w: int) -> tuple[int, int, int, int]:
    """Warp w of block b: (first h row js, k-steps nt, first output tile, end output tile) of its down run,
    which starts at element js * hidden + o0 * nt * 256 of the layer's packed down (csrc/mk_stream.cuh)."""
    js, nt, a, e = dn_block(lay, b)
    W = lay.warps_per_block
    return js, nt, a + (e - a) * w // W, a + (e - a) * (w + 1) // W


def dn_groups(lay) -> list[tuple[int, int]]:
    """The h row ranges [js, je) packed as one column block of down: each block's, or each pair's (pair_dn)."""
    step = 2 if lay.pair_dn else 1
    out = []
    for b in range(0, lay.num_sms, step):
        js, nt, _, _ = dn_block(lay, b)
        if nt:
            out.append((js, js + nt * TILE))
    return out


def max_block_tiles(lay) -> int:
    return _most_units(lay, lambda b: block_tiles(lay, b))


def block_tiled(lay) -> bool:
    """Whether the build runs a block-tiled tensor-core matvec (csrc/mk_block_mma.cuh), which stores pieces."""
    return lay.mma_mlp or lay.mma_qkv or lay.mma_o


def _most_units(lay, block_range) -> int:
    return max(v1 - v0 for v0, v1 in map(block_range, range(lay.num_sms)))


def _matrices(lay) -> list[tuple[int, int]]:
    """(most units in a block, chunks per step) of each block-tiled matrix of the build."""
    out = []
    if lay.mma_mlp:
        out.append((max_block_tiles(lay), 2))  # gate and up
    if lay.mma_qkv:
        out.append((_most_units(lay, lambda b: block_units(qkv_units(lay)[0], lay.num_sms, b)), 1))
    if lay.mma_o:
        out.append((_most_units(lay, lambda b: o_block_units(lay, b)), 1))
    return out


def pieces(lay) -> int:
    """The most pieces any block-tiled matrix of the build stores (piece index w + v < warps + units per block - 1;
    MK_MMLP_PIECES)."""
    return max((lay.warps_per_block + n - 1 for n, _ in _matrices(lay)), default=0)


def piece_floats(lay) -> int:
    """Shared floats of the pieces: [pieces][matrices: gate and up, or one][16 rows][slots rounded up to even]."""
    bc = (lay.batch + 1) // 2 * 2
    return max(((lay.warps_per_block + n - 1) * mats for n, mats in _matrices(lay)), default=0) * TILE * bc


# ---- packing (xp: numpy or cupy) ---------------------------------------------------------------

def pack_down(xp, lay, down):
    """down [hidden, inter] (bf16 bits) -> the layer's packed down, flat [inter * Hp] (the first
    inter * hidden elements used): each block's (pair_dn: each pair's) columns as A tiles, (output tile, k-step)
    order."""
    out = xp.zeros(lay.inter * lay.hp, xp.uint16)
    down = xp.asarray(down)
    for js, je in dn_groups(lay):
        out[js * lay.hidden:je * lay.hidden] = layout_mma._fragments(xp, xp.ascontiguousarray(down[:, js:je])).reshape(-1)
    return out


def plain_copies(lay) -> dict[str, str]:
    """The matrices the batch-only tensor-core options re-tile, each with the key that keeps the layout the
    prefill and the single-sequence build read (monokernel_batch.regrid_weights hands those to the single build).
    w_dn is not here: the single build's fused down is packed again for its own grid."""
    return {name: plain for on, name, plain in ((lay.mma_mlp, "w_gu", "w_gu_prefill"), (lay.mma_lm, "w_lm", "w_lm_prefill"),
                                                (lay.mma_qkv, "w_qkv", "w_qkv_prefill"), (lay.mma_o, "w_o", "w_o_groups")) if on}


def _retile(xp, lay, out: dict, name: str, pack_layer) -> None:
    """out[name] [L, ...] per layer through pack_layer (flat), the original kept under plain_copies(lay)[name]."""
    plain = out[name]
    out[plain_copies(lay)[name]] = plain
    out[name] = xp.empty_like(plain)
    for n in range(lay.layers):
        out[name][n] = pack_layer(plain[n]).reshape(plain.shape[1:])


def repack_qkv(xp, lay, out: dict) -> None:
    """pack_weights for mma_qkv: w_qkv in (tile, k part) units of A fragments; the plain rows move to w_qkv_prefill."""
    _retile(xp, lay, out, "w_qkv", lambda m: layout_mma.pack_rows(xp, m, lay.splits["qkv"]))


def repack_o(xp, lay, out: dict) -> None:
    """pack_weights for mma_o: w_o (fused_attn_o's [L][NKV][H][GDp]) in A-fragment tiles, unit g * H/16 + t; the
    by-group rows the single-sequence build streams move to w_o_groups (w_o_prefill keeps the plain rows)."""
    _retile(xp, lay, out, "w_o", lambda m: layout_mma.pack_o_groups(xp, m))


def repack(xp, lay, out: dict) -> None:
    """pack_weights for mma_mlp: w_gu in tiles (the plain rows move to w_gu_prefill, which the prefill and the
    single-sequence build read), w_dn in this module's down tiles (w_dn_prefill keeps the plain rows)."""
    _retile(xp, lay, out, "w_gu", lambda m: layout_mma.pack_gate_up(xp, m[:, 0], m[:, 1]))
    for n in range(lay.layers):
        out["w_dn"][n] = pack_down(xp, lay, out["w_dn_prefill"][n, :, :lay.inter])


# ---- the kernel's view (numpy model for the CPU tests) -----------------------------------------

def _bf16(u16) -> np.ndarray:
    return (np.asarray(u16).astype(np.uint32) << 16).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    from replicas.monokernel_weights import to_bf16_bits
    return _bf16(to_bf16_bits(np, np.asarray(x, np.float32)))


def unfragment(chunk: np.ndarray) -> np.ndarray:
    """One 512-element A-fragment chunk [32 lanes x 8] -> its 16 x 16 tile (inverse of layout_mma._fragments)."""
    a = _bf16(chunk).reshape(32, 8)
    lanes = np.arange(32)
    g, q = lanes >> 2, lanes & 3
    tile = np.zeros((TILE, TILE), np.float32)
    for j, (dr, dk) in enumerate(layout_mma.A_PIECES):
        for e in range(2):
            tile[g + dr, 2 * q + dk + e] = a[:, 2 * j + e]
    return tile


def simulate_mlp(lay, w_gu: np.ndarray, w_dn: np.ndarray, x: np.ndarray, live=None) -> np.ndarray:
    """What fused_mlp_mma computes for one layer from its packed w_gu, w_dn (flat uint16) and the slots'
    normed inputs x [B, Hp] fp32: every warp's share read from the packed buffers by gu_share / dn_share,
    fp32 tile sums (the tensor core's own summation order differs in the last bits), pieces added in warp
    order, h rounded to bf16, each block's output tile rounded to int64 fixed point. Returns [B, hidden]."""
    B, ks, W = x.shape[0], k_steps(lay), lay.warps_per_block
    live = range(B) if live is None else live
    xb = round_bf16(x).astype(np.float64)
    hb = np.zeros((lay.inter, B), np.float64)  # every block's h slice, bf16-rounded: [inter rows, B]
    for b in range(lay.num_sms):
        t0, t1 = block_tiles(lay, b)
        nt = t1 - t0
        if nt == 0:
            continue
        gate = np.zeros((nt, TILE, B), np.float32)
        up = np.zeros((nt, TILE, B), np.float32)
        for w in range(W):
            _, q0, q1 = gu_share(lay, b, w)
            for q in range(q0, q1):
                t, c = divmod(q, ks)
                pair = (t0 * ks + q) * 2 * 256
                xin = xb[:, c * TILE:(c + 1) * TILE].T  # [16 k, B]
                gate[t] += (unfragment(w_gu[pair:pair + 256]) @ xin).astype(np.float32)
                up[t] += (unfragment(w_gu[pair + 256:pair + 512]) @ xin).astype(np.float32)
        h = gate / (1 + np.exp(-gate.astype(np.float64))) * up
        hb[t0 * TILE:t1 * TILE] = round_bf16(h.reshape(nt * TILE, B)).astype(np.float64)
    for b_ in range(B):
        if b_ not in live:
            hb[:, b_] = 0.0
    total = np.zeros((B, lay.hidden), np.int64)
    for b in range(lay.num_sms):
        for w in range(W):
            js, nt_, o0, o1 = dn_share(lay, b, w)
            for o in range(o0, o1):
                acc = np.zeros((TILE, B), np.float32)
                for k in range(nt_):
                    off = js * lay.hidden + (o * nt_ + k) * 256
                    acc += (unfragment(w_dn[off:off + 256]) @ hb[js + k * TILE:js + (k + 1) * TILE]).astype(np.float32)
                total[:, o * TILE:(o + 1) * TILE] += np.rint(acc.T.astype(np.float64) * 2.0 ** layout_fused.FX_SHIFT).astype(np.int64)
    return (total.astype(np.float64) * 2.0 ** -layout_fused.FX_SHIFT).astype(np.float32)
