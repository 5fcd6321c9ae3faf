"""GPU state of one monokernel engine: packed weights, KV cache, work buffers, the parameter
block, host-mapped control memory, and one launch of the persistent kernel.

CuPy only (no torch). One `GpuModel` per GPU; a launch decodes one whole generation.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from collections.abc import Mapping, Sequence

import numpy as np

from replicas import layout as L
from replicas.layout import KernelLayout
from replicas.layout_tuned import engine_options
from replicas.monokernel_build import launch_args
from replicas.model import ModelConfig
from replicas.monokernel_weights import pack_weights, rope_tables

os.environ.setdefault("CUPY_TF32", "1")  # prefill GEMMs on TF32 tensor cores (read when CuPy loads)


class MonokernelUnavailable(RuntimeError):
    """No usable GPU / CuPy for the monokernel engine."""


def import_cupy():
    try:
        import cupy as cp
    except ImportError as e:
        raise MonokernelUnavailable(
            "the monokernel engine needs CuPy and an NVIDIA GPU: pip install 'monoserve[gpu]' "
            f"(cupy-cuda13x), or use --engine reference ({e})") from None
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # cudaErrorNoDevice, driver missing, ...
        raise MonokernelUnavailable(f"no usable CUDA device: {e}; use --engine reference") from None
    if n == 0:
        raise MonokernelUnavailable("no CUDA device found; use --engine reference")
    return cp


def field_bits(ctype: str, value) -> np.uint64:
    """One 8-byte parameter-block slot: float64 bits for a double, two's complement otherwise."""
    if ctype == "double":
        return np.uint64(struct.unpack("<Q", struct.pack("<d", float(value)))[0])
    return np.uint64(int(value) & (2**64 - 1))


def param_block(fields, ptrs: Mapping[str, int], scalars: Mapping[str, object]) -> np.ndarray:
    """The kernel's parameter block (layout.param_fields() order) from device pointers and scalars."""
    missing = {n for n, _ in fields} - set(ptrs) - set(scalars)
    assert not missing, f"parameter block fields without a value: {missing}"
    return np.array([ptrs[n] if n in ptrs else field_bits(ct, scalars[n]) for n, ct in fields], np.uint64)


def kernel_buffers(xp, lay: KernelLayout, c: ModelConfig, max_context: int) -> dict:
    """The device buffers a single-sequence launch points the kernel at (xp: cupy, or numpy for the
    CPU emulation, replicas/monokernel_emu.py), zeroed."""
    kv_shape = (c.num_hidden_layers, c.num_key_value_heads, max_context, c.head_dim)
    return {
        "k_cache": xp.zeros(kv_shape, xp.uint16),  # [L][kv_heads][max_ctx][D] bf16 bits
        "v_cache": xp.zeros(kv_shape, xp.uint16),
        "work": {k: xp.zeros(n, xp.float32) for k, n in lay.buffer_sizes().items()},
        "best_idx": xp.zeros(lay.total_warps, xp.int32),
        "attn_cnt": xp.zeros(c.num_key_value_heads, xp.uint32),
        "qkv_done": xp.zeros(c.num_key_value_heads, xp.uint32),
        "control": xp.zeros(4, xp.uint32),  # bar_count, bar_flag, cancel_step, shared_token
        "tokens": xp.zeros(max_context, xp.int32),
        "forced": xp.zeros(max_context, xp.int32),
        "stop_ids": xp.zeros(L.MAX_STOP_IDS, xp.int32),
        "logits1": xp.zeros(c.vocab_size, xp.float32),
    }


def buffer_ptr(a) -> int:
    """The address a launch gives the kernel for a buffer: a CuPy array's, a mapped host array's device
    side, or (the CPU emulation, replicas/monokernel_emu.py) a numpy array's; None -> 0."""
    if a is None:
        return 0
    if isinstance(a, MappedInts):
        return a.dev_ptr
    if isinstance(a, np.ndarray):
        return a.ctypes.data
    return a.data.ptr


def common_ptrs(m, work, weights=None) -> dict[str, int]:
    """What every launch points at: the packed weights (m.weights unless given), RoPE tables, the build's
    work buffers and the per-kv-group phase counters (m: GpuModel or a model with the same buffer names)."""
    P = buffer_ptr
    return {**{k: P(v) for k, v in (m.weights if weights is None else weights).items()}, "rope_cos": P(m.rope_cos), "rope_sin": P(m.rope_sin),
            **{k: P(v) for k, v in work.items()}, "attn_cnt": P(m.attn_cnt), "qkv_done": P(m.qkv_done)}


