"""Layout option `mma` (off by default; not yet run on a GPU): matvecs on tensor cores.

Why: a batch build dots every streamed weight chunk with each live slot's fp32 input, read from
shared memory per slot (8 wavefronts per slot per 512-byte chunk), so B > 1 is bound by
shared-memory bandwidth, not HBM (bench/RESULTS.md, session 3). With `mma` the QKV, O, gate/up and
LM-head weights are packed in the A-fragment order of `mma.m16n8k16` (bf16 in, fp32 accumulate):
one 512-byte chunk = 16 rows x 16 k, a lane's 16 bytes are exactly its registers a0..a3, and the
slots' inputs are the B operand (n = 8 columns = slots), stored in shared memory as bf16 in
B-fragment order: one 8-byte load per lane per chunk (2 wavefronts) serves all slots. The fused
down stays on CUDA cores (its per-slot input is one broadcast scalar per chunk).

What changes for a unit (the stream's contiguous piece of a matrix, mk_stream.cuh):
  qkv  unit (tile t, split s): rows [16t, 16t+16), k [s*Hp/S, (s+1)*Hp/S); unit index t*S + s
  o    unit (group g, tile t): rows [16t, 16t+16) of the group-g columns (fused_attn_o packing)
  gu   unit tile t: per k-step c the gate chunk then the up chunk of rows [16t, 16t+16)
  lm   unit tile t: rows [16t, 16t+16) (the vocabulary padded to a multiple of 16 with zero rows)
Inside a unit the chunks run over k in steps of 16. The kernel hands each row's sums to the phase's
epilogue as before (lanes 0..15, one row each), with the same row-unit index (row * S + s for QKV).

Numerics: inputs are rounded to bf16 (the B = 1 CUDA-core kernel keeps them fp32), so logits differ
from the plain kernel at bf16-rounding level (~2^-9 relative per input); tests compare by tolerance.
The prefill keeps plain copies of the repacked matrices (`w_qkv_prefill`, `w_gu_prefill`,
`w_lm_prefill`), as fused_mlp / fused_attn_o do for theirs.
"""

from __future__ import annotations

import numpy as np

TILE = 16  # rows per mma tile (and k per mma step)
A_PIECES = ((0, 0), (8, 0), (0, 8), (8, 8))  # (row, k) offsets of registers a0..a3 (bench/mma_probe.py)
SPLITS = (1, 2, 4, 8, 16, 32)  # QKV k-split candidates (a unit needs whole 16-k steps)


def mma_error(lay) -> str | None:
    if not lay.mma:
        return None
    if not (lay.fused_mlp and lay.fused_attn_o):
        return "mma needs the fused layout (fused_mlp and fused_attn_o): their packings are the ones it re-tiles"
    if lay.tp != 1:
        return "mma is single-GPU only (tp=1); drop mma or tensor parallelism"
    for name, rows in (("hidden", lay.hidden), ("intermediate", lay.inter), ("q/k/v rows", lay.qkv_rows)):
        if rows % TILE:
            return f"mma tiles rows by {TILE}: {name}={rows} is not a multiple of {TILE}; drop mma"
    return None


def mma_lm_error(lay) -> str | None:
    """Layout option mma_lm (batch builds): only the LM head in this module's tiles, its input in B-fragment order."""
    if not lay.mma_lm:
        return None
    if lay.batch < 2 or lay.mma or lay.tp != 1:
        return ("mma_lm puts a batch build's LM head on tensor cores: it needs batch >= 2 and tp=1, and not mma "
                "(which has it already)")
    if lay.vocab % TILE:
        return f"mma_lm tiles the vocabulary by {TILE} and the single-sequence build shares its shape: vocab={lay.vocab}"
    return None


