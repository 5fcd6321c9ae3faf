"""Refusals of the layout's tuning options (replicas/layout.py calls `option_error` in from_config): each
option that refines another path says which path it needs, so a bad combination fails before any compile."""

from __future__ import annotations

from replicas import layout_attn_o, layout_fused


def option_error(lay) -> str | None:
    """What is wrong with `lay`'s gu_il / o_align / zero_spread / ao_preload / dn_passes / half_vec / block_best /
    fold_x / fx_pack / pair_norm / pair_dn / ao_onepass / best_max / resident / act_bf16, or None."""
    if lay.gu_il and lay.tp > 1:
        return "gu_il needs tp=1: the tensor-parallel prefill reads the plain gate/up rows"
    if lay.gu_il and lay.mma:
        return "gu_il and mma both order gate/up for the kernel (mma's tiles already alternate): choose one"
    if lay.o_align and not lay.fused_attn_o:
        return "o_align deals fused_attn_o's kv-group-major O units to whole blocks: it needs fused_attn_o"
    if lay.zero_spread and not (lay.fused_mlp or lay.fused_attn_o):
        return "zero_spread changes how the fused accumulators are zeroed: it needs fused_mlp or fused_attn_o"
    if lay.ao_preload and not (lay.fused_attn_o and lay.batch == 1):
        return "ao_preload changes fused_attn_o's single-sequence O stage: it needs fused_attn_o and batch=1"
    if lay.ao_preload and layout_attn_o.act_floats(lay) + layout_attn_o.group_len(lay) > lay.act_floats:
        return "ao_preload: no room for its staging scratch in this model's activation buffer; drop ao_preload"
    if lay.act_bf16 and (lay.batch == 1 or lay.mma):
        return ("act_bf16 stores a batch build's matvec inputs as bf16 (the single-sequence build keeps fp32); it "
                "needs batch > 1 and not mma, whose inputs are bf16 already")
    if lay.norm_once and lay.batch == 1:
        return "norm_once changes the batch prologue (every slot's residual loaded once): it needs batch > 1"
    if lay.resident and lay.batch == 1:
        return "resident builds admit requests into free slots of a running batch launch: they need batch > 1"
    if lay.fold_x and lay.batch == 1:
        return "fold_x keeps a batch build's residual in its fixed-point accumulators: it needs batch > 1"
    if lay.block_best and lay.batch == 1:
        return "block_best merges a batch build's LM-head bests per block: it needs batch > 1"
    if lay.half_vec and not (lay.mma_qkv and lay.mma_o and lay.mma_mlp and lay.mma_lm):
        return ("half_vec halves a batch build's staged inputs, which must then all be bf16: it needs mma_qkv, mma_o, "
                "mma_mlp and mma_lm (the batch defaults)")
    if lay.pair_norm and not (lay.batch > 1 and lay.tp == 1 and lay.num_sms % 2 == 0):
        return (f"pair_norm runs a batch build's blocks in clusters of two: it needs batch > 1, tp=1 and an even "
                f"grid (num_sms={lay.num_sms})")
    if lay.pair_dn and not (lay.batch > 1 and lay.tp == 1 and lay.mma_mlp and lay.num_sms % 2 == 0):
        return (f"pair_dn runs a batch build's blocks in clusters of two that share the tensor-core down: it needs "
                f"batch > 1, tp=1, mma_mlp and an even grid (num_sms={lay.num_sms})")
    if lay.ao_onepass and not (lay.batch > 1 and lay.ao_slots):
        return ("ao_onepass changes the batch O stage of ao_slots (every slot staged in one pass): it needs batch > 1 "
                "and ao_slots (a batch default)")
    if lay.best_max and not (lay.batch > 1 and not lay.block_best):
        return ("best_max merges a batch build's LM-head bests with atomics (instead of block_best's per-block merge): "
                "it needs batch > 1 and not block_best")
    if lay.fx_pack and not (lay.batch > 1 and lay.fold_x and lay.mma_mlp and lay.mma_o):
        return ("fx_pack packs two slots into each word of a batch build's folded accumulators, written by the "
                "tensor-core down and O: it needs batch > 1, fold_x, mma_mlp and mma_o (the batch defaults)")
    if lay.dn_passes != 1:
        geometry = layout_fused.down_geometry(lay.hp, lay.warps_per_block) if lay.fused_mlp else None
        if not (2 <= lay.dn_passes <= 4 and lay.batch == 1 and geometry is not None and geometry[2] == 1):
            return (f"dn_passes={lay.dn_passes}: the fused down in 2..4 parts needs fused_mlp, batch=1 and one "
                    "chunk column per warp (hidden/256 <= the streaming warps); use dn_passes=1")
    return None