def single_ptrs(m, logits=None, profile=None) -> dict[str, int]:
    """The pointer fields of a single-sequence launch (GpuModel.launch) over m's buffers."""
    P, ctl = buffer_ptr, buffer_ptr(m.control)
    return {**common_ptrs(m, m.work), "k_cache": P(m.k_cache), "v_cache": P(m.v_cache), "best_idx": P(m.best_idx),
            "logits": P(logits if logits is not None else m.logits1),
            "bar_count": ctl, "bar_flag": ctl + 4, "cancel_step": ctl + 8, "shared_token": ctl + 12,
            "tokens": P(m.tokens), "forced": P(m.forced), "stop_ids": P(m.stop_ids),
            "host_tokens": P(m.host_tokens), "host_ctrl": P(m.host_ctrl), "profile": P(profile),
            "host_kctl": 0, "kctl": 0}  # this engine never asks a launch to yield


def inv_temperature(temperature: float) -> float:
    """The kernel's 1/T (greedy launches pass T = 0 and never use it)."""
    return 1.0 / temperature if temperature > 0 else 1.0


class MappedInts:
    """int32 array in pinned, device-mapped host memory: the kernel writes, the host polls."""

    def __init__(self, cp, n: int):
        rt = cp.cuda.runtime
        self.nbytes = 4 * n
        self.host_ptr = rt.hostAlloc(self.nbytes, 2)  # cudaHostAllocMapped
        self.dev_ptr = rt.hostGetDevicePointer(self.host_ptr, 0) if hasattr(rt, "hostGetDevicePointer") else self.host_ptr
        self.array = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(self.host_ptr))
        self.array[:] = 0
        self._rt = rt

    def __del__(self):
        try:
            self._rt.freeHost(self.host_ptr)
        except Exception:
            pass


def grid_option(layout_options: dict | None, num_sms: int | None) -> tuple[dict | None, int | None]:
    """num_sms may also come as a layout option (bench A/Bs: `--ab num_sms=124`, a grid that leaves SMs
    free): returns (the other options, the grid asked for)."""
    if not layout_options or "num_sms" not in layout_options:
        return layout_options, num_sms
    rest = {k: v for k, v in layout_options.items() if k != "num_sms"}
    grid = layout_options["num_sms"]
    if num_sms is not None and num_sms != grid:
        raise ValueError(f"num_sms={num_sms} and layout option num_sms={grid} disagree; give one")
    return rest, grid


def grid_blocks(device_sms: int, num_sms: int | None) -> int:
    """The kernel's grid (one block per SM): every SM of the device, or `num_sms` of them."""
    if num_sms is None:
        return device_sms
    if not 1 <= num_sms <= device_sms:
        raise ValueError(f"num_sms={num_sms}: the grid must be 1..{device_sms} blocks (the device's SMs; "
                         "one block per SM, all resident)")
    return int(num_sms)


