"""The monokernel's buffer layouts and compile-time constants: the single source of truth.

Everything the CUDA side (csrc/) assumes about shapes, padding, packed weight order and the
parameter block is decided here and handed to the compiler as `-D` flags plus one generated
header (`params_header()`, with the parameter block's fields, in replicas/layout_params.py);
csrc/mk_layout.cuh only derives from and checks those flags.

Weight stream. Each decode step reads, per layer, four packed bf16 matrices and then the LM head:

  qkv [L][q_dim + 2*kv_dim][Hp]   q, k, v projection rows stacked (HF row order)
  o   [L][hidden][Qp]             o_proj ([L][NKV][hidden][GDp] with fused_attn_o: layout_attn_o.py)
  gu  [L][inter][2][Hp]           gate row i then up row i, interleaved so one unit holds both
  dn  [L][hidden][Ip]             down_proj
  lm  [vocab][Hp]                 LM head (the embedding itself when tied and Hp == hidden)

Rows are zero-padded to a multiple of CHUNK (256 elements = one 16-byte load per lane of a
warp). A matrix is cut into *units* (a row, a k-split part of a row, or a gate/up row pair);
units are dealt to the grid's warps in contiguous, equal-count ranges, so every warp's share of
a phase is one contiguous run of bytes. The k-split factor per phase is chosen so that the
largest share is within a few percent of the mean (the phase lasts as long as its largest share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from replicas import layout_attn_o, layout_fused, layout_mma, layout_mma_mlp, layout_options
from replicas.layout_params import (  # noqa: F401 (re-exported: the parameter block and control words)
    PARAM_FIELDS,
    TP_PARAM_FIELDS,
    TP_HEADER_WORDS,
    BATCH_PARAM_FIELDS,
    SLOT_FIELDS,
    RESIDENT_PARAM_FIELDS,
    KCTL_YIELD,
    KCTL_ADMIT_SEQ,
    KCTL_ADMIT_MASK,
    KCTL_ADMIT_ACK,
    KCTL_WORDS,
    CTRL_COUNT,
    CTRL_STATUS,
    CTRL_DONE,
    CTRL_CANCEL,
    CTRL_STOP_TOKEN,
    CTRL_WORDS,
    STATUS_LENGTH,
    STATUS_STOP,
    STATUS_CANCELLED,
    STATUS_PEER_TIMEOUT,
    MODE_GREEDY,
    MODE_GUMBEL,
    MODE_TOPKP,
    params_header,
)
from replicas.model import ModelConfig

CHUNK = 256  # bf16 elements one warp loads at once (32 lanes x 16 bytes)
THREADS = 512  # threads per block (16 warps); one block per SM
WARP_BYTES = CHUNK * 2
SMEM_LIMIT = 227 * 1024  # opt-in dynamic shared memory per block on Hopper
MAX_RING = 32  # weight-ring slots per warp (16-byte cp.async per lane each)
ATTN_TILE = 64  # KV positions per attention tile (scores staged in shared memory)
ATTN_SPLIT_POS = 64  # KV positions per attention split (more positions -> more splits, up to the cap)
MAX_ATTN_SPLITS = 32  # most KV-length splits per kv head
# The QKV -> attention -> O-proj chain is latency-bound and leaves HBM mostly idle; during it every
# warp asks L2 to prefetch the start of its gate/up (then down) share, up to this many bytes in all
# (H200 L2: 60 MB). The gate/up phase then reads that part from L2.
L2_PREFETCH_BYTES = 0  # measured: 32-48 MB slowed QKV more than it sped gate/up (RESULTS.md)
MAX_STOP_IDS = 16
MAX_BATCH = 8  # slots of a batch build
RED_FLOATS = 96  # block-reduction scratch in shared memory
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)

# Layout options that only switch a code path on: (field, the -D flag set to 1 when on; emitted only then, so builds
# without them keep their flags and cubins)
SWITCH_FLAGS = (("fx_pack", "MK_FX_PACK"), ("pair_norm", "MK_PAIR_NORM"), ("pair_dn", "MK_PAIR_DN"), ("ao_onepass", "MK_AO_ONEPASS"), ("best_max", "MK_BEST_MAX"), ("fold_x", "MK_FOLD_X"), ("block_best", "MK_BLOCK_BEST"), ("half_vec", "MK_HALF_VEC"), ("mma_o", "MK_MMA_O"), ("mma_mlp", "MK_MMA_MLP"), ("mma_qkv", "MK_MMA_QKV"), ("mma_lm", "MK_MMA_LM"),
                ("param_value", "MK_PARAM_VALUE"), ("div32", "MK_DIV32"), ("gu_il", "MK_GU_IL"),
                ("o_align", "MK_O_ALIGN"), ("zero_spread", "MK_ZERO_SPREAD"))


class LayoutError(ValueError):
    """The model's shapes cannot be served by this monokernel build."""


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def choose_split(rows: int, k_padded: int, warps: int) -> int:
    """Smallest k-split S whose largest per-warp unit count is within 10% of the mean.

    A phase lasts as long as its most loaded warp; splitting rows into S parts makes the units
    finer (better balance) at the cost of S partial sums for the consumer to add.
    """
    best, best_eff = 1, -1.0
    for s in (1, 2, 4, 8):
        if k_padded % (s * CHUNK):
            break
        units = rows * s
        eff = (units / warps) / math.ceil(units / warps)
        if eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


