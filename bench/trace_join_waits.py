"""What a join into a running resident launch waits for (issue 9; csrc/NOTES.md "Joins after session 19"), as a
pytest plugin:

    python3 -m pytest -p bench.trace_join_waits -s -m gpu tests/test_monokernel_resident_gpu.py -k sessions
    TRACE_STUCK=1 TRACE_GC=1 python3 -m pytest -p bench.trace_join_waits ...

- Every CuPy module build (an ElementwiseKernel / ReductionKernel / RawModule is built the first time a process
  uses it, per dtype signature and, for elementwise kernels, per collapsed ndim, through
  cupy.cuda.compiler._compile_module_with_cache; loading it waits for a running kernel): one line each with the wall
  time, the duration, the thread, the kernels' names and the innermost call sites in this repository.
- TRACE_STUCK=1: the stack of a join worker thread that stays on one line for 150 ms or more (a blocking call), and
  where every other thread is meanwhile (a GIL holder would show there).
- TRACE_GC=1: every garbage collection of 1 ms or more (a finalizer calling cudaFree / cudaFreeHost would wait for a
  running launch).
"""

from __future__ import annotations

import re
import threading
import time
import traceback
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
_NAMES = re.compile(r"__global__\s+void\s+(\w+)")
_t0: list[float] = []


def _sites() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(ROOT)
              and "trace_join_waits" not in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in reversed(frames[-4:]))


def install() -> None:
    from cupy.cuda import compiler

    inner = compiler._compile_module_with_cache
    if getattr(inner, "_traced", False):
        return

    def traced(source, *args, **kwargs):
        start = time.perf_counter()
        if not _t0:
            _t0.append(start)
        try:
            return inner(source, *args, **kwargs)
        finally:
            names = ",".join(sorted(set(_NAMES.findall(source))))[:160] or "?"
            wall = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1e3) % 1000:03d}"
            print(f"[module-load] {wall} t={start - _t0[0]:9.3f}s took={1e3 * (time.perf_counter() - start):8.1f}ms "
                  f"thread={threading.current_thread().name} kernels={names} at {_sites()}", flush=True)

    traced._traced = True
    compiler._compile_module_with_cache = traced


def watch_stuck(prefixes=("mk-join-prefill",), stuck_s: float = 0.15, every_s: float = 0.01) -> None:
    """A daemon thread that prints the stack of any thread whose name starts with one of `prefixes` and that
    stays on one line (a blocking call: a CUDA call waiting for the running launch) for `stuck_s` or more, once
    per stay, with how long it stayed when it moves on."""
    import sys

    def loop():
        seen: dict[int, tuple] = {}  # thread id -> (line key, first seen, printed)
        while True:
            time.sleep(every_s)
            names = {t.ident: t.name for t in threading.enumerate()}
            frames = sys._current_frames()
            now = time.perf_counter()
            for ident, frame in frames.items():
                name = names.get(ident, "")
                if not name.startswith(prefixes):
                    continue
                key = (frame.f_code.co_filename, frame.f_lineno)
                last = seen.get(ident)
                if last is None or last[0] != key:
                    if last is not None and last[2]:
                        print(f"[stuck] {name} moved on after {1e3 * (now - last[1]):.0f} ms", flush=True)
                    seen[ident] = (key, now, False)
                elif not last[2] and now - last[1] >= stuck_s:
                    stack = "".join(traceback.format_stack(frame)[-8:])
                    wall = time.strftime("%H:%M:%S", time.localtime())
                    print(f"[stuck] {wall} {name} on one line for {1e3 * (now - last[1]):.0f} ms:\n{stack}", flush=True)
                    for other, f in frames.items():  # where every other thread is meanwhile (a GIL holder?)
                        if other != ident and names.get(other) != "stuck-watch":
                            top = " <- ".join(f"{Path(x.filename).name}:{x.lineno}({x.name})"
                                              for x in reversed(traceback.extract_stack(f)[-4:]))
                            print(f"[stuck]   meanwhile {names.get(other, other)}: {top}", flush=True)
                    seen[ident] = (key, last[1], True)

    threading.Thread(target=loop, name="stuck-watch", daemon=True).start()


def watch_gc(min_ms: float = 1.0) -> None:
    """Print each garbage collection that takes min_ms or more: its generation, thread, duration and what it
    collected (a finalizer that calls cudaFree or cudaFreeHost synchronizes with a running launch)."""
    import gc

    started: dict[int, float] = {}

    def cb(phase, info):
        ident = threading.get_ident()
        if phase == "start":
            started[ident] = time.perf_counter()
            return
        t = started.pop(ident, None)
        if t is not None and (ms := 1e3 * (time.perf_counter() - t)) >= min_ms:
            print(f"[gc] {time.strftime('%H:%M:%S')} gen {info['generation']} in {threading.current_thread().name}: "
                  f"{ms:.1f} ms, collected {info['collected']}, uncollectable {info['uncollectable']}", flush=True)

    gc.callbacks.append(cb)


def pytest_configure(config) -> None:  # a pytest plugin (-p bench.trace_join_waits)
    try:
        install()
    except ImportError:
        pass
    import os
    if os.environ.get("TRACE_STUCK") == "1":
        watch_stuck()
    if os.environ.get("TRACE_GC") == "1":
        watch_gc()
