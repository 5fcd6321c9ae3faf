"""Weight-stream shares per block, by measured SM speed (layout option `sm_shares`).

On the H200 the timeline probe (bench/timeline_probe.py) found 24 of the 132 SMs streaming ~25% faster
than the rest under full load (LM head 86 vs 111 µs per step; gate/up + down 16.0 vs 19.8 µs per layer),
the same SMs in every phase and launch. With equal shares those blocks wait at every barrier. With
`sm_shares` the LM head rows and the fused MLP's gate/up units (and so each block's h slice and down
columns) are dealt in proportion to integer weights w_b, one per block:

    share_w = prefix sums of the weights, rescaled to [0, ..., TOTAL]   (int32, num_sms + 1; p.share_w)
    block b's units of a matrix with U units: [U * share_w[b] // TOTAL, U * share_w[b + 1] // TOTAL)

(csrc/mk_stream.cuh mat_range / block_units mirror `block_units` here). The weights come from the
kernel itself: an sm_shares build has each block's warp 0 record its LM-head time for STEPS steps
(p.share_t); `GpuModel.calibrate_shares` runs one short launch at engine start, snaps the times to two
classes (fast / the rest, the speed ratio rounded to 1/8, so the shares do not follow noise) and
re-packs the fused down for the new slices. (Separate streaming probes, plain loads or a cp.async ring
like the weight stream, picked other blocks than the kernel's fast ones on the H200: RESULTS.md.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOTAL = 65536    # the table's last entry (csrc/mk_stream.cuh kShareTotal: the kernel divides by a constant)
UNIT = 32        # the weight of a block of median speed
MAX_RATIO = 1.5  # no block gets more than 1.5x the mean share (the h slice's shared memory is sized for it)
FAST = 0.92      # a block at most this fraction of the median time is in the fast class
STEP0, STEPS = 2, 8  # the decode steps whose LM-head times the kernel records (csrc/mk_stream.cuh kShare*)


class ShareError(ValueError):
    """A share table that does not fit the layout."""


def normalised(weights: Sequence[int]) -> tuple[int, ...]:
    """The prefix table of integer weights, rescaled so that it ends at TOTAL."""
    cum = np.concatenate([[0], np.cumsum(np.asarray(weights, np.int64))])
    return tuple(int(v) for v in (cum * TOTAL + cum[-1] // 2) // cum[-1])


def uniform(num_sms: int) -> tuple[int, ...]:
    return normalised([1] * num_sms)


def block_units(units: int, prefix: Sequence[int], b: int) -> tuple[int, int]:
    """Block b's unit range [u0, u1) of a matrix with `units` units (the kernel's formula)."""
    return units * prefix[b] // TOTAL, units * prefix[b + 1] // TOTAL


def max_slice(units: int, num_sms: int) -> int:
    """The most units one block may own under any accepted table (sizes the h slice in shared memory)."""
    return -(-units * 3 // (2 * num_sms)) + 1


def check(prefix: Sequence[int], num_sms: int, units: int | None = None) -> tuple[int, ...]:
    """`prefix` as a tuple, or ShareError saying what is wrong with it."""
    p = tuple(int(v) for v in prefix)
    if len(p) != num_sms + 1 or p[0] != 0 or p[-1] != TOTAL:
        raise ShareError(f"share_prefix needs {num_sms + 1} entries from 0 to {TOTAL} (one weight per block of the "
                         f"{num_sms}-block grid; sm_shares.normalised), got {len(p)}"
                         + ("" if not p else f" from {p[0]} to {p[-1]}"))
    w = np.diff(p)
    if (w <= 0).any():
        raise ShareError(f"share_prefix must grow strictly (every block streams something); block {int(np.argmin(w))} "
                         f"has weight {int(w.min())}")
    if w.max() * num_sms > MAX_RATIO * p[-1]:
        raise ShareError(f"block {int(np.argmax(w))} has {w.max() * num_sms / p[-1]:.2f}x the mean share; at most "
                         f"{MAX_RATIO}x fits the shared memory sized for it")
    if units is not None:
        big = max(block_units(units, p, b)[1] - block_units(units, p, b)[0] for b in range(num_sms))
        if big > max_slice(units, num_sms):
            raise ShareError(f"a block would own {big} of {units} units, more than {max_slice(units, num_sms)}")
    return p


def weights_from_times(times: Sequence[float]) -> tuple[int, ...]:
    """Prefix table from per-block streaming times: blocks faster than FAST x the median form one class
    whose weight is UNIT x (median time of the rest / median time of the class), rounded to UNIT/8."""
    t = np.asarray(times, np.float64)
    if t.ndim != 1 or len(t) == 0 or not np.isfinite(t).all() or (t <= 0).any():
        raise ShareError(f"need one positive time per block, got {t!r}")
    med = float(np.median(t))
    fast = t <= FAST * med
    w = np.full(len(t), UNIT, np.int64)
    if fast.any() and (~fast).any():
        ratio = float(np.median(t[~fast]) / np.median(t[fast]))
        w[fast] = int(round(UNIT * min(ratio, MAX_RATIO) * 8 / UNIT)) * UNIT // 8
    while w.max() * len(w) > MAX_RATIO * w.sum():  # (many fast blocks: the mean rises, so this rarely runs)
        w[w == w.max()] -= UNIT // 8
    return normalised(w)


def times_from_kernel(share_t: np.ndarray, num_sms: int) -> np.ndarray:
    """Per-block median of the kernel's recorded LM-head times ([STEPS * num_sms] u64 ns)."""
    t = np.asarray(share_t, np.float64).reshape(STEPS, num_sms)
    if (t <= 0).any():
        raise ShareError(f"the calibration launch recorded no time for blocks "
                         f"{sorted(set(np.nonzero(t <= 0)[1].tolist()))[:8]} (did it run {STEP0 + STEPS} steps?)")
    return np.median(t, axis=0)
