"""Peak-memory prediction by component, for ``train`` (planned at setup) and the ``plan`` command.

Figures are MiB. Weights, gradients and optimizer state are counted exactly from the model's
shapes; activations from the T5 layer shapes at the costliest micro-batch of the run (replayed
through its stream when it reads at most 10,000 rows, else from sampled lengths: see
``lowmem.memory.plan_batches``); the framework baseline is measured in this process (Python, torch,
transformers, tokenizer). On the CPU the host figure is
checked against measured peak RSS by ``bench/memory_modes.py``; the GPU figures are estimates
(no GPU was available to check them, see docs/memory.md). The ``plan`` command's table and the modes it
recommends for a budget are in ``lowmem.cli.plan_command``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

from config import TrainConfig
from data.streams.file_stream import total_steps
from lowmem.memory.plan_batches import eval_example_bytes, micro_batch_lengths
from lowmem.memory.plan_sharding import sharded_sizes
from lowmem.memory.probes import SHARDED_MMAP_THRESHOLD
from lowmem.memory.tensor_bytes import (
    activation_bytes,
    batch_cost,
    evaluation_bytes,
    frozen_matrix_elements,
    frozen_parts,
    largest_read_bytes,
    lora_merged_elements,
    matrix_elements,
    model_dims,
    numel,
    optimizer_bytes,
    parameter_shapes,
    part_elements,
    quantized_saving,
    quantized_shapes,
    trainable_shapes,
)
from lowmem.model.quantize import SHARD_BYTES

MB = 2**20
# Heap memory the CPU allocator keeps after freeing activations and optimizer temporaries
# (glibc reuses it, but it stays resident): a share of the bytes that are allocated and freed at
# every step. Calibrated with bench/memory_modes.py on the CPU.
ALLOCATOR_SLACK = 0.35
# glibc serves blocks above this with mmap and unmaps them when freed: they leave no heap behind.
MMAP_THRESHOLD = 32 * 2**20
# With LoRA the host peak sits this share of the costliest micro-batch's activations and logits above
# the live tensors (glibc keeps the blocks they were freed from). Full training hides the same gap in
# the heap its gradients churn through (ALLOCATOR_SLACK). Fitted on small, adapters q,v / k,v / wi,wo
# / all six, with and without dropout, chat and 6-turn prompts: 0.40-0.76, mean 0.56.
LORA_HEAP_SLACK = 0.55
# With one process and no accumulation the gradients are set to None at every step, and the next
# backward makes them again in the blocks they left (same sizes, same order): only those the step's
# activations (recomputed ones included) took in between are placed anew. At most this many times the
# activations' bytes churn. Fitted on 26 runs of tiny, small and base with accumulation 1 (2 was best;
# 1 and 3 within 0.05 of it), checked on 6 more: without the bound short rows were planned 1.09-1.14x.
FRESH_GRADIENT_CHURN = 2.0
FIRST_STEP_MB = 20  # kernels, thread pools and autograd bookkeeping created by the first step
CUDA_CONTEXT_MB = 500  # CUDA context and kernels on the GPU (outside torch's allocator)
CUDA_HOST_MB = 1500  # host RSS of the CUDA runtime libraries once initialised
GPU_ALLOCATOR_SLACK = 0.10  # torch's caching allocator: reserved above allocated
EVAL_FIRST_MB = 35  # resident after the first evaluation, heap trimmed: generation's kernels and objects (27-48)


def alive_at_peak(cfg: TrainConfig, shapes: dict, act: dict, grads: int, opt_state: float, opt_temp: int,
                  ddp_copy: int, world: int, first_step: bool) -> tuple[str, dict]:
    """Where a training step peaks ("backward" or "optimizer step") and what it holds then, by
    component (bytes): the backward of its costliest micro-batch, or the optimizer step (every
    gradient, the optimizer's state and temporaries; the activations are freed by then).

    The optimizers make their state at their first step, so the first step's backward (``first_step``:
    the batches planned are those of a fresh run's first step) does not have it beside: base with AdamW
    for one step was planned 1.17x its measured peak with the state counted there.

    The output layer's gradient is made first in the backward. Tied to a trained shared embedding
    (pretraining, --freeze=none) it is embedding-sized and held until the input embeddings' backward
    adds one more at its end, and only then is their sum added into ``.grad``; an untied ``lm_head``'s
    goes into its ``.grad`` at once (and a trained untied embedding's input gradients are held the
    same way). Gradients accumulated from earlier micro-batches (``--gradient_accumulation_steps`` > 1),
    or kept in DDP's buckets (several processes), are all alive during the backward, beside those.
    With one process and no accumulation, each optimizer step sets them to None, so the backward
    creates them while it frees the activations, layer by layer: its costliest moment is its start
    (everything saved, the logits and their gradient, and the output layer's gradient), the end of the
    decoder's backward (its gradients beside its first block's activations, saved or, with
    checkpointing, recomputed: small SFT with checkpointing was planned 0.93x without them), or its
    end (every gradient, and the input embeddings' one).
    """
    def moment(gradients, activations=0.0, logits=0.0, temp=0.0, copy=0.0, state=0.0 if first_step else opt_state):
        return {"optimizer": state, "gradients": gradients, "activations": activations, "logits_loss": logits,
                "optimizer_step_temp": temp, "ddp_gradient_copy": copy}

    frozen = frozen_parts(cfg)
    embedding = 4 * part_elements(shapes, "shared") if "shared" not in frozen else 0
    tied_head = 0 if shapes["lm_head"] else embedding  # the tied embedding's first share, held
    # An untied lm_head's gradient is made once the logits' gradient is, and only that gradient is left of
    # them then (mT5-small SFT measured 490 + 175 MiB above the micro-batch's start at that moment, where
    # the full logits and the head's gradient together were planned 700 + 490)
    own_head = 4 * part_elements(shapes, "lm_head") if shapes["lm_head"] and "lm_head" not in frozen else 0
    after_decoder = act["activations"] - act["decoder_saved"]
    moments = [moment(grads, temp=opt_temp, state=opt_state)]
    if world > 1 or cfg.gradient_accumulation_steps > 1:
        moments += [moment(grads + tied_head, act["activations"], act["logits"], copy=ddp_copy),
                    moment(grads + own_head, act["activations"], act["logits_grad"], copy=ddp_copy),
                    moment(grads + 2 * embedding, after_decoder - act["encoder_saved"], copy=ddp_copy)]
    else:
        decoder = 4 * part_elements(shapes, "decoder") if "decoder" not in frozen else grads
        moments += [moment(tied_head, act["activations"], act["logits"]),
                    moment(own_head, act["activations"], act["logits_grad"]),
                    moment(tied_head + own_head + decoder + embedding, after_decoder + act["decoder_block"]),
                    moment(grads + embedding, after_decoder - act["encoder_saved"])]
    costliest = max(moments, key=lambda parts: sum(parts.values()))
    return ("optimizer step" if costliest is moments[0] else "backward"), costliest


def runner_up_lengths(cfg: TrainConfig, dims: dict, lengths: dict, device: str) -> tuple[int, ...] | None:
    """The second costliest micro-batch of a replayed run (None when not replayed, or only one).

    The heap the allocator keeps from earlier micro-batches sits beside the costliest one at the
    peak: it was shaped by the other batches. A long batch met once leaves less than a run of them.
    """
    batches = micro_batch_lengths(lengths["windows"], cfg.batch_size, cfg.max_tokens_per_batch,
                                  padding_multiple(cfg, device)) if lengths.get("windows") else []
    if len(batches) < 2:
        return None
    return sorted(batches, key=batch_cost(cfg, dims, device))[-2]


def peak_batch_lengths(cfg: TrainConfig, dims: dict, lengths: dict, device: str, world: int) -> tuple[int, ...]:
    """Source and target lengths (and, when replayed, target tokens) of the costliest micro-batch the
    run is expected to meet.

    When the run's stream was replayed (``lengths["windows"]``, see ``plan_batches.replay_windows``), that
    is the costliest micro-batch it will train on. Otherwise a run that reads every row meets the
    longest source and the longest target (rows of similar length share a micro-batch, so both can
    meet in one), and a shorter run (``--max_steps``) reading n of the m sampled rows meets the
    median of the costliest of n draws: the row at rank ``m * 0.5 ** (1 / n)`` when the sample is
    sorted by the activation bytes a row costs.
    """
    cost = batch_cost(cfg, dims, device)
    if lengths.get("windows"):
        return max(micro_batch_lengths(lengths["windows"], cfg.batch_size, cfg.max_tokens_per_batch,
                                       padding_multiple(cfg, device)), key=cost)
    pairs = lengths["pairs"]
    share = lengths["rows"] / world  # the rows each process reads per epoch
    read = share * cfg.epochs
    if cfg.max_steps > 0:
        read = min(read, cfg.max_steps * cfg.batch_size * cfg.gradient_accumulation_steps)
    if not pairs or read >= share:
        return token_budget_rows(cfg, (lengths["max_source"], lengths["max_target"]))
    ranked = sorted(pairs, key=cost)
    rank = math.ceil(len(ranked) * 0.5 ** (1 / max(read, 1)))
    return token_budget_rows(cfg, ranked[min(max(rank, 1), len(ranked)) - 1])


def token_budget_rows(cfg: TrainConfig, batch: tuple[int, int]) -> tuple[int, ...]:
    """With --max_tokens_per_batch, the micro-batch of rows at these lengths the budget lets in (as many
    as fit, within one window); without, the lengths as given (--batch_size rows)."""
    if not cfg.max_tokens_per_batch:
        return tuple(batch)
    rows = max(1, min(cfg.batch_size * cfg.gradient_accumulation_steps, cfg.max_tokens_per_batch // max(sum(batch), 1)))
    return batch[0], batch[1], rows * batch[1], rows


@dataclass
class StepSizes:
    """Bytes of everything a training run holds, before they are split by device (see ``predict``)."""

    dims: dict  # the model's shape (tensor_bytes.model_dims)
    n_params: int  # the base model's (LoRA's adapters are n_train)
    n_train: int
    head_parts: dict  # bytes of the shared embedding and an untied lm_head as held (large vocabularies)
    half: int  # frozen elements stored in bf16 (--frozen_dtype=bfloat16)
    quantized: int  # frozen elements stored in 8 bits (--frozen_dtype=int8|float8)
    saved_8bit: int  # the bytes that saves against float32
    gathered: float  # of the weights, those a sharded process gathers from the others for the step
    encoder_elements: int  # the encoder stack's weights (offloaded from the GPU with the encoder cache)
    encoder_matrices: int  # of which matrices (the ones --frozen_dtype stores in bf16)
    weights: float
    optimizer: float
    cast_cache: float  # autocast's bf16 copy of every trainable weight
    cache: float  # the encoder cache read into RAM
    buffers: float  # shuffle buffer and eval set
    alive: dict  # optimizer state, gradients, activations, logits, optimizer temporaries, DDP's copy at the peak
    peak_at: str  # "backward" or "optimizer step"
    act: dict  # activation_bytes of the costliest micro-batch
    before: dict  # activation_bytes of the runner-up, which shaped the heap kept beside it
    churn: float  # gradient and optimizer-temporary bytes carved from (not mmapped beside) the CPU heap
    mmap_threshold: int  # glibc serves blocks of this size and up with mmap (lowmem.memory.probes.map_large_blocks)
    fresh_gradients: bool  # one process, no accumulation: each step's gradients are made anew, then freed
    first_step: bool  # the batches planned are a fresh run's first step: the optimizer state is made at its end
    optimizer_temp: float
    freed_at_save: float
    serialize: float
    export_copies: float
    evaluation: float
    peak: tuple
    largest_read: int = 0  # host bytes of the largest group the streamed load reads at once
    sharding: str | None = None


def padded_peak_batches(cfg: TrainConfig, dims: dict, lengths: dict, device: str,
                        world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The lengths of the costliest micro-batch and of the runner-up, padded as the trainer pads them."""
    from data.collate import round_up

    peak = peak_batch_lengths(cfg, dims, lengths, device, world)
    runner_up = runner_up_lengths(cfg, dims, lengths, device) or peak
    multiple = padding_multiple(cfg, device)
    if multiple > 1:  # the lengths padded as the trainer pads them (not the token and row counts)
        peak, runner_up = ((*(round_up(n, multiple) for n in batch[:2]), *batch[2:]) for batch in (peak, runner_up))
    return peak, runner_up


def padding_multiple(cfg: TrainConfig, device: str) -> int:
    from data.collate import shape_multiple

    return shape_multiple(cfg.mixed_precision, device == "cpu")


def encoder_cache_in_ram(cfg: TrainConfig, dims: dict, lengths: dict, world: int) -> float:
    """Bytes of the encoder cache read into RAM (--encoder_cache=memory, or auto when it is small)."""
    cache = 0
    rows_share = lengths["rows"] / world
    cache_bytes = rows_share * lengths["mean_source"] * dims["d_model"] * (4 if cfg.encoder_cache_dtype == "float32"
                                                                             else 2)
    if cfg.encoder_cache in ("memory", "auto"):
        import psutil

        if cfg.encoder_cache == "memory" or cache_bytes <= 0.1 * psutil.virtual_memory().available:
            cache = cache_bytes
    return cache


def heap_churn(cfg: TrainConfig, dims: dict, train_shapes: list, runner_up: tuple[int, ...], device: str,
               world: int, mmap_threshold: int = MMAP_THRESHOLD) -> tuple[float, bool]:
    """(bytes carved from the CPU heap at every step, whether each step's gradients are made anew).

    The tensors of each step that outlive no step: gradients (set to None at every optimizer step),
    activations, logits and the optimizer's temporaries; those above the mmap threshold (a large
    vocabulary's embedding gradient and its update) go back to the system when freed.
    """
    on_heap = [x for x in train_shapes if 4 * numel(x) < mmap_threshold]
    churn = 4 * sum(numel(x) for x in on_heap) + optimizer_bytes(cfg, on_heap)[1]
    fresh_gradients = world == 1 and cfg.gradient_accumulation_steps == 1 and not cfg.lora_r
    if fresh_gradients:
        made = activation_bytes(replace(cfg, gradient_checkpointing=False), dims, *runner_up[:2], device,
                                *runner_up[2:])  # with checkpointing, the recomputed ones too
        churn = min(churn, FRESH_GRADIENT_CHURN * (made["activations"] + made["logits"]))
    return churn, fresh_gradients


def step_sizes(cfg: TrainConfig, vocab_size: int, lengths: dict, device: str, world: int,
               first_step: bool = False, sharding: str | None = None) -> StepSizes:
    """Weights, gradients, optimizer state, the costliest micro-batch's activations, caches, buffers,
    saves and evaluation of a run, in bytes. ``first_step``: ``lengths`` holds a fresh run's first
    step only (a run of one step is one too). ``sharding`` ("fsdp", "zero2", "zero3"): one process of a
    sharded run (``lowmem.memory.plan_sharding``)."""
    dims = model_dims(cfg, vocab_size)
    shapes = parameter_shapes(dims)
    n_params = part_elements(shapes, *shapes)
    train_shapes = trainable_shapes(cfg, dims)
    n_train = sum(numel(x) for x in train_shapes)
    eight_bit = quantized_shapes(cfg, shapes)  # --frozen_dtype=int8|float8: 1 byte, and a scale per row
    quantized = sum(numel(shape) for shape in eight_bit)
    # --frozen_dtype=bfloat16 stores the frozen matrices in 2 bytes; int8|float8 those it does not quantize
    # (wo, the embedding, a frozen head: lowmem.model.streamed_load)
    half = frozen_matrix_elements(cfg, shapes) - quantized if cfg.frozen_dtype != "float32" else 0
    stored = {part: 2 if half and part in frozen_parts(cfg) else 4 for part in ("shared", "lm_head")}
    steps = total_steps(cfg, math.ceil(lengths["rows"] / world))
    head_parts = {"embedding": stored["shared"] * part_elements(shapes, "shared")}
    if shapes["lm_head"]:
        head_parts["lm_head"] = stored["lm_head"] * part_elements(shapes, "lm_head")
    weights = 4 * (n_params + (n_train if cfg.lora_r else 0)) - 2 * half
    saved_8bit = quantized_saving(cfg, eight_bit)
    weights -= saved_8bit
    grads = 4 * n_train
    opt_state, opt_temp = optimizer_bytes(cfg, train_shapes)
    peak, runner_up = padded_peak_batches(cfg, dims, lengths, device, world)
    act = activation_bytes(cfg, dims, *peak[:2], device, *peak[2:])
    before = activation_bytes(cfg, dims, *runner_up[:2], device, *runner_up[2:])
    mmap_threshold = SHARDED_MMAP_THRESHOLD if sharding else MMAP_THRESHOLD
    # The shuffle buffer never holds more than a process's share of the corpus, nor more text than
    # --shuffle_buffer_mb and the row that came in over it (data.streams.file_stream.through_buffer).
    rows_share = lengths["rows"] / world
    buffered = min(cfg.shuffle_buffer_size, math.ceil(rows_share)) if lengths["rows"] else cfg.shuffle_buffer_size
    if cfg.shuffle_buffer_mb and lengths["row_bytes"]:
        buffered = min(buffered, math.ceil(cfg.shuffle_buffer_mb * MB / lengths["row_bytes"]) + 1)
    # Under DDP (world > 1) the gradients live in its all-reduce buckets (as views), which stay
    # allocated between steps. Between all-reduces (no_sync micro-steps) autograd accumulates into
    # fresh tensors beside them: one more copy of the gradients whenever accumulation > 1.
    ddp_copy = grads if world > 1 and cfg.gradient_accumulation_steps > 1 else 0
    churn, fresh_gradients = heap_churn(cfg, dims, train_shapes, runner_up, device, world, mmap_threshold)
    gathered = 0.0
    if sharding:  # no DDP buckets; a share of the rest, and what is gathered for the step
        sized = sharded_sizes(sharding, world, dims, shapes, weights, grads, opt_state, opt_temp)
        weights, gathered, grads, opt_state, opt_temp = (sized.weights, sized.gathered, sized.gradients,
                                                         sized.optimizer, sized.optimizer_temp)
        ddp_copy = 0
    # Freed before a save: the step's temporaries and, on one process, the gradients (set to None).
    freed_at_save = act["activations"] + act["logits"] + opt_temp + ddp_copy + (grads if world == 1 else 0)
    first_step = first_step or (steps == 1 and not cfg.is_keep_training)
    peak_at, alive = alive_at_peak(cfg, shapes, act, grads, opt_state, opt_temp, ddp_copy, world, first_step)
    return StepSizes(
        dims=dims, n_params=n_params, n_train=n_train, head_parts=head_parts, half=half,
        quantized=quantized, saved_8bit=saved_8bit,
        gathered=gathered,
        encoder_elements=part_elements(shapes, "encoder"),
        encoder_matrices=matrix_elements(shapes["encoder"]),
        weights=weights, optimizer=opt_state,
        cast_cache=2 * n_train if cfg.mixed_precision == "bf16" else 0,
        cache=encoder_cache_in_ram(cfg, dims, lengths, world),
        buffers=buffered * (lengths["row_bytes"] * 2 + 400) + cfg.max_eval_samples * eval_example_bytes(cfg, lengths),
        alive=alive, peak_at=peak_at, act=act, before=before,
        churn=churn, mmap_threshold=mmap_threshold, fresh_gradients=fresh_gradients, first_step=first_step,
        optimizer_temp=opt_temp,
        freed_at_save=freed_at_save,
        **save_sizes(cfg, dims, device, sharding, n_params, n_train, quantized, half),
        largest_read=largest_read_bytes(dims, shapes) if cfg.init_from else 0,
        evaluation=evaluation_bytes(cfg, dims, lengths.get("eval", [])), peak=peak, sharding=sharding)


def save_sizes(cfg: TrainConfig, dims: dict, device: str, sharding: str | None, n_params: int, n_train: int,
               quantized: int, half: int) -> dict:
    """Host bytes a checkpoint (``serialize``) and an export (``export_copies``) make.

    Saving copies the weights to host bytes first: from a GPU always, on the CPU only with a safetensors that
    is not zero-copy (recent ones write straight from the tensors' memory); a checkpoint of a run with frozen
    weights holds the trained tensors only (lowmem.checkpointing.checkpoint.save_trained), while sharded engines write
    every process's shards of everything and a sharded export gathers the whole model on the main process.
    Exports also make new tensors: LoRA's merged weights, and float32 copies of bf16-stored ones (one tensor
    at a time), large, so mmapped fresh rather than carved from the heap the allocator kept (from a GPU they
    are made on the host, within the host copy of the weights counted there). An export of 8-bit weights
    dequantizes (and merges) them a shard at a time (lowmem.model.quantize). A LoRA run exports its adapters
    (float32 copies of them) unless --merge_lora.
    """
    copies = device == "gpu" or sharding or not zero_copy_save()
    serialize = 4 * (n_params if sharding or not frozen_parts(cfg) else n_train) if copies else 0
    if cfg.lora_r and not cfg.merge_lora and not sharding:
        export = 4 * n_train
    elif quantized:
        export = min(4 * (quantized + lora_merged_elements(cfg, dims)), SHARD_BYTES)
    else:
        export = 4 * lora_merged_elements(cfg, dims) + 2 * half
    return {"serialize": serialize, "export_copies": export}


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


def predict(cfg: TrainConfig, vocab_size: int, lengths: dict, framework_mb: float, device: str = "cpu",
            world: int = 1, sharding: str | None = None) -> dict:
    """Peak memory by component for host RAM and GPU memory (MiB), plus their totals.

    When the run's batches are known (replayed) and it starts fresh, its first step and the later ones
    are planned apart, and the larger peak is the plan: the optimizers make their state at the end of
    the first step, so a long batch met there has no state beside it (base pretraining with AdamW
    whose longest batch came in the first step was planned 1.16x its measured peak with it counted).
    """
    windows = lengths.get("windows")
    if windows and len(windows) > 1 and not cfg.is_keep_training:
        key = "gpu_peak_mb" if device == "gpu" else "host_peak_mb"
        return max((one_plan(cfg, vocab_size, {**lengths, "windows": windows[:1]}, framework_mb, device, world, True,
                             sharding),
                    one_plan(cfg, vocab_size, {**lengths, "windows": windows[1:]}, framework_mb, device, world,
                             sharding=sharding)),
                   key=lambda plan: plan[key])
    return one_plan(cfg, vocab_size, lengths, framework_mb, device, world, sharding=sharding)


def one_plan(cfg: TrainConfig, vocab_size: int, lengths: dict, framework_mb: float, device: str, world: int,
             first_step: bool = False, sharding: str | None = None) -> dict:
    """``predict`` for the batches of ``lengths`` (``first_step``: those of a fresh run's first step)."""
    s = step_sizes(cfg, vocab_size, lengths, device, world, first_step, sharding)
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


def zero_copy_save() -> bool:
    """Whether the installed safetensors writes CPU tensors without copying them to bytes first
    (measured: saving a 654 MiB model raised peak RSS by 0 MiB with safetensors 0.8; older releases
    built a bytes copy of every tensor, safetensors issue #458)."""
    import safetensors.torch

    return hasattr(safetensors.torch, "_flatten_as_ptr")


def framework_mb(cfg: TrainConfig | None = None) -> float:
    """RSS (MiB) of this process once the training stack is imported: the framework baseline.

    With ``cfg``, the optional extras the run will import count too (peft for LoRA: about 11 MiB, imported
    without bitsandbytes as ``lowmem.model.build.add_lora`` does; bitsandbytes for adamw8bit: about 44 MiB;
    optimum-quanto for 8-bit frozen weights; tensorboard for --report_to), when they are installed.
    """
    import psutil
    import torch  # noqa: F401

    from lowmem.memory.probes import free_memory, import_extras
    from lowmem.model.build import import_transformers_models

    free_memory()  # what reading and replaying the data left behind goes back first (long rows: 100+ MiB)
    import_transformers_models()  # accelerate too
    from transformers import T5ForConditionalGeneration  # noqa: F401

    if cfg is not None:
        import_extras(cfg)
    return psutil.Process().memory_info().rss / MB


def plan_data(cfg: TrainConfig, tokenizer, num_processes: int):
    """The ``data.pipeline.TrainData`` of the run's first process, from the data entry point the trainer
    reads through (the ``plan`` command predicts from its lengths: ``run_lengths``)."""
    from data.objectives.base import objective_for
    from data.pipeline import build_data, check_data

    objective = objective_for(cfg)
    # As the trainer: without --eval_file the eval set is the training files' last rows, never trained on.
    # Notes go to stderr: `plan --json` prints one JSON object on stdout.
    return build_data(cfg, check_data(cfg, objective), tokenizer, 0, num_processes, objective=objective,
                      report=lambda line: print(line, file=sys.stderr), warn=lambda line: print(line, file=sys.stderr))
