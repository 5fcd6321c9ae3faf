// Constants derived from the -D flags emitted by replicas/layout.py (the source of truth).
// This header only derives and checks; change shapes/padding in layout.py.
#pragma once

#ifndef MK_H
#error "compile with the -D flags from replicas.layout.KernelLayout.compile_flags()"
#endif
#ifndef MK_TP
#define MK_TP 1  // tensor-parallel GPUs (layout.py emits MK_TP and the MK_TP_* flags only when > 1)
#endif
#ifndef MK_FUSED_MLP
#define MK_FUSED_MLP 0  // gate/up -> down fused, block-local split-K (layout_fused.py; flags only when on)
#endif
#ifndef MK_ATTN_O
#define MK_ATTN_O 0  // O-proj fused into attention, O packed by kv group (layout_attn_o.py; flags only when on)
#endif

#ifndef MK_MMA
#define MK_MMA 0  // QKV, O, gate/up, LM head on tensor cores (layout option mma, layout_mma.py; flags only when on)
#endif
#ifndef MK_MMA_MLP
#define MK_MMA_MLP 0  // batch builds: gate/up and the fused down on tensor cores (layout_mma_mlp.py; flags only when on)
#endif
#ifndef MK_MMA_QKV
#define MK_MMA_QKV 0  // batch builds: QKV on tensor cores, block-tiled (layout option mma_qkv; flags only when on)
#endif
#ifndef MK_MMA_O
#define MK_MMA_O 0  // batch builds: O-proj on tensor cores, block-tiled per kv group (layout option mma_o; flags only when on)
#endif
#ifndef MK_MMA_LM
#define MK_MMA_LM 0  // batch builds: the LM head on tensor cores (layout option mma_lm, layout_mma.py tiles; flags only when on)
#endif
#ifndef MK_GU_IL
#define MK_GU_IL 0  // gate/up chunks interleaved per row (layout option gu_il; flag only when on)
#endif
#ifndef MK_BATCH
#define MK_BATCH 1  // slots decoded together (layout option batch; flags only when > 1, see mk_batch.cuh)
#endif
constexpr int kB = MK_BATCH;
#if MK_BATCH > 1
static_assert(MK_FUSED_MLP && MK_ATTN_O && MK_TP == 1, "batch builds use fused_mlp + fused_attn_o on one GPU");
constexpr int kActVec = MK_ACT_VEC;  // shared floats of one slot's matvec input
#else
constexpr int kActVec = 0;  // one slot: its input at s_act itself
#endif
// Shared floats every slot's matvec inputs take: half when all of them are bf16 in B-fragment order (mma, or
// layout option half_vec on mma_qkv + mma_o + mma_mlp + mma_lm: no phase stages an fp32 vector; layout.py
// bf16_vectors, act_floats)
#if MK_HALF_VEC
static_assert(MK_MMA_QKV && MK_MMA_O && MK_MMA_MLP && MK_MMA_LM, "half_vec: every staged input bf16");
#endif
#if MK_MMA || MK_HALF_VEC
constexpr int kVecFloats = kB * kActVec / 2;
#else
constexpr int kVecFloats = kB * kActVec;
#endif

constexpr int kChunk = 256;                 // bf16 elements per warp-wide 16-byte load
constexpr int kWarps = MK_THREADS / 32;     // warps per block
// With MK_CTRL_WARP the last warp streams no weights: it owns the grid-barrier arrival, whose
// memory fence would otherwise wait for the arriving thread's own in-flight weight loads.
constexpr int kStreamWarps = kWarps - MK_CTRL_WARP;
constexpr int kBarrierThread = (kWarps - 1) * 32 * MK_CTRL_WARP;
constexpr int kQDim = MK_NH * MK_D;
constexpr int kKVDim = MK_NKV * MK_D;
constexpr int kQKVRows = kQDim + 2 * kKVDim;
constexpr int kGroup = MK_NH / MK_NKV;      // query heads per kv head
constexpr int kHalfD = MK_D / 2;
constexpr int kDPerLane = MK_D / 32;         // head-dim elements per lane in attention scores

// Units of each streamed matrix: (count, length in elements). A unit is contiguous.
constexpr long long kUnitsQKV = (long long)kQKVRows * MK_S_QKV;
constexpr int kLenQKV = MK_HP / MK_S_QKV;
#if MK_ATTN_O
constexpr long long kUnitsO = (long long)MK_NKV * MK_H;  // unit (kv group, row): the row's group columns
constexpr int kLenO = MK_AO_GDP;
static_assert(MK_S_O == 1 && MK_AO_GDP % kChunk == 0, "fused_attn_o: whole-chunk group units, no k-split");
#else
constexpr long long kUnitsO = (long long)MK_H * MK_S_O;
constexpr int kLenO = MK_QP / MK_S_O;
#endif
constexpr long long kUnitsGU = MK_I;
constexpr int kLenGU = 2 * MK_HP;            // gate row then up row
constexpr long long kUnitsDN = (long long)MK_H * MK_S_DN;
constexpr int kLenDN = MK_IP / MK_S_DN;
constexpr long long kUnitsLM = MK_V;
constexpr int kLenLM = MK_HP;

