"""Peak-memory prediction by component, for ``train`` (planned at setup) and the ``plan`` command.

Figures are MiB. Weights, gradients and optimizer state are counted exactly from the model's
shapes; activations from the T5 layer shapes at the costliest micro-batch of the run (replayed
through its stream when it reads at most 10,000 rows, else from sampled lengths: see
``lowmem.memory.plan_batches``). Those bytes (``lowmem.memory.plan_sizes``) are split here into the host's
and the GPU's components; the framework baseline is measured in this process (Python, torch,
transformers, tokenizer). On the CPU the host figure is
checked against measured peak RSS by ``bench/memory_modes.py``; the GPU figures are estimates
(no GPU was available to check them, see docs/memory.md). The ``plan`` command's table and the modes it
recommends for a budget are in ``lowmem.cli.plan_command``.
"""

from __future__ import annotations

import sys

from config import TrainConfig
from lowmem.memory.plan_sizes import ONE_PROCESS, Placement, StepSizes, step_sizes
from lowmem.memory.tensor_bytes import parameter_shapes, quantized_saving, quantized_shapes

MB = 2**20
# Heap memory the CPU allocator keeps after freeing activations and optimizer temporaries
# (glibc reuses it, but it stays resident): a share of the bytes that are allocated and freed at
# every step. Calibrated with bench/memory_modes.py on the CPU.
ALLOCATOR_SLACK = 0.35
# With LoRA the host peak sits this share of the costliest micro-batch's activations and logits above
# the live tensors (glibc keeps the blocks they were freed from). Full training hides the same gap in
# the heap its gradients churn through (ALLOCATOR_SLACK). Fitted on small, adapters q,v / k,v / wi,wo
# / all six, with and without dropout, chat and 6-turn prompts: 0.40-0.76, mean 0.56.
LORA_HEAP_SLACK = 0.55
FIRST_STEP_MB = 20  # kernels, thread pools and autograd bookkeeping created by the first step
CUDA_CONTEXT_MB = 500  # CUDA context and kernels on the GPU (outside torch's allocator)
CUDA_HOST_MB = 1500  # host RSS of the CUDA runtime libraries once initialised
GPU_ALLOCATOR_SLACK = 0.10  # torch's caching allocator: reserved above allocated
EVAL_FIRST_MB = 35  # resident after the first evaluation, heap trimmed: generation's kernels and objects (27-48)


def gpu_components(cfg: TrainConfig, s: StepSizes, framework_mb: float) -> tuple[dict, dict]:
    """(GPU memory, host RAM) by component, in bytes, for a run on one GPU per process."""
    encoder_weights = 4 * s.encoder_elements if cfg.encoder_cache != "off" else 0
    if encoder_weights and s.half:
        encoder_weights -= 2 * s.encoder_matrices
    if encoder_weights and s.quantized:
        encoder_weights -= quantized_saving(cfg, quantized_shapes(cfg, {"encoder": parameter_shapes(s.dims)["encoder"],
                                                                        "decoder": []}))
    gpu = {"cuda_context": CUDA_CONTEXT_MB * MB, "weights": s.weights - encoder_weights,
           "gradients": s.alive["gradients"], "optimizer": s.alive["optimizer"], "bf16_weight_copies": s.cast_cache,
           **s.alive}
    live = sum(v for k, v in gpu.items() if k != "cuda_context")
    gpu["allocator_slack"] = GPU_ALLOCATOR_SLACK * live
    # Evaluation (cache emptied before it): the whole model on the GPU again, the optimizer state.
    at_eval = CUDA_CONTEXT_MB * MB + s.weights + s.optimizer + (1 + GPU_ALLOCATOR_SLACK) * s.evaluation
    gpu["evaluation"] = max(0, at_eval - sum(gpu.values()))
    # --init_from is read a block at a time, each tensor sent to the GPU as it comes (lowmem.model.streamed_load);
    # a model built from a preset is built on the host, whole; sharded engines shard a host copy.
    on_host = s.largest_read if cfg.init_from and not s.sharding else s.weights
    host = {"framework": framework_mb * MB + CUDA_HOST_MB * MB, "weights_on_host": max(on_host, s.serialize),
            "encoder_offloaded": encoder_weights, "caches": s.cache, "data_buffers": s.buffers}
    return gpu, host


