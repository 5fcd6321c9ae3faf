"""The layout options the engines build with unless told otherwise: the measured best on an H200.

`KernelLayout.from_config` stays a plain constructor (every option off unless asked for); this is
the one place that decides what a `MonokernelEngine` compiles. Each entry was kept only after an
A/B on the device (bench/decode.py --ab, same random weights, gpu tests passing on the build) made
it faster on both llama-3.2-1b and llama-3.1-8b; figures in bench/RESULTS.md, reasons in csrc/NOTES.md.
"""

from __future__ import annotations

from replicas import layout_fused
from replicas.layout import CHUNK, THREADS, round_up
from replicas.model import ModelConfig

# Single GPU (2026-12-01, H200): fused_mlp + fused_attn_o 3 barriers/layer (+3.5% 1B, +6.0% 8B),
# x_perm conflict-free input loads (+1.1% / +0.5% on top), split_pos 16 (+2.0% 1B: more, shorter
# attention splits). Tensor-parallel builds keep the plain layout (the fused paths are tp=1 only).
# Session 5: param_value (the parameter block as constant-bank operands, +4.2% 1B) and div32 (32-bit unit
# ranges, +0.2%): +4.8% 1B / +2.2% 8B with gu_il, which alone is +0.0% at B = 1 (so single engines leave it
# off: it keeps a plain gate/up copy for the prefill) but is on in batch builds (monokernel_batch.py).
# Session 6: o_align (O units per kv group to whole blocks: no block waits for two groups, +3.1% 1B) and
# zero_spread (accumulator zeroing over every block, +0.4%): together +3.3% 1B / +1.6% 8B.
# Session 8: norm_early (the prologues' RMSNorm weights loaded with the residual, one L2 round trip less per
# prologue): +4.2% 1B (1,196 -> 1,246 tok/s, 256 tokens), +2.5% per request in the B = 4 batch build; the
# official run (512 tokens) 1,229 tok/s 1B, 252 tok/s 8B. dn_passes=2 (-5.2%) and ao_preload (-3.7%) lost.
TUNED_SINGLE_GPU = {"fused_mlp": True, "fused_attn_o": True, "x_perm": True, "split_pos": 16,
                    "param_value": True, "div32": True, "o_align": True, "zero_spread": True,
                    "norm_early": True}


def engine_options(config: ModelConfig, overrides: dict | None = None) -> dict:
    """KernelLayout.from_config options for an engine: the tuned set for tp=1 where the model's shape
    allows it, then `overrides` (explicit choices win; e.g. {"fused_mlp": False} for the plain MLP)."""
    overrides = dict(overrides or {})
    tuned: dict = {}
    if overrides.get("tp", 1) == 1:
        tuned = dict(TUNED_SINGLE_GPU)
        threads = overrides.get("threads", THREADS)
        warps = threads // 32 - int(bool(overrides.get("control_warp", False)))
        if layout_fused.down_geometry(round_up(config.hidden_size, CHUNK), warps) is None:
            del tuned["fused_mlp"]  # e.g. llama-3.2-3b: 12 chunk columns over 16 warps
        if overrides.get("qkv_flags"):
            del tuned["fused_attn_o"]  # fused_attn_o needs the QKV barrier
    out = {**tuned, **overrides}
    # options that refine a fused path leave with it unless asked for explicitly
    if not out.get("fused_attn_o") and "o_align" not in overrides:
        out.pop("o_align", None)
    if not (out.get("fused_attn_o") or out.get("fused_mlp")) and "zero_spread" not in overrides:
        out.pop("zero_spread", None)
    return out


# Batch builds (2026-12-01, H200, llama-3.2-1b B = 4 at 4 requests, same greedy tokens; bench/RESULTS.md session 10):
# ao_slots +8.0% (session 6); the tensor-core set below +29.6% per request over gu_il + ao_slots (596.6 -> 773.2
# tok/s): norm_once +4.0% alone, + mma_mlp +17.2%, + mma_lm +29.6%. gu_il (+12.7% in session 5) orders gate/up
# for the CUDA-core MLP: a caller who asks for it, or for mma (every matvec on tensor cores), gets the old set.
# Session 11: mma_qkv + mma_o (QKV and the O-proj block-tiled on tensor cores) +14.1% per request at B = 4 of 4 on
# llama-3.2-1b (760.5 -> 868.1 tok/s; mma_o alone +9.0%, mma_qkv alone +4.6%), same greedy tokens, batch gpu tests 14/14.
# Session 12: fold_x (the residual kept in the int64 accumulators: the batch prologues read 8 of 12 bytes per element
# and slot; they are bound by L2 bandwidth) +5.5% at B = 4 of 4 on llama-3.2-1b (878.9 -> 927.0 tok/s) and +9.4% at
# B = 8; llama-3.1-8b +5.3% at B = 4, +6.2% at B = 8; batch gpu tests 14/14 with it. half_vec (-4.3% 1B B = 8) and
# block_best (noise) stay off.
# Session 14: fx_pack (two slots per int64 accumulator word as 2^-16 fixed-point lanes: half the down's and O's atomics
# and half the prologues' accumulator bytes) +1.5% / +2.2% at B = 4 of 4 on llama-3.2-1b (two calls), -1.2% / +1.5% at
# B = 8; llama-3.1-8b +4.7% at B = 4, +7.4% at B = 8; batch gpu tests 14/14 (tiny, 1B) and 7/7 (8B), resident 10/10.
# Session 16: ao_onepass (the O stage's split statistics and outputs in one L2 round trip, an online softmax per
# thread) +1.2% / +1.2% at B = 4 of 4 on llama-3.2-1b (two calls), +2.0% at B = 2, +0.3% at B = 8, same greedy tokens;
# llama-3.1-8b +1.9% at B = 4, +0.9% at B = 8; 8-slot batch gpu tests 14/14 and resident 10/10 with it.
# best_max (the LM head's warp bests merged by 64-bit atomicMax keys; the sampling step reads one key per slot)
# +1.1% at B = 4 and +3.1% at B = 8 on llama-3.2-1b, -0.3% on llama-3.1-8b B = 4 (noise: its steps are 4x longer),
# same greedy tokens everywhere; the timeline's bests reduction 7.03 -> 1.56 us per step; batch gpu tests 14/14 and
# resident 10/10 with it.
TUNED_BATCH = {"ao_slots": True, "mma_mlp": True, "mma_lm": True, "norm_once": True, "mma_qkv": True, "mma_o": True,
               "fold_x": True, "fx_pack": True, "ao_onepass": True, "best_max": True}
