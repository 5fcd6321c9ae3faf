"""The batched monokernel engine: up to B generations decode together in one resident launch.

    engine = BatchedMonokernelEngine.from_pretrained("ckpt/", batch=4)
    gens = [engine.generate(p, SamplingParams(max_tokens=64)) for p in prompts]   # max_batch = 4

One scheduler thread owns the GPU. While a launch runs it streams every slot's tokens out of
host-mapped memory, forwards cancels (the kernel drops that slot at its next step) and frees the
slots that finish — the others keep decoding in the same launch. A new request is prefilled with
cuBLAS, which needs the SMs the persistent kernel holds, so admitting one asks the running launch to
end at its next step boundary (`request_yield`); the scheduler prefills the newcomers into free slots
and relaunches with every running slot resumed where it was (its KV, emitted count and RNG counter
are kept; its hidden state is handed over). So a join costs the running slots one prefill plus one
relaunch, and the joining request waits at most one step for its prefill to start. A launch with a
single occupied slot runs the single-sequence build of the same layout (the B = 1 engine's speed);
a batch launch left with one slot yields to it. A launch ends by itself when no slot is left.

Same tokens as the single-sequence engine for the same request (slots do not interact): each slot's
math is the B = 1 kernel's, except that its int64 fixed-point sums are exact in any order.
forward_logits runs on slot 0.

Agent sessions (`generate(..., session_id=...)`) as in MonokernelEngine, per slot
(replicas/monokernel_batched_sessions.py): a session's next turn is admitted with the stored KV
rows copied into its slot and only the new suffix prefilled; when its slot ends, the request ends at
once and the valid rows are copied when that launch ends (by itself, or at the next join's yield,
which the session's next turn is): no extra relaunch for the other slots. Not yet run on a GPU.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from replicas import layout as L
from replicas.engine import EngineBusy, EngineFailed, FinishReason, Generation, SamplingParams
from replicas.model import ModelConfig
from replicas.host_poll import poll_sleep
from replicas.monokernel import _STATUS, TEACHER_PREFILL, check_request, sampling_mode, sampling_seed
from replicas.monokernel_batch import BatchGpuModel, SlotSpec
from replicas.monokernel_batched_sessions import SlotSessions
from replicas.monokernel_batched_teacher import teacher_forced_slots
from replicas.monokernel_resident import Joiner, ResidentJoins, prefer_eager_module_loading
from replicas.session_cache import DEFAULT_MAX_BYTES, DEFAULT_MAX_SESSIONS, SessionCache, SessionLease, SessionStats


SWITCH_MIN_TOKENS = 16  # a batch launch left with one slot yields to the single build if more remain


@dataclass
class _Request:
    ids: list[int]
    params: SamplingParams
    stops: list[int]
    cancel: threading.Event
    out: queue.Queue = field(default_factory=queue.Queue)  # ("tok", id) ... then ("end", reason, stop) | ("err", exc)
    spec: SlotSpec | None = None
    sent: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0  # when its prefill started (join latency = admitted - submitted)
    session_id: str | None = None
    lease: SessionLease | None = None  # taken at admission (SlotSessions.restore)
    reused: int = 0  # leading prompt tokens whose KV came from the session's previous turn


class _BatchGeneration(Generation):
    """A Generation that reports its request's reused session tokens (set at admission, before any token)."""

    def __init__(self, steps, req: _Request):
        super().__init__(steps)
        self._req = req

    @property
    def reused_tokens(self) -> int:
        return self._req.reused