// Units as the weight stream deals them to warps (mat_info): the units above, or with MK_MMA tiles of
// 16 of them (rows of 16 x the same k range; layout_mma.py), 16x as long. kRowsPerUnit maps back.
#if MK_MMA
constexpr int kRowsPerUnit = 16;
static_assert(MK_FUSED_MLP && MK_ATTN_O && MK_TP == 1 && !MK_QKV_FLAGS, "mma: fused single-GPU layouts (layout_mma.mma_error)");
static_assert(kQKVRows % 16 == 0 && MK_H % 16 == 0 && MK_I % 16 == 0 && MK_VT % 16 == 0 && MK_VT >= MK_V, "mma tiles");
constexpr long long kSUnitsLM = MK_VT / 16;
#else
constexpr int kRowsPerUnit = 1;
#if MK_MMA_LM
constexpr long long kSUnitsLM = MK_VT / 16;
#else
constexpr long long kSUnitsLM = kUnitsLM;
#endif
#endif
constexpr int kLmTile = (MK_MMA || MK_MMA_LM) ? 16 : 1;  // LM-head rows per unit
#if MK_MMA_LM
static_assert(MK_BATCH > 1 && !MK_MMA && MK_TP == 1 && MK_VT == MK_V && MK_V % 16 == 0, "mma_lm (layout_mma.mma_lm_error)");
#endif
constexpr long long kSUnitsQKV = kUnitsQKV / kRowsPerUnit;
constexpr long long kSUnitsO = kUnitsO / kRowsPerUnit;
constexpr long long kSUnitsGU = kUnitsGU / kRowsPerUnit;
constexpr long long kSUnitsDN = kUnitsDN;  // the fused down stays on CUDA cores (mk_fused.cuh)
// Gate/up rows per block-slice unit (gu_row0): tiles of 16 with mma or mma_mlp, else rows.
constexpr int kGuTile = (MK_MMA || MK_MMA_MLP) ? 16 : 1;
constexpr long long kGuUnits = kUnitsGU / kGuTile;
#if MK_MMA_QKV
constexpr int kQkvTiles = kQKVRows / 16 * MK_S_QKV;  // units: (16-row tile, k-split part), layout_mma.pack_rows
constexpr int kQkvSteps = MK_HP / 16 / MK_S_QKV;     // 16-k steps of a unit
static_assert(MK_BATCH > 1 && !MK_MMA && !MK_QKV_FLAGS && kQKVRows % 16 == 0 && (MK_HP / 16) % MK_S_QKV == 0,
              "mma_qkv: batch builds, rows in whole tiles, the QKV barrier (layout_mma_mlp.mma_qkv_error)");
#endif
#if MK_MMA_O
constexpr int kOTiles = MK_H / 16;        // 16-row tiles of one kv group's O (layout_mma.pack_o_groups: unit g * kOTiles + t)
constexpr int kOSteps = MK_AO_GDP / 16;   // 16-k steps of a tile (the group's columns)
static_assert(MK_BATCH > 1 && !MK_MMA && MK_ATTN_O && MK_O_ALIGN && MK_AO_SLOTS && MK_H % 16 == 0,
              "mma_o: batch builds with fused_attn_o, o_align and ao_slots (layout_mma_mlp.mma_o_error)");
#endif
#if MK_MMA_MLP
constexpr int kKS = MK_HP / 16;  // 16-k steps of a gate/up tile
static_assert(MK_BATCH > 1 && MK_FUSED_MLP && !MK_MMA && !MK_GU_IL && MK_H % 16 == 0 && MK_I % 16 == 0,
              "mma_mlp: batch builds of the fused layout, rows in whole tiles (layout_mma_mlp.mma_mlp_error)");
#endif

// Per-layer element strides of the packed matrices.
constexpr long long kStrideQKV = (long long)kQKVRows * MK_HP;
constexpr long long kStrideO = kUnitsO * kLenO;  // == MK_H * MK_QP without MK_ATTN_O
constexpr long long kStrideGU = (long long)MK_I * 2 * MK_HP;
#if MK_FUSED_MLP
constexpr long long kStrideDN = (long long)MK_I * MK_HP;  // block-slice tiles of down^T (mk_fused.cuh)
static_assert(MK_FX_R * MK_FX_WC == kStreamWarps && MK_FX_WC * MK_FX_M * kChunk == MK_HP, "fused down tiling");
#else
constexpr long long kStrideDN = (long long)MK_H * MK_IP;
#endif

static_assert(MK_THREADS % 32 == 0 && MK_THREADS <= 1024, "block size");
static_assert(MK_HP % kChunk == 0 && MK_QP % kChunk == 0 && MK_IP % kChunk == 0, "padding");
// (mma, mma_qkv: a unit of 16 rows x kLenQKV is kLenQKV / 16 whole chunks)
static_assert(kLenQKV % ((MK_MMA || MK_MMA_QKV) ? 16 : kChunk) == 0 && kLenO % kChunk == 0 && kLenDN % kChunk == 0, "k-split");
static_assert(MK_D % 32 == 0 && MK_D <= 256, "head_dim must be a multiple of 32, at most 256");
static_assert(MK_NH % MK_NKV == 0, "GQA grouping");
static_assert(MK_RING >= 2 && MK_RING <= 32, "weight ring depth");
static_assert(MK_ACT_FLOATS >= MK_HP && MK_ACT_FLOATS >= MK_QP, "act buffer");
static_assert(MK_FUSED_MLP || MK_ACT_FLOATS >= MK_IP, "act buffer: the unfused down stages h");
static_assert(MK_ACT_FLOATS >= kGroup * MK_D + 2 * MK_D + kGroup * MK_ATTN_TILE + 4 * kGroup, "attn scratch");

// Stream order of one decode step: LM head first (the step starts from the previous hidden
// state), then per layer QKV, O, GU, DN.
enum Mat : int { MAT_LM = 0, MAT_QKV = 1, MAT_O = 2, MAT_GU = 3, MAT_DN = 4 };
