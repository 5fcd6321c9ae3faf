"""BatchGpuModel's slot API on the CPU emulation of the kernel (tests only; replicas/monokernel_emu.py).

`EmuBatchGpu` is what `BatchedMonokernelEngine.around(config, gpu, prefill)` drives: the real
scheduler thread and the real batch kernel (and, for a lone slot, the B = 1 build of the same layout)
with their host protocol: per-slot control words, cancel, the yield word, the exit state (fused turn,
steps) and the hidden-state handover between launches. A launch runs the emulated kernel in a
background thread (ctypes releases the GIL), so the scheduler polls host words while it decodes, as it
does on a GPU. Buffers mirror replicas/monokernel_batch.py:
    # k_cache, v_cache: [B][L][kv_heads][max_ctx][D] bf16 bits; xbuf: [2][B][Hp] fp32
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np

from replicas import layout as L
from replicas.layout import KernelLayout
from replicas.layout_tuned import engine_options
from replicas.model import ModelConfig
from replicas.monokernel_batch import (BATCH_ONLY_OPTIONS, SlotSpec, batch_scalars, fresh_slot, lone_slot_ptrs,
                                       lone_slot_scalars, pick_build, regrid_weights, slot_hidden, slot_row, slots_ptrs)
from replicas.monokernel_resident import Admissions
from replicas.monokernel_emu import EmuModel, build
from replicas.monokernel_gpu import param_block
from replicas.monokernel_weights import pack_weights, rope_tables


class _Stream(nullcontext):
    """The engine's stream: `done` while no emulated launch runs."""

    def __init__(self):
        super().__init__()
        self.thread: threading.Thread | None = None
        self.failed: str | None = None

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


class _HostStream(nullcontext):
    """A resident engine's prefill stream: the emulation's prefill runs on the host, done when it returns."""

    def synchronize(self) -> None:
        pass


