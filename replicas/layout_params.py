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
# region, the device array of all N GPUs' regions (peer addresses, rank order), this GPU's rank, and how
# long (ns) a wait for a peer may last before the kernel gives up (csrc/mk_tp.cuh tp_wait).
TP_PARAM_FIELDS: tuple[tuple[str, str], ...] = (
    ("tp_local", "float*"), ("tp_peers", "float* const*"), ("tp_rank", "long long"),
    ("tp_timeout_ns", "unsigned long long"),
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
# One slot of a batch launch: 8-byte fields in this order (struct MkSlot, generated).
SLOT_FIELDS: tuple[tuple[str, str], ...] = (
    ("start_pos", "long long"),  # prompt length: the position of emitted token 0's predecessor + 1
    ("step0", "long long"),  # tokens this slot emitted in earlier launches (positions / RNG continue)
    ("max_steps", "long long"),  # token budget of the whole generation
    ("n_stop", "long long"), ("mode", "long long"), ("top_k", "long long"),
    ("seed", "unsigned long long"), ("inv_temperature", "double"), ("top_p", "double"),
    ("active", "long long"),  # 1: decode this slot in this launch
)
# Extra fields of a resident batch build (layout option resident), after BATCH_PARAM_FIELDS.
RESIDENT_PARAM_FIELDS: tuple[tuple[str, str], ...] = (
    ("admit_x", "const float*"),  # [B][Hp] an admitted slot's last prompt hidden state (its first LM head's input)
    ("idle_ns", "long long"),  # how long the launch waits with no slot decoding before it ends (0: it ends at once)
)
# host_kctl words (int32, pinned host-mapped; the host writes all but ACK):
KCTL_YIELD = 0  # host asks the kernel to exit at the next step boundary (to admit a request by relaunch)
# Admission into a running resident launch: the host prepares free slots (KV, slot-table row, stop ids,
# admit_x), writes their bit mask to ADMIT_MASK, then increments ADMIT_SEQ. The kernel reads SEQ with
# YIELD every step (one 8-byte load); on a new value it reads MASK, admits those slots at the next step
# boundary and writes SEQ to ADMIT_ACK. The host changes MASK again only once ACK == SEQ.
KCTL_ADMIT_SEQ, KCTL_ADMIT_MASK, KCTL_ADMIT_ACK = 1, 2, 3
KCTL_WORDS = 4

# host_ctrl slots (int32 in pinned, host-mapped memory; per slot in a batch build: [B][CTRL_WORDS])
CTRL_COUNT, CTRL_STATUS, CTRL_DONE, CTRL_CANCEL, CTRL_STOP_TOKEN = range(5)
CTRL_WORDS = 8
# finish status the kernel writes to host_ctrl[CTRL_STATUS]
STATUS_LENGTH, STATUS_STOP, STATUS_CANCELLED = 1, 2, 3
STATUS_PEER_TIMEOUT = 4  # tensor parallel: a peer GPU stopped answering; the kernel trapped (the context is lost)
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
    lines.append("#if defined(MK_RESIDENT) && MK_RESIDENT")
    lines += [f"  {ctype} {name};" for name, ctype in RESIDENT_PARAM_FIELDS]
    lines.append("#endif")
    lines.append("#endif")
    lines.append("};")
    n_tp, n_b = len(TP_PARAM_FIELDS), len(BATCH_PARAM_FIELDS)
    n_r = n_b + len(RESIDENT_PARAM_FIELDS)
    lines.append("#if defined(MK_TP) && MK_TP > 1")
    lines.append(f"static_assert(sizeof(MkParams) == {8 * (len(PARAM_FIELDS) + n_tp)}, \"one 8-byte slot per field\");")
    lines.append("#elif defined(MK_BATCH) && MK_BATCH > 1 && defined(MK_RESIDENT) && MK_RESIDENT")
    lines.append(f"static_assert(sizeof(MkParams) == {8 * (len(PARAM_FIELDS) + n_r)}, \"one 8-byte slot per field\");")
    lines.append("#elif defined(MK_BATCH) && MK_BATCH > 1")
    lines.append(f"static_assert(sizeof(MkParams) == {8 * (len(PARAM_FIELDS) + n_b)}, \"one 8-byte slot per field\");")
    lines.append("#else")
    lines.append(f"static_assert(sizeof(MkParams) == {8 * len(PARAM_FIELDS)}, \"one 8-byte slot per field\");")
    lines.append("#endif")
    consts = {"MK_CTRL_WORDS": CTRL_WORDS, "MK_KCTL_YIELD": KCTL_YIELD, "MK_KCTL_ADMIT_SEQ": KCTL_ADMIT_SEQ,
              "MK_KCTL_ADMIT_MASK": KCTL_ADMIT_MASK, "MK_KCTL_ADMIT_ACK": KCTL_ADMIT_ACK, "MK_CTRL_COUNT": CTRL_COUNT, "MK_CTRL_STATUS": CTRL_STATUS, "MK_CTRL_DONE": CTRL_DONE,
              "MK_CTRL_CANCEL": CTRL_CANCEL, "MK_CTRL_STOP_TOKEN": CTRL_STOP_TOKEN,
              "MK_STATUS_LENGTH": STATUS_LENGTH, "MK_STATUS_STOP": STATUS_STOP,
              "MK_STATUS_CANCELLED": STATUS_CANCELLED, "MK_STATUS_PEER_TIMEOUT": STATUS_PEER_TIMEOUT, "MK_MODE_GREEDY": MODE_GREEDY,
              "MK_MODE_GUMBEL": MODE_GUMBEL, "MK_MODE_TOPKP": MODE_TOPKP}
    lines += [f"#define {k} {v}" for k, v in consts.items()]
    return "\n".join(lines) + "\n"