class GpuModel:
    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], device: int = 0,
                 max_context: int | None = None, progress: bool | None = None,
                 layout_options: dict | None = None, num_sms: int | None = None,
                 cooperative: bool = True):
        """num_sms: the grid (default every SM; fewer leaves SMs to other kernels, e.g. the other
        ranks of monokernel_tp's one-GPU emulation). cooperative=False: ordinary launches (the
        emulation's concurrent grids rely on ordinary concurrent-kernel scheduling)."""
        cp = import_cupy()
        layout_options, num_sms = grid_option(layout_options, num_sms)
        self.cp, self.config, self.device = cp, config, device
        self.max_context = int(max_context or min(config.max_context, 8192))
        with cp.cuda.Device(device):
            sms = grid_blocks(cp.cuda.Device(device).attributes["MultiProcessorCount"], num_sms)
            # the tuned single-GPU layout unless layout_options say otherwise (replicas/layout_tuned.py)
            self.layout = KernelLayout.from_config(config, self.max_context, num_sms=sms,
                                                   **engine_options(config, layout_options))
            try:
                self._allocate(tensors, progress)
            except cp.cuda.memory.OutOfMemoryError as e:
                raise MemoryError(
                    f"out of GPU memory loading {config.architecture} ({self.layout.stream_bytes_per_token() / 1e9:.1f} GB "
                    f"of weights, max_context={self.max_context}) on device {device}: {e}; lower max_context "
                    "or use a larger GPU / more GPUs") from None
            from replicas.monokernel_build import load_module

            t0 = time.perf_counter()
            self.kernel = load_module(self.layout, cooperative=cooperative)
            self.compile_seconds = time.perf_counter() - t0
            self.stream = cp.cuda.Stream(non_blocking=True)

    # ---- allocation ------------------------------------------------------------------------
    def _allocate(self, tensors, progress) -> None:
        cp, lay, c = self.cp, self.layout, self.config
        total = sum(int(a.nbytes) for a in tensors.values())
        show = total > 2**30 if progress is None else progress
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="to GPU")
        try:
            self.weights = pack_weights(cp, lay, c, tensors, progress=bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        cos, sin = rope_tables(c, self.max_context)
        self.rope_cos, self.rope_sin = cp.asarray(cos), cp.asarray(sin)
        self.__dict__.update(kernel_buffers(cp, lay, c, self.max_context))
        self.host_tokens = MappedInts(cp, self.max_context)
        self.host_ctrl = MappedInts(cp, L.CTRL_WORDS)
        self.params_dev = cp.zeros(len(self.layout.param_fields()), cp.uint64)
        self.tp_params: dict[str, int] = {}  # tp_local, tp_peers, tp_rank (set by monokernel_tp.GpuGroup)

    # ---- one launch ------------------------------------------------------------------------
    def launch(self, x_last, start_pos: int, max_steps: int, *, mode: int = L.MODE_GREEDY,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               stop_ids: Sequence[int] = (), forced: Sequence[int] | None = None, logits=None,
               profile=None, defer: bool = False) -> None:
        """Start the persistent kernel (asynchronously) on `self.stream`.

        x_last: the prompt's last hidden state [H] fp32 (CuPy). forced: teacher-forced tokens
        (then `logits` [max_steps, V] receives every step's logits). profile: optional CuPy uint64[13]
        receiving ns per phase kind (LM+sample, QKV, attention, O, gate/up, down), the step count,
        then the part of each phase block 0 spent waiting in the grid barrier.
        defer: set up inputs and the parameter block only; `start_kernel()` launches later
        (monokernel_tp.GpuGroup prepares every rank before starting any kernel).
        """
        cp, lay, w = self.cp, self.layout, self.work
        if len(stop_ids) > L.MAX_STOP_IDS:
            raise ValueError(f"at most {L.MAX_STOP_IDS} stop token ids are supported, got {len(stop_ids)}")
        with cp.cuda.Device(self.device), self.stream:
            w["xbuf"][:] = 0
            w["xbuf"][:self.config.hidden_size] = x_last
            w["dn_part"][:] = 0
            self.attn_cnt[:] = 0
            self.qkv_done[:] = 0
            self.control[:] = 0
            if stop_ids:
                self.stop_ids[:len(stop_ids)] = cp.asarray(list(stop_ids), cp.int32)
            if forced is not None and len(forced):
                self.forced[:len(forced)] = cp.asarray(list(forced), cp.int32)
            self.host_ctrl.array[:] = 0
            ptrs = single_ptrs(self, logits, profile)
            scalars = {
                "start_pos": start_pos, "max_steps": max_steps, "n_stop": len(stop_ids),
                "teacher": int(forced is not None), "mode": mode, "top_k": top_k, "seed": seed,
                "inv_temperature": inv_temperature(temperature), "top_p": top_p,
                "logits_per_step": self.config.vocab_size if logits is not None else 0, "step0": 0,
                **self.tp_params,
            }
            self.params_host = param_block(lay.param_fields(), ptrs, scalars)  # sent by start_kernel
        if not defer:
            self.start_kernel()

    def start_kernel(self) -> None:
        """The kernel on `self.stream`, with the parameter block `launch` built."""
        lay = self.layout
        with self.cp.cuda.Device(self.device), self.stream:
            args = launch_args(self.cp, lay, self.params_dev, self.params_host, self.stream)
            self.kernel((lay.num_sms,), (lay.threads,), args, shared_mem=lay.smem_bytes)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def check(self) -> None:
        """Raise EngineFailed if the running kernel stopped without finishing its launch: a fault (the stream
        reports it; the GPU's CUDA context is lost) or an end without the done word. The engine calls this
        while it waits for tokens, so a dead kernel is an error for the caller, not a generation that hangs."""
        from replicas.engine import EngineFailed

        try:
            ended = self.stream.done
        except self.cp.cuda.runtime.CUDARuntimeError as e:
            raise EngineFailed(f"the monokernel on GPU {self.device} failed ({e}); its CUDA context is lost: "
                               "restart the replica") from e
        if ended and not self.host_ctrl.array[L.CTRL_DONE]:
            raise EngineFailed(f"the monokernel on GPU {self.device} ended without finishing its launch; "
                               "restart the replica")