TUNED_BATCH_CUDA_CORES = {"gu_il": True, "ao_slots": True}
# Session 13: pair_norm (the blocks in clusters of two, each batch prologue's L2 reads split over the pair) pays
# where the prologues read wide vectors: llama-3.1-8b (hidden 4,096) +3.3% / +3.8% at B = 4 (two calls), +14.1% at
# B = 8; llama-3.2-1b (hidden 2,048) loses (-4.5% at B = 4, -1.3% at B = 8): its three cluster barriers per
# prologue cost more than half of a 2,048-wide read saves. So: on from this hidden size, where the grid pairs up.
# Session 14: with fx_pack the prologues read half the bytes, and pair_norm pays on llama-3.2-1b at B = 8 (+8.1% /
# +8.7%, two calls) but still not at B = 4 (-0.9% / -1.0%); on llama-3.1-8b turning it off now costs -5.9% at B = 4
# and -16.7% at B = 8. So also on where a prologue reads this many elements over all slots (hidden x B).
PAIR_NORM_MIN_HIDDEN = 4096
PAIR_NORM_MIN_SLOT_ELEMENTS = 16384
# Session 15: pair_dn (blocks in clusters of two share their h slices; each downs half the output rows over the
# pair's h, so half the down's atomics) on llama-3.2-1b +2.1% / +0.9% at B = 4 (two calls), +1.6% at B = 2, +2.6% at
# B = 8, same greedy tokens; llama-3.1-8b +4.4% at B = 4, +3.3% at B = 8; batch gpu tests 14/14 (tiny, 1B, and with 8
# slots), 7/7 (8B), resident 10/10 with it. Engine-wide (every build of an engine shares one down packing): on with
# the tensor-core MLP where the grid pairs up and tp = 1.


def batch_options(config: ModelConfig, given: dict | None = None, grid_sms: int | None = None,
                  batch: int | None = None) -> dict:
    """The layout options a batched engine adds to the caller's `given` (explicit choices win) for its build of
    `batch` slots (None: not known): the tensor-core set where the model's shapes allow it (rows and vocabulary
    in whole 16-row tiles), else gu_il + ao_slots; with the tensor-core set, pair_norm from PAIR_NORM_MIN_HIDDEN
    or from PAIR_NORM_MIN_SLOT_ELEMENTS = hidden x batch on, and pair_dn at every batch, where the grid
    (`grid_sms` blocks, None: not known yet) is even and tp = 1."""
    given = dict(given or {})
    if given.get("mma"):
        return given
    tiles = all(n % 16 == 0 for n in (config.hidden_size, config.intermediate_size, config.vocab_size))
    cuda_cores = given.get("gu_il") or not tiles or given.get("mma_mlp") is False
    tuned = dict(TUNED_BATCH_CUDA_CORES if cuda_cores else TUNED_BATCH)
    wide = (config.hidden_size >= PAIR_NORM_MIN_HIDDEN
            or (batch is not None and config.hidden_size * batch >= PAIR_NORM_MIN_SLOT_ELEMENTS))
    pairs = not cuda_cores and given.get("tp", 1) == 1 and (grid_sms is None or grid_sms % 2 == 0)
    if pairs and wide:
        tuned["pair_norm"] = True
    if pairs:
        tuned["pair_dn"] = True
    # mma_qkv needs the QKV barrier, mma_o the fused attention + O with o_align: a caller who turns those off
    # keeps the CUDA-core QKV / O instead of a refused layout
    if given.get("qkv_flags"):
        tuned.pop("mma_qkv", None)
    if given.get("qkv_flags") or given.get("fused_attn_o") is False or given.get("o_align") is False:
        tuned.pop("mma_o", None)
    if given.get("block_best"):
        tuned.pop("best_max", None)  # (the other merge of the LM head's bests)
    # fx_pack packs what fold_x keeps and the tensor-core down and O add: without one of them, the int64 words
    if "mma_o" not in tuned or any(given.get(k) is False for k in ("fold_x", "mma_o", "mma_mlp")):
        tuned.pop("fx_pack", None)
    return {**tuned, **given}
