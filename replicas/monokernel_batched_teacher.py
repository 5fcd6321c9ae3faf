"""BatchedMonokernelEngine.forward_logits_slots: teacher-forced logits of up to B sequences in one batch launch
(tests compare each slot with the single-sequence engine and transformers). It needs the GPU to itself: an idle
engine, or an idle resident launch, which is asked to hand the GPU back (replicas/monokernel_resident.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from replicas.engine import EngineBusy, InvalidRequest, validate_teacher_ids
from replicas.monokernel_batch import SlotSpec


def teacher_forced_slots(engine, sequences: Sequence[Sequence[int]], prefill_len: int) -> list[np.ndarray]:
    """`engine.forward_logits_slots` (its scheduler state: _cv, _running, _pending, _slots, _prefill)."""
    seqs = [validate_teacher_ids(s, engine.config, engine.max_context) for s in sequences]
    if not 1 <= len(seqs) <= engine.max_batch:
        raise InvalidRequest(f"{len(seqs)} sequences for {engine.max_batch} slots")
    cp, gpu, V = engine.gpu.cp, engine.gpu, engine.config.vocab_size
    with engine._cv:
        if engine._running and not engine._pending and not any(s is not None for s in engine._slots):
            # an idle resident launch (idle_s > 0) holds the GPU with no request in it: ask for it back
            engine._want_gpu.set()
            engine._cv.wait_for(lambda: not engine._running or engine._pending or any(engine._slots), timeout=30)
            engine._want_gpu.clear()
        if engine._running or engine._pending or any(s is not None for s in engine._slots):
            raise EngineBusy("forward_logits needs an idle batched engine")
        engine._running = True
    try:
        heads, specs, fresh = [], [None] * engine.max_batch, {}
        p = [max(1, min(prefill_len, len(s))) for s in seqs]
        with cp.cuda.Device(gpu.device), gpu.stream:
            for b, s in enumerate(seqs):
                gpu.slot_ctrl(b)[:] = 0  # not the last request's words (a cancel there would stop this one)
                x_last, head = engine._prefill[b].run(s[:p[b]], all_logits=True)
                heads.append(cp.asnumpy(head))
                if len(s) > p[b]:
                    specs[b] = SlotSpec(start_pos=p[b], max_steps=len(s) - p[b] + 1, forced=s[p[b]:])
                    fresh[b] = x_last
            steps = max((len(s) - pb + 1 for s, pb in zip(seqs, p)), default=0)
            if fresh:
                out = cp.zeros((steps, engine.max_batch, V), cp.float32)
                gpu.launch_slots(specs, fresh=fresh, logits=out)
                gpu.synchronize()
                out = cp.asnumpy(out)
        rows = []
        for b, s in enumerate(seqs):
            parts = [heads[b]]
            if len(s) > p[b]:
                parts.append(out[1:len(s) - p[b] + 1, b])
            rows.append(np.concatenate(parts).astype(np.float32, copy=False))
        return rows
    finally:
        with engine._cv:
            engine._running = False
            engine._cv.notify_all()
