"""The monokernel's parameter block and host-mapped control words: the field lists both sides share.

`PARAM_FIELDS` (+ the TP and batch extras, + the batch build's slot table) are mirrored into C by
`params_header()` as the structs `MkParams` / `MkSlot` (one 8-byte slot per field, in order), and the
control-word constants become `#define`s; replicas/layout.py re-exports everything here.
"""

from __future__ import annotations

# Kernel parameter block: one 8-byte slot per field, in this order (mirrored into C by
# params_header()). Pointers are device addresses; scalars are int64 or float64 bit patterns.
PARAM_FIELDS: tuple[tuple[str, str], ...] = (
    # packed weights (bf16 as uint16)
    ("w_qkv", "const uint16_t*"), ("w_o", "const uint16_t*"), ("w_gu", "const uint16_t*"),
    ("w_dn", "const uint16_t*"), ("w_lm", "const uint16_t*"), ("embed", "const uint16_t*"),
    # small fp32 tensors
    ("ln1", "const float*"), ("ln2", "const float*"), ("lnf", "const float*"),
    ("qkv_bias", "const float*"), ("o_bias", "const float*"),
    ("q_norm", "const float*"), ("k_norm", "const float*"),
    ("rope_cos", "const float*"), ("rope_sin", "const float*"),
    # KV cache, bf16 [L][kv_heads][max_ctx][D]
    ("k_cache", "uint16_t*"), ("v_cache", "uint16_t*"),
    # activations and partials (fp32)
    ("xbuf", "float*"), ("qkv_part", "float*"), ("o_part", "float*"), ("h_buf", "float*"),
    ("dn_part", "float*"), ("attn_out", "float*"), ("attn_m", "float*"), ("attn_l", "float*"),
    ("attn_o", "float*"), ("attn_cnt", "unsigned*"), ("logits", "float*"),
    ("best_val", "float*"), ("best_idx", "int*"),
    # control
    ("bar_count", "unsigned*"), ("bar_flag", "unsigned*"), ("cancel_step", "int*"),
    ("tokens", "int*"), ("forced", "const int*"), ("stop_ids", "const int*"),
    ("host_tokens", "volatile int*"), ("host_ctrl", "volatile int*"), ("shared_token", "int*"),
    ("profile", "unsigned long long*"), ("qkv_done", "unsigned*"),  # null, or 13 counters (see csrc/monokernel.cu)
    # scalars
    ("start_pos", "long long"), ("max_steps", "long long"), ("n_stop", "long long"),
    ("teacher", "long long"), ("mode", "long long"), ("top_k", "long long"),
    ("seed", "unsigned long long"), ("inv_temperature", "double"), ("top_p", "double"),
    ("logits_per_step", "long long"),
    # resuming (the batched engine): tokens emitted by earlier launches (positions and RNG counters
    # continue), the host-mapped yield request and the exit state (null: never yield)
    ("step0", "long long"), ("host_kctl", "volatile int*"), ("kctl", "int*"),
)

# Extra fields of a tensor-parallel build (MK_TP > 1), after PARAM_FIELDS: this GPU's exchange
# region, the device array of all N GPUs' regions (peer addresses, rank order), this GPU's rank.
TP_PARAM_FIELDS: tuple[tuple[str, str], ...] = (
    ("tp_local", "float*"), ("tp_peers", "float* const*"), ("tp_rank", "long long"),
)
# Exchange region of one GPU (4-byte words; peers write into it): per-source arrival counters of
# the bulk exchanges (all-reduces, logits gather), the per-step token messages (flag, value, id,
# cancel) of every source, the two all-reduce receive buffers [hidden][N], the gathered logits.
TP_HEADER_WORDS = 256

# Extra fields of a batch build (MK_BATCH > 1), after PARAM_FIELDS (the scalars above are then unused:
# every slot has its own, in the slot table).
BATCH_PARAM_FIELDS: tuple[tuple[str, str], ...] = (
    ("slots", "const MkSlot*"),  # [B] slot table (SLOT_FIELDS), fixed for one launch
    ("slot_stop", "const int*"),  # [B][MAX_STOP_IDS] stop token ids
    ("fx_turn0", "long long"),  # fused-MLP turn to resume from (0 on a fresh launch; kctl[0] of the last one)
)
# Extra field of an sm_shares build (MK_SM_SHARES, replicas/sm_shares.py), after the others.
SHARES_PARAM_FIELDS: tuple[tuple[str, str], ...] = (
    ("share_w", "const int*"),  # [num_sms + 1] prefix sums of the per-block weights
    ("share_t", "unsigned long long*"),  # [STEPS][num_sms] ns each block's warp 0 spends on its LM rows, or null
)
# One slot of a batch launch: 8-byte fields in this order (struct MkSlot, generated).
SLOT_FIELDS: tuple[tuple[str, str], ...] = (
    ("start_pos", "long long"),  # prompt length: the position of emitted token 0's predecessor + 1
    ("step0", "long long"),  # tokens this slot emitted in earlier launches (positions / RNG continue)
    ("max_steps", "long long"),  # token budget of the whole generation
    ("n_stop", "long long"), ("mode", "long long"), ("top_k", "long long"),
    ("seed", "unsigned long long"), ("inv_temperature", "double"), ("top_p", "double"),
    ("active", "long long"),  # 1: decode this slot in this launch
)
KCTL_YIELD = 0  # host_kctl word: host asks the kernel to exit at the next step boundary (to admit a request)

