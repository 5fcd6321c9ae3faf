"""The monokernel's CUDA source run on the CPU (tests only): csrc/emu/cuda_on_cpu.h emulates the CUDA
built-ins it uses, g++ builds the assembled kernel with -DMK_EMU and the layout's -D flags, and
`EmuModel` fills the same buffers and parameter block as `GpuModel.launch` with numpy arrays.

    m = EmuModel(config, tensors, layout_options={"mma": True})
    logits = m.forward_logits(ids)          # [len, V]: prefill (numpy) for 16 positions, the kernel after

Every thread of the grid is a fiber on one OS thread, so keep models tiny and grids small (num_sms=4:
4 blocks of 512 threads). It checks what the kernel computes, its phases, indices, barriers and
hand-offs between blocks; not its speed, its memory ordering or its timing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from replicas import layout as L
from replicas.layout import KernelLayout
from replicas.layout_tuned import engine_options
from replicas.model import ModelConfig
from replicas.monokernel_build import CSRC, kernel_source
from replicas.monokernel_gpu import buffer_ptr, inv_temperature, kernel_buffers, param_block, single_ptrs
from replicas.monokernel_weights import pack_weights, rope_tables

PRELUDE = CSRC / "emu" / "cuda_on_cpu.h"
SHARED_DECL = "extern __shared__ __align__(16) unsigned char smem[];"
ENTRY = """
extern "C" int mk_emu_launch(const void* params, unsigned blocks, unsigned threads, unsigned long long smem,
                             unsigned long long stack, unsigned long long max_switches) {
  return mk_emu::run([](const void* p) { monokernel(static_cast<const MkParams*>(p)); }, params, blocks, threads,
                     smem, stack, max_switches);
}
"""
# Each fiber's stack: the deepest of 61 launches of the suite's emulated layouts used 1.3 KB (session 21); the
# kernel's big arrays live in shared memory; the whole suite runs in 32 KB. A launch that outgrows it fails with
# rc 3 (a canary at each stack's bottom).
# On huge pages the whole 32 KB x threads is resident: 64 MB for 4 blocks of 512 threads.
STACK_BYTES = 32 << 10
CACHE = Path(os.environ.get("MK_EMU_CACHE", Path(tempfile.gettempdir()) / "monoserve-emu"))


class EmuUnavailable(RuntimeError):
    """No C++ compiler for the CPU emulation (g++)."""


def emu_source() -> str:
    src = kernel_source()
    if SHARED_DECL not in src:
        raise RuntimeError(f"csrc/monokernel.cu no longer declares `{SHARED_DECL}`: update monokernel_emu.py")
    return PRELUDE.read_text() + src.replace(SHARED_DECL, "unsigned char* smem = mk_emu::block_smem();") + ENTRY


def build(layout: KernelLayout) -> ctypes.CDLL:
    """Compile (or reuse from CACHE) the emulated kernel of `layout`."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None or platform.machine() not in ("x86_64", "AMD64"):
        raise EmuUnavailable("the monokernel CPU emulation needs g++ (or $CXX) on x86-64 (its fiber switch is "
                             f"x86-64 assembly); this is {platform.machine()}")
    src = emu_source()
    cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-DMK_EMU", *layout.compile_flags()]
    key = hashlib.sha256((src + "\0".join(cmd)).encode()).hexdigest()[:20]
    lib = CACHE / f"mk_emu_{key}.so"
    if not lib.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as d:
            cu = Path(d) / "mk_emu.cpp"
            cu.write_text(src)
            tmp = Path(d) / "mk_emu.so"
            r = subprocess.run([*cmd, "-x", "c++", str(cu), "-o", str(tmp)], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"building the emulated monokernel failed:\n{r.stderr[-4000:]}")
            shutil.move(str(tmp), lib)
    so = ctypes.CDLL(str(lib))
    so.mk_emu_launch.restype = ctypes.c_int
    so.mk_emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_ulonglong,
                                 ctypes.c_ulonglong, ctypes.c_ulonglong]
    return so


