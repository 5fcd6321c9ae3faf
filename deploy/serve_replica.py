"""`EngineReplica`: one engine as a Ray Serve deployment replica (one 8-GPU placement group).

Serve places each replica into its own `STRICT_PACK` placement group (set in
`deploy/serve_app.py`); Ray restricts CUDA_VISIBLE_DEVICES to the granted GPUs, which become
the engine's devices — the same engine choice as the Ray-actor path (`replicas.actor`).
`generate` streams token ids then one final dict; `record_routing_stats` reports the load our
custom request router (`deploy/serve_router.py`) ranks replicas by.
"""

from __future__ import annotations

import asyncio
import threading
import time

from ray import serve

from replicas.actor import ReplicaSpec, make_engine
from replicas.engine import EngineBusy, SamplingParams

TPOT_EWMA_WEIGHT = 0.2


def _pump(gen, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    """Run one generation on its own thread, posting ("token", id) ... then ("end"|"error", x).

    The generation is closed (its engine slot freed) before the end is posted, so the next
    request Serve sends once this one finishes finds the slot free.
    """
    def post(kind, value=None):
        loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
    try:
        for token in gen:
            post("token", token)
    except Exception as e:  # noqa: BLE001 -- any engine error is re-raised in the caller's stream
        gen.close()
        post("error", e)
    else:
        gen.close()
        post("end")


@serve.deployment
class EngineReplica:
    def __init__(self, spec: dict):
        import ray

        self.spec = ReplicaSpec(**spec)
        self.gpu_ids = [int(g) for g in ray.get_gpu_ids()]
        self.engine = make_engine(self.spec, list(range(len(self.gpu_ids))))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._running: dict[int, list[int]] = {}  # request key -> [max_tokens, produced]
        self._tpot_s: float | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams):
        """Stream token ids, then {"finish_reason", "stop_token_id", "replica_id"}.

        Invalid prompts/params raise `InvalidRequest` before any token; cancelling the stream
        stops the engine within one step.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gen = await self._start(prompt_ids, params)
        slot = [params.max_tokens, 0]
        self._running[id(slot)] = slot
        pump = threading.Thread(target=_pump, args=(gen, loop, queue), daemon=True)
        pump.start()
        last = None
        try:
            while True:
                kind, value = await queue.get()
                if kind == "token":
                    now = time.perf_counter()
                    if last is not None:
                        self._observe_tpot(now - last)
                    last = now
                    slot[1] += 1
                    yield value
                elif kind == "error":
                    raise value
                else:
                    yield {"finish_reason": gen.finish_reason.value, "stop_token_id": gen.stop_token_id,
                           "replica_id": self.replica_id}
                    return
        finally:
            gen.cancel()  # the engine stops within one step
            self._running.pop(id(slot), None)
            if pump.is_alive():  # cancelled mid-stream: free the slot before Serve sends the next request
                await asyncio.to_thread(pump.join, 5.0)

    async def _start(self, prompt_ids: list[int], params: SamplingParams):
        """engine.generate, waiting for a slot when Serve sent more than the engine holds (an
        `auto` deployment sized for GPU engine groups that landed on the CPU engine)."""
        while True:
            try:
                return self.engine.generate(prompt_ids, params)
            except EngineBusy:
                await asyncio.sleep(0.005)

    def _observe_tpot(self, seconds: float) -> None:
        old = self._tpot_s
        self._tpot_s = seconds if old is None else old + TPOT_EWMA_WEIGHT * (seconds - old)

    def record_routing_stats(self) -> dict:
        """Load for the request router (Serve polls it every request_routing_stats_period_s)."""
        remaining = sum(max(0, m - p) for m, p in self._running.values())
        return {
            "busy": len(self._running), "capacity": self.engine.max_batch, "tokens_remaining": remaining,
            "tpot_s": self._tpot_s, "expected_idle_s": remaining * self._tpot_s if self._tpot_s else None,
            "reported_at": time.time(), "healthy": True,
        }

    def info(self) -> dict:
        return {"replica_id": self.replica_id, "engine": self.engine.kind, "gpu_ids": self.gpu_ids,
                "max_batch": self.engine.max_batch, "max_context": self.engine.max_context}