class EmuBatchGpu:
    """The batch build of `layout_options` + batch=B and its B = 1 build, on shared weights and KV."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], batch: int, max_context: int = 256,
                 layout_options: dict | None = None, num_sms: int = 4, resident: bool = False, prefill_sms: int = 1):
        """resident: as BatchGpuModel's (the batch build on num_sms - prefill_sms blocks, the single build
        on num_sms, each with its own fused-down packing)."""
        c, ctx = config, int(max_context)
        self.config, self.batch, self.max_context, self.device = c, int(batch), ctx, 0
        self.resident = bool(resident)
        opts = dict(layout_options or {})
        batch_sms = num_sms - prefill_sms if resident else num_sms
        self.layout = KernelLayout.from_config(c, ctx, num_sms=batch_sms,
                                               **engine_options(c, {**opts, "batch": batch, "resident": self.resident}))
        single = {k: v for k, v in opts.items() if k not in BATCH_ONLY_OPTIONS}
        self.single_layout = KernelLayout.from_config(c, ctx, num_sms=num_sms, **engine_options(c, single))
        assert self.single_layout.packed_shapes() == self.layout.packed_shapes(), "one packing for both builds"
        self.lib, self.single_lib = build(self.layout), build(self.single_layout)
        self.builds = {self.batch: self.layout}
        self.weights = pack_weights(np, self.layout, c, tensors)
        self.single_weights = regrid_weights(np, self.weights, self.layout, self.single_layout, c)
        self.rope_cos, self.rope_sin = rope_tables(c, ctx)
        b = self.batch
        kv = (b, c.num_hidden_layers, c.num_key_value_heads, ctx, c.head_dim)
        self.k_cache, self.v_cache = np.zeros(kv, np.uint16), np.zeros(kv, np.uint16)
        self.work = {k: np.zeros(n, np.float32) for k, n in self.layout.buffer_sizes().items()}
        self.single_work = {k: np.zeros(n, np.float32) for k, n in self.single_layout.buffer_sizes().items()}
        z = lambda n, t=np.int32: np.zeros(n, t)
        self.best_idx, self.single_best_idx = z(b * self.layout.total_warps), z(self.single_layout.total_warps)
        self.attn_cnt, self.qkv_done = z(c.num_key_value_heads, np.uint32), z(c.num_key_value_heads, np.uint32)
        self.control, self.single_control = z(4, np.uint32), z(8, np.uint32)
        self.tokens, self.forced, self.stop_ids = z(b * ctx), z(b * ctx), z(b * L.MAX_STOP_IDS)
        self.logits1, self.cancel, self.shared_token = z(b * c.vocab_size, np.float32), z(b + 3), z(b)
        self.kctl, self.slot_table = z(4), z(b * len(L.SLOT_FIELDS), np.uint64)
        self.host_tokens, self.host_ctrl, self.host_kctl = z(b * ctx), z(b * L.CTRL_WORDS), z(L.KCTL_WORDS)
        self.admit_x = z(b * self.layout.hp, np.float32)
        self.admissions = Admissions(self.host_kctl)
        self.stream, self.prefill_stream = _Stream(), _HostStream()
        self.cp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: nullcontext(),
                                                       memory=SimpleNamespace(OutOfMemoryError=MemoryError)),
                                  zeros=np.zeros, float32=np.float32, asnumpy=np.asarray)  # (forward_logits_slots)
        self._exit: tuple[int, int] | None = None
        self.launches = 0

    # ---- the slot API the batched engine uses ------------------------------------------------
    def slot_view(self, b: int):
        return SimpleNamespace(config=self.config, weights=self.weights, rope_cos=self.rope_cos,
                               rope_sin=self.rope_sin, k_cache=self.k_cache[b], v_cache=self.v_cache[b])

    def slot_ctrl(self, b: int) -> np.ndarray:
        return self.host_ctrl[b * L.CTRL_WORDS:(b + 1) * L.CTRL_WORDS]

    def slot_tokens(self, b: int) -> np.ndarray:
        return self.host_tokens[b * self.max_context:(b + 1) * self.max_context]

    def request_yield(self) -> None:
        self.host_kctl[L.KCTL_YIELD] = 1

    def _stops(self, b: int, stop_ids: Sequence[int]) -> np.ndarray:
        if len(stop_ids) > L.MAX_STOP_IDS:
            raise ValueError(f"at most {L.MAX_STOP_IDS} stop token ids per slot, got {len(stop_ids)}")
        row = self.stop_ids[b * L.MAX_STOP_IDS:(b + 1) * L.MAX_STOP_IDS]
        row[:] = 0
        row[:len(stop_ids)] = list(stop_ids)
        return row

    def _start(self, lib, lay: KernelLayout, params: np.ndarray) -> None:
        if not self.stream.done:
            raise RuntimeError("a launch while a launch runs")

        def run():
            try:
                EmuModel._run(lib, lay, params)
            except RuntimeError as e:
                self.stream.failed = str(e)

        self._params = params  # kept alive while the kernel reads it
        self._exit = None
        self.launches += 1
        self.stream.thread = threading.Thread(target=run, daemon=True)
        self.stream.thread.start()

    def launch_slots(self, slots: Sequence[SlotSpec | None], *, fresh: Mapping[int, np.ndarray], fx_turn0: int = 0,
                     logits=None, profile=None, idle_ns: int = 0, room: int = 0) -> int:
        """BatchGpuModel.launch_slots (one build)."""
        lay, b_n = self.layout, self.batch
        if len(slots) != b_n:
            raise ValueError(f"{len(slots)} slot specs for a batch of {b_n}")
        table = np.zeros((b_n, len(L.SLOT_FIELDS)), np.uint64)
        for b, s in enumerate(slots):
            if s is None:
                continue
            table[b] = slot_row(s)
            self._stops(b, s.stop_ids)
            if s.forced is not None and len(s.forced):
                self.forced[b * self.max_context:b * self.max_context + len(s.forced)] = list(s.forced)
            if b in fresh:
                fresh_slot(np, lay, self.work, b_n, b, fresh[b], fx_turn0, self.config.hidden_size)
            self.slot_ctrl(b)[L.CTRL_DONE] = 0
        self.slot_table[:] = table.reshape(-1)
        for a in (self.attn_cnt, self.qkv_done, self.control, self.cancel, self.kctl, self.host_kctl, self.work["best_val"]):
            a[:] = 0
        self.admissions.reset()
        teacher = logits is not None  # [steps, B, V]: every slot forced (BatchedMonokernelEngine.forward_logits_slots)
        ptrs = slots_ptrs(self, self.work, logits)  # BatchGpuModel's
        scalars = batch_scalars(teacher, b_n * self.config.vocab_size if teacher else 0, fx_turn0, idle_ns)
        self._start(self.lib, lay, param_block(lay.param_fields(), ptrs, scalars))
        return pick_build(self.builds, slots, room=room)

    def prepare_join(self, b: int, s: SlotSpec, x_last) -> None:
        """BatchGpuModel.prepare_join: slot b's row, stop ids and hidden state for the running launch."""
        self.stage_join(b, s)
        self.hand_over(b, x_last)

    def stage_join(self, b: int, s: SlotSpec) -> None:
        """BatchGpuModel.stage_join: slot b's row (active = 0) and stop ids."""
        self._stops(b, s.stop_ids)
        n = len(L.SLOT_FIELDS)
        self.slot_table[b * n:(b + 1) * n] = slot_row(s, active=False)
        self.slot_ctrl(b)[:] = 0

    def hand_over(self, b: int, x_last) -> None:
        """BatchGpuModel.hand_over: slot b's hidden state into admit_x."""
        self.queue_hand_over(b, x_last)

    def queue_hand_over(self, b: int, x_last) -> None:
        """BatchGpuModel.queue_hand_over (the emulation has no streams: done at once)."""
        hp = self.layout.hp
        self.admit_x[b * hp:b * hp + self.config.hidden_size] = x_last

    def launch_single(self, b: int, s: SlotSpec, x_last, profile=None) -> None:
        """BatchGpuModel.launch_single: the B = 1 build on slot b's KV, tokens and host words."""
        lay, w = self.single_layout, self.single_work
        stops = self._stops(b, s.stop_ids)
        w["xbuf"][:] = 0
        w["xbuf"][:self.config.hidden_size] = x_last
        w["dn_part"][:] = 0
        for a in (self.attn_cnt, self.qkv_done, self.single_control, self.kctl, self.host_kctl):
            a[:] = 0
        self.slot_ctrl(b)[L.CTRL_DONE] = 0
        ptrs, scalars = lone_slot_ptrs(self, b, stops), lone_slot_scalars(s)  # BatchGpuModel's
        self._start(self.single_lib, lay, param_block(lay.param_fields(), ptrs, scalars))

    def synchronize(self) -> None:
        if self.stream.thread is not None:
            self.stream.thread.join()
        if self.stream.failed:
            raise RuntimeError(self.stream.failed)

    def exit_state(self) -> tuple[int, int]:
        return int(self.kctl[0]), int(self.kctl[1])

    def hidden_state(self, b: int, single: bool):
        """BatchGpuModel.hidden_state: residual + the last fused accumulator * 2^-32, in fp32."""
        if self._exit is None:
            self._exit = self.exit_state()
        if single:
            return slot_hidden(np, self.single_layout, self.single_work, 1, 0, self._exit[0], self.config.hidden_size)
        return slot_hidden(np, self.layout, self.work, self.batch, b, self._exit[0], self.config.hidden_size)