def on_heap(act: dict, mmap_threshold: int) -> float:
    """Of a micro-batch's activations and logits, the bytes carved from the CPU heap: each copy of the
    logits at or above the mmap threshold is mapped and goes back to the system when freed (tiny at
    micro-batch 32 on 128-token targets, 93 MiB a copy, was planned 1.14-1.29x its peak with them kept)."""
    return act["activations"] + (act["logits"] if act["logits_grad"] < mmap_threshold else 0)


def host_components(cfg: TrainConfig, s: StepSizes, framework_mb: float) -> dict:
    """Host RAM by component, in bytes, for a run on the CPU."""
    act = s.act  # the runner-up's (s.before) freed blocks are the heap kept beside it
    slack = ALLOCATOR_SLACK * (s.churn + on_heap(s.before, s.mmap_threshold)) + FIRST_STEP_MB * MB
    if cfg.lora_r:  # nothing weight-sized churns: the activations' freed blocks stay behind (measured)
        slack += LORA_HEAP_SLACK * on_heap(act, s.mmap_threshold)
    if s.fresh_gradients:
        # The gradients made anew in the backward land beside the activations, whose blocks, freed by
        # the optimizer step, stay behind it (its temporaries do not fill them: measured, 26 runs).
        at_step = 4 * s.n_train + s.optimizer_temp + on_heap(act, s.mmap_threshold) + FIRST_STEP_MB * MB
        if s.first_step:  # the state, made at that step, is carved from those freed blocks
            at_step -= s.optimizer
        # (logits mapped apart from the heap sit beside it, not in it)
        mapped = s.alive["logits_loss"] if act["logits_grad"] >= s.mmap_threshold else 0
        slack = max(slack, at_step - sum(v for k, v in s.alive.items() if k != "optimizer") + mapped)
    host = {"framework": framework_mb * MB, "weights": s.weights - s.gathered,
            **({"gathered_weights": s.gathered} if s.gathered else {}), "gradients": s.alive["gradients"],
            "optimizer": s.alive["optimizer"], "bf16_weight_copies": s.cast_cache, **s.alive,
            "allocator_slack": slack, "caches": s.cache, "data_buffers": s.buffers}
    host["checkpoint_copy"] = (max(0, s.serialize - s.freed_at_save - slack)
                               + max(0, s.export_copies - (1 - ALLOCATOR_SLACK) * s.freed_at_save))
    # Evaluation runs between optimizer steps (gradients freed, heap trimmed): what stays is the
    # framework, the weights, the optimizer state, caches and buffers. An evaluation before the
    # training peak (step 0, then every --eval_steps) leaves EVAL_FIRST_MB resident under it.
    resident = EVAL_FIRST_MB * MB if cfg.eval_steps > 0 else 0
    kept = s.optimizer + sum(host[k] for k in ("framework", "weights", "caches", "data_buffers"))
    at_eval = kept + (FIRST_STEP_MB + EVAL_FIRST_MB) * MB + s.evaluation
    host["evaluation"] = resident + max(0, at_eval - sum(host.values()) - resident)
    return host


def predict(cfg: TrainConfig, vocab_size: int, lengths: dict, framework_mb: float,
            placement: Placement = ONE_PROCESS) -> dict:
    """Peak memory by component for host RAM and GPU memory (MiB), plus their totals, of one process of a run
    (``placement``: its device, processes and sharding).

    When the run's batches are known (replayed) and it starts fresh, its first step and the later ones
    are planned apart, and the larger peak is the plan: the optimizers make their state at the end of
    the first step, so a long batch met there has no state beside it (base pretraining with AdamW
    whose longest batch came in the first step was planned 1.16x its measured peak with it counted).
    """
    windows = lengths.get("windows")
    if windows and len(windows) > 1 and not cfg.is_keep_training:
        key = "gpu_peak_mb" if placement.device == "gpu" else "host_peak_mb"
        return max((one_plan(cfg, vocab_size, {**lengths, "windows": windows[:1]}, framework_mb, placement, True),
                    one_plan(cfg, vocab_size, {**lengths, "windows": windows[1:]}, framework_mb, placement)),
                   key=lambda plan: plan[key])
    return one_plan(cfg, vocab_size, lengths, framework_mb, placement)


