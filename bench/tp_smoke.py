"""First contact of the tensor-parallel monokernel with GPUs (run under `timeout`: a hang means an
exchange protocol bug). tiny preset, TP=1 vs TP=N: teacher-forced logits, 32 greedy tokens,
a seeded top-k/top-p sample, a cancel; prints one JSON line per check.

    timeout 90 python bench/tp_smoke.py --tp 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def cancel_after(engine, k: int):
    """A long greedy generation cancelled once `k` tokens arrived: (tokens received, generation)."""
    from replicas.engine import SamplingParams

    gen = engine.generate([1, 2], SamplingParams(max_tokens=400, ignore_eos=True))
    got = []
    for tok in gen:
        got.append(tok)
        if len(got) == k:
            gen.cancel()
    return got, gen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args()
    from replicas.checkpoint import make_checkpoint
    from replicas.engine import SamplingParams
    from replicas.monokernel import MonokernelEngine

    path = make_checkpoint(args.preset, Path(tempfile.mkdtemp()) / args.preset, seed=0)
    t = time.perf_counter()
    one = MonokernelEngine.from_pretrained(path, devices=[0], max_context=512)
    many = MonokernelEngine.from_pretrained(path, devices=list(range(args.tp)), max_context=512)
    print(json.dumps({"check": "load", "s": round(time.perf_counter() - t, 1),
                      "compile_s": round(many.gpu.compile_seconds, 1)}), flush=True)
    ids = np.random.default_rng(1).integers(0, one.config.vocab_size, 40).tolist()
    a, b = one.forward_logits(ids), many.forward_logits(ids)
    print(json.dumps({"check": "teacher_logits", "rel_prefill": float(np.abs(a[:16] - b[:16]).max() / np.abs(a).max()),
                      "rel_kernel": float(np.abs(a[16:] - b[16:]).max() / np.abs(a).max())}), flush=True)
    for name, p in [("greedy", SamplingParams(max_tokens=32, ignore_eos=True)),
                    ("topkp", SamplingParams(max_tokens=32, ignore_eos=True, seed=7, temperature=0.9, top_k=40, top_p=0.9)),
                    ("gumbel", SamplingParams(max_tokens=32, ignore_eos=True, seed=7, temperature=1.3))]:
        x, y = list(one.generate([3, 4, 5], p)), list(many.generate([3, 4, 5], p))
        print(json.dumps({"check": name, "equal": x == y, "tp1": x[:12], "tpN": y[:12]}), flush=True)
    got, gen = cancel_after(many, 3)
    after = list(many.generate([1], SamplingParams(max_tokens=2, ignore_eos=True)))
    print(json.dumps({"check": "cancel", "tokens": len(got), "reason": str(gen.finish_reason), "after": len(after)}),
          flush=True)


if __name__ == "__main__":
    main()
