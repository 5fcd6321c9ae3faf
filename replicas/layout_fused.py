"""Layout option `fused_mlp` (off by default): gate/up -> down fused with a block-local split-K.

Without it a layer ends `... | gate/up | down |`: the down phase needs every block's h = SiLU(gate)·up,
so a grid barrier sits between them. With it, block b computes h for its own slice
[I·b/S, I·(b+1)/S) of the intermediate dimension (exactly the gate/up units its warps already own)
into shared memory, then multiplies that slice by the matching *columns* of down, producing a
partial hidden vector. The S partials are summed deterministically as int64 fixed point
(value·2^32, two's-complement adds commute, so arrival order does not matter) into one of two
accumulators the next phase's prologue reads: 5 -> 4 grid barriers per layer.

Packed down (per layer, I·Hp bf16): down^T [I][Hp] cut into tiles, one per (block b, row group r):
rows [js(b)+a_r, js(b)+a_r+len_r) of down^T stored column-chunk-major ([C][len_r][256], C = Hp/256).
Within a block the warps form R row groups of Wc = min(W, C) warps; warp (r, cw) owns chunk columns
[cw·M, (cw+1)·M), M = C/Wc, over its group's rows: one contiguous run of M·len_r chunks, read in
(column, row) order — the order `warp_down_share` gives and csrc/mk_fused.cuh mirrors.
"""

from __future__ import annotations

import numpy as np

CHUNK = 256
FX_SHIFT = 32  # fixed-point fraction bits of the int64 down accumulators (range ±2^31)
# fx_pack (batch builds, csrc/mk_fx_pack.cuh): two slots per int64 word as 32-bit lanes (slot 2c low, 2c + 1 high)
# of this many fraction bits: range ±2^15, step 1.5e-5 (finer than a bf16 residual from magnitude 0.004 up)
FX_PACK_SHIFT = 16


def acc_rows(lay, b_n: int) -> int:
    """Rows of hp int64 words in one fused turn's accumulator of a build of `lay` with b_n slots."""
    return (b_n + 1) // 2 if lay.fx_pack else b_n


def acc_shift(lay) -> int:
    """Fraction bits of one slot's value in the accumulators."""
    return FX_PACK_SHIFT if lay.fx_pack else FX_SHIFT