def vocab_rows(lay) -> int:
    """Rows of the packed LM head: the vocabulary padded to whole tiles (MK_VT)."""
    return -(-lay.vocab // TILE) * TILE


def choose_split_tiles(tiles: int, k: int, warps: int) -> int:
    """layout.choose_split for units of 16-row tiles: the smallest k-split whose most loaded warp is
    within 10% of the mean (units of one tile are 16x coarser than row units, so S runs higher)."""
    best, best_eff = 1, -1.0
    for s in SPLITS:
        if k % (s * TILE):
            break
        units = tiles * s
        eff = (units / warps) / -(-units // warps)
        if eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


# ---- packing (xp: numpy or cupy) ---------------------------------------------------------------

def _fragments(xp, m):
    """m [R, K] (R, K multiples of 16) -> [R/16, K/16, 32 lanes, 8]: lane l = 4g + q holds, of each
    16 x 16 block, a0..a3 = (row g, k 2q..2q+1), (row g+8, same k), (row g, k 2q+8..), (row g+8, k 2q+8..).
    Row = 8 hr + g and k = 8 hk + 2q + e put element (hk, hr, e) of lane (g, q) at 2 (2 hk + hr) + e:
    a reshape and a transpose (no fancy indexing, so cupy does the same on the GPU)."""
    r, k = m.shape
    t = m.reshape(r // TILE, 2, 8, k // TILE, 2, 4, 2)  # [tile, hr, g, k-step, hk, q, e]
    return t.transpose(0, 3, 2, 5, 4, 1, 6).reshape(r // TILE, k // TILE, 32, 8)


def pack_rows(xp, m, splits: int = 1):
    """Plain matrix [R, K] -> flat units (tile t, split s) in order t*S + s, each its K/(16 S) chunks."""
    r, k = m.shape
    f = _fragments(xp, m)  # [T, K/16, 32, 8]
    f = f.reshape(r // TILE, splits, k // TILE // splits, 32, 8)
    return xp.ascontiguousarray(f).reshape(-1)


def pack_gate_up(xp, gate, up):
    """gate, up [I, Hp] -> flat units (tile t): per k-step the gate chunk then the up chunk."""
    f = xp.stack([_fragments(xp, gate), _fragments(xp, up)], axis=2)  # [T, Hp/16, 2, 32, 8]
    return xp.ascontiguousarray(f).reshape(-1)


def pack_o_groups(xp, by_group):
    """fused_attn_o's O [NKV, H, GDp] -> flat units (group g, tile t) in order g * H/16 + t."""
    return xp.concatenate([pack_rows(xp, by_group[g]) for g in range(by_group.shape[0])])


def pack_lm(xp, lay, head):
    """LM head [V, H] -> flat tiles of the vocabulary padded to vocab_rows(lay) x Hp."""
    m = xp.zeros((vocab_rows(lay), lay.hp), xp.uint16)
    m[:head.shape[0], :head.shape[1]] = head
    return pack_rows(xp, m)


# ---- the kernel's view (numpy models for the CPU tests) ----------------------------------------

def act_word(b: int, i, batch: int):
    """uint16 index of slot b's input element i in shared memory (csrc/mk_stream.cuh act_store): per
    16-element chunk c, lane 4b + t holds k 2t, 2t+1 in its first 32-bit word and 2t+8, 2t+9 in its
    second."""
    i = np.asarray(i)
    c, r = i >> 4, i & 15
    word = (c * 4 * batch + b * 4 + ((r & 7) >> 1)) * 2 + (r >> 3)
    return word * 2 + (r & 1)


def stage_inputs(xs: np.ndarray) -> np.ndarray:
    """Slots' inputs xs [B, K] fp32 -> the shared uint16 image act_store leaves (bf16 bits)."""
    from replicas.monokernel_weights import to_bf16_bits
    b_n, k = xs.shape
    img = np.zeros(b_n * k, np.uint16)
    for b in range(b_n):
        img[act_word(b, np.arange(k), b_n)] = to_bf16_bits(np, xs[b].astype(np.float32))
    return img


def _bf16(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def run_units(flat: np.ndarray, img: np.ndarray, batch: int, chunk0, n_units: int, chunks: int,
              two: bool = False) -> np.ndarray:
    """What run_phase computes from a matrix's flat packed units: unit v's `chunks` k-steps read the
    input fragments of chunks chunk0(v) + c from the shared image, every lane as the hardware does.
    Returns sums [units, 16 rows, batch] (and the up rows' as a second array when two=True)."""
    lanes = np.arange(32)
    g, q = lanes >> 2, lanes & 3
    words = img.view(np.uint32) if img.size % 2 == 0 else np.append(img, 0).view(np.uint32)
    per_unit = chunks * (2 if two else 1) * 256
    out = np.zeros((2 if two else 1, n_units, TILE, batch), np.float64)
    for v in range(n_units):
        unit = flat[v * per_unit:(v + 1) * per_unit].reshape(chunks, 2 if two else 1, 32, 8)
        for c in range(chunks):
            cc = chunk0(v) + c
            # B fragment: lane 4n + t reads words 2 (cc*4*batch + lane), +1 (slots n < batch only)
            bt = np.zeros((TILE, 8))
            for lane in range(4 * batch):
                w0, w1 = words[2 * (cc * 4 * batch + lane)], words[2 * (cc * 4 * batch + lane) + 1]
                n, t = lane >> 2, lane & 3
                lo = _bf16(np.array([w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16], np.uint16))
                bt[2 * t, n], bt[2 * t + 1, n], bt[2 * t + 8, n], bt[2 * t + 9, n] = lo
            for h in range(2 if two else 1):
                a = _bf16(unit[c, h])  # [32, 8]
                tile = np.zeros((TILE, TILE))
                for j, (dr, dk) in enumerate(A_PIECES):
                    for e in range(2):
                        tile[g + dr, 2 * q + dk + e] = a[:, 2 * j + e]
                out[h, v] += (tile @ bt)[:, :batch]
    return out if two else out[0]


def tile_row_source(r: int, b: int) -> tuple[int, int]:
    """(lane, register) holding row r, slot b of a 16 x 8 mma accumulator tile: what csrc/mk_stream.cuh
    tile_row shuffles lane r < 16 from (c0, c1: row g = lane >> 2, cols 2t, 2t+1; c2, c3: row g + 8)."""
    return 4 * (r & 7) + (b >> 1), (2 if r >= 8 else 0) + (b & 1)
