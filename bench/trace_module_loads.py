"""Which CuPy modules a process compiles or loads, when, from which thread and call site, and how long each took
(issue 9: a join whose prefill needs a module loaded for the first time waits for the running resident launch).

    python3 -m pytest -p bench.trace_module_loads -s -m gpu tests/test_monokernel_resident_gpu.py -k sessions

CuPy builds an ElementwiseKernel / ReductionKernel / RawModule the first time a process uses it (per dtype
signature and, for elementwise kernels, per collapsed ndim), through cupy.cuda.compiler._compile_module_with_cache;
loading the result into the context waits for a running kernel. This wraps that function (CuPy looks it up as a
module attribute at each call) and prints one line per call: seconds since the first call, the call's duration,
the thread, the kernels' names in the source, and the innermost call sites in this repository.
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
              and "trace_module_loads" not in f.filename]
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


def pytest_configure(config) -> None:  # a pytest plugin (-p bench.trace_module_loads)
    try:
        install()
    except ImportError:
        pass
