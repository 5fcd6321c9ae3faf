"""The monokernel over N GPUs of one node (tensor parallelism, issue 6).

    engine = MonokernelEngine.from_pretrained("ckpt/", devices=[0, 1])   # -> TpMonokernelEngine

At load the checkpoint is cut into Megatron shards (replicas/tp_shard.py) and each GPU gets an
ordinary single-GPU `GpuModel` of its shard, compiled with MK_TP = N (csrc/mk_tp.cuh), plus a
peer-visible exchange region. Per generation: the sharded prefill (replicas/tp_prefill.py), then
one persistent cooperative kernel per GPU, launched back to back from this thread. The kernels
all-reduce over NVLink among themselves and agree on every token; no host on the token path.
Tokens stream from GPU 0's host-mapped buffer; cancel is written to GPU 0's host flag and GPU 0
forwards it to its peers inside the step's token message, so every GPU stops at the same step.

One-GPU emulation (`emulate_on_one_gpu=True`, devices = one GPU repeated N times, e.g. [0, 0]):
the N ranks' kernels (the TP=N code) run side by side on one GPU, each on its own stream with a
grid of SMs // N blocks (one block per SM fills the SM's shared memory, so the N grids take
disjoint SMs and all their blocks are resident at once), each rank with its own buffers; the
"peer" pointers are then addresses on the same GPU. The kernels are launched plainly (not
cooperatively): concurrency of cooperative grids on one device is not something the driver
promises. Compile-time k-splits follow the smaller grid (tiny's flags equal the real N-GPU
build's; larger models get smaller split factors). This checks the exchange protocol (flags,
counters, buffer reuse, the token and cancel messages) and the numerics against TP=1 -- not
speed: no NVLink, 1/N of the SMs per rank, and the sharded prefill runs rank after rank.
Supported N: 2, 4, 8 where check_tp allows. More streams than CUDA's hardware queues
(CUDA_DEVICE_MAX_CONNECTIONS, default 8) can put two ranks in one queue, serialized: set it to
32 before CUDA starts for N = 8. A hang (a protocol bug, or grids that cannot all run at once)
spins forever: run under `timeout`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager

import numpy as np

from replicas.engine import Generation, SamplingParams, validate_teacher_ids
from replicas.model import ModelConfig
from replicas.monokernel import TEACHER_PREFILL, MonokernelEngine
from replicas.monokernel_gpu import GpuModel, MonokernelUnavailable, import_cupy
from replicas.tp_prefill import ShardedPrefill
from replicas.tp_shard import check_tp, shard_config, shard_tensors


PEER_TIMEOUT_S = 10.0  # a wait for a peer GPU longer than this is a dead peer (a decode step takes milliseconds)


def peer_timeout_s() -> float:
    """How long a rank's kernel waits for a peer before it reports STATUS_PEER_TIMEOUT and traps: PEER_TIMEOUT_S,
    or MK_TP_PEER_TIMEOUT_S from the environment (a positive number of seconds)."""
    raw = os.environ.get("MK_TP_PEER_TIMEOUT_S")
    if raw is None:
        return PEER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"MK_TP_PEER_TIMEOUT_S={raw!r}: give a positive number of seconds (default {PEER_TIMEOUT_S})")
    return value


def check_devices(devices: Sequence[int], emulate_on_one_gpu: bool = False) -> None:
    """Raise ValueError unless `devices` suits the group: distinct GPUs, or with emulation one GPU
    named once per rank (checked before any GPU work)."""
    devices, n = list(devices), len(devices)
    if not emulate_on_one_gpu:
        if len(set(devices)) != n:
            raise ValueError(f"devices={devices} repeats a GPU; to emulate {n} ranks on one GPU (checks the "
                             "protocol and numerics, not speed) pass emulate_on_one_gpu=True")
        return
    if n < 2:
        raise ValueError(f"emulate_on_one_gpu needs at least 2 ranks, got devices={devices}; "
                         "name the GPU once per rank, e.g. devices=[0, 0]")
    if len(set(devices)) != 1:
        raise ValueError(f"emulate_on_one_gpu runs every rank on one GPU, but devices={devices} names "
                         f"{len(set(devices))}; use devices=[{devices[0]}] * {n}")


def emulated_sms(device_sms: int, n: int) -> int:
    """Blocks per rank when `n` ranks share one GPU of `device_sms` SMs: N grids side by side."""
    return device_sms // n


def enable_peer_access(cp, devices: Sequence[int]) -> None:
    """Let every GPU of the group read and write every other's memory (NVLink / PCIe P2P)."""
    rt = cp.cuda.runtime
    for a in devices:
        with cp.cuda.Device(a):
            for b in devices:
                if a == b:
                    continue
                if not rt.deviceCanAccessPeer(a, b):
                    raise MonokernelUnavailable(f"GPU {a} cannot access GPU {b}'s memory (no peer access): "
                                                "tensor parallelism needs GPUs linked by NVLink or PCIe P2P")
                try:
                    rt.deviceEnablePeerAccess(b)
                except rt.CUDARuntimeError as e:  # already enabled by an earlier engine in this process
                    if "PeerAccessAlreadyEnabled" not in str(e):
                        raise


