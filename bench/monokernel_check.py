"""Monokernel correctness on the GPU, as a report (the pytest gpu tests assert the same things).

    python bench/monokernel_check.py --presets tiny qwen3-0.6b llama-3.2-1b --out $OUT

Per preset: synthetic checkpoint (replicas.checkpoint), MonokernelEngine vs HF transformers fp32
and vs the numpy ReferenceEngine, teacher-forced over >= 256 positions; greedy decode vs the
oracle's argmax where its top-2 margin is clear; seeded sampling reproducibility; cancel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOL = 2e-2


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def hf_logits(path: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    return out


def check_preset(preset: str, root: Path, n: int, use_reference: bool) -> dict:
    from replicas.checkpoint import make_checkpoint
    from replicas.engine import FinishReason, SamplingParams
    from replicas.monokernel import MonokernelEngine

    res: dict = {"preset": preset}
    t = time.perf_counter()
    path = make_checkpoint(preset, root / preset, seed=0, dtype="bf16")
    res["make_checkpoint_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    eng = MonokernelEngine.from_pretrained(path, max_context=2048)
    res["load_s"] = round(time.perf_counter() - t, 1)
    res["compile_s"] = round(eng.gpu.compile_seconds, 2)
    res["layout"] = {"splits": eng.gpu.layout.splits, "ring": eng.gpu.layout.ring_slots,
                     "smem": eng.gpu.layout.smem_bytes}
    rng = np.random.default_rng(1)
    ids = rng.integers(0, eng.config.vocab_size, n).tolist()
    t = time.perf_counter()
    mk = eng.forward_logits(ids)
    res["forward_logits_s"] = round(time.perf_counter() - t, 2)
    hf = hf_logits(path, ids)
    res["rel_err_vs_hf"] = rel_err(mk, hf)
    res["rel_err_vs_hf_prefill_rows"] = rel_err(mk[:16], hf[:16])
    res["rel_err_vs_hf_decode_rows"] = rel_err(mk[16:], hf[16:])
    res["worst_position"] = int(np.argmax(np.max(np.abs(mk - hf), axis=1)))
    if use_reference:
        from replicas.reference import ReferenceEngine

        ref = ReferenceEngine.from_pretrained(path)
        rl = ref.forward_logits(ids)
        res["rel_err_vs_reference"] = rel_err(mk, rl)
    # greedy decode vs the oracle's argmax on the same (teacher-forced) sequence
    prompt = ids[:32]
    gen = eng.generate(prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    toks = list(gen)
    seq = prompt + toks
    oracle = hf_logits(path, seq)[len(prompt) - 1:len(seq) - 1]
    top2 = np.sort(oracle, axis=1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]) / np.max(np.abs(oracle))
    agree = np.argmax(oracle, axis=1) == np.array(toks)
    res["greedy_tokens"] = len(toks)
    res["greedy_mismatch_clear_margin"] = int(np.sum(~agree & (margin > TOL)))
    res["greedy_mismatch_any"] = int(np.sum(~agree))
    # seeded sampling
    sp = SamplingParams(max_tokens=32, temperature=1.5, seed=1234, ignore_eos=True)
    a, b = list(eng.generate(prompt, sp)), list(eng.generate(prompt, sp))
    c = list(eng.generate(prompt, SamplingParams(max_tokens=32, temperature=1.5, seed=99, ignore_eos=True)))
    res["seeded_reproducible"] = a == b
    res["seeds_differ"] = a != c
    kp = SamplingParams(max_tokens=16, temperature=0.7, top_k=20, top_p=0.9, seed=5, ignore_eos=True)
    d, e = list(eng.generate(prompt, kp)), list(eng.generate(prompt, kp))
    res["topkp_reproducible"] = d == e
    # cancel
    g = eng.generate(prompt, SamplingParams(max_tokens=1000, ignore_eos=True))
    got = []
    for tk in g:
        got.append(tk)
        if len(got) == 5:
            g.cancel()
    res["cancel_tokens"] = len(got)
    res["cancel_reason"] = g.finish_reason.value
    # stop token: force the first greedy token to be a stop id
    j = next((i for i in range(1, len(toks)) if toks[i] not in toks[:i]), None)
    if j is not None:
        s = list(eng.generate(prompt, SamplingParams(max_tokens=64, stop_token_ids=[toks[j]], ignore_eos=True)))
        res["stop_ok"] = s == toks[:j]
    # throughput
    t = time.perf_counter()
    out = list(eng.generate(prompt, SamplingParams(max_tokens=256, ignore_eos=True)))
    res["tok_s_256"] = round(len(out) / (time.perf_counter() - t), 1)
    res["finish_length"] = FinishReason.LENGTH.value
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny", "qwen3-0.6b", "llama-3.2-1b"])
    ap.add_argument("--positions", type=int, default=288)
    ap.add_argument("--root", default="/tmp/ckpt")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()
    results = []
    for preset in args.presets:
        try:
            r = check_preset(preset, Path(args.root), args.positions, not args.no_reference)
        except Exception:
            r = {"preset": preset, "error": traceback.format_exc()}
        print(json.dumps(r, indent=1), flush=True)
        results.append(r)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
