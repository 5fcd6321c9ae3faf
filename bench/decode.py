"""Batch-1 decode benchmark on one GPU: copy-bandwidth roofline, the monokernel, and a peer.

    python bench/decode.py --presets llama-3.2-1b llama-3.1-8b --out $OUT [--no-peer] [--tp 1 2]

In one run: (1) device-to-device copy bandwidth (bytes read + written), the roofline;
(2) per preset, random bf16 weights generated straight in GPU memory (same shapes as the
synthetic checkpoints; the real loader path is covered by bench/monokernel_check.py and the gpu
tests), a 32-token prompt and 512 new greedy tokens, median of >= 5 runs: tokens/s, µs/token,
achieved GB/s, % of roofline; TTFT for 32/512/2000-token prompts; (3) the peer: Hugging Face
transformers with a static cache (its compiled path) on the same shapes. Writes decode.json and
decode.md under --out.

--tp 1 2 [4 8]: each preset at every tensor-parallel size (TP > 1 over GPUs 0..N-1), and for each
TP > 1 also the timing-only build that skips the in-kernel all-reduces (wrong tokens by design):
the difference is the all-reduce cost per token (and per all-reduce: 2 per layer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def copy_bandwidth(cp, nbytes: int = 4 << 30) -> float:
    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    for _ in range(3):
        b[...] = a
    s, e = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(10):
        s.record()
        b[...] = a
        e.record()
        e.synchronize()
        times.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times)


def random_tensors(cp, config, seed: int = 0) -> dict:
    """HF-named bf16 (uint16 bits) tensors on the GPU, scaled like replicas.checkpoint's."""
    from replicas.monokernel_weights import to_bf16_bits
    from replicas.weights import expected_tensors

    rs = cp.random.RandomState(seed)
    out = {}
    for name, shape in expected_tensors(config).items():
        if name.endswith("norm.weight"):
            out[name] = to_bf16_bits(cp, cp.ones(shape, cp.float32))
            continue
        fan_in = shape[-1] if len(shape) == 2 else 1
        scale = 1.0 if "embed" in name else (1.0 / fan_in) ** 0.5
        out[name] = to_bf16_bits(cp, rs.standard_normal(shape, dtype=cp.float32) * scale)
    return out


def time_generation(engine, prompt, n_new: int):
    """(seconds from first token to last, tokens, ttft seconds)."""
    from replicas.engine import SamplingParams

    t0 = time.perf_counter()
    gen = engine.generate(prompt, SamplingParams(max_tokens=n_new, ignore_eos=True))
    first = None
    count = 0
    for _ in gen:
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return end - first, count, first - t0