def teacher_forced(prefill, decode, ids: Sequence[int], prefill_len: int) -> np.ndarray:
    """[len, V] logits of `ids`: prefill(ids[:p], all_logits=True) -> (x_last, head) for the first p positions, then
    decode(x_last, p, steps, forced) -> [steps, V] from the kernel (its row 0 repeats the prefill's last)."""
    p = max(1, min(prefill_len, len(ids)))
    x_last, head = prefill(ids[:p], all_logits=True)
    rows = [head]
    if len(ids) > p:
        rows.append(decode(x_last, p, len(ids) - p + 1, list(ids[p:]))[1:])
    return np.concatenate(rows).astype(np.float32, copy=False)


class EmuModel:
    """GpuModel's buffers and single-sequence launch, in host memory, run by the emulated kernel."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], max_context: int = 256,
                 layout_options: dict | None = None, num_sms: int = 4):
        c = self.config = config
        self.max_context = int(max_context)
        lay = self.layout = KernelLayout.from_config(config, self.max_context, num_sms=num_sms,
                                                     **engine_options(config, layout_options))
        self.lib = build(lay)
        self.weights = pack_weights(np, lay, c, tensors)
        self.rope_cos, self.rope_sin = rope_tables(c, self.max_context)
        self.__dict__.update(kernel_buffers(np, lay, c, self.max_context))
        self.host_tokens = np.zeros(self.max_context, np.int32)
        self.host_ctrl = np.zeros(L.CTRL_WORDS, np.int32)
        self.tp_params: dict[str, int] = {}  # tp_local, tp_peers, tp_rank (set by monokernel_emu_tp.EmuTpGroup)

    def launch(self, x_last: np.ndarray, start_pos: int, max_steps: int, *, max_switches: int = 10**10,
               **kw) -> None:
        """GpuModel.launch, run to completion (tokens in host_tokens, status in host_ctrl)."""
        self._run(self.lib, self.layout, self.launch_params(x_last, start_pos, max_steps, **kw), max_switches)

    def launch_params(self, x_last: np.ndarray, start_pos: int, max_steps: int, *, mode: int = L.MODE_GREEDY,
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                      stop_ids: Sequence[int] = (), forced: Sequence[int] | None = None,
                      logits: np.ndarray | None = None) -> np.ndarray:
        """GpuModel.launch's buffer resets and parameter block (the launch itself is `_run`'s)."""
        lay, w = self.layout, self.work
        w["xbuf"][:] = 0
        w["xbuf"][:self.config.hidden_size] = x_last
        w["dn_part"][:] = 0
        for a in (self.attn_cnt, self.qkv_done, self.control, self.host_ctrl, self.stop_ids):
            a[:] = 0
        self.stop_ids[:len(stop_ids)] = list(stop_ids)
        if forced is not None:
            self.forced[:len(forced)] = list(forced)
        ptrs = single_ptrs(self, logits)  # GpuModel.launch's, over these numpy buffers
        scalars = {
            "start_pos": start_pos, "max_steps": max_steps, "n_stop": len(stop_ids),
            "teacher": int(forced is not None), "mode": mode, "top_k": top_k, "seed": seed,
            "inv_temperature": inv_temperature(temperature), "top_p": top_p,
            "logits_per_step": self.config.vocab_size if logits is not None else 0, "step0": 0,
            **self.tp_params,
        }
        return param_block(lay.param_fields(), ptrs, scalars)

    def forward_logits_slots(self, seqs: Sequence[Sequence[int]], prefill_len: int = 16) -> list[np.ndarray]:
        """A batch build (layout option batch = B): teacher-forced logits of up to B sequences decoded in one
        launch, as BatchedMonokernelEngine.forward_logits_slots (slot b <- seqs[b]). [len_b, V] each."""
        from replicas.monokernel_batch import SlotSpec, batch_scalars, fresh_slot, slot_row, slots_ptrs
        from replicas.monokernel_prefill import Prefill

        lay, c, b_n, ctx = self.layout, self.config, self.layout.batch, self.max_context
        if b_n < 2 or not 1 <= len(seqs) <= b_n:
            raise ValueError(f"{len(seqs)} sequences for a build of batch={b_n} (needs a batch layout)")
        z = lambda n, t=np.int32: np.zeros(n, t)
        kv = (b_n, c.num_hidden_layers, c.num_key_value_heads, ctx, c.head_dim)
        m = SimpleNamespace(  # BatchGpuModel's buffers, by its names (slots_ptrs reads them)
            weights=self.weights, rope_cos=self.rope_cos, rope_sin=self.rope_sin,
            k_cache=np.zeros(kv, np.uint16), v_cache=np.zeros(kv, np.uint16),  # [B][L][kv_heads][ctx][D]
            attn_cnt=z(c.num_key_value_heads, np.uint32), qkv_done=z(c.num_key_value_heads, np.uint32),
            best_idx=z(b_n * lay.total_warps), logits1=None, control=z(4, np.uint32), cancel=z(b_n + 3),
            shared_token=z(b_n), tokens=z(b_n * ctx), forced=z(b_n * ctx), stop_ids=z(b_n * L.MAX_STOP_IDS),
            host_tokens=z(b_n * ctx), host_ctrl=z(b_n * L.CTRL_WORDS), host_kctl=z(L.KCTL_WORDS), kctl=z(4),
            slot_table=np.zeros((b_n, len(L.SLOT_FIELDS)), np.uint64), admit_x=z(b_n * lay.hp, np.float32))
        work = {k: np.zeros(n, np.float32) for k, n in lay.buffer_sizes().items()}
        p = min(prefill_len, *(len(q) for q in seqs))
        heads = []
        for b, q in enumerate(seqs):
            view = SimpleNamespace(config=c, weights=self.weights, rope_cos=self.rope_cos, rope_sin=self.rope_sin,
                                   k_cache=m.k_cache[b], v_cache=m.v_cache[b])  # the prefill writes slot b's cache
            x_last, head = Prefill(view, np).run(list(q[:p]), all_logits=True)
            heads.append(head)
            fresh_slot(np, lay, work, b_n, b, x_last, 0, c.hidden_size)  # (fx_turn0 0: batch_scalars below)
            m.forced[b * ctx:b * ctx + len(q) - p] = q[p:]
            m.slot_table[b] = slot_row(SlotSpec(start_pos=p, max_steps=len(q) - p + 1))
        logits = np.zeros((max(len(q) for q in seqs) - p + 1, b_n, c.vocab_size), np.float32)
        self._run(self.lib, lay, param_block(lay.param_fields(), slots_ptrs(m, work, logits),
                                             batch_scalars(True, b_n * c.vocab_size, 0)))
        return [np.concatenate([h, logits[1:len(q) - p + 1, b]]) for b, (h, q) in enumerate(zip(heads, seqs))]

    @staticmethod
    def _run(lib, lay: KernelLayout, params: np.ndarray, max_switches: int = 10**10) -> None:
        rc = lib.mk_emu_launch(buffer_ptr(params), lay.num_sms, lay.threads, lay.smem_bytes, STACK_BYTES, max_switches)
        if rc == 2:
            raise RuntimeError("the emulated kernel trapped (__trap: on a GPU, a launch failure)")
        if rc == 3:
            raise RuntimeError(f"a thread of the emulated kernel outgrew its {STACK_BYTES} byte stack: raise "
                               "replicas.monokernel_emu.STACK_BYTES")
        if rc == 4:
            raise MemoryError(f"could not map {lay.num_sms * lay.threads} fiber stacks of {STACK_BYTES} bytes "
                              "for the emulated kernel")
        if rc:
            raise RuntimeError("the emulated kernel did not finish (a deadlock, or more than max_switches)")

    def prefill(self, ids: Sequence[int], all_logits: bool = False):
        from replicas.monokernel_prefill import Prefill
        return Prefill(self, np).run(list(ids), all_logits=all_logits)

    def forward_logits(self, ids: Sequence[int], prefill_len: int = 16) -> np.ndarray:
        """MonokernelEngine.forward_logits: [len, V], positions >= prefill_len from the kernel."""
        def decode(x_last, p, steps, forced):
            out = np.zeros((steps, self.config.vocab_size), np.float32)
            self.launch(x_last, p, steps, forced=forced, logits=out)
            return out

        return teacher_forced(self.prefill, decode, ids, prefill_len)

    def generate_greedy(self, ids: Sequence[int], n: int) -> list[int]:
        x_last, _ = self.prefill(ids)
        self.launch(x_last, len(ids), n)
        return [int(t) for t in self.host_tokens[:int(self.host_ctrl[L.CTRL_COUNT])]]
