// Per-block phase timeline (probe builds only: -DMK_TIMELINE=1 through MK_NVRTC_EXTRA, e.g.
// bench/timeline_probe.py). Thread 0 of every block stores %globaltimer at fixed marks of steps
// [MK_TL_STEP0, MK_TL_STEP0 + MK_TL_STEPS) into p.profile + kTLBase, laid out
// [block][step][layer 0..L (L = the LM head + sampling)][kTLMarks] u64. Stores only (no read on
// thread 0's path), so the probe perturbs little; default builds compile none of it (the macros
// expand to nothing and the cubins stay byte-identical).
#pragma once
#include "mk_common.cuh"
#ifndef MK_TIMELINE
#define MK_TIMELINE 0
#endif
#if MK_TIMELINE
#ifndef MK_TL_STEP0
#define MK_TL_STEP0 32
#endif
#ifndef MK_TL_STEPS
#define MK_TL_STEPS 64
#endif
constexpr int kTLBase = 16;   // after the 13 phase counters (rounded up)
constexpr int kTLMarks = 16;  // marks per (step, layer); see bench/timeline_probe.py MARKS
constexpr long long kTLRowsPerBlock = (long long)MK_TL_STEPS * (MK_L + 1) * kTLMarks;  // then one %smid per block
MK_DEVICE unsigned long long tl_smid() {
#ifdef MK_EMU
  return blockIdx.x;
#else
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
#endif
}
// this block's row of marks for (step, layer), or nullptr outside the window / without a buffer
MK_DEVICE unsigned long long* tl_row(const MkParams& p, int step, int layer) {
  if (p.profile == nullptr || step < MK_TL_STEP0 || step >= MK_TL_STEP0 + MK_TL_STEPS) return nullptr;
  return p.profile + kTLBase + (long long)blockIdx.x * kTLRowsPerBlock +
         ((long long)(step - MK_TL_STEP0) * (MK_L + 1) + layer) * kTLMarks;
}
#define MK_TL_PARAM , unsigned long long* tl = nullptr
#define MK_TL_ARG(row) , (row)
#define MK_TL_AT(row, k) do { if ((row) != nullptr && threadIdx.x == 0) (row)[k] = global_ns(); } while (0)
#else
#define MK_TL_PARAM
#define MK_TL_ARG(row)
#define MK_TL_AT(row, k) do { } while (0)
#endif
