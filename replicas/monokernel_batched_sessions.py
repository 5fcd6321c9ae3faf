"""Agent-session KV reuse for the slots of the batched monokernel engine (replicas/monokernel_batched.py).

The single-sequence engine's rules (replicas/monokernel.py), per slot. When a request of a session
is admitted into slot b, the scheduler acquires the session's lease (replicas/session_cache.py),
copies the stored rows [0, reused) into slot b's KV view and prefills only the rest. When the slot
ends by STOP or LENGTH, the rows the kernel left valid are copied into GPU arrays of exactly that
length and kept as the session's entry; a cancel or an error drops the entry (which rows are valid
is then unknown). A second request of a session that is running gets a fresh prefill.

A slot usually ends while the other slots keep decoding in the same launch. Its generation ends at
once; its KV is copied only after that launch has ended (no device allocation while the persistent
kernel holds the GPU), ahead of any admission: the kernel no longer touches a finished slot, and
nothing is prefilled into it before the launch ends. The session's next turn is such an admission
(its join makes the launch yield), so it always finds the entry. Until then the entry is not
visible in session_stats(); a slot that was the launch's last is stored before its end is sent.

With a resident engine (replicas/monokernel_resident.py) the launch may not end for a long time, so a
session's slot is copied out as soon as it ends (on the prefill stream, which the running kernel leaves
alone), and a later turn joining that launch gets its rows copied in on that stream before its prefill.

Tested on the CPU (tests/test_monokernel_batched_sessions_cpu.py, tests/test_monokernel_resident_cpu.py) and
on the H200 (tests/test_monokernel_batch_gpu.py::test_a_sessions_turn_two_equals_a_fresh_request; resident:
not yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replicas.engine import FinishReason
from replicas.monokernel import _SessionKV
from replicas.session_cache import SessionCache


@dataclass
class _Keep:
    """A finished slot whose KV is copied once the launch has ended."""

    req: Any  # the engine's request (its `lease`, `ids`)
    slot: int
    n: int  # valid KV rows
    tokens: list[int]  # the ids those rows hold


class SlotSessions:
    """The session side of one batched engine: lease per admitted request, KV copies per slot."""

    def __init__(self, cache: SessionCache, gpu):
        self.cache, self.gpu = cache, gpu
        self.pending: list[_Keep] = []  # slots that ended in the running launch, KV not copied yet

    def restore(self, req, b: int, stream=None) -> int:
        """At admission into slot b (no launch running, or a resident launch in which slot b is free): take
        the request's lease and copy the stored rows [0, reused) into the slot's cache, on `stream` (default
        the engine's), where the slot's prefill follows; returns how many (0 = prefill the whole prompt)."""
        if not req.session_id:
            return 0
        req.lease = lease = self.cache.acquire(req.session_id, req.ids)
        if lease.kv is None:
            return 0
        r, view, gpu = lease.reused, self.gpu.slot_view(b), self.gpu
        with gpu.cp.cuda.Device(gpu.device), stream or gpu.stream:  # ordered before the prefill on that stream
            view.k_cache[:, :, :r] = lease.kv.k[:, :, :r]
            view.v_cache[:, :, :r] = lease.kv.v[:, :, :r]
        return r

    def ended(self, req, b: int, reason: FinishReason, count: int) -> bool:
        """Slot b finished with `count` tokens emitted. True: its KV is to be kept, by `store()` once the
        launch has ended (before anything is admitted into slot b); False: nothing to keep.

        The kernel feeds a token through the layers (writing its K/V) only at a step that did not end
        the generation: on LENGTH the last emitted token never was; on STOP every emitted token was
        (the stop token is neither emitted nor fed)."""
        lease = req.lease
        if lease is None:
            return False
        if reason not in (FinishReason.STOP, FinishReason.LENGTH):
            self.cache.discard(lease)
            return False
        n = len(req.ids) + count - (1 if reason is FinishReason.LENGTH else 0)
        view = self.gpu.slot_view(b)
        nbytes = int(view.k_cache[:, :, :n].nbytes + view.v_cache[:, :, :n].nbytes)
        if nbytes > self.cache.max_bytes or self.cache.max_sessions == 0:
            self.cache.discard(lease)  # would be evicted at once: skip the copy
            return False
        fed = [int(t) for t in self.gpu.slot_tokens(b)[:n - len(req.ids)]]
        self.pending.append(_Keep(req, b, n, req.ids + fed))
        return True

    def store(self, stream=None) -> int:
        """Copy each pending slot's valid rows into the session's entry: after the launch has ended, on the
        engine's stream; or while a resident launch runs (which no longer touches a finished slot) on
        `stream`, its prefill stream, waited for, so the entry is complete for any stream that reads it.
        Returns how many were pending."""
        done, gpu = 0, self.gpu
        while self.pending:
            keep = self.pending[0]
            view = gpu.slot_view(keep.slot)
            try:
                with gpu.cp.cuda.Device(gpu.device), stream or gpu.stream:
                    kv = _SessionKV(view.k_cache[:, :, :keep.n].copy(), view.v_cache[:, :, :keep.n].copy())
                    if stream is not None:
                        stream.synchronize()
            except gpu.cp.cuda.memory.OutOfMemoryError:  # keeping the KV is an optimisation: the turn itself succeeded
                self.cache.discard(keep.req.lease)
            else:
                self.cache.release(keep.req.lease, kv, keep.tokens, kv.nbytes)
            self.pending.pop(0)
            done += 1
        return done

    def abandon(self) -> None:
        """A GPU failure: drop the pending slots' entries (their requests ended before the failure)."""
        for k in self.pending:
            self.cache.discard(k.req.lease)
        self.pending.clear()

    def fail(self, req) -> None:
        """The request ended with an error: which rows are valid is unknown, drop the session's entry."""
        if req.lease is not None:
            self.cache.discard(req.lease)