class GpuGroup:
    """N `GpuModel`s (one shard each) that launch and finish together; quacks like one GpuModel
    where MonokernelEngine's generation loop uses it (host_ctrl, host_tokens, synchronize)."""

    def __init__(self, config: ModelConfig, tensors, devices: Sequence[int], max_context: int | None = None,
                 progress: bool | None = None, layout_options: dict | None = None,
                 emulate_on_one_gpu: bool = False):
        """emulate_on_one_gpu: the N ranks on the one GPU `devices` repeats (module docstring)."""
        self.config, self.devices, self.emulated = config, list(devices), bool(emulate_on_one_gpu)
        n = len(self.devices)
        check_tp(config, n)
        check_devices(self.devices, self.emulated)
        cp = self.cp = import_cupy()
        grid = None
        if self.emulated:  # no peer access to enable: the "peers" are this GPU
            grid = emulated_sms(cp.cuda.Device(self.devices[0]).attributes["MultiProcessorCount"], n)
            queues = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))
            if n >= queues:
                warnings.warn(f"{n} emulated ranks and CUDA_DEVICE_MAX_CONNECTIONS={queues}: two ranks' streams may "
                              "share a hardware queue and hang; set it to 32 before CUDA starts")
        else:
            enable_peer_access(cp, self.devices)
        local = shard_config(config, n)
        opts = {**(layout_options or {}), "tp": n, "vocab_total": config.vocab_size}
        self.models = []
        for r, d in enumerate(self.devices):
            shard = {k: self._to_device(a, d) for k, a in shard_tensors(config, tensors, n, r).items()}
            self.models.append(GpuModel(local, shard, device=d, max_context=max_context, progress=progress,
                                        layout_options=opts, num_sms=grid, cooperative=not self.emulated))
            del shard
        sms = {m.layout.num_sms for m in self.models}
        if len(sms) != 1:  # exchange counters count blocks: every GPU must run the same grid
            raise MonokernelUnavailable(f"GPUs {self.devices} have different SM counts {sorted(sms)}; "
                                        "tensor parallelism needs identical GPUs")
        self.layout = self.models[0].layout
        self.max_context = self.models[0].max_context
        self.device, self.stream = self.devices[0], self.models[0].stream
        self.compile_seconds = sum(m.compile_seconds for m in self.models)
        words = self.layout.tp_offsets()["WORDS"]
        self.regions = []
        for m in self.models:
            with cp.cuda.Device(m.device):
                self.regions.append(cp.zeros(words, cp.float32))
        ptrs = [r.data.ptr for r in self.regions]
        self.peer_tables = []
        for rank, m in enumerate(self.models):
            with cp.cuda.Device(m.device):
                table = cp.asarray(np.array(ptrs, np.uint64))
            self.peer_tables.append(table)
            m.tp_params = {"tp_local": ptrs[rank], "tp_peers": table.data.ptr, "tp_rank": rank,
                           "tp_timeout_ns": int(peer_timeout_s() * 1e9)}
        self.host_ctrl, self.host_tokens = self.models[0].host_ctrl, self.models[0].host_tokens

    def _to_device(self, a, device: int):
        """Host arrays as they are; a CuPy array on another GPU (bench's random weights) copied to
        `device` (the packer's kernels must not read another GPU's memory)."""
        cp = self.cp
        if not isinstance(a, cp.ndarray) or a.device.id == device:
            return a
        with cp.cuda.Device(a.device.id):
            a = cp.ascontiguousarray(a)
            cp.cuda.Device(a.device.id).synchronize()
        with cp.cuda.Device(device):
            out = cp.empty(a.shape, a.dtype)
            cp.cuda.runtime.memcpyPeer(out.data.ptr, device, a.data.ptr, a.device.id, a.nbytes)
        return out

    @contextmanager
    def on(self, rank: int):
        """Rank `rank`'s device and stream current."""
        m = self.models[rank]
        with ExitStack() as stack:
            stack.enter_context(self.cp.cuda.Device(m.device))
            stack.enter_context(m.stream)
            yield
            if self.emulated:
                # ranks sharing a GPU share its cuBLAS handle (one workspace) and memory pool, and
                # read each other's arrays without copies: finish a rank's work before the next's
                m.stream.synchronize()

    def to(self, a, rank: int):
        """A copy of CuPy array `a` (finished on its own device's stream) on rank `rank`'s device."""
        cp, m = self.cp, self.models[rank]
        if a.device.id == m.device:
            if self.emulated:  # `a` may come from another rank's stream on this device
                self.synchronize()
            return a
        src = next(x for x in self.models if x.device == a.device.id)
        with cp.cuda.Device(src.device), src.stream:
            a = cp.ascontiguousarray(a)
        src.stream.synchronize()
        with cp.cuda.Device(m.device):
            out = cp.empty(a.shape, a.dtype)
            cp.cuda.runtime.memcpyPeerAsync(out.data.ptr, m.device, a.data.ptr, src.device, a.nbytes, m.stream.ptr)
            m.stream.synchronize()  # `a` may be freed (and reused on its stream) once this returns
        return out

    def prefill(self, ids, all_logits: bool = False):
        return ShardedPrefill(self.models, self.config.vocab_size, self.cp, on=self.on, to=self.to).run(
            ids, all_logits=all_logits)

    def launch(self, x_last, start_pos: int, max_steps: int, *, logits=None, profile=None, **kw) -> None:
        """Every GPU's kernel. x_last: per-rank last hidden states; logits: per-rank [steps, V/N]."""
        for rank, m in enumerate(self.models):  # clean exchange regions on every GPU before any kernel runs
            with self.on(rank):
                self.regions[rank][:] = 0
        for rank, m in enumerate(self.models):
            m.launch(x_last[rank], start_pos, max_steps, logits=None if logits is None else logits[rank],
                     profile=profile if rank == 0 else None, defer=True, **kw)
        # Every rank's inputs are in place before any kernel starts, and nothing but the kernels is
        # issued between their launches (with shared GPUs, a memset or allocation there could keep
        # the later kernels from running beside the earlier ones, which then spin forever).
        self.synchronize()
        for m in self.models:
            m.start_kernel()

    def synchronize(self) -> None:
        for m in self.models:
            m.synchronize()

    def check(self) -> None:
        """GpuModel.check on every rank (a rank that timed out waiting for a peer traps: its stream fails)."""
        for m in self.models:
            m.check()


