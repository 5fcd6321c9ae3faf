"""The CPU emulator's scheduler (csrc/emu/cuda_on_cpu.h): fibers waiting at a barrier are passed over until its
round moves, and a launch whose every remaining fiber waits at a barrier no one can reach ends as a deadlock (rc 1)
at once instead of spinning to its switch limit."""

from __future__ import annotations

import ctypes
import time

import numpy as np

from tests.emu_cpp import build_emulated

SOURCE = r"""
struct Args { int* out; int leave; };
static void body(const void* p) {
  const Args* a = static_cast<const Args*>(p);
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (a->leave && threadIdx.x == 5) return;  // leaves before the barrier: its block's others wait forever
  for (int r = 0; r < 3; r++) {              // three rounds: every thread sees the others' writes of the last one
    a->out[i] += 1;
    __syncthreads();
  }
  __syncthreads();
  int sum = 0;
  for (int t = 0; t < (int)blockDim.x; t++) sum += a->out[blockIdx.x * blockDim.x + t];
  __syncthreads();
  a->out[i] = sum;
}
extern "C" int launch(int* out, int leave, unsigned long long max_switches) {
  Args a{out, leave};
  return mk_emu::run(body, &a, 2, 64, 0, 64 << 10, max_switches);
}
"""


def test_barriers_release_every_round_and_an_unreachable_barrier_is_a_deadlock(tmp_path):
    lib = build_emulated(tmp_path, "sched", SOURCE)
    lib.launch.restype = ctypes.c_int
    lib.launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong]
    out = np.zeros(128, np.int32)
    assert lib.launch(out.ctypes.data, 0, 10**9) == 0
    assert (out == 3 * 64).all()  # every thread of a block counted 3 rounds of all 64 threads
    out[:] = 0
    t0 = time.monotonic()
    assert lib.launch(out.ctypes.data, 1, 10**12) == 1  # (a switch limit it would take hours to reach)
    assert time.monotonic() - t0 < 5


DEEP_SOURCE = r"""
static void deep(const void* p) {
  const int bytes = *static_cast<const int*>(p);
  if (threadIdx.x != 1) return;  // thread 0 has finished before thread 1 starts (no barrier): its stack is dead
  volatile unsigned char buf[16384];
  for (int i = 0; i < bytes; i++) buf[sizeof buf - 1 - i] = 1;  // from its top down, as the stack grows
}
extern "C" int launch(int bytes, unsigned long long stack_bytes) {
  return mk_emu::run(deep, &bytes, 1, 2, 0, stack_bytes, 1000);
}
"""


def test_a_thread_that_outgrows_its_stack_fails_the_launch_and_a_bad_stack_size_is_refused(tmp_path):
    lib = build_emulated(tmp_path, "deep", DEEP_SOURCE)
    lib.launch.restype = ctypes.c_int
    lib.launch.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
    assert lib.launch(4096, 16384) == 0  # 4 KB of locals in a 16 KB stack
    assert lib.launch(12288, 8192) == 3  # 12 KB in 8 KB: over its bottom, the canary there is gone
    assert lib.launch(16, 8192 + 8) == 4 and lib.launch(16, 2048) == 4  # not a multiple of 64, or too small
