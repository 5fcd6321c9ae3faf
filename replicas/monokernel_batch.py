"""GPU state of a batch monokernel build (layout option batch = B > 1, csrc/mk_batch.cuh).

B sequences ("slots") decode in one persistent launch: every weight chunk is streamed once per step
and dotted with all live slots' inputs; a lone slot runs the single-sequence build of the same
layout instead (`launch_single`, same packed weights), at the B = 1 engine's speed. Per-slot KV cache, buffers and host-mapped control words;
the slot table (replicas/layout.py SLOT_FIELDS) gives each slot its position, budget, stops and
sampling. A launch ends when every slot has finished or, when the host asks (`request_yield`), at
the next step boundary; the next launch resumes the running slots where they were (positions, RNG
counters and the fused-MLP accumulator parity continue) and may start new ones in free slots.

    # k_cache, v_cache: [B][L][kv_heads][max_ctx][D] bf16 bits
    # xbuf: [2][B][Hp] fp32; host_tokens: [B][max_ctx]; host_ctrl: [B][CTRL_WORDS]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from replicas import layout as L, layout_fused, layout_mma_mlp
from replicas.model import ModelConfig
from replicas.monokernel_build import launch_args
from replicas.monokernel_gpu import (GpuModel, MappedInts, buffer_ptr, common_ptrs, field_bits, import_cupy,
                                     inv_temperature, param_block)
from replicas.monokernel_resident import PREFILL_SMS, Admissions
from replicas.layout_fused import pack_down_fused


BATCH_ONLY_OPTIONS = ("batch", "ao_slots", "resident", "act_bf16", "mma_mlp", "norm_once", "mma_lm", "mma_qkv", "mma_o",
                      "half_vec", "block_best", "fold_x", "pair_norm", "fx_pack", "pair_dn",
                      "ao_onepass", "best_max")  # layout options the single-sequence build does not take


def fresh_slot(xp, lay, work, b_n: int, b: int, x_last, fx_turn0: int, hidden: int) -> None:
    """Slot b of a launch of `lay` (b_n slots) starts from hidden state x_last [hidden]: the residual in xbuf, the
    fixed-point accumulators zero; with fold_x the residual is the accumulator the first LM head reads (fused turn
    fx_turn0 - 1), as int64 * 2^-32 (csrc/mk_fold.cuh; fx_pack: slot b's 32-bit lane * 2^-16, the pair's other slot
    kept)."""
    x = work["xbuf"].reshape(2, b_n, lay.hp)
    acc = work["dn_part"].view(xp.int64).reshape(2, layout_fused.acc_rows(lay, b_n), lay.hp)  # both fused turns
    x[:, b] = 0
    for t in (0, 1):
        layout_fused.set_slot_fixed(xp, lay, acc[t], b, 0, lay.hp)
    if lay.fold_x:  # (fp32 * 2^k is exact in fp64: with 2^32 the kernel reads x_last back exactly; with fx_pack's
        # 2^16 it reads x_last on a 2^-16 grid, which slot_hidden's values are already on)
        fixed = xp.rint(xp.asarray(x_last, xp.float64) * 2.0 ** layout_fused.acc_shift(lay)).astype(xp.int64)
        layout_fused.set_slot_fixed(xp, lay, acc[(fx_turn0 - 1) & 1], b, fixed, hidden)
    else:
        x[0, b, :hidden] = x_last


def slot_hidden(xp, lay, work, b_n: int, b: int, turn: int, hidden: int):
    """Slot b's hidden state after a launch of `lay` that ended at fused turn `turn`: x + the accumulator of turn
    - 1 * 2^-32 in fp32 (fold_x: the accumulator alone; fx_pack: slot b's lane * 2^-16), as the next LM head would
    read it."""
    acc = work["dn_part"].view(xp.int64).reshape(2, layout_fused.acc_rows(lay, b_n), lay.hp)[(turn - 1) & 1]
    h = layout_fused.slot_fixed(xp, lay, acc, b, hidden).astype(xp.float32) * xp.float32(2.0 ** -layout_fused.acc_shift(lay))
    return h if lay.fold_x else work["xbuf"].reshape(2, b_n, lay.hp)[0, b, :hidden] + h


@dataclass
class SlotSpec:
    """What one slot decodes in a launch (the slot table row, SLOT_FIELDS)."""

    start_pos: int  # prompt length
    max_steps: int  # token budget of the whole generation
    mode: int = L.MODE_GREEDY
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: Sequence[int] = ()
    step0: int = 0  # tokens emitted by earlier launches (a resumed slot)
    forced: Sequence[int] | None = field(default=None, repr=False)  # teacher-forced tokens (forward_logits)


def _check_stop_count(stop_ids: Sequence[int]) -> None:
    if len(stop_ids) > L.MAX_STOP_IDS:
        raise ValueError(f"at most {L.MAX_STOP_IDS} stop token ids per slot, got {len(stop_ids)}")


def slot_row(s: SlotSpec, active: bool = True) -> list[np.uint64]:
    """Slot s's row of the slot table (SLOT_FIELDS order). A row for a resident launch to admit says
    active = 0: the admission makes it live, and a launch that starts before it must not."""
    values = {"start_pos": s.start_pos, "step0": s.step0, "max_steps": s.max_steps, "n_stop": len(s.stop_ids),
              "mode": s.mode, "top_k": s.top_k, "seed": s.seed, "inv_temperature": inv_temperature(s.temperature),
              "top_p": s.top_p, "active": int(active)}
    return [field_bits(ct, values[name]) for name, ct in L.SLOT_FIELDS]


def slots_ptrs(m, work, logits=None, profile=None) -> dict[str, int]:
    """The pointer fields of a batch launch (launch_slots) over m's buffers (m: BatchGpuModel, or the CPU
    emulation's stand-in with the same buffer names, replicas/monokernel_emu_batch.py)."""
    P, ctl = buffer_ptr, buffer_ptr(m.control)
    return {**common_ptrs(m, work), "k_cache": P(m.k_cache), "v_cache": P(m.v_cache), "best_idx": P(m.best_idx),
            "logits": P(logits if logits is not None else m.logits1), "bar_count": ctl, "bar_flag": ctl + 4,
            "cancel_step": P(m.cancel), "shared_token": P(m.shared_token), "tokens": P(m.tokens),
            "forced": P(m.forced), "stop_ids": P(m.stop_ids), "host_tokens": P(m.host_tokens),
            "host_ctrl": P(m.host_ctrl), "profile": P(profile), "slots": P(m.slot_table), "slot_stop": P(m.stop_ids),
            "host_kctl": P(m.host_kctl), "kctl": P(m.kctl), "admit_x": P(m.admit_x)}


def batch_scalars(teacher: bool, logits_per_step: int, fx_turn0: int, idle_ns: int = 0) -> dict:
    """The scalar fields of a batch launch (the single-sequence ones are unused: the slot table has them)."""
    return {"start_pos": 0, "max_steps": 0, "n_stop": 0, "teacher": int(teacher), "mode": 0, "top_k": 0, "seed": 0,
            "inv_temperature": 1.0, "top_p": 1.0, "logits_per_step": logits_per_step, "fx_turn0": fx_turn0,
            "step0": 0, "idle_ns": int(idle_ns)}


def lone_slot_ptrs(m, b: int, stops, profile=None) -> dict[str, int]:
    """The pointer fields of the B = 1 build on slot b alone (launch_single): its KV, tokens and host words."""
    P, ctl, ctx = buffer_ptr, buffer_ptr(m.single_control), m.max_context
    return {**common_ptrs(m, m.single_work, m.single_weights), "k_cache": P(m.k_cache[b]), "v_cache": P(m.v_cache[b]),
            "best_idx": P(m.single_best_idx), "logits": P(m.logits1),
            "bar_count": ctl, "bar_flag": ctl + 4, "cancel_step": ctl + 8, "shared_token": ctl + 16,
            "tokens": P(m.tokens[b * ctx:]), "forced": P(m.forced[b * ctx:]), "stop_ids": P(stops),
            "host_tokens": P(m.host_tokens) + 4 * b * ctx, "host_ctrl": P(m.host_ctrl) + 4 * b * L.CTRL_WORDS,
            "profile": P(profile), "host_kctl": P(m.host_kctl), "kctl": P(m.kctl)}


def regrid_weights(xp, weights: Mapping[str, object], lay, single_lay, config: ModelConfig) -> Mapping[str, object]:
    """The packed weights for the single-sequence build `single_lay`: `weights` (packed for the batch
    layout `lay`) where both pack the MLP alike, else with the fused down packed again for its grid (its
    block tiles follow the grid) from the prefill's plain down rows; and with mma_mlp (a batch-only
    option) the plain gate/up rows the prefill reads too (layout_mma_mlp.repack)."""
    own_down = single_lay.fused_mlp and (single_lay.num_sms != lay.num_sms or lay.mma_mlp)
    copies = layout_mma_mlp.plain_copies(lay)
    if not own_down and not copies:
        return weights
    out = {**weights, **{name: weights[plain] for name, plain in copies.items()}}
    if own_down:
        dn = weights["w_dn_prefill"]  # [L][H][Ip] plain down rows
        out["w_dn"] = xp.empty_like(weights["w_dn"])
        for n in range(config.num_hidden_layers):
            out["w_dn"][n] = pack_down_fused(xp, single_lay, dn[n, :, :config.intermediate_size])
    return out


def lone_slot_scalars(s: SlotSpec) -> dict:
    """The scalar fields of launch_single: slot s's settings as the B = 1 build's parameters."""
    return {"start_pos": s.start_pos, "max_steps": s.max_steps, "n_stop": len(s.stop_ids), "teacher": 0,
            "mode": s.mode, "top_k": s.top_k, "seed": s.seed, "inv_temperature": inv_temperature(s.temperature),
            "top_p": s.top_p, "logits_per_step": 0, "step0": s.step0}


def pick_build(sizes, slots: Sequence[object | None], room: int = 0) -> int:
    """The smallest build (slot count) that holds the highest occupied slot and `room` more (for requests
    to join a resident launch): a build of n slots runs slots [0, n) (the scheduler fills the lowest free
    slot, so occupancy n mostly needs n)."""
    hi = 1 + max((b for b, s in enumerate(slots) if s is not None), default=0)
    if hi <= max(sizes):
        hi = min(hi + room, max(sizes))
    fits = [n for n in sizes if n >= hi]
    if not fits:
        raise ValueError(f"slot {hi - 1} is occupied but the largest build has {max(sizes)} slots")
    return min(fits)


class BatchGpuModel(GpuModel):
    """A `GpuModel` compiled with batch = B: one launch decodes up to B slots."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], batch: int, device: int = 0,
                 max_context: int | None = None, progress: bool | None = None,
                 layout_options: dict | None = None, sub_builds: bool = False, resident: bool = False,
                 prefill_sms: int = PREFILL_SMS):
        """sub_builds: also compile the batch builds of 2, 4, .. < batch slots (same weights, KV and host
        words: a build of B' slots runs the slots [0, B')); a launch then uses the smallest build that
        holds its highest occupied slot (a B = 8 build is slower than a B = 2 one at 2 requests).
        resident: the batch builds admit requests while they run (replicas/monokernel_resident.py) on a
        grid that leaves `prefill_sms` SMs to the joiners' prefill; the single-sequence build keeps every
        SM (its fused down then needs its own packing: one more copy of the down weights)."""
        if not 2 <= int(batch) <= L.MAX_BATCH:
            raise ValueError(f"batch={batch}: a batch build decodes 2..{L.MAX_BATCH} slots (batch 1 is GpuModel)")
        from replicas.layout_tuned import batch_options
        layout_options = dict(layout_options or {})
        self.resident = bool(resident)
        cp = import_cupy()
        self.device_sms = device_sms = cp.cuda.Device(device).attributes["MultiProcessorCount"]
        if self.resident:
            layout_options["resident"] = True
            if "num_sms" not in layout_options:
                if not 1 <= int(prefill_sms) < device_sms:
                    raise ValueError(f"prefill_sms={prefill_sms}: leave 1..{device_sms - 1} of the device's "
                                     f"{device_sms} SMs to the prefill")
                layout_options["num_sms"] = device_sms - int(prefill_sms)
        # the measured batch defaults (layout_tuned.py), for the grid the batch builds get and each build's slots
        given, grid = layout_options, layout_options.get("num_sms", device_sms)

        def options_for(n: int) -> dict:
            return batch_options(config, given, grid, n)

        layout_options = options_for(int(batch))
        super().__init__(config, tensors, device=device, max_context=max_context, progress=progress,
                         layout_options={**layout_options, "batch": int(batch)})
        self.batch = self.layout.batch
        # The single-sequence build of the same layout (same packed weights): a lone slot decodes at
        # exactly the B = 1 engine's speed (launch_single), on its slot's KV and host words.
        from replicas.layout import KernelLayout
        from replicas.layout_tuned import engine_options
        from replicas.monokernel_build import load_module

        with cp.cuda.Device(device):
            # (num_sms, if given as a layout option, is the grid every batch build shares: self.layout.num_sms;
            # the single build's too unless resident, which gives it the whole device)
            other = {k: v for k, v in layout_options.items() if k != "num_sms"}
            single_opts = {k: v for k, v in other.items() if k not in BATCH_ONLY_OPTIONS}
            single_sms = device_sms if self.resident else self.layout.num_sms
            self.single_layout = KernelLayout.from_config(config, self.max_context, num_sms=single_sms,
                                                          **engine_options(config, single_opts))
            assert self.single_layout.packed_shapes() == self.layout.packed_shapes(), "one packing for both builds"
            assert self.single_layout.gu_il == self.layout.gu_il, "one gate/up order for both builds"
            self.single_weights = regrid_weights(cp, self.weights, self.layout, self.single_layout, config)
            self.single_kernel = load_module(self.single_layout)
            self.single_work = {k: cp.zeros(n, cp.float32) for k, n in self.single_layout.buffer_sizes().items()}
            self.single_best_idx = cp.zeros(self.single_layout.total_warps, cp.int32)
            self.single_control = cp.zeros(8, cp.uint32)  # bar_count, bar_flag, cancel + yield seen, shared_token
            self.single_params = cp.zeros(len(self.single_layout.param_fields()), cp.uint64)
            # batch builds by slot count: (layout, kernel, work buffers); the others share everything else
            self.builds = {self.batch: (self.layout, self.kernel, self.work)}
            for n in (2, 4) if sub_builds else ():
                if n < self.batch:
                    opts = {k: v for k, v in options_for(n).items() if k != "num_sms"}
                    lay = KernelLayout.from_config(config, self.max_context, num_sms=self.layout.num_sms,
                                                   **engine_options(config, {**opts, "batch": n}))
                    assert lay.packed_shapes() == self.layout.packed_shapes(), "one packing for every build"
                    assert lay.pair_dn == self.layout.pair_dn, "one down packing for every build (pair_dn)"
                    self.builds[n] = (lay, load_module(lay),
                                      {k: cp.zeros(m, cp.float32) for k, m in lay.buffer_sizes().items()})
        self._last = (self.work, self.batch)  # the work buffers (and slot count) of the last batch launch
        self._exit = None  # the last launch's exit_state(), read once by hidden_state
        # The handover's CuPy elementwise kernels compile now, not inside the first join (measured on the
        # H200: that join's hidden_state took 80.5 ms, every later one 0.4 ms; bench/join_probe.py).
        self.hidden_state(0, single=False)
        self.hidden_state(0, single=True)
        self.synchronize()
        self._exit = None

    def _allocate(self, tensors, progress) -> None:
        super()._allocate(tensors, progress)
        cp, c, b, ctx = self.cp, self.config, self.layout.batch, self.max_context
        # replace the single-sequence buffers by per-slot ones (free the old first)
        self.k_cache = self.v_cache = None
        kv_shape = (b, c.num_hidden_layers, c.num_key_value_heads, ctx, c.head_dim)
        self.k_cache = cp.zeros(kv_shape, cp.uint16)
        self.v_cache = cp.zeros(kv_shape, cp.uint16)
        self.best_idx = cp.zeros(b * self.layout.total_warps, cp.int32)
        self.tokens = cp.zeros(b * ctx, cp.int32)
        self.forced = cp.zeros(b * ctx, cp.int32)
        self.stop_ids = cp.zeros(b * L.MAX_STOP_IDS, cp.int32)
        self.logits1 = cp.zeros(b * c.vocab_size, cp.float32)
        self.cancel = cp.zeros(b + 3, cp.int32)  # per-slot cancel seen this step, the yield request, admission mask, seq
        self.admit_x = cp.zeros(b * self.layout.hp, cp.float32)  # [B][Hp] a joining slot's last prompt hidden state
        self.shared_token = cp.zeros(b, cp.int32)
        self.kctl = cp.zeros(4, cp.int32)  # left at exit: fused turn, steps run
        self.slot_table = cp.zeros(b * len(L.SLOT_FIELDS), cp.uint64)
        self.host_tokens = MappedInts(cp, b * ctx)
        self.host_ctrl = MappedInts(cp, b * L.CTRL_WORDS)
        self.host_kctl = MappedInts(cp, L.KCTL_WORDS)
        self.admissions = Admissions(self.host_kctl.array)
        self.prefill_stream = cp.cuda.Stream(non_blocking=True)  # resident launches: joiners' prefill meanwhile
        # pinned staging of a join's row [B][fields] uint64 and stop ids [B][MAX_STOP_IDS] int32: copied to the
        # device without the host waiting (a pageable copy beside a running launch took 0.2-0.8 ms)
        self.join_rows = MappedInts(cp, b * 2 * len(L.SLOT_FIELDS))
        self.join_stops = MappedInts(cp, b * L.MAX_STOP_IDS)

    # ---- per-slot views --------------------------------------------------------------------
    def slot_view(self, b: int):
        """What the prefill (monokernel_prefill.Prefill) needs, with slot b's KV cache."""
        return SimpleNamespace(config=self.config, weights=self.weights, rope_cos=self.rope_cos,
                               rope_sin=self.rope_sin, k_cache=self.k_cache[b], v_cache=self.v_cache[b])

    def slot_ctrl(self, b: int) -> np.ndarray:
        return self.host_ctrl.array[b * L.CTRL_WORDS:(b + 1) * L.CTRL_WORDS]

    def slot_tokens(self, b: int) -> np.ndarray:
        return self.host_tokens.array[b * self.max_context:(b + 1) * self.max_context]

    def request_yield(self) -> None:
        """Ask the running launch to end at its next step boundary (slots resume in the next one)."""
        self.host_kctl.array[L.KCTL_YIELD] = 1

    def _write_stops(self, b: int, stop_ids: Sequence[int]):
        """Slot b's stop ids into its row of the stop table (zero padded); returns the row."""
        _check_stop_count(stop_ids)
        row = self.stop_ids[b * L.MAX_STOP_IDS:(b + 1) * L.MAX_STOP_IDS]
        row[:] = 0
        if len(stop_ids):
            row[:len(stop_ids)] = self.cp.asarray(list(stop_ids), self.cp.int32)
        return row

    # ---- one launch ------------------------------------------------------------------------
    def launch_slots(self, slots: Sequence[SlotSpec | None], *, fresh: Mapping[int, object], fx_turn0: int = 0,
                     logits=None, profile=None, idle_ns: int = 0, room: int = 0) -> int:
        """Start the kernel on `self.stream` for the slots that are not None; returns its slot count.

        fresh: slot -> the prompt's last hidden state [H] (CuPy) for slots starting now; the other
        given slots resume (their xbuf, accumulators and KV are where the last launch left them, and
        fx_turn0 must be that launch's `exit_state()[0]`). logits: [steps, B, V] fp32 for teacher
        forcing (every slot then needs `forced`). Resident builds: `room` more slots than the highest
        occupied one for requests to join (`admit`), and the launch waits `idle_ns` with none decoding."""
        cp, b_n = self.cp, self.layout.batch
        if len(slots) != b_n:
            raise ValueError(f"{len(slots)} slot specs for a batch of {b_n}")
        teacher = logits is not None
        if not teacher:  # (teacher logits are laid out for all B slots)
            b_n = pick_build(self.builds, slots, room=room)
            slots = slots[:b_n]
        lay, kernel, w = self.builds[b_n]
        self._last, self._exit = (w, b_n), None
        if teacher and any(s is not None and s.forced is None for s in slots):
            raise ValueError("teacher forcing (logits=...) needs `forced` tokens for every slot")
        hp, ctx = lay.hp, self.max_context
        table = np.zeros((b_n, len(L.SLOT_FIELDS)), np.uint64)
        with cp.cuda.Device(self.device), self.stream:
            for b, s in enumerate(slots):
                if s is None:
                    continue
                table[b] = slot_row(s)
                self._write_stops(b, s.stop_ids)
                if s.forced is not None and len(s.forced):
                    self.forced[b * ctx:b * ctx + len(s.forced)] = cp.asarray(list(s.forced), cp.int32)
                if b in fresh:
                    fresh_slot(cp, lay, w, b_n, b, fresh[b], fx_turn0, self.config.hidden_size)
                self.slot_ctrl(b)[L.CTRL_DONE] = 0  # (a new request's words were zeroed when it was admitted)
            self.slot_table[:table.size].set(table.reshape(-1), stream=self.stream)
            self.attn_cnt[:] = 0
            w["best_val"][:] = 0  # (best_max: the per-step argmax keys start from 0)
            self.qkv_done[:] = 0
            self.control[:] = 0
            self.cancel[:] = 0
            self.kctl[:] = 0
            self.host_kctl.array[:] = 0
            self.admissions.reset()
            ptrs = slots_ptrs(self, w, logits, profile)
            scalars = batch_scalars(teacher, b_n * self.config.vocab_size if teacher else 0, fx_turn0, idle_ns)
            block = param_block(lay.param_fields(), ptrs, scalars)
            kernel((lay.num_sms,), (lay.threads,), launch_args(cp, lay, self.params_dev, block, self.stream),
                   shared_mem=lay.smem_bytes)
        return b_n

    def prepare_join(self, b: int, s: SlotSpec, x_last) -> None:
        """Slot b's table row, stop ids and hidden state for a running resident launch to admit; returns once
        they are written. The caller then publishes the slot (`admissions.publish`)."""
        self.stage_join(b, s)
        self.hand_over(b, x_last)

    def stage_join(self, b: int, s: SlotSpec) -> None:
        """The first half of prepare_join, which needs no prefill: slot b's row (active = 0: only the admission
        starts it) and stop ids, queued on the prefill stream (a joiner's prefill runs after them, on that stream)."""
        _check_stop_count(s.stop_ids)
        cp, rt, n, m = self.cp, self.cp.cuda.runtime, len(L.SLOT_FIELDS), L.MAX_STOP_IDS
        self.join_rows.array.view(np.uint64)[b * n:(b + 1) * n] = slot_row(s, active=False)
        stops = self.join_stops.array[b * m:(b + 1) * m]
        stops[:] = 0
        stops[:len(s.stop_ids)] = s.stop_ids
        with cp.cuda.Device(self.device):  # (the staging is rewritten only after hand_over drained the stream)
            rt.memcpyAsync(self.slot_table.data.ptr + 8 * b * n, self.join_rows.host_ptr + 8 * b * n, 8 * n,
                           rt.memcpyHostToDevice, self.prefill_stream.ptr)
            rt.memcpyAsync(self.stop_ids.data.ptr + 4 * b * m, self.join_stops.host_ptr + 4 * b * m, 4 * m,
                           rt.memcpyHostToDevice, self.prefill_stream.ptr)
        self.slot_ctrl(b)[:] = 0

    def hand_over(self, b: int, x_last) -> None:
        """The second half: slot b's hidden state [H] into admit_x, then the prefill stream drained (the row,
        stops, prefill and this copy are all on the GPU before the slot is published)."""
        self.queue_hand_over(b, x_last)
        self.prefill_stream.synchronize()

    def queue_hand_over(self, b: int, x_last) -> None:
        """hand_over's copy alone, queued on the prefill stream (the caller waits for it before publishing)."""
        cp, hp = self.cp, self.layout.hp
        with cp.cuda.Device(self.device), self.prefill_stream:
            self.admit_x[b * hp:b * hp + self.config.hidden_size] = x_last

    def launch_single(self, b: int, s: SlotSpec, x_last, profile=None) -> None:
        """Start the single-sequence build on slot b alone (its KV, token and control words): the
        B = 1 kernel's code and speed. Resumes at s.step0 from the hidden state x_last [H]."""
        cp, lay, w, ctx = self.cp, self.single_layout, self.single_work, self.max_context
        with cp.cuda.Device(self.device), self.stream:
            stops = self._write_stops(b, s.stop_ids)
            w["xbuf"][:] = 0
            w["xbuf"][:self.config.hidden_size] = x_last
            w["dn_part"][:] = 0
            self.attn_cnt[:] = 0
            w["best_val"][:] = 0  # (best_max: the per-step argmax keys start from 0)
            self.qkv_done[:] = 0
            self.single_control[:] = 0
            self._exit = None
            self.kctl[:] = 0
            self.host_kctl.array[:] = 0
            self.slot_ctrl(b)[L.CTRL_DONE] = 0
            ptrs, scalars = lone_slot_ptrs(self, b, stops, profile), lone_slot_scalars(s)
            block = param_block(lay.param_fields(), ptrs, scalars)
            args = launch_args(cp, lay, self.single_params, block, self.stream)
            self.single_kernel((lay.num_sms,), (lay.threads,), args, shared_mem=lay.smem_bytes)

    def hidden_state(self, b: int, single: bool):
        """Slot b's hidden state after the last launch (which must have finished): its residual
        stream plus the last fused-MLP accumulator, as the kernel's next LM head would read it
        (x + int64 * 2^-32 in fp32; the scale is a power of two, so no rounding step differs; slot_hidden)."""
        cp, h = self.cp, self.config.hidden_size
        if self._exit is None:  # one device read per launch, not per slot
            self._exit = self.exit_state()
        with cp.cuda.Device(self.device), self.stream:
            if single:
                return slot_hidden(cp, self.single_layout, self.single_work, 1, 0, self._exit[0], h)
            w, n = self._last
            return slot_hidden(cp, self.builds[n][0], w, n, b, self._exit[0], h)

    def exit_state(self) -> tuple[int, int]:
        """(fused turn, steps run) the last launch left (after it finished)."""
        t, n = (int(v) for v in self.cp.asnumpy(self.kctl[:2]))
        return t, n
