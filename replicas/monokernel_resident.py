"""Host side of a resident batch launch (layout option resident, csrc/mk_batch.cuh): requests join the
running kernel at a step boundary instead of through a relaunch.

The scheduler prefills a request into a free slot while the kernel decodes the others (the resident
builds leave `PREFILL_SMS` SMs to the prefill's kernels), writes the slot's table row, stop ids and last
hidden state (`admit_x`), and then publishes the slot through the host-mapped words of
replicas/layout_params.py (KCTL_ADMIT_*). The kernel admits it at its next step boundary and
acknowledges; a launch that ends first (a yield, or idle for longer than its `idle_ns`) never admits
what it did not acknowledge, so the scheduler then starts those slots in its next launch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

import numpy as np

from replicas import layout as L
from replicas.engine import FinishReason

log = logging.getLogger(__name__)

PREFILL_SMS = 16  # SMs a resident build leaves free for a joining request's prefill (cuBLAS, our kernels)
# Prompt lengths the join worker prefills once before the first launch, so that the kernels (and, with lazy
# module loading, the cuBLAS GEMMs picked for these sizes) are loaded before any launch runs.
WARM_LENGTHS = (1, 8, 32, 128, 512, 2048)
# fp32 GEMM mode (cuBLAS's SIMT kernels on the 16 free SMs) measured on the H200, llama-3.2-1b beside a B = 4
# launch: 40 / 60-token joins prefilled in 50-60 ms (join TTFT 46-62 ms; idle engine 11 ms). Longer prompts
# relaunch: their prefill runs on every SM's tensor cores, for a 12-24 ms gap in the running slots.
FP32_JOIN_TOKENS = 64
# The mma.sync GEMM (replicas/prefill_gemm.py) on the 16 free SMs, replayed from CUDA graphs, measured on the H200
# (llama-3.2-1b beside a B = 4 launch): 40 / 60-token joins prefill in 10 ms (TTFT 12 ms), 300 tokens (padded to
# 512 rows) in 58 ms. Longer prompts relaunch. Open: with graph prefill a relaunch got cheaper too (its prefill
# runs on every SM); where the two cross for the joiner and the running slots is not measured yet.
MMA_JOIN_TOKENS = 512
# A join under way for longer than this is waiting for the running launch, not prefilling (the longest joins
# measured: 512 rows beside a B = 4 launch ~60 ms; fp32 mode's 64 tokens 50-60 ms). What waits for a launch is a
# kernel loaded for the first time (or a device-wide synchronization): it would wait until every running request
# ends, seconds. Past this the scheduler asks the launch to yield, so the join completes and starts in a relaunch.
JOIN_STALL_S = 0.5
# A join mode's logits against the tensor-core prefill's: the same bf16 products summed in another order,
# so an activation's bf16 re-rounding between GEMMs can land one ulp (2^-8) apart and spread through the
# layers. Measured on the H200 (llama-3.2-1b shapes, every logit of a 200-token prompt): mma 6.2e-3, fp32
# 7.0e-3 of the largest logit. A broken kernel is off by O(1); the transformers bound (tests' TOL) is 2e-2.
JOIN_MODE_TOL = 1e-2


def prefer_eager_module_loading() -> None:
    """Ask CUDA to load every kernel at start (CUDA_MODULE_LOADING=EAGER) unless the operator chose: with
    lazy loading (CUDA 12's default) a kernel's first launch can wait for the running kernels to finish,
    and the resident launch runs until its slots end, so a join whose prefill meets a new cuBLAS GEMM would
    wait for the whole batch. Takes effect only before this process first uses CUDA."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


def module_loading_mode() -> str | None:
    """This process's CUDA module loading ("lazy" / "eager", from the driver), None where unknown."""
    try:
        mode = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuModuleGetLoadingMode(ctypes.byref(mode)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return {1: "eager", 2: "lazy"}.get(mode.value)  # CU_MODULE_EAGER_LOADING = 1, CU_MODULE_LAZY_LOADING = 2


class Admissions:
    """The admission words of one launch (`kctl`: the host-mapped host_kctl int32 array, zeroed at launch).

    publish(mask) hands slots to the kernel; `consumed` says whether the last publication was
    acknowledged; only then may the next one be written (the kernel reads the mask once per new
    sequence number)."""

    def __init__(self, kctl):
        self.kctl = kctl
        self.seq = 0
        self.pending = 0  # slot mask published and not yet acknowledged

    def reset(self) -> None:
        """A new launch (its host_kctl words were just zeroed)."""
        self.seq, self.pending = 0, 0

    @property
    def consumed(self) -> bool:
        return int(self.kctl[L.KCTL_ADMIT_ACK]) == self.seq

    def publish(self, mask: int) -> None:
        if not self.consumed:
            raise RuntimeError("the kernel has not acknowledged the last admission yet")
        if not 0 < mask < 1 << L.MAX_BATCH:
            raise ValueError(f"admission mask {mask:#x}: one bit per slot of at most {L.MAX_BATCH}")
        self.kctl[L.KCTL_ADMIT_MASK] = mask  # (x86 keeps these two stores in order, and the kernel
        self.seq += 1                        # fences between reading SEQ and MASK)
        self.kctl[L.KCTL_ADMIT_SEQ] = self.seq
        self.pending = mask

    def settle(self) -> int:
        """Slots whose publication the kernel acknowledged since the last call (and forget them)."""
        if self.pending and self.consumed:
            done, self.pending = self.pending, 0
            return done
        return 0


class _Queued:
    """A join the scheduler queued on the prefill stream itself, shaped like the worker's Future for
    Joiner.poll and finish_launch: done() once its event has completed and the slot is published."""

    def __init__(self, event, publish, error: BaseException | None = None):
        self.event, self._publish, self._error = event, publish, error
        self._done = error is not None

    def done(self) -> bool:
        if not self._done and self.event.done:
            self._publish()
            self._done = True
        return self._done

    def exception(self) -> BaseException | None:
        if not self._done:
            self.event.synchronize()
            self.done()
        return self._error


class Joiner:
    """One join at a time into a running resident launch, for the batched engine's scheduler thread:
    the prefill (on the prefill stream, in a worker thread so the scheduler keeps streaming tokens),
    then the slot's admission words. `x[b]` keeps each joiner's hidden state until the kernel has
    acknowledged it, so a launch that ended first can start the slot itself."""

    def __init__(self, gpu, prefills):
        from concurrent.futures import ThreadPoolExecutor

        self.gpu, self.prefills = gpu, prefills
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mk-join-prefill")
        self.job = None  # (slot, Future) of the join under way
        self.mode: str | None = "tensor"  # the joins' GEMMs (warm() checks what runs beside a launch)
        self.max_join_tokens: int | None = None  # longest prompt that joins (None: any)
        self.x: dict[int, object] = {}  # slot -> hidden state of a join not yet acknowledged
        self.started = 0.0  # perf_counter at the last start()

    def start(self, b: int, ids, spec, start: int = 0) -> None:
        """Prefill `ids[start:]` into slot b (free, and outside the running launch's live slots; rows
        [0, start) restored on the prefill stream before) and publish it.

        A prompt whose prefill graph is captured already is queued right here, on the scheduler's thread (a
        few async calls: row, graph replay, hidden-state copy, event), and published when poll() finds its
        event done. Others prefill in the worker thread (a capture or an eager prefill takes milliseconds of
        host time). Measured on the H200 beside a B = 8 launch: each handover between the two threads cost
        0.1-0.5 ms waiting for the GIL behind the polling threads."""
        if self.job is not None or not self.gpu.admissions.consumed:
            raise RuntimeError("one join at a time: the last one is still under way")
        self.started = time.perf_counter()
        try:
            self.gpu.stage_join(b, spec)  # (queued ahead of the prefill, on the prefill stream)
            queued = self._queue_replay(b, ids, start)
        except Exception as e:  # noqa: BLE001 - the join fails (its request gets the error), not the scheduler
            queued = _Queued(None, None, e)
        if queued is not None:
            self.job = (b, queued)
            return

        def run():
            gpu = self.gpu
            with gpu.cp.cuda.Device(gpu.device), gpu.prefill_stream:
                x_last, _ = self.prefills[b].run(ids, start=start)
            gpu.hand_over(b, x_last)
            self.x[b] = x_last
            gpu.admissions.publish(1 << b)

        self.job = (b, self._pool.submit(run))

    def _queue_replay(self, b: int, ids, start: int) -> _Queued | None:
        """Slot b's prefill from its captured graph, the hidden-state copy and an event, all queued on the
        prefill stream; None when no graph of this shape is captured (the worker prefills it then)."""
        gpu, graphs = self.gpu, getattr(self.prefills[b], "graphs", None)
        if graphs is None or self.mode is None:
            return None
        with gpu.cp.cuda.Device(gpu.device), gpu.prefill_stream:
            x_last = graphs.replay_captured(ids, start, self.mode)
            if x_last is None:
                return None
            gpu.queue_hand_over(b, x_last)
            done = gpu.cp.cuda.Event(disable_timing=True)
            done.record(gpu.prefill_stream)

        def publish():
            self.x[b] = x_last
            gpu.admissions.publish(1 << b)
        return _Queued(done, publish)

    def warm(self, slot: int, max_context: int, vocab_size: int) -> str | None:
        """Before the first launch, in the worker thread on the prefill stream: pick the joins' GEMM mode
        (replicas/monokernel_blas.GEMM_MODES, in that order) as the first one whose prefills of WARM_LENGTHS
        (into `slot`, free now) run beside a kernel holding the launch's SMs (concurrency_check.runs_beside)
        and agree with the tensor-core prefill within JOIN_MODE_TOL. Loading each mode's kernels then (and
        the thread's cuBLAS handle, told to plan for the free SMs) keeps those loads out of a running launch.
        Sets and returns the mode; None: nothing ran beside it (no joins: every request relaunches)."""
        from replicas.concurrency_check import runs_beside
        from replicas.monokernel_blas import GEMM_MODES, load_gemm_mode, set_sm_count_target, use_gemm_mode

        gpu, cp, pre = self.gpu, self.gpu.cp, self.prefills[slot]
        lengths = [n for n in WARM_LENGTHS if n < max_context]
        probe = [i * 7 % vocab_size for i in range(min(128, max_context - 1))]

        def prefill_all():
            for n in lengths:
                pre.run([i % vocab_size for i in range(n)])
            gpu.prefill_stream.synchronize()

        def logits():
            out = cp.asnumpy(pre.run(probe, all_logits=True)[1])
            gpu.prefill_stream.synchronize()
            return out

        def run():
            tried = []
            with cp.cuda.Device(gpu.device), gpu.prefill_stream:
                targeted = set_sm_count_target(cp, gpu.device_sms - gpu.layout.num_sms)
                use_gemm_mode("tensor")
                want = logits()
                self._warm_handover(slot)
                for mode in GEMM_MODES:
                    try:
                        use_gemm_mode(mode)
                        load_gemm_mode(cp, mode)
                        prefill_all()  # loads this mode's kernels (the ones shape-specific libraries pick)
                        if mode == "fp32" and module_loading_mode() == "lazy":  # cuBLAS picks by shape
                            for n in range(1, min(FP32_JOIN_TOKENS, max_context - 1) + 1):
                                pre.run([i % vocab_size for i in range(n)])  # each fresh join's GEMM shapes
                        err = float(np.max(np.abs(logits() - want)) / np.max(np.abs(want)))
                        if not err <= JOIN_MODE_TOL:
                            tried.append(f"{mode}: logits {err:.1e} from the tensor-core prefill's")
                            continue
                        t = time.perf_counter()
                        prefill_all()
                        free_s = time.perf_counter() - t  # on every SM; beside a launch it gets 1/8 of them
                        beside, secs = runs_beside(cp, gpu.layout.num_sms, gpu.stream, prefill_all,
                                                   max_s=max(2.0, 30 * free_s))
                    except Exception as e:  # noqa: BLE001 - a mode that fails here is not used; the next is tried
                        tried.append(f"{mode}: {type(e).__name__}: {e}")
                        continue
                    tried.append(f"{mode}: {secs * 1e3:.1f} ms, {'beside' if beside else 'waited'}")
                    if beside:
                        for p in self.prefills:  # every slot's prefill graphs of this mode, before any launch
                            if getattr(p, "graphs", None) is not None:  # (sessions' suffix shapes too)
                                p.graphs.capture_all()
                        gpu.prefill_stream.synchronize()
                        return mode, targeted, tried
                use_gemm_mode("tensor")
                return None, targeted, tried

        self.mode, targeted, tried = self._pool.submit(run).result()
        self.max_join_tokens = self._limit(self.mode)
        msg = (f"resident joins: GEMM mode {self.mode} (prefills of {lengths} tokens beside a kernel on "
               f"{gpu.layout.num_sms} SMs: {'; '.join(tried)}; cuBLAS SM target set: {targeted})")
        (log.info if self.mode == "tensor" else log.warning)(msg if self.mode else
                                                             msg + "; joins are off, requests relaunch")
        if module_loading_mode() == "lazy":
            log.warning("CUDA lazy module loading is on in this process: a join whose prefill needs a kernel "
                        "not loaded yet waits for the running launch to end. Set CUDA_MODULE_LOADING=EAGER "
                        "before the process first uses CUDA (`monoserve replica --resident` and the resident "
                        "engine's from_pretrained do when nothing used CUDA yet).")
        return self.mode

    def _warm_handover(self, slot: int) -> None:
        """CuPy compiles and loads a kernel at its first use, and that load waits for a running launch:
        measured on the H200, a session's first KV store (a strided copy) held its turn's end until the launch
        ended. So the join's other GPU operations run once here, on `slot` (free; no launch yet): a session's
        store and restore copies, and prepare_join's writes (its row says active = 0, nothing is published)."""
        from replicas.monokernel_batch import SlotSpec

        gpu, cp = self.gpu, self.gpu.cp
        view = gpu.slot_view(slot)
        for n in (1, 2, 17, 300):
            n = min(n, view.k_cache.shape[2])
            for cache in (view.k_cache, view.v_cache):
                rows = cache[:, :, :n].copy()  # SlotSessions.store
                cache[:, :, :n] = rows  # SlotSessions.restore: all stored rows
                cache[:, :, :max(1, n - 1)] = rows[:, :, :max(1, n - 1)]  # or a prefix of them
        gpu.prefill_stream.synchronize()
        spec = SlotSpec(start_pos=1, max_steps=1, stop_ids=(1, 2))  # stop ids: their copy kernel too
        gpu.prepare_join(slot, spec, cp.zeros(gpu.config.hidden_size, cp.float32))

    @staticmethod
    def _limit(mode: str | None) -> int | None:
        return {"fp32": FP32_JOIN_TOKENS, "mma": MMA_JOIN_TOKENS}.get(mode)

    def takes(self, n_tokens: int) -> bool:
        """Whether a join that prefills n_tokens may join (mma / fp32 modes: up to their limit; a longer
        prefill is faster relaunched, on every SM's tensor cores)."""
        return self.max_join_tokens is None or n_tokens <= self.max_join_tokens

    def poll(self) -> tuple[int, BaseException | None] | None:
        """(slot, error or None) once the join under way has been published (or failed), else None."""
        if self.job is None or not self.job[1].done():
            return None
        b, fut = self.job
        self.job = None
        return b, fut.exception()

    @property
    def busy(self) -> bool:
        return self.job is not None or not self.gpu.admissions.consumed

    def finish_launch(self) -> dict[int, object]:
        """After a launch ended: the slots published to it that it never admitted -> their hidden states
        (the next launch starts them as fresh slots). Waits for a join still under way."""
        if self.job is not None:
            self.job[1].exception()  # wait; its error is reported by poll()
        self.acknowledged()
        left, self.x = self.x, {}
        return left

    def close(self) -> None:
        """Stop the prefill worker (after the engine's scheduler has stopped)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def acknowledged(self) -> None:
        """Forget the hidden states of joins the running launch has acknowledged."""
        joined = self.gpu.admissions.settle()
        for b in [b for b in self.x if (joined >> b) & 1]:
            del self.x[b]


class ResidentJoins:
    """The batched engine's scheduler steps for a resident launch (mixed into BatchedMonokernelEngine,
    replicas/monokernel_batched.py, whose state they use: _joiner, _slots, _pending, _cv)."""

    def _join_resident(self, width: int) -> bool:
        """While a resident batch launch of `width` slots runs: carry the join under way forward, or start
        the next pending request's in a free slot of the launch (an agent session's stored rows are copied
        into it first, on the prefill stream; ended sessions' rows are copied out as their slots end, in
        `_drain`). A join with no free slot takes the yield path. True while a join is under way, so the
        launch is not asked to yield for it."""
        j = self._joiner
        j.acknowledged()
        done = j.poll()
        if done is not None and done[1] is not None:  # its prefill failed: that request ends with the error
            self._fail_join(*done)
        if j.busy:
            return True
        kept = {k.slot for k in self._sessions.pending}  # (stored by _drain before their ends are sent)
        with self._cv:
            free = [b for b in range(width) if self._slots[b] is None and b not in kept]
            if self._closed or not self._pending or not free or not j.takes(self._to_prefill(self._pending[0])):
                return False
            r = self._pending.popleft()
            if r.cancel.is_set():
                r.out.put(("end", FinishReason.CANCELLED, None))
                return True
            b = free[0]
            self.gpu.slot_ctrl(b)[:] = 0  # before the slot is drained: not its last occupant's words
            self._slots[b] = r
        r.admitted = time.perf_counter()
        self.join_latencies.append(r.admitted - r.submitted)
        r.spec = self._slot_spec(r)
        r.reused = start = self._sessions.restore(r, b, stream=self.gpu.prefill_stream)
        j.start(b, r.ids, r.spec, start=start)
        self.resident_joins += 1
        return True

    def _join_stalled(self) -> bool:
        """The join under way has taken longer than JOIN_STALL_S (logged once per join): the running launch
        should yield, since whatever the join waits for (a first kernel load) waits for the launch to end."""
        j = self._joiner
        if j.job is None or time.perf_counter() - j.started <= JOIN_STALL_S:
            return False
        log.warning("a join into slot %d has been under way for %.0f ms (more than JOIN_STALL_S = %.2f s): it is "
                    "waiting for the running launch (most likely a kernel loaded for the first time; "
                    "CUDA_MODULE_LOADING=EAGER avoids most); asking the launch to yield so it starts in a relaunch",
                    j.job[0], 1e3 * (time.perf_counter() - j.started), JOIN_STALL_S)
        self.stalled_joins += 1
        return True

    def _to_prefill(self, r) -> int:
        """Tokens a join of r would prefill: its prompt less what its session's stored rows hold."""
        return len(r.ids) - (self.sessions.reusable(r.session_id, r.ids) if r.session_id else 0)

    def _end_joins(self) -> dict[int, object]:
        """After a resident launch ended: slots published to it that it never admitted -> their hidden
        states (the next launch starts them); a join whose prefill failed ends its request."""
        left = self._joiner.finish_launch()
        done = self._joiner.poll()
        if done is not None and done[1] is not None:
            self._fail_join(*done)
            left.pop(done[0], None)
        return left

    def _fail_join(self, b: int, err: BaseException) -> None:
        r = self._slots[b]
        self._sessions.fail(r)  # its rows are unknown: the session's entry goes
        with self._cv:  # the slot first: a retry must find it free
            self._slots[b] = None
            self._cv.notify_all()
        r.out.put(("err", err))
