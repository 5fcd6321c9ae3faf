"""Build a CUDA source for the CPU emulator (csrc/emu/cuda_on_cpu.h prepended) into a loaded shared library;
the test is skipped where the emulator cannot run (its fiber switch is x86-64 assembly, built with g++)."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "emu" / "cuda_on_cpu.h"


def build_emulated(directory: Path, name: str, source: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    cxx = shutil.which("g++")
    if cxx is None or platform.machine() != "x86_64":
        pytest.skip("the CUDA CPU emulator needs g++ on x86-64")
    src, so = directory / f"{name}.cpp", directory / f"{name}.so"
    src.write_text(HEADER.read_text() + source)
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-w", *defines, str(src), "-o", str(so)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return ctypes.CDLL(str(so))