class TpMonokernelEngine(MonokernelEngine):
    """Engine protocol over N GPUs (kind="monokernel"); built by MonokernelEngine for devices=[..N].
    No agent-session KV reuse (the sharded prefill always starts at position 0): `generate` takes
    no session_id, so accepts_session_id() is False, and there is no session_stats."""

    session_stats = None  # callers probe getattr(engine, "session_stats", None)

    def __init__(self, config: ModelConfig, tensors, devices: Sequence[int] = (0, 1),
                 max_context: int | None = None, progress: bool | None = None,
                 layout_options: dict | None = None, *, emulate_on_one_gpu: bool = False):
        """emulate_on_one_gpu=True with devices=[g] * N: N ranks on GPU g (module docstring)."""
        import threading

        if config.dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"unsupported checkpoint dtype {config.dtype}")
        self.config = config
        self.gpu = GpuGroup(config, tensors, devices, max_context=max_context, progress=progress,
                            layout_options=layout_options, emulate_on_one_gpu=emulate_on_one_gpu)
        self.max_context = self.gpu.max_context
        self.devices = list(devices)
        self._busy = threading.Lock()
        self.profile = None

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        return self._start(prompt_ids, params, None)

    def prefill(self, ids: Sequence[int], all_logits: bool = False, start: int = 0):
        """Prompt -> (per-rank last hidden states, logits [T, V] on GPU 0 or None)."""
        if start:
            raise ValueError("the tensor-parallel prefill cannot continue cached positions (start must be 0)")
        return self.gpu.prefill(list(ids), all_logits=all_logits)

    def forward_logits(self, token_ids: Sequence[int], prefill_len: int = TEACHER_PREFILL) -> np.ndarray:
        ids = validate_teacher_ids(token_ids, self.config, self.max_context)
        p = max(1, min(prefill_len, len(ids)))
        self._take()
        try:
            cp, group = self.gpu.cp, self.gpu
            x_last, head = self.prefill(ids[:p], all_logits=True)
            group.synchronize()
            rows = [cp.asnumpy(head)]
            if len(ids) > p:
                steps = len(ids) - p + 1
                outs = []
                for m in group.models:
                    with cp.cuda.Device(m.device), m.stream:
                        outs.append(cp.empty((steps, m.config.vocab_size), cp.float32))
                group.launch(x_last, p, steps, forced=ids[p:], logits=outs)
                group.synchronize()
                rows.append(np.concatenate([cp.asnumpy(o[1:]) for o in outs], axis=1)[:, :self.config.vocab_size])
            return np.concatenate(rows).astype(np.float32, copy=False)
        finally:
            self._busy.release()