def one_plan(cfg: TrainConfig, vocab_size: int, lengths: dict, framework_mb: float, placement: Placement,
             first_step: bool = False) -> dict:
    """``predict`` for the batches of ``lengths`` (``first_step``: those of a fresh run's first step)."""
    s = step_sizes(cfg, vocab_size, lengths, placement, first_step)
    device, sharding = placement.device, placement.sharding
    gpu, host = gpu_components(cfg, s, framework_mb) if device == "gpu" else ({}, host_components(cfg, s, framework_mb))
    host_mb = {k: round(v / MB, 1) for k, v in host.items()}
    gpu_mb = {k: round(v / MB, 1) for k, v in gpu.items()}
    peak = s.peak
    parts_mb = {k: round(v / MB, 1) for k, v in {**s.head_parts, "logits": s.act["logits"]}.items()}
    # As the trainer counts them (lowmem.model.build.count_parameters): LoRA's adapters are parameters too
    return {"device": device, "parameters": s.n_params + (s.n_train if cfg.lora_r else 0),
            "trainable_parameters": s.n_train, "embedding_shape": [s.dims["vocab_size"], s.dims["d_model"]],
            "lm_head": "tied" if s.dims["tied"] else "untied", "model_parts_mb": parts_mb, "sharding": sharding,
            "max_source_tokens": peak[0], "max_target_tokens": peak[1],
            "peak_batch_target_tokens": peak[2] if len(peak) > 2 else cfg.batch_size * peak[1],
            "peak_batch_rows": peak[3] if len(peak) > 3 else cfg.batch_size,
            "training_peak_at": s.peak_at,
            "host_mb": host_mb, "gpu_mb": gpu_mb, "host_peak_mb": round(sum(host_mb.values()), 1),
            "gpu_peak_mb": round(sum(gpu_mb.values()), 1)}


def framework_mb(cfg: TrainConfig | None = None) -> float:
    """RSS (MiB) of this process once the training stack is imported: the framework baseline.

    With ``cfg``, the optional extras the run will import count too (peft for LoRA: about 11 MiB, imported
    without bitsandbytes as ``lowmem.model.build.add_lora`` does; bitsandbytes for adamw8bit: about 44 MiB;
    optimum-quanto for 8-bit frozen weights; tensorboard for --report_to), when they are installed.
    """
    import psutil
    import torch  # noqa: F401

    from lowmem.hardware.memory_use import free_memory
    from lowmem.model.build import import_transformers_models
    from lowmem.monitoring.trackers import import_trackers
    from lowmem.utils.optional import import_extras

    free_memory()  # what reading and replaying the data left behind goes back first (long rows: 100+ MiB)
    import_transformers_models()  # accelerate too
    from transformers import T5ForConditionalGeneration  # noqa: F401

    if cfg is not None:
        import_trackers(cfg.report_to)
        import_extras(cfg)
    return psutil.Process().memory_info().rss / MB


def plan_data(cfg: TrainConfig, tokenizer, num_processes: int):
    """The ``data.pipeline.TrainData`` of the run's first process, from the data entry point the trainer
    reads through (the ``plan`` command predicts from its lengths: ``run_lengths``)."""
    from data.objectives.base import objective_for
    from data.pipeline import DataProcess, build_data, check_data

    # As the trainer: without --eval_file the eval set is the training files' last rows, never trained on.
    # Notes go to stderr: `plan --json` prints one JSON object on stdout.
    def note(line: str) -> None:
        print(line, file=sys.stderr)

    return build_data(cfg, check_data(cfg, objective_for(cfg)), tokenizer, DataProcess(0, num_processes, report=note,
                                                                                       warn=note))
