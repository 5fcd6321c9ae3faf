"""The tensor-parallel monokernel emulated on ONE GPU: for each N, the TP=N engine's N ranks run
side by side on GPU 0 (grids of SMs // N blocks, replicas/monokernel_tp.py) against the TP=1
engine on the whole GPU: teacher-forced logits (prefill part and kernel part), greedy tokens,
seeded top-k/top-p and Gumbel samples, a cancel and a generation after it. Checks the exchange
protocol and the numerics, not speed.

    timeout 120 python bench/tp_emulate.py --tp 2 4 8 --preset tiny [--out DIR]

One JSON line per check on stdout (flushed; with --out also into DIR/tp_emulate.jsonl), each with
"tp" and "ok". Every N runs in its own worker process under its own time limit (--timeout), so a
hang (an exchange-protocol bug spins forever) is reported as {"tp": N, "check": <the check that
did not finish>, "hung": true} and the other Ns still run; an N the model's heads do not allow is
a "skip" line. The last line is the summary; the exit status is 0 only when every N passed.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHECKS = ("load", "teacher_logits", "greedy", "topkp", "gumbel", "cancel")
TOL = 1e-2  # max |Δ| / max |ref| vs TP=1, as tests/test_tp_gpu.py (fp32 summation order only: expect ~1e-4)
POSITIONS = 64  # teacher-forced: the first TEACHER_PREFILL through the prefill, the rest through the kernel
GREEDY_STEPS = 64
SAMPLED_STEPS = 32


class Emitter:
    """JSON lines to stdout and (optionally) a file, flushed at once."""

    def __init__(self, out_dir: str | None):
        self.file = None
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(out_dir) / "tp_emulate.jsonl", "a")  # noqa: SIM115 - closed at exit

    def __call__(self, rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


# ---- one N, in the worker process ---------------------------------------------------------------
def worker(args) -> int:
    from replicas.engine import FinishReason, SamplingParams
    from replicas.monokernel import TEACHER_PREFILL, MonokernelEngine
    from tp_smoke import cancel_after  # bench/ (this script's folder) is on sys.path

    n = args.worker
    emit = Emitter(None)

    def report(check: str, ok: bool, **kw) -> bool:
        emit({"tp": n, "preset": args.preset, "check": check, "ok": bool(ok), **kw})
        return bool(ok)

    t = time.perf_counter()
    one = MonokernelEngine.from_pretrained(args.ckpt, devices=[0], max_context=args.max_context, progress=False)
    many = MonokernelEngine.from_pretrained(args.ckpt, devices=[0] * n, max_context=args.max_context,
                                            progress=False, emulate_on_one_gpu=True)
    cp = many.gpu.cp
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    ok = report("load", True, s=round(time.perf_counter() - t, 1), compile_s=round(many.gpu.compile_seconds, 1),
                gpu=name, sms=int(props["multiProcessorCount"]), grid_per_rank=many.gpu.layout.num_sms,
                tp_build=many.gpu.layout.tp)

    ids = np.random.default_rng(1).integers(0, one.config.vocab_size, POSITIONS).tolist()
    a, b = one.forward_logits(ids), many.forward_logits(ids)
    scale = float(np.abs(a).max())
    p = TEACHER_PREFILL
    rel_prefill = float(np.abs(a[:p] - b[:p]).max() / scale)
    rel_kernel = float(np.abs(a[p:] - b[p:]).max() / scale)
    good = a.shape == b.shape and bool(np.isfinite(b).all()) and max(rel_prefill, rel_kernel) <= TOL
    ok &= report("teacher_logits", good, rel_prefill=rel_prefill, rel_kernel=rel_kernel, tol=TOL, positions=POSITIONS)

    prompt = [3, 4, 5]
    params = SamplingParams(max_tokens=GREEDY_STEPS, ignore_eos=True)
    x, y = list(one.generate(prompt, params)), list(many.generate(prompt, params))
    info: dict = {}
    good = x == y
    if not good and len(x) == len(y):  # allowed only after a near-tie of the top-2 logits (fp32 order)
        first = next(i for i, (u, v) in enumerate(zip(x, y)) if u != v)
        row = one.forward_logits(prompt + x[:first + 1])[len(prompt) + first - 1]
        top2 = np.sort(row)[-2:]
        margin = float((top2[1] - top2[0]) / np.abs(row).max())
        info = {"first_diff": first, "margin": margin}
        good = margin <= TOL
    ok &= report("greedy", good, equal=x == y, n=len(y), tp1=x[:12], tpN=y[:12], **info)

    for check, kw in [("topkp", {"temperature": 0.9, "top_k": 40, "top_p": 0.9}), ("gumbel", {"temperature": 1.3})]:
        sp = SamplingParams(max_tokens=SAMPLED_STEPS, ignore_eos=True, seed=7, **kw)
        x, y = list(one.generate(prompt, sp)), list(many.generate(prompt, sp))
        ok &= report(check, x == y and len(y) == SAMPLED_STEPS, equal=x == y, n=len(y), tp1=x[:12], tpN=y[:12])

    got, gen = cancel_after(many, 3)
    after_params = SamplingParams(max_tokens=8, ignore_eos=True)
    after, ref = list(many.generate([1], after_params)), list(one.generate([1], after_params))
    ok &= report("cancel", len(got) == 3 and gen.finish_reason is FinishReason.CANCELLED and after == ref,
                 tokens=len(got), reason=str(gen.finish_reason), after=after, after_tp1=ref)
    return 0 if ok else 1


# ---- the driver: one worker per N, each under its own limit ---------------------------------------
class Interrupted(Exception):
    """SIGTERM (an outer `timeout`): report where we were before dying."""


def _raise_interrupted(*_):
    raise Interrupted


def run_one(args, n: int, ckpt: Path, emit: Emitter) -> str:
    """Run worker N; returns "ok", "failed", "hung in <check>" or "error in <check>"."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(n), "--ckpt", str(ckpt),
           "--preset", args.preset, "--max-context", str(args.max_context)]
    # 8 ranks + the TP=1 engine's stream exceed CUDA's default 8 hardware queues: two ranks sharing
    # one would serialize their kernels (a hang), so give every stream its own
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "32")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:  # the worker's lines, then None at its end (the main thread waits with a deadline)
        for x in proc.stdout:
            lines.put(x)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    failed = False
    t0 = time.monotonic()
    deadline = t0 + args.timeout

    def pending() -> str:
        return next((c for c in CHECKS if c not in seen), "exit")

    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                emit({"tp": n, "preset": args.preset, "check": pending(), "ok": False, "hung": True,
                      "after_s": round(time.monotonic() - t0, 1), "limit_s": args.timeout})
                return f"hung in {pending()}"
            if line is None:
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                print(line, end="", file=sys.stderr)  # stray output of the worker
                continue
            seen.append(rec.get("check", ""))
            failed |= not rec.get("ok", False)
            emit(rec)
    except Interrupted:
        emit({"tp": n, "preset": args.preset, "check": pending(), "ok": False, "hung": True,
              "interrupted": "SIGTERM", "after_s": round(time.monotonic() - t0, 1)})
        raise
    finally:
        if proc.poll() is None:
            proc.kill()  # its CUDA context dies with it, and with it any spinning kernels
        proc.wait()
    if proc.returncode not in (0, 1) or pending() != "exit":  # crashed (traceback on stderr)
        emit({"tp": n, "preset": args.preset, "check": pending(), "ok": False,
              "error": f"worker exit {proc.returncode}"})
        return f"error in {pending()}"
    return "failed" if failed else "ok"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4], choices=(2, 4, 8),
                    help="rank counts to emulate (each where the model's heads allow it)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--out", help="directory for tp_emulate.jsonl")
    ap.add_argument("--timeout", type=float, default=0.0,
                    help="seconds per N before it counts as hung (default 50 for tiny, 240 otherwise)")
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from replicas.checkpoint import make_checkpoint, preset_config
    from replicas.tp_shard import TensorParallelError, check_tp

    signal.signal(signal.SIGTERM, _raise_interrupted)
    args.timeout = args.timeout or (50.0 if args.preset == "tiny" else 240.0)
    emit = Emitter(args.out)
    config = preset_config(args.preset)
    t = time.perf_counter()
    ckpt = make_checkpoint(args.preset, Path(tempfile.mkdtemp()) / args.preset, seed=0, progress=False)
    emit({"check": "checkpoint", "preset": args.preset, "s": round(time.perf_counter() - t, 1), "tp": args.tp})
    results: dict[str, str] = {}
    try:
        for n in args.tp:
            try:
                check_tp(config, n)
            except TensorParallelError as e:
                emit({"tp": n, "preset": args.preset, "check": "skip", "ok": True, "reason": str(e)})
                results[str(n)] = "skipped"
                continue
            results[str(n)] = "interrupted (SIGTERM)"  # until run_one returns
            results[str(n)] = run_one(args, n, ckpt, emit)
    except Interrupted:
        pass
    ok = all(v in ("ok", "skipped") for v in results.values())
    emit({"check": "summary", "preset": args.preset, "ok": ok, "results": results})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
