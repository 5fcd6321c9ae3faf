"""Does the sm_shares calibration see the monokernel's fast SMs? (one GPU)

    python bench/sm_probe_check.py --out $OUT/smp [--timeline $OUT/tl/timeline.json]

Runs replicas/sm_shares.measure_block_times with both probe kinds (the weight stream's cp.async ring and
plain loads) on the 1B default layout's grid and shared memory, prints per-block times and the weight
table each gives; with --timeline (bench/timeline_probe.py's JSON from the same machine) also the
monokernel's own per-block LM-head time and how well each probe's fast class matches the kernel's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeline", type=Path, default=None)
    args = ap.parse_args()
    import cupy as cp

    from replicas import sm_shares
    from replicas.checkpoint import preset_config
    from replicas.layout import KernelLayout
    from replicas.layout_tuned import engine_options

    c = preset_config("llama-3.2-1b")
    lay = KernelLayout.from_config(c, 4096, num_sms=cp.cuda.Device().attributes["MultiProcessorCount"],
                                   **engine_options(c))
    res: dict = {"num_sms": lay.num_sms, "ring": lay.ring_slots, "smem": lay.smem_bytes}
    truth = None
    if args.timeline and args.timeline.exists():
        tl = json.loads(args.timeline.read_text())
        lm = np.array(tl["lm_us"]["lm matvec"]["per_block"], float)
        truth = lm <= sm_shares.FAST * np.median(lm)
        res["kernel_fast_blocks"] = [int(b) for b in np.flatnonzero(truth)]
    for kind in ("ring", "loads"):
        for size in (4 << 20, 16 << 20):
            t = sm_shares.measure_block_times(cp, lay.num_sms, lay.threads, lay.smem_bytes, per_block_bytes=size,
                                              ring=lay.ring_slots, kind=kind)
            prefix = sm_shares.weights_from_times(t)
            w = np.diff(prefix)
            fast = w > np.median(w)
            r = {"times_us": [round(x / 1e3, 2) for x in t], "fast_blocks": [int(b) for b in np.flatnonzero(fast)],
                 "ratio": round(float(np.median(t[~fast]) / np.median(t[fast])), 3) if fast.any() else 1.0,
                 "GBps_per_block_median": round(size / float(np.median(t)), 2)}
            if truth is not None:
                r["agree_with_kernel"] = int((fast == truth).sum())
            res[f"{kind}_{size >> 20}MB"] = r
            print(kind, size >> 20, "MB:", {k: v for k, v in r.items() if k != "times_us"}, flush=True)
    if truth is not None:
        print("kernel fast blocks:", res["kernel_fast_blocks"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sm_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