# host_ctrl slots (int32 in pinned, host-mapped memory; per slot in a batch build: [B][CTRL_WORDS])
CTRL_COUNT, CTRL_STATUS, CTRL_DONE, CTRL_CANCEL, CTRL_STOP_TOKEN = range(5)
CTRL_WORDS = 8
# finish status the kernel writes to host_ctrl[CTRL_STATUS]
STATUS_LENGTH, STATUS_STOP, STATUS_CANCELLED = 1, 2, 3
# sampling modes
MODE_GREEDY, MODE_GUMBEL, MODE_TOPKP = 0, 1, 2


def params_header() -> str:
    """C declaration of the parameter block, generated from PARAM_FIELDS (one 8-byte slot each)."""
    lines = ["// generated by replicas/layout_params.py:params_header(); do not edit", "#pragma once",
             "#ifdef __CUDACC_RTC__", "typedef unsigned short uint16_t;", "typedef unsigned int uint32_t;",
             "#else", "#include <stdint.h>", "#endif"]
    lines.append("struct __align__(8) MkSlot {")
    lines += [f"  {ctype} {name};" for name, ctype in SLOT_FIELDS]
    lines.append("};")
    lines.append(f"static_assert(sizeof(MkSlot) == {8 * len(SLOT_FIELDS)}, \"one 8-byte slot per field\");")
    lines.append("struct __align__(8) MkParams {")
    lines += [f"  {ctype} {name};" for name, ctype in PARAM_FIELDS]
    lines.append("#if defined(MK_TP) && MK_TP > 1")
    lines += [f"  {ctype} {name};" for name, ctype in TP_PARAM_FIELDS]
    lines.append("#endif")
    lines.append("#if defined(MK_BATCH) && MK_BATCH > 1")
    lines += [f"  {ctype} {name};" for name, ctype in BATCH_PARAM_FIELDS]
    lines.append("#endif")
    lines.append("#if defined(MK_SM_SHARES) && MK_SM_SHARES")
    lines += [f"  {ctype} {name};" for name, ctype in SHARES_PARAM_FIELDS]
    lines.append("#endif")
    lines.append("};")
    n_tp, n_b, n_s = len(TP_PARAM_FIELDS), len(BATCH_PARAM_FIELDS), len(SHARES_PARAM_FIELDS)
    lines += ["#if defined(MK_TP) && MK_TP > 1", f"#define MK_NP_TP_ {n_tp}", "#else", "#define MK_NP_TP_ 0", "#endif",
              "#if defined(MK_BATCH) && MK_BATCH > 1", f"#define MK_NP_B_ {n_b}", "#else", "#define MK_NP_B_ 0", "#endif",
              "#if defined(MK_SM_SHARES) && MK_SM_SHARES", f"#define MK_NP_S_ {n_s}", "#else", "#define MK_NP_S_ 0", "#endif"]
    lines.append(f"static_assert(sizeof(MkParams) == 8 * ({len(PARAM_FIELDS)} + MK_NP_TP_ + MK_NP_B_ + MK_NP_S_), "
                 "\"one 8-byte slot per field\");")
    consts = {"MK_CTRL_WORDS": CTRL_WORDS, "MK_KCTL_YIELD": KCTL_YIELD, "MK_CTRL_COUNT": CTRL_COUNT, "MK_CTRL_STATUS": CTRL_STATUS, "MK_CTRL_DONE": CTRL_DONE,
              "MK_CTRL_CANCEL": CTRL_CANCEL, "MK_CTRL_STOP_TOKEN": CTRL_STOP_TOKEN,
              "MK_STATUS_LENGTH": STATUS_LENGTH, "MK_STATUS_STOP": STATUS_STOP,
              "MK_STATUS_CANCELLED": STATUS_CANCELLED, "MK_MODE_GREEDY": MODE_GREEDY,
              "MK_MODE_GUMBEL": MODE_GUMBEL, "MK_MODE_TOPKP": MODE_TOPKP}
    lines += [f"#define {k} {v}" for k, v in consts.items()]
    return "\n".join(lines) + "\n"