def _lanes(xp, w):
    """(lo, hi) int64 lane values of packed words w, as csrc/mk_fx_pack.cuh unpacks them."""
    lo = ((w & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000  # the low 32 bits, sign-extended
    return lo, (w - lo) >> 32


def slot_fixed(xp, lay, acc_t, b: int, n: int):
    """Slot b's first n fixed-point values (int64) in one turn's accumulator acc_t [rows, hp] (int64)."""
    if not lay.fx_pack:
        return acc_t[b, :n]
    lo, hi = _lanes(xp, acc_t[b // 2, :n])
    return hi if b & 1 else lo


def set_slot_fixed(xp, lay, acc_t, b: int, values, n: int) -> None:
    """Slot b's first n fixed-point values (int64, or a scalar) into acc_t [rows, hp], the pair's other slot kept."""
    if not lay.fx_pack:
        acc_t[b, :n] = values
        return
    lo, hi = _lanes(xp, acc_t[b // 2, :n])
    values = xp.broadcast_to(xp.asarray(values, xp.int64), lo.shape)
    lo, hi = (lo, values) if b & 1 else (values, hi)
    acc_t[b // 2, :n] = hi * (1 << 32) + lo  # (int64 arithmetic wraps as the kernel's does)


def block_rows(inter: int, num_sms: int, b: int, tile: int = 1) -> tuple[int, int]:
    """Block b's intermediate slice [js, je): the gate/up units its warps own (warp_range of csrc;
    with layout option mma a unit is a tile of 16 rows: csrc/mk_stream.cuh gu_row0)."""
    units = inter // tile
    return tile * (units * b // num_sms), tile * (units * (b + 1) // num_sms)


def gu_tile(lay) -> int:
    """Gate/up rows per block-slice unit: 16 with layout option mma or mma_mlp (whole tiles), else 1."""
    return 16 if lay.mma or lay.mma_mlp else 1


def down_geometry(hp: int, warps: int) -> tuple[int, int, int] | None:
    """(R row groups, Wc warps per group, M chunk columns per warp), or None if the block's warps
    cannot tile the C = hp/256 chunk columns evenly (C must divide W or W divide C)."""
    c = hp // CHUNK
    if warps % c == 0:
        return warps // c, c, 1
    if c % warps == 0:
        return 1, warps, c // warps
    return None


def fused_error(lay) -> str | None:
    if not lay.fused_mlp:
        return None
    if lay.tp != 1:
        return ("fused_mlp is single-GPU only (tp=1): with tp > 1 the down output is all-reduced "
                "across GPUs from the k-split partials; drop fused_mlp or use tp=1")
    if down_geometry(lay.hp, lay.warps_per_block) is None:
        return (f"fused_mlp needs hidden/256 chunk columns ({lay.hp // CHUNK}) to divide or be a multiple of "
                f"the {lay.warps_per_block} streaming warps per block (hidden={lay.hidden}); drop fused_mlp")
    return None


def part_floats(lay) -> int:
    """Shared floats of the per-row-group partial vectors ([R][Hp]); they alias the normed x."""
    r, _, _ = down_geometry(lay.hp, lay.warps_per_block)
    return r * lay.hp


def slice_floats(lay) -> int:
    """Shared floats holding the block's h slice (after the partials)."""
    t = gu_tile(lay)
    return (-(-(lay.inter // t) // lay.num_sms) * t + 3) // 4 * 4


def act_floats(lay) -> int:
    return max(lay.hp, part_floats(lay)) + slice_floats(lay)


def warp_down_share(lay, b: int, w: int) -> tuple[int, int, int, int, int]:
    """Warp w of block b: (first h row inside the block slice, rows, first chunk column, columns,
    element offset of its run in the layer's packed down)."""
    r_groups, wc, m = down_geometry(lay.hp, lay.warps_per_block)
    js, je = block_rows(lay.inter, lay.num_sms, b, gu_tile(lay))
    nb = je - js
    r, cw = divmod(w, wc)
    a = nb * r // r_groups
    n = nb * (r + 1) // r_groups - a
    return a, n, cw * m, m, (js + a) * lay.hp + cw * m * n * CHUNK


def pack_down_fused(xp, lay, down):
    """down [hidden, inter] (bf16 bits) -> the layer's packed fused down, flat [inter * Hp]."""
    i_dim, hp = lay.inter, lay.hp
    dt = xp.zeros((i_dim, hp), xp.uint16)
    dt[:, :lay.hidden] = xp.asarray(down).T
    out = xp.empty(i_dim * hp, xp.uint16)
    r_groups, _, _ = down_geometry(hp, lay.warps_per_block)
    for b in range(lay.num_sms):
        js, je = block_rows(i_dim, lay.num_sms, b, gu_tile(lay))
        for r in range(r_groups):
            a0, a1 = js + (je - js) * r // r_groups, js + (je - js) * (r + 1) // r_groups
            tile = dt[a0:a1].reshape(a1 - a0, hp // CHUNK, CHUNK).transpose(1, 0, 2)
            out[a0 * hp:a1 * hp] = tile.reshape(-1)
    return out


def simulate_fused_down(lay, packed: np.ndarray, h: np.ndarray) -> np.ndarray:
    """What the kernel computes from one layer's packed fused down and h [inter] (fp32): per warp
    fp32 accumulation over its rows in stream order, row-group partials summed in group order,
    each block's vector rounded to int64 fixed point, blocks summed as integers. Returns [hidden]."""
    r_groups, _, _ = down_geometry(lay.hp, lay.warps_per_block)
    f32 = (packed.astype(np.uint32) << 16).view(np.float32)
    total = np.zeros(lay.hidden, np.int64)
    for b in range(lay.num_sms):
        js, _ = block_rows(lay.inter, lay.num_sms, b, gu_tile(lay))
        part = np.zeros((r_groups, lay.hp), np.float32)
        for w in range(lay.warps_per_block):
            a, n, col0, ncols, off = warp_down_share(lay, b, w)
            r = w // (lay.warps_per_block // r_groups)
            run = f32[off:off + ncols * n * CHUNK].reshape(ncols, n, CHUNK)
            for k in range(ncols):
                acc = np.zeros(CHUNK, np.float32)
                for j in range(n):  # the kernel's order: one fma per row, fp32
                    acc = (acc + np.float32(h[js + a + j]) * run[k, j]).astype(np.float32)
                part[r, (col0 + k) * CHUNK:(col0 + k + 1) * CHUNK] = acc
        vec = np.zeros(lay.hp, np.float32)
        for r in range(r_groups):
            vec = (vec + part[r]).astype(np.float32)
        total += np.rint(vec[:lay.hidden].astype(np.float64) * 2.0 ** FX_SHIFT).astype(np.int64)
    return (total.astype(np.float64) * 2.0 ** -FX_SHIFT).astype(np.float32)