def bench_monokernel(cp, preset: str, runs: int, n_new: int, ttft_lens: list[int], options=None,
                     tensors=None, tp: int = 1, keep_tokens: int = 0) -> dict:
    """keep_tokens > 0: also record that many greedy tokens (res["tokens"]) to compare builds."""
    from replicas.checkpoint import preset_config
    from replicas.monokernel import MonokernelEngine
    from replicas.monokernel_tp import TpMonokernelEngine

    config = preset_config(preset)
    t = time.perf_counter()
    engine_cls = MonokernelEngine if tp == 1 else TpMonokernelEngine
    engine = engine_cls(config, tensors or random_tensors(cp, config), devices=list(range(tp)), max_context=4096,
                        layout_options=options)
    cp.get_default_memory_pool().free_all_blocks()
    res = {"preset": preset, "tp": tp, "skip_allreduce": bool((options or {}).get("tp_skip_allreduce")),
           "l2_budget_MB": engine.gpu.layout.l2_budget >> 20,
           "evict_first": engine.gpu.layout.evict_first, "control_warp": engine.gpu.layout.control_warp,
           "bar_release": engine.gpu.layout.bar_release, "qkv_flags": engine.gpu.layout.qkv_flags,
           "kv_regs": engine.gpu.layout.kv_regs, "fused_mlp": engine.gpu.layout.fused_mlp,
           "options": {k: v for k, v in (options or {}).items()}, "setup_s": round(time.perf_counter() - t, 1),
           "compile_s": round(engine.gpu.compile_seconds, 2),
           "splits": engine.gpu.layout.splits, "ring": engine.gpu.layout.ring_slots}
    prompt = list(range(100, 132))
    time_generation(engine, prompt, 64)  # warm-up
    if keep_tokens:
        from replicas.engine import SamplingParams

        res["tokens"] = list(engine.generate(prompt, SamplingParams(max_tokens=keep_tokens, ignore_eos=True)))
    rates = []
    for _ in range(runs):
        dt, count, _ = time_generation(engine, prompt, n_new)
        rates.append((count - 1) / dt)
    tok_s = statistics.median(rates)
    lay = engine.gpu.layout
    # all GPUs together (a TP shard's layout describes one GPU; replicated kv heads counted)
    kv_avg = 2 * lay.layers * lay.kv_heads * lay.head_dim * 2 * (len(prompt) + n_new / 2) * tp
    bytes_per_token = lay.stream_bytes_per_token() * tp + kv_avg
    res.update(tok_s=round(tok_s, 1), us_per_token=round(1e6 / tok_s, 1), runs=[round(r, 1) for r in rates],
               bytes_per_token=bytes_per_token, achieved_GBps=round(bytes_per_token * tok_s / 1e9, 1))
    ttft = {}
    for n in ttft_lens:
        p = [(7 * i) % config.vocab_size for i in range(n)]
        vals = [time_generation(engine, p, 2)[2] for _ in range(3)]
        ttft[n] = round(1e3 * statistics.median(vals), 2)
    res["ttft_ms"] = ttft
    # phase timing from inside the kernel (block 0's view, barrier to barrier)
    engine.profile = cp.zeros(13, cp.uint64)
    time_generation(engine, prompt, n_new)
    prof = cp.asnumpy(engine.profile).astype(float)
    steps = max(prof[6], 1)
    names = ["lm_head+sample", "qkv", "attention", "o_proj", "gate_up", "down"]
    per = {nm: prof[i] / steps / 1e3 / (1 if i == 0 else lay.layers) for i, nm in enumerate(names)}
    res["phase_us"] = {k: round(v, 2) for k, v in per.items()}  # per step (LM) or per layer-step
    res["phase_wait_us"] = {nm: round(prof[7 + i] / steps / 1e3 / (1 if i == 0 else lay.layers), 2)
                            for i, nm in enumerate(names)}  # block 0's barrier wait inside each phase
    res["phase_us_total_per_token"] = round(float(prof[:6].sum()) / steps / 1e3, 1)
    engine.profile = None
    del engine
    cp.get_default_memory_pool().free_all_blocks()
    return res


def bench_peer(preset: str, n_new: int, runs: int) -> dict:
    """HF transformers, random bf16 weights, static KV cache (compiled decode), same prompt."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from replicas.presets import PRESETS

    cfg = AutoConfig.for_model(**{k: v for k, v in PRESETS[preset].items() if k != "architectures"})
    cfg.architectures = PRESETS[preset]["architectures"]
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        except TypeError:  # transformers 4.x spelling
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
    ids = torch.arange(100, 132, device="cuda")[None]
    t0 = time.perf_counter()
    kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, cache_implementation="static")
    rates = []
    with torch.no_grad():
        model.generate(ids, **kw)  # warm-up: the static cache and the compiled decode step
        warm_s = time.perf_counter() - t0
        for _ in range(runs):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(ids, **kw)
            torch.cuda.synchronize()
            rates.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - t))
    del model
    torch.cuda.empty_cache()
    return {"preset": preset, "peer": "transformers static cache", "tok_s": round(statistics.median(rates), 1),
            "runs": [round(r, 1) for r in rates], "warmup_s": round(warm_s, 1)}


def bench_tp(cp, preset: str, args, bw: float, results: dict) -> None:
    """One preset at every --tp size (same random weights), plus the skip-all-reduce builds."""
    from replicas.checkpoint import preset_config

    config = preset_config(preset)
    tensors = random_tensors(cp, config)  # on GPU 0; TP engines copy each shard to its GPU
    first = preset == args.presets[0]
    for tp in args.tp:
        for skip in ((False, True) if tp > 1 else (False,)):
            opts = {"tp_skip_allreduce": True} if skip else None
            r = bench_monokernel(cp, preset, args.runs, args.new_tokens, args.ttft if first and not skip else [],
                                 options=opts, tensors=tensors, tp=tp)
            r["roofline_tok_s"] = round(tp * bw / r["bytes_per_token"], 1)  # N GPUs' bandwidth
            r["pct_roofline"] = round(100 * r["tok_s"] / r["roofline_tok_s"], 1)
            if skip:
                full = next(x for x in results["monokernel"]
                            if x["preset"] == preset and x["tp"] == tp and not x["skip_allreduce"])
                per_token = 1e6 / full["tok_s"] - 1e6 / r["tok_s"]
                r["allreduce_us_per_token"] = round(per_token, 1)
                r["allreduce_us_each"] = round(per_token / (2 * config.num_hidden_layers), 2)
                full["allreduce_us_per_token"], full["allreduce_us_each"] = (r["allreduce_us_per_token"],
                                                                             r["allreduce_us_each"])
            print(json.dumps(r), flush=True)
            results["monokernel"].append(r)
    del tensors
    cp.get_default_memory_pool().free_all_blocks()


def same_prefix(a: list, b: list) -> int:
    """Steps before the first token that differs (greedy decoding diverges for good after one)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _layout_defaults() -> dict:
    import inspect

    from replicas.layout import KernelLayout

    params = inspect.signature(KernelLayout.from_config).parameters
    return {n: v.default for n, v in params.items() if isinstance(v.default, (bool, int))} | {"l2_budget_mb": 0}