@dataclass(frozen=True)
class KernelLayout:
    """Compile-time shape of one monokernel build (per model, per GPU SM count)."""

    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    max_ctx: int
    num_sms: int
    threads: int = THREADS
    splits: dict = field(default_factory=dict)  # phase -> k-split factor
    l2_budget: int = 0  # bytes of MLP weights warmed into L2 per layer during the attention chain
    evict_first: bool = True  # stream weights with an L2 evict-first hint
    control_warp: bool = False  # one warp per block streams nothing and owns the barrier arrival
    qkv_flags: bool = False  # attention waits on per-kv-group QKV counters instead of a grid barrier
    # (measured slower than the barrier on H200: 1,013 vs 1,037 tok/s on llama-3.2-1b; kept as an option)
    kv_regs: bool = False  # attention's K/V tiles through registers (not cp.async behind the weight ring);
    # measured slower (register spills): 1,012 vs 1,041 tok/s on llama-3.2-1b
    bar_release: bool = False  # barrier arrival as red.release (fence.acq_rel) instead of membar + atomic
    tp: int = 1  # tensor-parallel GPUs; the other fields then describe this GPU's shard (tp_shard.py)
    vocab_total: int = 0  # the full vocabulary (tp > 1; `vocab` is then the padded per-GPU slice)
    tp_skip_allreduce: bool = False  # timing only: skip the all-reduces (wrong output by design)
    fused_mlp: bool = False  # gate/up -> down without a grid barrier (block-local split-K; layout_fused.py)
    fused_attn_o: bool = False  # O-proj inside the attention phase, per-kv-group waits (layout_attn_o.py)
    max_ring: int = 0  # cap on weight-ring slots per warp (0: as many as shared memory holds); tuning
    x_perm: bool = False  # matvec inputs permuted in shared memory so a warp's float4 loads are conflict-free
    split_pos: int = ATTN_SPLIT_POS  # KV positions per attention split before another split is used
    batch: int = 1  # sequences decoded together in one weight pass per step (slots; csrc/mk_batch.cuh)
    ao_slots: bool = False  # batch builds: the O-combine stages every slot in one pass (+8.0% at 4 of 4 slots; batch default)
    mma: bool = False  # QKV, O, gate/up and LM head on tensor cores, bf16 inputs (layout_mma.py; measured slower)
    param_value: bool = False  # the parameter block passed by value (constant bank) instead of through a pointer
    div32: bool = False  # the weight stream's unit ranges in 32-bit division (same values; 64-bit is slow)
    gu_il: bool = False  # gate/up chunks interleaved per row: one input load per gate+up chunk pair
    o_align: bool = False  # fused_attn_o: O units dealt per kv group to whole blocks (none stages two groups)
    zero_spread: bool = False  # the fused accumulators' zeroing spread over every block (none arrives late)
    norm_early: bool = False  # the prologues load their RMSNorm weights with the residual (one L2 round trip)
    ao_preload: bool = False  # fused_attn_o, B=1: the O stage loads split outputs and statistics together
    dn_passes: int = 1  # fused_mlp, B=1: the block's down rows in parts, each part's atomics issued when it is done
    resident: bool = False  # batch builds: requests join a running launch at a step boundary (mk_batch.cuh)
    act_bf16: bool = False  # batch builds: matvec inputs in shared memory as bf16 (half the per-slot input reads)
    mma_mlp: bool = False  # batch builds: the fused MLP's gate/up and down on tensor cores (layout_mma_mlp.py)
    norm_once: bool = False  # batch builds: the prologues load every slot's residual once, all loads in flight
    mma_lm: bool = False  # batch builds: the LM head on tensor cores (layout_mma.py tiles, bf16 input)
    mma_qkv: bool = False  # batch builds: QKV on tensor cores, block-tiled k-split (layout_mma_mlp.py)
    mma_o: bool = False  # batch builds: O-proj on tensor cores, block-tiled per kv group (layout_mma_mlp.py)
    half_vec: bool = False  # all-tensor-core batch builds: the staged bf16 slot inputs in half the shared memory
    block_best: bool = False  # batch builds: the LM head's warp bests merged per block before they go to memory
    fold_x: bool = False  # batch builds: the residual kept in the int64 accumulators (prologues read 8 of 12 bytes)
    pair_norm: bool = False  # batch builds in clusters of 2 blocks: each prologue's L2 reads split over the pair
    fx_pack: bool = False  # fold_x builds: two slots per int64 accumulator word (half the atomics and prologue bytes)
    pair_dn: bool = False  # mma_mlp builds in clusters of 2: each block downs half the rows of the pair's h (half the atomics)
    ao_onepass: bool = False  # ao_slots builds: the O stage's split statistics and outputs in one L2 round trip
    best_max: bool = False  # batch builds: the LM head's warp bests merged by one 64-bit atomicMax per slot

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: ModelConfig, max_ctx: int, num_sms: int = 132,
                    threads: int = THREADS, l2_budget: int = L2_PREFETCH_BYTES,
                    evict_first: bool = True, control_warp: bool = False,
                    bar_release: bool = False, qkv_flags: bool = False,
                    kv_regs: bool = False, tp: int = 1, vocab_total: int = 0,
                    tp_skip_allreduce: bool = False, fused_mlp: bool = False,
                    fused_attn_o: bool = False, max_ring: int = 0, x_perm: bool = False,
                    split_pos: int = ATTN_SPLIT_POS, batch: int = 1, ao_slots: bool = False,
                    mma: bool = False, param_value: bool = False, div32: bool = False,
                    gu_il: bool = False, o_align: bool = False, zero_spread: bool = False,
                    dn_passes: int = 1, norm_early: bool = False, ao_preload: bool = False,
                    resident: bool = False, act_bf16: bool = False, mma_mlp: bool = False,
                    norm_once: bool = False, mma_lm: bool = False, mma_qkv: bool = False,
                    mma_o: bool = False, half_vec: bool = False, block_best: bool = False,
                    fold_x: bool = False, pair_norm: bool = False, fx_pack: bool = False,
                    pair_dn: bool = False, ao_onepass: bool = False,
                    best_max: bool = False) -> KernelLayout:
        """`config`: the model, or with tp > 1 this GPU's shard (replicas.tp_shard.shard_config)
        and `vocab_total` the full vocabulary."""
        if config.head_dim not in SUPPORTED_HEAD_DIMS:
            raise LayoutError(f"head_dim={config.head_dim} is not supported by the monokernel; "
                              f"supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
        if config.group_size * config.head_dim > 4 * threads:
            raise LayoutError(f"a GQA group of {config.group_size} heads x {config.head_dim} is too wide")
        if max_ctx < 2:
            raise LayoutError(f"max_ctx={max_ctx} must be at least 2")
        base = cls(hidden=config.hidden_size, inter=config.intermediate_size,
                   layers=config.num_hidden_layers, heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   vocab=config.vocab_size, eps=float(config.rms_norm_eps),
                   qkv_bias=config.qkv_bias, o_bias=config.o_bias, qk_norm=config.qk_norm,
                   max_ctx=int(max_ctx), num_sms=int(num_sms), threads=threads, l2_budget=int(l2_budget),
                   evict_first=bool(evict_first), control_warp=bool(control_warp),
                   bar_release=bool(bar_release), qkv_flags=bool(qkv_flags),
                   kv_regs=bool(kv_regs), tp=int(tp), vocab_total=int(vocab_total or config.vocab_size),
                   tp_skip_allreduce=bool(tp_skip_allreduce), fused_mlp=bool(fused_mlp),
                   fused_attn_o=bool(fused_attn_o), max_ring=int(max_ring), x_perm=bool(x_perm),
                   split_pos=int(split_pos), batch=int(batch), ao_slots=bool(ao_slots), mma=bool(mma),
                   param_value=bool(param_value), div32=bool(div32), gu_il=bool(gu_il),
                   o_align=bool(o_align), zero_spread=bool(zero_spread), dn_passes=int(dn_passes),
                   norm_early=bool(norm_early), ao_preload=bool(ao_preload), resident=bool(resident),
                   act_bf16=bool(act_bf16), mma_mlp=bool(mma_mlp),
                   norm_once=bool(norm_once), mma_lm=bool(mma_lm), mma_qkv=bool(mma_qkv),
                   mma_o=bool(mma_o), half_vec=bool(half_vec), block_best=bool(block_best),
                   fold_x=bool(fold_x), pair_norm=bool(pair_norm), fx_pack=bool(fx_pack), pair_dn=bool(pair_dn),
                   ao_onepass=bool(ao_onepass), best_max=bool(best_max))
        if not 1 <= split_pos <= 4096:
            raise LayoutError(f"split_pos={split_pos}: KV positions per attention split must be 1..4096")
        if batch_error := base._batch_error():
            raise LayoutError(batch_error)
        if max_ring and not 4 <= max_ring <= MAX_RING:
            raise LayoutError(f"max_ring={max_ring}: choose 0 (as many as fit) or 4..{MAX_RING} slots")
        if tp_error := (base._tp_error() or layout_fused.fused_error(base) or layout_attn_o.attn_o_error(base)
                        or layout_mma.mma_error(base) or layout_mma.mma_lm_error(base)
                        or layout_mma_mlp.mma_mlp_error(base) or layout_mma_mlp.mma_qkv_error(base)
                        or layout_mma_mlp.mma_o_error(base)
                        or layout_options.option_error(base)):
            raise LayoutError(tp_error)
        warps = base.total_warps
        splits = {
            "qkv": layout_mma.choose_split_tiles(base.qkv_rows // layout_mma.TILE, base.hp, warps) if base.mma
            else layout_mma_mlp.qkv_split(base.qkv_rows, base.hp, base.num_sms) if base.mma_qkv
            else choose_split(base.qkv_rows, base.hp, warps),
            "o": 1 if base.fused_attn_o else choose_split(base.hidden, base.qp, warps),
            "dn": choose_split(base.hidden, base.ip, warps),
        }
        lay = cls(**{**base.__dict__, "splits": splits})
        if lay.ring_slots < 4:
            raise LayoutError(f"shapes too large for shared memory ({lay.act_floats} activation floats)")
        return lay

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def hp(self) -> int:
        return round_up(self.hidden, CHUNK)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qp(self) -> int:
        return round_up(self.q_dim, CHUNK)

    @property
    def ip(self) -> int:
        return round_up(self.inter, CHUNK)

    @property
    def qkv_rows(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def warps_per_block(self) -> int:
        """Warps per block that stream weights (the control warp, if any, does not)."""
        return self.threads // 32 - int(self.control_warp)

    @property
    def total_warps(self) -> int:
        return self.num_sms * self.warps_per_block

    @property
    def cluster(self) -> int:
        """Blocks per thread-block cluster of the launch (pair_norm, pair_dn: pairs sharing one TPC)."""
        return 2 if self.pair_norm or self.pair_dn else 1

    @property
    def attn_floats(self) -> int:
        """Attention scratch (aliases the activation buffer): q, k/v of the step, scores, stats,
        one tile of cached K and V (mirrors kAttnFloats in csrc/mk_attention.cuh)."""
        g, d = self.group, self.head_dim
        stats_end = g * d + 2 * d + g * ATTN_TILE + 4 * g + 4
        return round_up(stats_end, 4) + ATTN_TILE * d  # + bf16 K and V tiles [TILE][D] each

    @property
    def act_floats(self) -> int:
        # fused_mlp never stages h (ip floats) and fused_attn_o never runs combine_attention: the
        # shared memory they free goes to the weight ring
        combine = 0 if self.fused_attn_o else self.qp + 2 * self.heads * MAX_ATTN_SPLITS  # O input + split weights
        h_stage = 0 if self.fused_mlp else self.ip
        fused = layout_fused.act_floats(self) if self.fused_mlp else 0
        attn_o = layout_attn_o.act_floats(self) if self.fused_attn_o else 0
        if self.batch > 1:  # per-slot matvec inputs side by side, then the fused MLP's h slices (mk_batch.cuh)
            vectors = self.batch * self.act_vec // (2 if self.bf16_vectors else 1)  # (kVecFloats)
            fx_h = max(layout_fused.part_floats(self), vectors)
            # mma_mlp: the h slices are bf16 (half; pair_dn: the pair's two); then the block-tiled matvecs' pieces
            # (csrc/mk_block_mma.cuh)
            h = self.batch * layout_fused.slice_floats(self) // (2 if self.mma_mlp and not self.pair_dn else 1)
            pieces = layout_mma_mlp.piece_floats(self) if layout_mma_mlp.block_tiled(self) else 0
            return max(fx_h + h + pieces,
                       vectors + 2 * self.group * MAX_ATTN_SPLITS,
                       self.attn_floats)
        return max(self.hp, self.qp, h_stage, self.attn_floats, combine, fused, attn_o)

    @property
    def bf16_vectors(self) -> bool:
        """Whether the per-slot matvec inputs a batch build stages take half the shared memory: mma, or half_vec
        (needs all four of mma_qkv, mma_o, mma_mlp and mma_lm: every input is then bf16 in B-fragment order);
        the weight ring gets what they free (mirrors kVecFloats in csrc/mk_layout.cuh)."""
        return self.mma or self.half_vec

    @property
    def act_vec(self) -> int:
        """Shared floats of one slot's matvec input in a batch build: the normed x, or the O input
        staged by kv group (mirrors kActVec in csrc/mk_layout.cuh)."""
        return max(self.hp, self.kv_heads * layout_attn_o.group_len(self))

    @property
    def red_floats(self) -> int:
        """Block-reduction scratch after the activations (batch builds: one row of warp sums per slot,
        csrc/mk_batch.cuh residual_norm_slots)."""
        # (pair_norm: + this block's and the peer's half sums per slot)
        rows = self.threads // 32 + (3 if self.pair_norm else 1)
        return RED_FLOATS if self.batch == 1 else max(RED_FLOATS, rows * self.batch)

    @property
    def resident_bytes(self) -> int:
        """Resident builds: every slot's table row and stop ids copied into shared memory after the
        block-reduction scratch, 8-byte aligned (mirrors kResidentOff in csrc/mk_batch.cuh)."""
        if not self.resident:
            return 0
        return 8 + self.batch * (8 * len(SLOT_FIELDS) + 4 * MAX_STOP_IDS)

    @property
    def smem_fixed(self) -> int:
        return 4 * (self.act_floats + self.red_floats) + self.resident_bytes

    @property
    def ring_slots(self) -> int:
        free = SMEM_LIMIT - self.smem_fixed
        return min(self.max_ring or MAX_RING, free // (self.warps_per_block * WARP_BYTES))

    @property
    def smem_bytes(self) -> int:
        return self.smem_fixed + self.ring_slots * self.warps_per_block * WARP_BYTES

    @property
    def attn_splits_max(self) -> int:
        """KV-length splits per kv head (one block each); sized so every block has one."""
        return max(1, min(self.num_sms // self.kv_heads, MAX_ATTN_SPLITS))

    def packed_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes (uint16 elements) of the packed weight buffers."""
        L = self.layers
        return {
            "w_qkv": (L, self.qkv_rows, self.hp),
            "w_o": (L, self.kv_heads, self.hidden, layout_attn_o.group_len(self)) if self.fused_attn_o
            else (L, self.hidden, self.qp),
            "w_gu": (L, self.inter, 2, self.hp),
            "w_dn": (L, self.inter * self.hp) if self.fused_mlp else (L, self.hidden, self.ip),
            "w_lm": (layout_mma.vocab_rows(self) if self.mma or self.mma_lm else self.vocab, self.hp),
        }

    def l2_prefetch_per_warp(self) -> tuple[int, int]:
        """(gate/up, down) bytes each warp prefetches into L2 per layer (multiples of 512)."""
        per_warp = self.l2_budget // self.total_warps
        gu_share = math.ceil(self.inter / self.total_warps) * 2 * self.hp * 2
        dn_share = math.ceil(self.hidden * self.splits["dn"] / self.total_warps) * (self.ip // self.splits["dn"]) * 2
        gu = min(per_warp, gu_share) // WARP_BYTES * WARP_BYTES
        # fused_mlp streams down in block tiles, not the row ranges l2_prefetch walks: gate/up only
        dn = 0 if self.fused_mlp else min(per_warp - gu, dn_share) // WARP_BYTES * WARP_BYTES
        return max(gu, 0), max(dn, 0)

    def stream_bytes_per_token(self) -> int:
        return 2 * sum(math.prod(s) for s in self.packed_shapes().values())

    # ---- tensor parallelism ------------------------------------------------------------------
    def _tp_error(self) -> str | None:
        if self.tp not in (1, 2, 4, 8):
            return f"tp={self.tp}: the monokernel supports 1, 2, 4 or 8 GPUs"
        if self.tp == 1 and self.tp_skip_allreduce:
            return "tp_skip_allreduce needs tp > 1"
        if not self.vocab <= self.vocab_total <= self.tp * self.vocab:
            return f"vocab_total={self.vocab_total} does not fit {self.tp} slices of {self.vocab}"
        return None

    def _batch_error(self) -> str | None:
        if not 1 <= self.batch <= MAX_BATCH:
            return f"batch={self.batch}: the monokernel decodes 1..{MAX_BATCH} sequences at once"
        if self.batch > 1 and not (self.fused_mlp and self.fused_attn_o):
            return (f"batch={self.batch} needs the fused layout (fused_mlp and fused_attn_o): the plain layout "
                    "stages a whole intermediate vector per slot in shared memory")
        if self.ao_slots and self.batch == 1:
            return "ao_slots combines several slots' attention: it needs batch > 1"
        if self.batch > 1 and layout_fused.down_geometry(self.hp, self.warps_per_block)[2] != 1:
            return (f"batch={self.batch} needs hidden/256 <= {self.warps_per_block} (one fused-down chunk column per "
                    f"warp); hidden={self.hidden}")
        return None

    def tp_offsets(self) -> dict[str, int]:
        """Word offsets inside one GPU's exchange region (mirrored as MK_TP_OFF_* flags)."""
        n, h = self.tp, self.hidden
        return {"COUNT": 0, "TOKFLAG": 32, "TOKVAL": 64, "TOKID": 96, "TOKCANCEL": 128,
                "RECV_O": TP_HEADER_WORDS, "RECV_DN": TP_HEADER_WORDS + h * n,
                "LOGITS": TP_HEADER_WORDS + 2 * h * n, "WORDS": TP_HEADER_WORDS + 2 * h * n + n * self.vocab}

    def param_fields(self) -> tuple[tuple[str, str], ...]:
        """The kernel's parameter block of this build (params_header() guards the TP and batch fields)."""
        return (PARAM_FIELDS + (TP_PARAM_FIELDS if self.tp > 1 else ()) + (BATCH_PARAM_FIELDS if self.batch > 1 else ())
                + (RESIDENT_PARAM_FIELDS if self.resident else ()))

    # ---- what the compiler sees -----------------------------------------------------------
    def compile_flags(self) -> list[str]:
        """The -D flags of this build (replicas/layout_flags.py)."""
        from replicas.layout_flags import compile_defs
        return [f"-D{k}={v}" for k, v in compile_defs(self).items()]

    def buffer_sizes(self) -> dict[str, int]:
        """Element counts of the fp32 work buffers the kernel's parameter block points to."""
        s = self.splits
        nsplit = self.attn_splits_max
        b = self.batch  # per-slot buffers: slot-major ([2][B][Hp] for xbuf and the fused accumulators)
        rows = (b + 1) // 2 if self.fx_pack else b  # accumulator rows (fx_pack: a pair of slots each)
        return {
            "xbuf": 2 * b * self.hp,
            "qkv_part": b * self.qkv_rows * s["qkv"],
            "o_part": 2 * rows * self.hp if self.fused_attn_o else self.hidden * s["o"],  # fused: int64 accumulator
            "h_buf": self.ip,
            "dn_part": 4 * rows * self.hp if self.fused_mlp else self.hidden * s["dn"],  # fused: 2 int64 accumulators
            "attn_out": self.qp,
            "attn_m": b * self.kv_heads * nsplit * self.group,
            "attn_l": b * self.kv_heads * nsplit * self.group,
            "attn_o": b * self.kv_heads * nsplit * self.group * self.head_dim,
            "best_val": b * self.total_warps,
        }
