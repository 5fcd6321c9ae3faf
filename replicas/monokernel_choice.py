"""Which monokernel engine serves a replica's `max_batch`, and the settings it cannot serve.

max_batch 1 is `MonokernelEngine`: one sequence at a time, tensor parallelism over several GPUs,
agent-session KV reuse on one GPU. max_batch 2..MAX_BATCH is `BatchedMonokernelEngine`: that many
sequences decoded together on one GPU, no tensor parallelism, agent-session KV reuse per slot (the
session settings size its cache as they size the single-sequence engine's).

The replica CLI, the Ray replica spec, the cluster config and the Serve app args refuse the same
combinations through `batch_problem`, each in its own spelling of the settings, before any GPU work.
"""

from __future__ import annotations


def batch_problem(max_batch: int, batch_knob: str, *, tensor_parallel: str | None, one_gpu_fix: str) -> str | None:
    """Why the monokernel cannot serve `max_batch` slots as configured; None when it can.

    batch_knob: how the caller spells max_batch ("--max-batch", "replicas.max_batch").
    tensor_parallel: the setting that spreads one engine over several GPUs ("--devices 0,1"), None if one.
    one_gpu_fix: how to get one GPU per engine, in the caller's terms.
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
    return None


def fields_problem(engine: str, max_batch: int, tensor_parallel_size: int, prefix: str = "",
                   tp_given: bool = True) -> str | None:
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
                                        "a replica with N GPUs serves N x max_batch)")
    return problem and f"engine 'monokernel': {problem}"
