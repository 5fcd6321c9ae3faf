"""The monokernel engine: one persistent CUDA kernel decodes each whole generation on the GPU.

    engine = MonokernelEngine.from_pretrained("ckpt/", devices=[0])
    for token in engine.generate(prompt_ids, SamplingParams(max_tokens=64)):
        ...

Per generation: the prompt is prefilled with cuBLAS GEMMs (monokernel_prefill.py), then one
cooperative launch of csrc/monokernel.cu runs every decode step (LM head, sampling, stop checks,
all layers) with no host round trip; each sampled token lands in pinned host-mapped memory,
which the generator polls and yields. Cancel writes a host-mapped flag the kernel reads every
step. One generation at a time per engine (max_batch = 1). devices=[0..N-1] gives the
tensor-parallel engine (replicas/monokernel_tp.py); resident small-batch decoding is issue 9.

Agent sessions (`generate(..., session_id=...)`, single GPU): at the end of a generation the KV
rows the kernel left valid are copied into GPU arrays of exactly that length and kept in a
`SessionCache`; the session's next turn copies the common prefix back into the engine's cache and
prefills only the rest (`Prefill.run(ids, start=reused)`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Generator as PyGenerator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replicas import layout as L
from replicas.engine import (
    EngineBusy,
    EngineFailed,
    FinishReason,
    Generation,
    InvalidRequest,
    SamplingParams,
    stop_ids,
    validate_prompt,
    validate_teacher_ids,
)
from replicas.host_poll import poll_sleep
from replicas.model import ModelConfig
from replicas.monokernel_gpu import GpuModel, MonokernelUnavailable  # noqa: F401 (re-exported)
from replicas.reference import _GenerationInfo
from replicas.session_cache import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_SESSIONS,
    SessionCache,
    SessionLease,
    SessionStats,
)

CHECK_SECONDS = 0.05  # while no token comes: how often to ask whether the kernel died (GpuModel.check)
TEACHER_PREFILL = 16  # forward_logits prefills this many tokens; the kernel decodes the rest
_STATUS = {L.STATUS_LENGTH: FinishReason.LENGTH, L.STATUS_STOP: FinishReason.STOP,
           L.STATUS_CANCELLED: FinishReason.CANCELLED}


def check_request(config: ModelConfig, max_context: int, prompt_ids: Sequence[int], params: SamplingParams
                  ) -> tuple[list[int], list[int]]:
    """(prompt ids, stop ids) of a valid monokernel request, else InvalidRequest."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
    ids = validate_prompt(prompt_ids, params, config, max_context)
    stops = sorted(stop_ids(config, params))
    if len(stops) > L.MAX_STOP_IDS:
        raise InvalidRequest(f"{len(stops)} stop token ids (with EOS); the monokernel supports at most "
                             f"{L.MAX_STOP_IDS}")
    return ids, stops


def sampling_mode(params: SamplingParams) -> int:
    """The kernel's sampling mode: argmax, Gumbel-max over all logits, or top-k / top-p first."""
    if params.greedy:
        return L.MODE_GREEDY
    return L.MODE_GUMBEL if params.top_k == 0 and params.top_p >= 1.0 else L.MODE_TOPKP


