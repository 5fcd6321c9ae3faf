"""Which monokernel engine serves a replica's `max_batch`, and the settings it cannot serve.

max_batch 1 is `MonokernelEngine`: one sequence at a time, tensor parallelism over several GPUs,
agent-session KV reuse on one GPU. max_batch 2..MAX_BATCH is `BatchedMonokernelEngine`: that many
sequences decoded together on one GPU, no tensor parallelism, no session reuse.

The replica CLI, the Ray replica spec, the cluster config and the Serve app args refuse the same
combinations through `batch_problem`, each in its own spelling of the settings, before any GPU work.
"""

from __future__ import annotations

from collections.abc import Mapping


def batch_problem(max_batch: int, batch_knob: str, *, tensor_parallel: str | None, one_gpu_fix: str,
                  sessions: Mapping[str, float | None]) -> str | None:
    """Why the monokernel cannot serve `max_batch` slots as configured; None when it can.

    batch_knob: how the caller spells max_batch ("--max-batch", "replicas.max_batch").
    tensor_parallel: the setting that spreads one engine over several GPUs ("--devices 0,1"), None if one.
    one_gpu_fix: how to get one GPU per engine, in the caller's terms.
    sessions: session-reuse settings by spelling; None = not given (the engine default).
    """
    if max_batch <= 1:
        return None
    from replicas.layout import MAX_BATCH  # here: the layout module costs numpy, config parsing need not

    if max_batch > MAX_BATCH:
        return (f"{batch_knob} {max_batch}: the monokernel decodes at most {MAX_BATCH} sequences together on "
                f"one GPU (the kernel's limit, replicas.layout.MAX_BATCH); use {batch_knob} 2..{MAX_BATCH}, "
                "or more GPUs or replicas for more concurrent requests")
    if tensor_parallel:
        return (f"{batch_knob} {max_batch} with {tensor_parallel}: tensor parallelism and batching are not "
                "supported together (the tensor-parallel monokernel decodes one sequence at a time); "
                f"{one_gpu_fix}, or keep {batch_knob} 1 for one engine over several GPUs")
    # 0 turns reuse off, which is what the batched engine does anyway: not a conflict
    asked = [f"{k} {_number(v)}" for k, v in sessions.items() if v is not None and v != 0]
    if asked:
        return (f"{batch_knob} {max_batch} with {' and '.join(asked)}: the batched monokernel keeps no "
                "agent-session KV between turns (every turn prefills its whole prompt; only the "
                f"single-sequence engine, {batch_knob} 1, reuses sessions); drop the session settings "
                f"or use {batch_knob} 1")
    return None


def fields_problem(engine: str, max_batch: int, tensor_parallel_size: int, session_cache_mb: float | None,
                   max_sessions: int | None, prefix: str = "", tp_given: bool = True) -> str | None:
    """`batch_problem` for settings spelled as fields (`prefix` + name: the spec, cluster config, Serve
    args), as "engine 'monokernel': ..."; tp_given=False: tensor_parallel_size was left to default to
    gpus_per_replica (said so). Only engine "monokernel" is judged: `auto` may pick the reference
    engine, which serves any max_batch (replicas.actor.monokernel_loader handles auto on a GPU)."""
    if engine != "monokernel":
        return None
    tp = None
    if tensor_parallel_size > 1:
        tp = f"{prefix}tensor_parallel_size {tensor_parallel_size}" + (
            "" if tp_given else f" (the default: {prefix}gpus_per_replica)")
    problem = batch_problem(max_batch, f"{prefix}max_batch", tensor_parallel=tp,
                            one_gpu_fix=f"set {prefix}tensor_parallel_size to 1 (one batched engine per GPU: "
                                        "a replica with N GPUs serves N x max_batch)",
                            sessions={f"{prefix}session_cache_mb": session_cache_mb,
                                      f"{prefix}max_sessions": max_sessions})
    return problem and f"engine 'monokernel': {problem}"


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)
