"""The tensor-parallel monokernel (MK_TP = N, csrc/mk_tp.cuh) run on the CPU (tests only).

Each rank is an `EmuModel` of its Megatron shard (replicas/tp_shard.py) built with tp=N, and its grid runs
in its own OS thread (the emulation's scheduler is thread-local; ctypes lets go of the GIL during a
launch), so the ranks' kernels run side by side as on N GPUs. Their "peer memory" is the N exchange
regions in host memory, read and written through the pointer table every rank gets; the emulation's
fences and the exchange's acquire/release words are real atomics between the OS threads. The prompt goes
through the numpy sharded prefill (replicas/tp_prefill.py), which adds the ranks' partials in the
kernel's order.

    group = EmuTpGroup(config, raw_tensors, n=2)
    group.forward_logits(ids)                 # [len, V]: TP=N decode kernel from position 16
    group.generate(ids, 20)                   # greedy (or mode/temperature/top_k/top_p/seed) tokens

What it checks that a one-GPU run cannot: the exchange protocol (counters, message slots by step parity,
buffer reuse), the sharded numerics against TP=1 and the reference, and that every rank stops at the same
step (stop ids, length, a cancel forwarded from rank 0). Not speed, not the GPU's memory model.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np

from replicas import layout as L
from replicas.model import ModelConfig
from replicas.monokernel_emu import EmuModel, teacher_forced
from replicas.monokernel_gpu import buffer_ptr
from replicas.tp_prefill import ShardedPrefill
from replicas.tp_shard import check_tp, shard_config, shard_tensors


class EmuTpGroup:
    """N emulated ranks of one tensor-parallel group (monokernel_tp.GpuGroup's wiring, in host memory)."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], n: int, num_sms: int = 4,
                 max_context: int = 256, layout_options: dict | None = None, peer_timeout_ns: int = 10**9):
        """peer_timeout_ns: the kernels' tp_timeout_ns, in the emulation's clock, which advances 1 us per read
        (one read per spin: 10**9 is a million rounds of a rank's fibers, minutes of real time)."""
        check_tp(config, n)
        self.config, self.n = config, n
        local = shard_config(config, n)
        opts = {**(layout_options or {}), "tp": n, "vocab_total": config.vocab_size}
        self.ranks = [EmuModel(local, shard_tensors(config, tensors, n, r), max_context=max_context,
                               layout_options=opts, num_sms=num_sms) for r in range(n)]
        self.layout = self.ranks[0].layout
        words = self.layout.tp_offsets()["WORDS"]
        self.regions = [np.zeros(words, np.float32) for _ in range(n)]  # each rank's exchange region
        self.peer_table = np.array([buffer_ptr(r) for r in self.regions], np.uint64)  # (the same for every rank)
        for rank, m in enumerate(self.ranks):
            m.tp_params = {"tp_local": buffer_ptr(self.regions[rank]), "tp_peers": buffer_ptr(self.peer_table),
                           "tp_rank": rank, "tp_timeout_ns": int(peer_timeout_ns)}

    def prefill(self, ids: Sequence[int], all_logits: bool = False):
        """(per-rank last hidden states, logits [T, V] or None): the numpy sharded prefill, which also writes
        every rank's KV cache."""
        return ShardedPrefill(self.ranks, self.config.vocab_size, np).run(list(ids), all_logits=all_logits)

    def launch(self, x_last: Sequence[np.ndarray], start_pos: int, max_steps: int, *, ranks: Sequence[int] | None = None,
               logits: Sequence[np.ndarray] | None = None, cancel: bool = False, max_switches: int = 10**9,
               **kw) -> None:
        """Every rank's kernel at once, each in its own OS thread, to completion. `ranks` launches only those
        (the others never start: their peers must notice, not hang); `cancel` sets rank 0's host cancel flag
        before the launch. Raises RuntimeError naming the ranks whose grid did not finish."""
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        for region in self.regions:
            region[:] = 0
        params = {}
        for r in ranks:
            params[r] = self.ranks[r].launch_params(x_last[r], start_pos, max_steps,
                                                    logits=None if logits is None else logits[r], **kw)
        if cancel:
            self.ranks[0].host_ctrl[L.CTRL_CANCEL] = 1
        errors: dict[int, BaseException] = {}

        def run(r: int) -> None:
            try:
                m = self.ranks[r]
                m._run(m.lib, m.layout, params[r], max_switches)
            except BaseException as e:  # noqa: BLE001 - reported below, per rank
                errors[r] = e

        threads = [threading.Thread(target=run, args=(r,), name=f"emu-tp-rank-{r}") for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"emulated TP ranks {sorted(errors)} did not finish: "
                               + "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))

    def forward_logits(self, ids: Sequence[int], prefill_len: int = 16) -> np.ndarray:
        """[len, V]: the sharded prefill's logits for the first `prefill_len` positions, the TP kernel's after (the
        ranks' vocabulary slices side by side, the last one's padding dropped)."""
        def decode(x_last, p, steps, forced):
            outs = [np.zeros((steps, m.config.vocab_size), np.float32) for m in self.ranks]
            self.launch(x_last, p, steps, forced=forced, logits=outs)
            return np.concatenate(outs, axis=1)[:, :self.config.vocab_size]

        return teacher_forced(self.prefill, decode, ids, prefill_len)

    def generate(self, ids: Sequence[int], n: int, **kw) -> list[int]:
        """Up to n tokens after prompt `ids` (mode/temperature/top_k/top_p/seed/stop_ids/cancel as launch):
        rank 0's stream. Every rank must have emitted the same tokens, count and status."""
        x_last, _ = self.prefill(ids)
        self.launch(x_last, len(ids), n, **kw)
        outs = []
        for m in self.ranks:
            count = int(m.host_ctrl[L.CTRL_COUNT])
            outs.append(([int(t) for t in m.host_tokens[:count]], int(m.host_ctrl[L.CTRL_STATUS]),
                         int(m.host_ctrl[L.CTRL_DONE])))
        if any(o != outs[0] for o in outs[1:]):
            raise AssertionError(f"the ranks disagree on (tokens, status, done): {outs}")
        return outs[0][0]

    def status(self) -> int:
        """Rank 0's finish status of the last launch (layout.STATUS_*)."""
        return int(self.ranks[0].host_ctrl[L.CTRL_STATUS])