def sampling_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random one (63 bits)."""
    return params.seed if params.seed is not None else int.from_bytes(np.random.bytes(8), "little") >> 1


class MonokernelEngine:
    """Engine protocol (replicas.engine.Engine) on one GPU, kind="monokernel"."""

    kind = "monokernel"
    max_batch = 1
    failed: str | None = None  # why the GPU can run nothing more (EngineFailed); every later request is refused

    def __init__(self, config: ModelConfig, tensors, devices: Sequence[int] = (0,),
                 max_context: int | None = None, progress: bool | None = None,
                 layout_options: dict | None = None, *, session_cache_bytes: int = DEFAULT_MAX_BYTES,
                 max_sessions: int = DEFAULT_MAX_SESSIONS):
        """Agent sessions' KV is kept between turns (in GPU memory) within `session_cache_bytes` /
        `max_sessions` (replicas.session_cache; max_sessions=0 turns reuse off)."""
        self.sessions = SessionCache(session_cache_bytes, max_sessions)  # bad bounds fail before the GPU work
        devices = list(devices)
        if len(devices) != 1:
            raise ValueError(f"devices={devices}: MonokernelEngine(...) decodes on one GPU; for tensor "
                             "parallelism use MonokernelEngine.from_pretrained(path, devices=[...]) or "
                             "replicas.monokernel_tp.TpMonokernelEngine")
        if config.dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"unsupported checkpoint dtype {config.dtype}")
        self.config = config
        self.gpu = GpuModel(config, tensors, device=devices[0], max_context=max_context, progress=progress,
                            layout_options=layout_options)
        self.max_context = self.gpu.max_context
        self.devices = devices
        from replicas.monokernel_prefill import Prefill

        self._prefill = Prefill(self.gpu)
        if self._prefill.graphs is not None:  # capture the common prompt buckets now, not at first requests
            with self.gpu.cp.cuda.Device(self.gpu.device), self.gpu.stream:
                self._prefill.graphs.warm()
        self._busy = threading.Lock()
        self.profile = None  # set to a CuPy uint64[13] to time the kernel's phases (bench/decode.py)

    @classmethod
    def from_pretrained(cls, path: str | Path, devices: Sequence[int] = (0,), max_context: int | None = None,
                        progress: bool | None = None, layout_options: dict | None = None, *,
                        session_cache_bytes: int = DEFAULT_MAX_BYTES,
                        max_sessions: int = DEFAULT_MAX_SESSIONS,
                        emulate_on_one_gpu: bool = False) -> MonokernelEngine:
        """layout_options: extra KernelLayout.from_config options (tuning variants, e.g. fused_mlp=True).
        session_cache_bytes / max_sessions: see __init__; ignored over several GPUs (no session reuse).
        emulate_on_one_gpu: devices=[g] * N runs the N-GPU engine's ranks side by side on GPU g
        (replicas/monokernel_tp.py; a protocol and numerics check, not a speed one)."""
        from replicas.monokernel_gpu import import_cupy
        from replicas.weights import load_weights

        devices = list(devices)
        config = ModelConfig.from_pretrained(path)
        engine_cls = cls
        extra = {"session_cache_bytes": session_cache_bytes, "max_sessions": max_sessions}
        if len(devices) > 1 or emulate_on_one_gpu:  # tensor parallelism (replicas/monokernel_tp.py)
            from replicas.monokernel_tp import TpMonokernelEngine, check_devices
            from replicas.tp_shard import check_tp

            check_tp(config, len(devices))  # before reading gigabytes
            check_devices(devices, emulate_on_one_gpu)
            engine_cls, extra = TpMonokernelEngine, {"emulate_on_one_gpu": emulate_on_one_gpu}
        import_cupy()  # fail fast with a clear message before reading gigabytes
        tensors = load_weights(path, config, dtype="raw", progress=progress)
        return engine_cls(config, tensors, devices=devices, max_context=max_context, progress=progress,
                          layout_options=layout_options, **extra)

    # ---- helpers ---------------------------------------------------------------------------
    def _take(self) -> None:
        if self.failed:
            raise EngineFailed(self.failed)
        if not self._busy.acquire(blocking=False):
            raise EngineBusy("the monokernel engine is decoding another generation (max_batch=1); "
                             "retry when it finishes")

    def prefill(self, ids: Sequence[int], all_logits: bool = False, start: int = 0):
        """Prompt -> (last hidden state on the GPU, logits [T - start, V] on the GPU or None); start > 0:
        the cache already holds positions 0..start-1 (see Prefill.run)."""
        with self.gpu.cp.cuda.Device(self.gpu.device), self.gpu.stream:
            return self._prefill.run(list(ids), all_logits=all_logits, start=start)

    def session_stats(self) -> SessionStats:
        """Session KV reuse counters and what is resident now."""
        return self.sessions.stats()

    def _restore(self, lease: SessionLease | None) -> int:
        """Copy a session's stored KV rows [0, reused) into the engine's cache; returns how many."""
        if lease is None or lease.kv is None:
            return 0
        r = lease.reused
        with self.gpu.cp.cuda.Device(self.gpu.device), self.gpu.stream:  # ordered before the prefill
            self.gpu.k_cache[:, :, :r] = lease.kv.k[:, :, :r]
            self.gpu.v_cache[:, :, :r] = lease.kv.v[:, :, :r]
        return r

    def _keep(self, lease: SessionLease, ids: list[int], reason: FinishReason, count: int) -> bool:
        """After a finished kernel: store the cache rows whose KV is valid as the session's entry.

        The kernel feeds a token through the layers (writing its K/V) only at a step that did not
        end the generation: on LENGTH the last emitted token never was; on STOP every emitted token
        was (the stop token is neither emitted nor fed). False = not kept (caller discards)."""
        gpu, cp = self.gpu, self.gpu.cp
        n = len(ids) + count - (1 if reason is FinishReason.LENGTH else 0)
        c = self.config
        nbytes = 2 * c.num_hidden_layers * c.num_key_value_heads * n * c.head_dim * 2  # K and V, bf16
        if nbytes > self.sessions.max_bytes or self.sessions.max_sessions == 0:
            return False  # would be evicted at once: skip the copy
        tokens = ids + [int(t) for t in gpu.host_tokens.array[:n - len(ids)]]
        try:
            with cp.cuda.Device(gpu.device), gpu.stream:
                kv = _SessionKV(gpu.k_cache[:, :, :n].copy(), gpu.v_cache[:, :, :n].copy())
        except cp.cuda.memory.OutOfMemoryError:
            return False  # keeping the KV is an optimisation: the turn itself succeeded
        self.sessions.release(lease, kv, tokens, kv.nbytes)
        return True

    # ---- Engine protocol -------------------------------------------------------------------
    def forward_logits(self, token_ids: Sequence[int], prefill_len: int = TEACHER_PREFILL) -> np.ndarray:
        """Teacher-forced logits [len, V] float32: the first `prefill_len` positions from the
        prefill path, every later one from the decode kernel fed the given tokens."""
        ids = validate_teacher_ids(token_ids, self.config, self.max_context)
        p = max(1, min(prefill_len, len(ids)))
        self._take()
        try:
            cp = self.gpu.cp
            x_last, head = self.prefill(ids[:p], all_logits=True)
            self.gpu.synchronize()  # the prefill ran on the engine's stream
            rows = [cp.asnumpy(head)]
            if len(ids) > p:
                steps = len(ids) - p + 1
                with cp.cuda.Device(self.gpu.device), self.gpu.stream:
                    out = cp.empty((steps, self.config.vocab_size), cp.float32)
                self.gpu.launch(x_last, p, steps, forced=ids[p:], logits=out)
                self.gpu.synchronize()
                rows.append(cp.asnumpy(out[1:]))
            return np.concatenate(rows).astype(np.float32, copy=False)
        finally:
            self._busy.release()

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 session_id: str | None = None) -> Generation:
        """Start a generation; raises InvalidRequest (bad input) or EngineBusy. With `session_id`, the
        KV that session's previous turn left is reused for the common prefix (only the rest is
        prefilled) and this turn's KV is kept for the next one (not after a cancel or an error)."""
        return self._start(prompt_ids, params, session_id)

    def _start(self, prompt_ids: Sequence[int], params: SamplingParams, session_id: str | None) -> Generation:
        ids, stops = check_request(self.config, self.max_context, prompt_ids, params)
        self._take()
        release = _Once(self._busy.release)
        info = _GenerationInfo()
        gen = _MkGeneration(lambda cancel: self._steps(ids, params, stops, cancel, release, session_id, info),
                            release, info)
        weakref.finalize(gen, release)  # a generation dropped before it started frees the engine
        return gen

    def _steps(self, ids: list[int], params: SamplingParams, stops: list[int], cancel: threading.Event,
               release, session_id: str | None,
               info: _GenerationInfo) -> PyGenerator[int, None, tuple[FinishReason, int | None]]:
        gpu = self.gpu
        launched = kept = False
        lease = None
        try:
            lease = self.sessions.acquire(session_id, ids) if session_id else None
            if cancel.is_set():
                return FinishReason.CANCELLED, None
            budget = min(params.max_tokens, self.max_context - len(ids))
            info.reused_tokens = start = self._restore(lease)
            x_last, _ = self.prefill(ids, start=start)
            mode, seed = sampling_mode(params), sampling_seed(params)
            gpu.launch(x_last, len(ids), budget, mode=mode, temperature=params.temperature,
                       top_k=params.top_k, top_p=params.top_p, seed=seed, stop_ids=stops,
                       profile=self.profile)
            launched = True
            ctrl, toks = gpu.host_ctrl.array, gpu.host_tokens.array
            sent, checked = 0, time.perf_counter()
            while True:
                if cancel.is_set():  # stop the kernel; tokens it made meanwhile are dropped
                    ctrl[L.CTRL_CANCEL] = 1
                    gpu.synchronize()
                    launched = False
                    return FinishReason.CANCELLED, None
                done = ctrl[L.CTRL_DONE] != 0
                count = int(ctrl[L.CTRL_COUNT])
                while sent < count and not cancel.is_set():
                    tok = int(toks[sent])
                    sent += 1
                    yield tok
                if done and sent == count:
                    break
                if sent == count:
                    if time.perf_counter() - checked >= CHECK_SECONDS:
                        try:
                            gpu.check()
                        except EngineFailed as e:
                            launched = False  # (nothing left to stop or wait for)
                            self.failed = str(e)
                            raise
                        checked = time.perf_counter()
                    poll_sleep()
            if int(ctrl[L.CTRL_STATUS]) == L.STATUS_PEER_TIMEOUT:  # the kernel trapped: do not wait for it
                launched = False
                self.failed = ("a tensor-parallel peer GPU stopped answering inside the kernel (waited more than "
                               "MK_TP_PEER_TIMEOUT_S); the GPUs' CUDA contexts are lost: restart the replica")
                raise EngineFailed(self.failed)
            gpu.synchronize()
            launched = False
            reason = _STATUS.get(int(ctrl[L.CTRL_STATUS]), FinishReason.LENGTH)
            if lease is not None and reason is not FinishReason.CANCELLED:
                kept = self._keep(lease, ids, reason, int(ctrl[L.CTRL_COUNT]))
            return reason, (int(ctrl[L.CTRL_STOP_TOKEN]) if reason is FinishReason.STOP else None)
        finally:
            if launched:  # closed early: stop the kernel and wait for it before freeing the engine
                gpu.host_ctrl.array[L.CTRL_CANCEL] = 1
                gpu.synchronize()
            if lease is not None and not kept:  # cancelled, closed or failed: which rows are valid is unknown
                self.sessions.discard(lease)
            release()


class _Once:
    """Calls `fn` at most once (generation end, close(), or garbage collection)."""

    def __init__(self, fn):
        self._fn, self._lock = fn, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


@dataclass
class _SessionKV:
    """A session's stored KV: copies of the cache rows [0, n), [L][kv_heads][n][D] bf16 bits on the GPU."""

    k: Any
    v: Any

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


class _MkGeneration(Generation):
    def __init__(self, steps, release: _Once, info: _GenerationInfo):
        super().__init__(steps)
        self._release = release
        self.info = info

    @property
    def reused_tokens(self) -> int:
        return self.info.reused_tokens

    def close(self) -> None:
        super().close()
        self._release()