_AB_KNOWN = _layout_defaults()


def ab_options(name: str) -> dict:
    """'x_perm=0+l2_budget_mb=24' -> {'x_perm': False, 'l2_budget': 24 << 20}: '+' joins options, NAME
    alone turns a boolean on, NAME=N sets an integer (or 0/1 a boolean); l2_budget_mb is in MiB.
    Each build is the engine's default (replicas/layout_tuned.py) with these on top."""
    opts: dict = {}
    for part in name.split("+"):
        key, eq, val = part.partition("=")
        if not eq:
            opts[key] = True
        elif key == "l2_budget_mb":
            opts["l2_budget"] = int(val) << 20
        elif isinstance(_AB_KNOWN.get(key), bool):
            opts[key] = bool(int(val))
        else:
            opts[key] = int(val)
    return opts


def bench_ab(cp, args, bw: float, results: dict) -> None:
    """Default build vs each --ab layout option on every preset, same random weights, alternating
    A B A B so drift hits both; writes ab.md. tok/s is the median over both rounds' runs."""
    from replicas.checkpoint import preset_config

    lines = ["| model | layout | tok/s | µs/token | % roofline | Δ vs default | per-layer µs (qkv/attn/o/gu/dn) | "
             "greedy steps equal to default's |", "|---|---|---|---|---|---|---|---|"]
    for preset in args.presets:
        tensors = random_tensors(cp, preset_config(preset))
        builds = [("default", None)] + [(name, ab_options(name)) for name in args.ab]
        got: dict[str, list] = {name: [] for name, _ in builds}
        for _ in range(2):
            for name, opts in builds:
                try:
                    r = bench_monokernel(cp, preset, args.runs, args.new_tokens, [], options=opts, tensors=tensors,
                                         keep_tokens=128)
                except Exception as e:  # a broken variant must not hide the default's figures
                    print(json.dumps({"preset": preset, "layout": name, "error": repr(e)[:500]}), flush=True)
                    continue
                r["layout"] = name
                print(json.dumps(r), flush=True)
                results.setdefault("ab", []).append(r)
                got[name].append(r)
        base = None
        ref_tokens = got["default"][0]["tokens"] if got["default"] else []
        for name, _ in builds:
            rs = got[name]
            if not rs:
                lines.append(f"| {preset} | {name} | failed (see ab.log) | | | | | |")
                continue
            tok_s = statistics.median([x for r in rs for x in r["runs"]])
            base = base or tok_s
            ph = rs[-1]["phase_us"]
            per_layer = "/".join(f"{ph[k]:.1f}" for k in ("qkv", "attention", "o_proj", "gate_up", "down"))
            lines.append(f"| {preset} | {name} | {tok_s:.1f} | {1e6 / tok_s:.1f} | "
                         f"{100 * tok_s * rs[0]['bytes_per_token'] / bw:.1f} | {100 * (tok_s / base - 1):+.1f}% | {per_layer} | "
                         f"{same_prefix(ref_tokens, rs[0]['tokens'])}/{len(ref_tokens)} |")
        del tensors
        cp.get_default_memory_pool().free_all_blocks()
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ab.md").write_text(f"copy bandwidth {bw / 1e12:.2f} TB/s; 'default' = the engine's default "
                                              "layout (replicas/layout_tuned.py), each variant = default + its options\n\n"
                                              + table + "\n")
        (Path(args.out) / "ab.json").write_text(json.dumps(results.get("ab", []), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--ttft", type=int, nargs="*", default=[32, 512, 2000])
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="extra layouts to time on the first preset, for tuning: L2MB:EVICT:CTRLWARP:BARRELEASE:QKVFLAGS:KVREGS e.g. 0:1:0:0:0:0")
    ap.add_argument("--tp", type=int, nargs="+", default=[1],
                    help="tensor-parallel sizes to time per preset, e.g. --tp 1 2 (adds skip-all-reduce builds)")
    ap.add_argument("--ab", nargs="+", default=[],
                    help="A/B only: boolean layout options to time against the default build on every preset, "
                         "e.g. --ab fused_mlp fused_mlp+fused_attn_o+l2_at_attn+l2_budget_mb=24 ('+' combines options, NAME=N sets an integer one; writes ab.md/ab.json under --out; skips the main table and peers)")
    ap.add_argument("--layout", default="",
                    help="layout options of the monokernel rows of the main table (--ab syntax, e.g. sm_shares), on "
                         "top of the engine default; recorded in decode.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.ab or args.layout:
        bad = []
        for name in args.ab + ([args.layout] if args.layout else []):
            for part in name.split("+"):
                key, eq, val = part.partition("=")
                if key not in _AB_KNOWN:
                    bad.append(part)
                elif isinstance(_AB_KNOWN[key], bool):
                    if eq and val not in ("0", "1"):
                        bad.append(part)
                elif not (eq and val.isdigit()):
                    bad.append(part)
        if bad:
            ap.error(f"--ab {' '.join(bad)}: not a layout option (boolean NAME or NAME=0/1, integer NAME=N); "
                     f"choose from {', '.join(sorted(_AB_KNOWN))}")
    import cupy as cp

    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    bw = copy_bandwidth(cp)
    print(f"GPU {gpu}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"gpu": gpu, "copy_TBps": round(bw / 1e12, 3), "monokernel": [], "peer": []}
    if args.ab:
        bench_ab(cp, args, bw, results)
        return
    if args.variants:
        from replicas.checkpoint import preset_config

        tensors = random_tensors(cp, preset_config(args.presets[0]))
        for spec in args.variants:
            mb, ev, cw, rel, qf, kr = spec.split(":")
            opts = {"l2_budget": int(mb) << 20, "evict_first": bool(int(ev)), "control_warp": bool(int(cw)),
                    "bar_release": bool(int(rel)), "qkv_flags": bool(int(qf)), "kv_regs": bool(int(kr))}
            v = bench_monokernel(cp, args.presets[0], 3, args.new_tokens, [], options=opts, tensors=tensors)
            keys = ("preset", "l2_budget_MB", "evict_first", "control_warp", "bar_release", "qkv_flags", "kv_regs", "splits", "tok_s",
                    "phase_us", "phase_wait_us")
            print("variant", json.dumps({k: v[k] for k in keys}), flush=True)
            results.setdefault("variants", []).append(v)
        del tensors
    for preset in args.presets:
        if args.tp == [1]:
            r = bench_monokernel(cp, preset, args.runs, args.new_tokens, args.ttft if preset == args.presets[0] else [],
                                 options=ab_options(args.layout) if args.layout else None)
            r["roofline_tok_s"] = round(bw / r["bytes_per_token"], 1)
            r["pct_roofline"] = round(100 * r["tok_s"] / r["roofline_tok_s"], 1)
            print(json.dumps(r), flush=True)
            results["monokernel"].append(r)
        else:
            bench_tp(cp, preset, args, bw, results)
    if args.out:  # save our figures before the (slow, compiling) peer runs
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode.json").write_text(json.dumps(results, indent=1))
    if not args.no_peer:
        for preset in args.presets:
            try:
                p = bench_peer(preset, args.new_tokens, max(2, args.runs // 2))
            except Exception as e:  # the peer is informative; its failure must not hide our numbers
                p = {"preset": preset, "error": repr(e)[:300]}
            print(json.dumps(p), flush=True)
            results["peer"].append(p)
    lines = [f"GPU: {gpu}; copy bandwidth {bw / 1e12:.2f} TB/s (read+write)", "",
             ("| model | TP | monokernel tok/s | µs/token | achieved GB/s | % roofline | roofline tok/s | "
              "all-reduce µs/token (each) | peer tok/s |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["monokernel"]:
        peer = next((p.get("tok_s", "error") for p in results["peer"] if p["preset"] == r["preset"]), "-")
        tp = f"{r['tp']}" + (" (no all-reduce)" if r["skip_allreduce"] else "")
        ar = f"{r['allreduce_us_per_token']} ({r['allreduce_us_each']})" if "allreduce_us_each" in r else "-"
        lines.append(f"| {r['preset']} | {tp} | {r['tok_s']} | {r['us_per_token']} | {r['achieved_GBps']} | "
                     f"{r['pct_roofline']} | {r['roofline_tok_s']} | {ar} | {peer} |")
    if results["monokernel"] and results["monokernel"][0].get("ttft_ms"):
        lines.append("")
        lines.append("TTFT (ms, prefill + first token) on " + results["monokernel"][0]["preset"] + ": " +
                     ", ".join(f"{k} tokens: {v}" for k, v in results["monokernel"][0]["ttft_ms"].items()))
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode.json").write_text(json.dumps(results, indent=1))
        (out / "decode.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