class BatchedMonokernelEngine(ResidentJoins):
    """Engine protocol (replicas.engine.Engine) on one GPU with max_batch = batch slots."""

    kind = "monokernel"

    def __init__(self, config: ModelConfig, tensors, batch: int = 4, devices: Sequence[int] = (0,),
                 max_context: int | None = None, progress: bool | None = None, layout_options: dict | None = None,
                 sub_builds: bool = True, *, session_cache_bytes: int = DEFAULT_MAX_BYTES,
                 max_sessions: int = DEFAULT_MAX_SESSIONS, resident: bool = False, idle_s: float = 0.0):
        """sub_builds: also compile the smaller batch builds for partial occupancy (BatchGpuModel; measured on
        the H200, B = 8 engine at 2 / 4 requests: 886 / 539 tok/s each instead of 597 / 449).
        Agent sessions' KV is kept between turns (in GPU memory) within `session_cache_bytes` /
        `max_sessions` (replicas.session_cache; max_sessions=0 turns reuse off), one cache for all slots.
        resident: requests join a running batch launch without a relaunch when a slot of its build is free
        (replicas/monokernel_resident.py; the batch builds leave SMs to the joiners' prefill). idle_s: how
        long such a launch stays up with no request left (0: it ends; a lone request is faster on the
        single-sequence build anyway)."""
        sessions = SessionCache(session_cache_bytes, max_sessions)  # bad bounds fail before the GPU work
        if not 0.0 <= float(idle_s) <= 3600.0:
            raise ValueError(f"idle_s={idle_s}: a resident launch waits 0..3600 s for a request")
        devices = list(devices)
        if len(devices) != 1:
            raise ValueError(f"devices={devices}: the batched monokernel runs on one GPU")
        if resident:
            prefer_eager_module_loading()
        gpu = BatchGpuModel(config, tensors, batch, device=devices[0], max_context=max_context,
                            progress=progress, layout_options=layout_options, sub_builds=sub_builds,
                            resident=resident)
        from replicas.monokernel_prefill import Prefill
        from replicas.prefill_graph import GraphArena

        arena = GraphArena(gpu.cp)  # the slots' prefill graphs share one pool of temporaries (prefill_graph.py)
        self._start(config, gpu, devices, lambda view: Prefill(view, graph_arena=arena), sessions, idle_s)
        with gpu.cp.cuda.Device(gpu.device), gpu.stream:  # the slots' prompt-bucket graphs, before any request
            for graphs in (p.graphs for p in self._prefill if p.graphs is not None):
                graphs.warm()
        if self._joiner is not None and self._joiner.warm(self.max_batch - 1, self.max_context,
                                                          config.vocab_size) is None:
            self._joiner.close()
            self._joiner = None  # nothing of a join's prefill runs beside a launch here: requests relaunch

    @classmethod
    def around(cls, config: ModelConfig, gpu, prefill, devices: Sequence[int] = (0,), *,
               session_cache_bytes: int = DEFAULT_MAX_BYTES,
               max_sessions: int = DEFAULT_MAX_SESSIONS, idle_s: float = 0.0) -> BatchedMonokernelEngine:
        """Exists for tests (tests/test_monokernel_batch_cpu.py): the engine around an already built `gpu`
        (BatchGpuModel, or a stand-in with its slot API; `gpu.resident` makes it resident) and
        `prefill(slot_view)` -> an object whose `run(ids, all_logits=False, start=0)` prefills that slot
        (monokernel_prefill.Prefill)."""
        engine = cls.__new__(cls)
        engine._start(config, gpu, list(devices), prefill, SessionCache(session_cache_bytes, max_sessions), idle_s)
        return engine

    def _start(self, config: ModelConfig, gpu, devices: list[int], prefill, sessions: SessionCache,
               idle_s: float = 0.0) -> None:
        self.config, self.gpu, self.sessions = config, gpu, sessions
        self._sessions = SlotSessions(sessions, gpu)
        self.max_batch, self.max_context, self.devices = self.gpu.batch, self.gpu.max_context, devices
        self._prefill = [prefill(self.gpu.slot_view(b)) for b in range(self.max_batch)]
        self.resident = bool(getattr(gpu, "resident", False))
        self._joiner = Joiner(gpu, self._prefill) if self.resident else None
        self.idle_ns = int(float(idle_s) * 1e9)
        self.resident_joins = 0  # requests admitted into a running launch (no relaunch)
        self.stalled_joins = 0  # joins that waited past JOIN_STALL_S for the running launch (it was asked to yield)
        self._resident_launch = False  # a resident batch launch is running (session KV is then copied at once)
        self._want_gpu = threading.Event()  # forward_logits waits for an idle resident launch to end
        self._cv = threading.Condition()
        self._pending: deque[_Request] = deque()
        self._slots: list[_Request | None] = [None] * self.max_batch
        self._x: dict[int, object] = {}  # slot -> hidden state to (re)start it from (CuPy [H])
        self._closed = False
        self.failed: str | None = None  # why the GPU can run nothing more (EngineFailed); then every request is refused
        self._running = False  # a launch is on the GPU
        self._admitting = 0  # requests taken from _pending whose prefill has not put them in a slot yet
        self.profile = None  # CuPy uint64[13]: phase times of each launch (bench)
        self.launches = 0  # launches so far (each join costs one)
        self.single_launches = 0  # of which on the single-sequence build (one slot occupied)
        self.join_latencies: deque[float] = deque(maxlen=256)  # submit -> prefill start, seconds
        self._thread = threading.Thread(target=self._schedule, name="mk-batch-scheduler", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path: str | Path, batch: int = 4, devices: Sequence[int] = (0,),
                        max_context: int | None = None, progress: bool | None = None,
                        layout_options: dict | None = None, sub_builds: bool = True, *,
                        session_cache_bytes: int = DEFAULT_MAX_BYTES,
                        max_sessions: int = DEFAULT_MAX_SESSIONS, resident: bool = False,
                        idle_s: float = 0.0) -> BatchedMonokernelEngine:
        from replicas.monokernel_gpu import import_cupy
        from replicas.weights import load_weights

        SessionCache(session_cache_bytes, max_sessions)  # bad bounds fail before reading gigabytes
        if resident:
            prefer_eager_module_loading()  # before import_cupy's first CUDA call
        config = ModelConfig.from_pretrained(path)
        import_cupy()
        tensors = load_weights(path, config, dtype="raw", progress=progress)
        return cls(config, tensors, batch=batch, devices=devices, max_context=max_context, progress=progress,
                   layout_options=layout_options, sub_builds=sub_builds, session_cache_bytes=session_cache_bytes,
                   max_sessions=max_sessions, resident=resident, idle_s=idle_s)

    # ---- Engine protocol -------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 session_id: str | None = None) -> Generation:
        """Start a generation in a free slot; raises InvalidRequest (bad input) or EngineBusy. With
        `session_id`, as MonokernelEngine.generate: the KV that session's previous turn left is reused
        for the common prefix and this turn's KV is kept for the next one (not after a cancel or an error)."""
        ids, stops = check_request(self.config, self.max_context, prompt_ids, params)
        with self._cv:
            if self.failed:
                raise EngineFailed(self.failed)
            if self._closed:
                raise EngineBusy("the engine is closed")
            if len(self._pending) + self._admitting + sum(s is not None for s in self._slots) >= self.max_batch:
                raise EngineBusy(f"all {self.max_batch} slots of the batched monokernel are busy; "
                                 "retry when one finishes")
            req = _Request(ids, params, stops, threading.Event(), session_id=session_id or None)

            def steps(cancel: threading.Event):
                req.cancel = cancel  # watched from the start: cancel()/close() before next() frees the slot too
                return self._stream(req, cancel)

            gen = _BatchGeneration(steps, req)
            self._pending.append(req)
            self._cv.notify_all()
        weakref.finalize(gen, gen._cancel.set)  # dropped without close(): its slot is freed, not decoded to the end
        return gen

    def _stream(self, req: _Request, cancel: threading.Event):
        finished = False
        try:
            while True:
                try:
                    item = req.out.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item[0] == "tok":
                    yield item[1]
                elif item[0] == "end":
                    finished = True
                    return item[1], item[2]
                else:
                    finished = True
                    raise item[1]
        finally:
            if not finished:  # closed early: the scheduler cancels the slot (or drops the pending request)
                cancel.set()
                with self._cv:
                    self._cv.notify_all()

    def forward_logits(self, token_ids: Sequence[int], prefill_len: int = TEACHER_PREFILL) -> np.ndarray:
        return self.forward_logits_slots([token_ids], prefill_len)[0]

    def forward_logits_slots(self, sequences: Sequence[Sequence[int]], prefill_len: int = TEACHER_PREFILL
                             ) -> list[np.ndarray]:
        """Teacher-forced logits of up to B sequences decoded together (slot i = sequences[i]): each
        [len, V] float32, the first `prefill_len` positions from the prefill, the rest from one batch
        launch. Needs an idle engine (raises EngineBusy otherwise; replicas/monokernel_batched_teacher.py)."""
        return teacher_forced_slots(self, sequences, prefill_len)

    def session_stats(self) -> SessionStats:
        """Session KV reuse counters and what is resident now."""
        return self.sessions.stats()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
        if self._joiner is not None:
            self._joiner.close()

    # ---- the scheduler thread --------------------------------------------------------------
    def _schedule(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._pending and not any(self._slots):
                    self._cv.wait(0.1)
                if self._closed and not any(self._slots):
                    for r in self._pending:
                        r.out.put(("err", EngineBusy("the engine was closed before this request started")))
                    self._pending.clear()
                    return
                joins = self._take_joins()
            try:
                self._admit(joins)
                if any(self._slots):
                    self._decode()
                with self._cv:
                    self._running = False
                    self._cv.notify_all()  # (forward_logits may be waiting for the GPU)
            except Exception as e:  # a GPU failure ends every request it touched, with the error
                if isinstance(e, EngineFailed):
                    self.failed = str(e)
                with self._cv:  # slots freed before anyone hears of the failure (a retry must find them free)
                    failed = [r for r in self._slots if r is not None] + [r for r in joins if r.spec is None]
                    self._slots = [None] * self.max_batch
                    self._running = False
                    self._admitting = 0
                    self._cv.notify_all()
                self._sessions.abandon()  # slots that finished before the failure: their KV is not kept
                for r in failed:
                    self._sessions.fail(r)
                    r.out.put(("err", e))

    def _take_joins(self) -> list[_Request]:
        """Pending requests that fit the free slots (called with the lock held)."""
        free = sum(s is None for s in self._slots)
        joins = []
        while self._pending and len(joins) < free:
            joins.append(self._pending.popleft())
        self._admitting = len(joins)  # still busy slots for generate() until admitted
        self._running = True  # forward_logits must not start meanwhile
        return joins

    def _admit(self, joins: list[_Request]) -> None:
        """Prefill each join into a free slot (the GPU is ours: no launch is running)."""
        for r in joins:
            if r.cancel.is_set():
                with self._cv:
                    self._admitting -= 1
                r.out.put(("end", FinishReason.CANCELLED, None))
                continue
            b = self._slots.index(None)
            r.admitted = time.perf_counter()
            self.join_latencies.append(r.admitted - r.submitted)
            self.gpu.slot_ctrl(b)[:] = 0  # a new request's control words
            with self.gpu.cp.cuda.Device(self.gpu.device), self.gpu.stream:
                r.reused = start = self._sessions.restore(r, b)  # a session's stored rows [0, start)
                x_last, _ = self._prefill[b].run(r.ids, start=start)
            r.spec = self._slot_spec(r)
            with self._cv:
                self._slots[b] = r
                self._admitting -= 1
            self._x[b] = x_last

    def _slot_spec(self, r: _Request) -> SlotSpec:
        p = r.params
        return SlotSpec(start_pos=len(r.ids), max_steps=min(p.max_tokens, self.max_context - len(r.ids)),
                        mode=sampling_mode(p), temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                        seed=sampling_seed(p), stop_ids=r.stops)

    def _decode(self) -> None:
        """One launch over the occupied slots, streaming until it ends (all done, or a yield). A lone
        slot runs the single-sequence build; every slot resumes from its hidden state and emitted count."""
        gpu = self.gpu
        occupied = [b for b, r in enumerate(self._slots) if r is not None]
        for b in occupied:
            self._slots[b].spec.step0 = int(gpu.slot_ctrl(b)[L.CTRL_COUNT])  # resume after what it emitted
        single = len(occupied) == 1
        width = 1
        if single:
            gpu.launch_single(occupied[0], self._slots[occupied[0]].spec, self._x[occupied[0]], profile=self.profile)
            self.single_launches += 1
        else:
            width = gpu.launch_slots([r.spec if r is not None else None for r in self._slots],
                                     fresh={b: self._x[b] for b in occupied}, profile=self.profile,
                                     idle_ns=self.idle_ns)
        resident = self._joiner is not None and not single
        self._resident_launch = resident
        self.launches += 1
        yielded = False
        while True:
            try:
                running = not gpu.stream.done
            except Exception as e:  # the launch faulted: CUDA's error is sticky, nothing runs on this GPU again
                raise EngineFailed(f"the batched monokernel on GPU {gpu.device} failed ({e}); its CUDA context is "
                                   "lost: restart the replica") from e
            self._drain(final=not running)
            if not running:
                break
            joining = resident and not yielded and self._join_resident(width)
            # an idle resident launch hands the GPU back when the engine closes or forward_logits wants it
            hand_back = resident and not any(self._slots) and (self._closed or self._want_gpu.is_set())
            if not yielded and (hand_back or (not joining and (self._join_waiting()
                                                               or (not single and self._lone_left())))
                                or (joining and self._join_stalled())):
                gpu.request_yield()  # admit the newcomer, go to the single build, or hand the GPU back
                yielded = True
            poll_sleep()
        gpu.synchronize()
        self._resident_launch = False
        unjoined = self._end_joins() if resident else {}
        self._sessions.store()  # the KV of sessions' slots that ended in this launch (before any admission)
        for b, r in enumerate(self._slots):
            if r is not None:  # (a join the launch never took starts from its prefill's hidden state)
                self._x[b] = unjoined[b] if b in unjoined else gpu.hidden_state(b, single)

    def _join_waiting(self) -> bool:
        with self._cv:
            return bool(self._pending) and not self._closed and any(s is None for s in self._slots)

    def _lone_left(self) -> bool:
        """One slot still decodes in a batch launch, with enough tokens left to pay for a relaunch."""
        left = [r for r in self._slots if r is not None]
        return len(left) == 1 and left[0].spec.max_steps - left[0].sent > SWITCH_MIN_TOKENS

    def _drain(self, final: bool) -> None:
        """Send each slot's new tokens, forward cancels, free finished slots. Slots that have sent nothing yet
        go first: their first token is a request's TTFT, and each token put wakes its caller's thread."""
        gpu, ends = self.gpu, []
        for b in sorted(range(len(self._slots)), key=lambda b: self._slots[b] is None or self._slots[b].sent > 0):
            r = self._slots[b]
            if r is None:
                continue
            ctrl = gpu.slot_ctrl(b)
            if r.cancel.is_set() and not ctrl[L.CTRL_DONE]:
                ctrl[L.CTRL_CANCEL] = 1
            done = bool(ctrl[L.CTRL_DONE])
            count = int(ctrl[L.CTRL_COUNT])
            if not r.cancel.is_set():
                toks = gpu.slot_tokens(b)
                while r.sent < count:
                    r.out.put(("tok", int(toks[r.sent])))
                    r.sent += 1
            if done or (final and r.cancel.is_set()):
                status = _STATUS.get(int(ctrl[L.CTRL_STATUS]), FinishReason.LENGTH)
                if r.cancel.is_set():
                    status = FinishReason.CANCELLED
                stop = int(ctrl[L.CTRL_STOP_TOKEN]) if status is FinishReason.STOP else None
                self._sessions.ended(r, b, status, count)  # its KV, if kept, is copied when the launch ends
                with self._cv:  # free the slot first: a caller that saw the end may reuse it at once
                    self._slots[b] = None
                    self._cv.notify_all()
                ends.append((r, ("end", status, stop)))
        try:
            if self._sessions.pending and self._resident_launch:
                # a resident launch keeps running: the ended slots' rows are copied now, on the prefill
                # stream, before their ends are sent (and before a joiner may take the slot)
                self._sessions.store(stream=gpu.prefill_stream)
            elif self._sessions.pending and not any(self._slots):
                # the last slot ended: the launch is ending anyway, so the session's entry is stored
                # before its end is sent (session_stats() is then current when the caller sees the end)
                gpu.synchronize()
                self._sessions.store()
        finally:  # (a GPU failure in the copy: these requests still end; the scheduler fails the rest)
            for r, end in ends:
                r.out.put(end)
