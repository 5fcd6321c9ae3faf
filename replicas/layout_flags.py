"""The preprocessor flags of a kernel build: every dimension and option of a KernelLayout as the -D values
csrc/ reads (single source of truth: the CUDA side never derives a shape the Python side does not emit)."""

from __future__ import annotations

from replicas import layout_attn_o, layout_fused, layout_mma, layout_mma_mlp


def compile_defs(lay) -> dict:
    """{flag: value} of `lay` (a replicas.layout.KernelLayout). Options are emitted only when on, so a build
    without them keeps the flags (and cached cubins) it always had."""
    from replicas.layout import ATTN_SPLIT_POS, ATTN_TILE, MAX_ATTN_SPLITS, MAX_STOP_IDS, SWITCH_FLAGS
    s = lay.splits
    defs = {
        "MK_H": lay.hidden, "MK_HP": lay.hp, "MK_I": lay.inter, "MK_IP": lay.ip,
        "MK_L": lay.layers, "MK_NH": lay.heads, "MK_NKV": lay.kv_heads, "MK_D": lay.head_dim,
        "MK_QP": lay.qp, "MK_V": lay.vocab, "MK_EPS": f"{lay.eps!r}f",
        "MK_QKV_BIAS": int(lay.qkv_bias), "MK_O_BIAS": int(lay.o_bias), "MK_QK_NORM": int(lay.qk_norm),
        "MK_MAX_CTX": lay.max_ctx, "MK_THREADS": lay.threads, "MK_RING": lay.ring_slots,
        "MK_ACT_FLOATS": lay.act_floats, "MK_S_QKV": s["qkv"], "MK_S_O": s["o"], "MK_S_DN": s["dn"],
        "MK_ATTN_TILE": ATTN_TILE, "MK_MAX_STOP": MAX_STOP_IDS, "MK_MAX_SPLITS": MAX_ATTN_SPLITS,
        "MK_EVICT_FIRST": int(lay.evict_first), "MK_CTRL_WARP": int(lay.control_warp),
        "MK_BAR_RELEASE": int(lay.bar_release), "MK_QKV_FLAGS": int(lay.qkv_flags),
        "MK_KV_REGS": int(lay.kv_regs), "MK_PF_GU": lay.l2_prefetch_per_warp()[0], "MK_PF_DN": lay.l2_prefetch_per_warp()[1],
    }

    if lay.x_perm:  # emitted only when set, like the fused options
        defs["MK_XPERM"] = 1
    if lay.split_pos != ATTN_SPLIT_POS:
        defs["MK_SPLIT_POS"] = lay.split_pos
    if lay.fused_mlp:  # emitted only when on: default builds keep their flags (and cubins)
        r, wc, m = layout_fused.down_geometry(lay.hp, lay.warps_per_block)
        defs.update({"MK_FUSED_MLP": 1, "MK_FX_R": r, "MK_FX_WC": wc, "MK_FX_M": m,
                     "MK_FX_PART": layout_fused.part_floats(lay), "MK_FX_SHIFT": layout_fused.FX_SHIFT})
    if lay.fused_attn_o:  # emitted only when on, like fused_mlp
        defs.update({"MK_ATTN_O": 1, "MK_AO_GDP": layout_attn_o.group_len(lay)})
    if lay.batch > 1:  # emitted only for batch builds, like the options above
        defs.update({"MK_BATCH": lay.batch, "MK_ACT_VEC": lay.act_vec,
                     "MK_FX_SLICE": layout_fused.slice_floats(lay)})
        if lay.ao_slots:
            defs["MK_AO_SLOTS"] = 1
        if lay.resident:
            defs.update({"MK_RESIDENT": 1, "MK_RED_FLOATS": lay.red_floats})
        if lay.act_bf16:
            defs["MK_ACT_BF16"] = 1
        if lay.norm_once:
            defs["MK_NORM_ONCE"] = 1
    if lay.mma:  # emitted only when on, like the options above
        defs.update({"MK_MMA": 1, "MK_VT": layout_mma.vocab_rows(lay)})
    if layout_mma_mlp.block_tiled(lay):
        defs["MK_MMLP_PIECES"] = layout_mma_mlp.pieces(lay)
    for option, flag in SWITCH_FLAGS:  # one-bit options: flag = 1 when on
        if getattr(lay, option):
            defs[flag] = 1
    if lay.mma_lm:
        defs["MK_VT"] = layout_mma.vocab_rows(lay)
    if lay.dn_passes > 1:
        defs["MK_DN_PASSES"] = lay.dn_passes
    if lay.norm_early:
        defs["MK_NORM_EARLY"] = 1
    if lay.fx_pack:
        defs["MK_FX_PACK_SHIFT"] = layout_fused.FX_PACK_SHIFT
    if lay.cluster > 1:
        defs["MK_CLUSTER"] = lay.cluster  # (the kernel's __cluster_dims__; the CPU emulation's cluster size)
    if lay.ao_preload:
        defs["MK_AO_PRELOAD"] = 1
    if lay.tp > 1:  # single-GPU builds get exactly the flags (and code) they always had
        defs.update({"MK_TP": lay.tp, "MK_V_ALL": lay.vocab_total,
                     "MK_TP_SKIP_AR": int(lay.tp_skip_allreduce)})
        defs.update({f"MK_TP_OFF_{k}": v for k, v in lay.tp_offsets().items()})
    return defs
