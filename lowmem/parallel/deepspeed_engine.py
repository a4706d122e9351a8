"""DeepSpeed ZeRO (stages 2 and 3), started by accelerate from the launch config and driven by the trainer.

accelerate builds the engine (``accelerator.prepare``) from the config's ``deepspeed_config``; this
module fills in what the trainer decides (micro-batch, accumulation, clipping) and drives the engine
itself: accelerate's ``backward`` would step the optimizer inside the last micro-batch's backward and
divide the loss by the accumulation count, where the trainer normalises a window by its target tokens
(``accumulate_gradients``). Per window: one ``engine.backward`` per micro-batch, the last one marked as
the window's boundary, then one ``engine.step``, which clips at ``--max_grad_norm`` (0 = off), skips a
step whose gradient norm is not finite, steps AdamW and zeroes the gradients.

ZeRO reduces (reduce-scatters) each micro-batch's gradients in its backward: there is no
``no_sync`` under stages 2 and 3, so a window costs one reduce per micro-batch, not one per window.

Checkpoints are DeepSpeed's own (``engine.save_checkpoint``: each process writes its partition) inside
the trainer's atomic checkpoint folder; before DeepSpeed reads them, every file is read once with
torch's ``weights_only`` unpickler allowing DeepSpeed's three plain record classes, so a file holding
any other object is refused before any of it is built.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from pathlib import Path

import torch

from config import TrainConfig
from lowmem.hardware.precision import PRECISIONS
from lowmem.utils.errors import UserError
from lowmem.utils.optional import import_while_replaced, replaced

CHECKPOINT_TAG = "deepspeed"  # the sub-folder of a checkpoint that holds DeepSpeed's files
CPU_ENV = "ACCELERATE_USE_CPU"


def check_deepspeed(cfg: TrainConfig) -> None:
    """Refuse, in one line, what does not run under DeepSpeed here."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise UserError("the launch config asks for DeepSpeed, which is not installed: pip install '.[deepspeed]' "
                        "(or launch with accelerate_configs/fsdp.yaml, fsdp_cpu.yaml on CPU processes)") from None
    if cfg.optimizer not in ("adamw", "adafactor"):
        raise UserError(f"--optimizer={cfg.optimizer} is not supported with DeepSpeed (ZeRO hands the optimizer flat "
                        "slices of the weights); use --optimizer=adamw or adafactor")
    if PRECISIONS[cfg.mixed_precision].scales_loss:
        raise UserError("--mixed_precision=fp16 is not supported with DeepSpeed (its fp16 mode keeps float16 weights, "
                        "which T5 overflows); use --mixed_precision=bf16 or no, or launch with the FSDP config")
    if torch.cuda.is_available():
        if cfg.cpu or os.environ.get(CPU_ENV, "false").lower() == "true":
            raise UserError("--cpu=True with a DeepSpeed launch config: DeepSpeed trains on the GPUs it finds; leave "
                            "--cpu out, or launch with accelerate_configs/cpu_2proc.yaml")
    else:  # DeepSpeed runs on the CPU by itself; accelerate's CPU flag would start plain data parallelism instead
        os.environ.pop(CPU_ENV, None)


def process_group_kwargs() -> list:
    """accelerate's process-group settings for DeepSpeed: gloo on CPU processes (no oneCCL needed)."""
    if torch.cuda.is_available():
        return []
    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(backend="gloo")]


def configure(accelerator, cfg: TrainConfig) -> None:
    """Fill the launch config's DeepSpeed settings the trainer owns."""
    # DeepSpeed 0.19 calls the collectives torch 2.13 deprecated, at every gather and reduce: the warnings,
    # which nothing in this run can act on, would repeat thousands of times a run (17,000 lines in 8 steps of
    # the tiny preset on 2 processes)
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\.(all_gather_into_tensor|"
                            r"reduce_scatter_tensor)` is deprecated")
    settings = accelerator.state.deepspeed_plugin.deepspeed_config
    settings.update(# set here, not in the launch config: accelerate drops a configured 0.0 (DeepSpeed's
                    # default then clips at 1.0); 0 turns DeepSpeed's clipping off
                    gradient_clipping=float(cfg.max_grad_norm))
    # torch's AdamW, as DDP and FSDP runs use (with optimizer offload too: DeepSpeed would insist on its own)
    settings.setdefault("zero_allow_untested_optimizer", True)
    settings.setdefault("zero_force_ds_cpu_optimizer", False)


def set_batch_sizes(accelerator, micro: int, accumulation: int) -> None:
    """The micro-batch and accumulation the run uses (chosen by ``lowmem.memory.batch_budget`` once the data is
    read), in DeepSpeed's settings before the engine is built: its bookkeeping checks them."""
    accelerator.state.deepspeed_plugin.deepspeed_config.update(
        train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation,
        train_batch_size=micro * accumulation * accelerator.num_processes)


def size_buckets(accelerator, d_model: int) -> None:
    """ZeRO's buffer sizes from the model's width, where the launch config sets none.

    DeepSpeed's own defaults are sized for large models on GPUs: communication buckets of 5e8
    elements, and under ZeRO-3 up to 1e9 parameters kept gathered ("live") and any parameter reused
    within 1e9 kept whole, which with a model this size keeps every weight gathered from forward to
    backward, the memory ZeRO-3 is there to save. Buckets of d_model^2 elements (accelerate's "auto"), at
    most about two blocks' weights live or kept for reuse.
    """
    zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
    block = 12 * d_model * d_model  # a T5 block's weights with d_ff = 4 x d_model, in elements
    for key, value in (("reduce_bucket_size", d_model * d_model), ("allgather_bucket_size", d_model * d_model),
                       ("stage3_prefetch_bucket_size", int(0.9 * d_model * d_model)),
                       ("stage3_param_persistence_threshold", 10 * d_model),
                       ("stage3_max_live_parameters", 2 * block), ("stage3_max_reuse_distance", 2 * block),
                       # the optimizer steps one sub-group at a time: its temporaries (DeepSpeed's flat copy
                       # of the sub-group's gradients, AdamW's) are a block's size, not the partition's
                       ("sub_group_size", block)):
        if zero.get(key, "auto") == "auto":
            zero[key] = value


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer with its kernels left to run eagerly, before its ZeRO optimizer
    imports it compiled.

    DeepSpeed 0.19's ZeRO optimizers import Muon for one ``isinstance`` check when they start, and its
    functions are decorated with ``torch.compile``: that imports the compiler stack (dynamo's debugging
    backends, functorch's AOT autograd, inductor's code generation, networkx), 41 MiB more RSS and 2.3 s in
    every process, for an optimizer the trainer never hands DeepSpeed (``check_deepspeed`` admits AdamW and
    Adafactor only). Nothing here is compiled; a Muon run elsewhere in the process would run eagerly.
    """
    try:
        from deepspeed.runtime import compiler
    except ImportError:  # another DeepSpeed layout: it imports what it imports
        return
    import_while_replaced("deepspeed.runtime.zero.muon.muon_optimizer", compiler, "compile",
                          lambda *args, **kwargs: (lambda function: function))


@contextlib.contextmanager
def unwrapped_without_import():
    """While inside, unwrapping a model (accelerate's ``extract_model_from_parallel``, which every
    ``save_pretrained`` calls) does not import DeepSpeed to ask whether the model is a DeepSpeed engine,
    when none can be: a process that never imported DeepSpeed has no engine.

    Where DeepSpeed is installed, that import cost every run's first export 0.5 s and 22 MiB (measured on
    the CPU with DeepSpeed 0.19.8), and a warning line in the log, for an answer known beforehand.
    """
    try:
        from accelerate.utils import other
    except ImportError:  # another accelerate layout: it does what it does
        other = None
    if "deepspeed" in sys.modules or not hasattr(other, "is_deepspeed_available"):
        yield  # an engine may exist (accelerate asks as it would), or nothing to answer for
        return
    with replaced(other, "is_deepspeed_available", lambda: False):
        yield


@contextlib.contextmanager
def loading_whole(accelerator):
    """While inside, transformers' ``from_pretrained`` loads a checkpoint whole, not into ZeRO-3 partitions.

    accelerate registers its DeepSpeed settings with transformers, and under ZeRO-3 ``from_pretrained`` then
    loads straight into partitions (``deepspeed.zero.Init``). transformers 5 ties a T5 head to the shared
    embedding where their checkpoint values are equal, and partitions, empty placeholders on each process,
    always compare equal: flan-t5's, t5-v1_1's, mT5's and umT5's own head was dropped for the embedding (a
    tiny flan-t5 shape: eval loss 31.8 after 3 SFT steps, 6.7 under DDP). Loaded whole, the model is
    partitioned when the engine is built, as a model built from a config always was.
    """
    registered = getattr(getattr(accelerator.state, "deepspeed_plugin", None), "dschf", None)
    if registered is None:  # no DeepSpeed settings registered with transformers: it loads as it would
        yield
        return
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(registered)


def share_master_weights(engine) -> None:
    """Under ZeRO-3 with float32 weights, let the optimizer step the partitions themselves instead of a
    float32 copy of them: 1/N of the weights per process less (a quarter of AdamW's sharded model state).

    DeepSpeed means to skip the copy when the partitions are float32 already, but compares a tensor's
    ``torch.device`` with its device name (a string), which is never equal, so it always copies. Done
    right after the engine is built: the copies hold no optimizer state and no gradient yet; DeepSpeed's
    copy back after each step is then a copy onto itself.
    """
    zero = engine.optimizer
    if not hasattr(zero, "fp32_partitioned_groups_flat") or zero.offload_optimizer or zero.swap_optimizer:
        return
    for i, (weights, master) in enumerate(zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat)):
        if weights is None or weights.dtype != master.dtype or weights.device != master.device:
            continue
        if weights.data_ptr() != master.data_ptr() and master.grad is None and master not in zero.optimizer.state:
            weights.ds_id, weights.requires_grad = master.ds_id, True
            zero.fp32_partitioned_groups_flat[i] = weights


def describe_partitions(engine) -> None:
    """Tell Adafactor which slices of which weights each flat float32 partition holds (it needs whole
    weights' statistics, ``lowmem.parallel.adafactor_slices``), from DeepSpeed's own records of the partitioning:
    under ZeRO-3 every weight is split on its own into equal parts, the last padded; under ZeRO-1 and 2
    a group's weights are concatenated, then split."""
    from lowmem.parallel.adafactor_slices import SliceAware

    zero = engine.optimizer
    adafactor = getattr(zero, "optimizer", None)
    if not isinstance(adafactor, SliceAware):
        return
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
        for flat, weights, group in zip(zero.fp32_partitioned_groups_flat, zero.fp16_groups,
                                        zero.sub_group_process_groups):
            adafactor.describe(flat, _zero3_layout(weights, group))
    else:
        for i, flat in enumerate(zero.single_partition_of_fp32_groups):
            adafactor.describe(flat, _zero2_layout(zero, i))


def _zero3_layout(weights: list, group):
    import torch.distributed as dist

    from lowmem.parallel.adafactor_slices import Layout, Slice

    rank, slices, offset = dist.get_rank(group=group), [], 0
    for weight in weights:
        size = weight.partition_numel()
        start = rank * size
        slices.append(Slice(tuple(weight.ds_shape), start, max(0, min(size, weight.ds_numel - start)), offset))
        offset += size
    return Layout(tuple(slices), group)


def _zero2_layout(zero, i: int):
    import torch.distributed as dist

    from lowmem.parallel.adafactor_slices import Layout, Slice

    group = zero.real_dp_process_group[i]
    partition = zero.parallel_partitioned_bit16_groups[i][dist.get_rank(group=group)]
    begin = partition.storage_offset() - zero.bit16_groups_flat[i].storage_offset()
    end, slices = begin + partition.numel(), []
    # the weights' shapes as DeepSpeed recorded them (their storage may be swapped out for a while)
    for weight, at in zip(zero.round_robin_bit16_meta[i], zero.round_robin_bit16_offsets[i]):
        low, high = max(at, begin), min(at + weight.numel(), end)
        held = high > low
        slices.append(Slice(tuple(weight.shape), low - at if held else 0, high - low if held else 0,
                            low - begin if held else 0))
    return Layout(tuple(slices), group)


def backward(engine, loss: torch.Tensor, last: bool) -> None:
    """One micro-batch's backward; ``last`` marks the window's end (where the optimizer steps next).
    The loss is used as given: not divided by the accumulation count."""
    engine.set_gradient_accumulation_boundary(last)
    engine.backward(loss, scale_wrt_gas=False)


def step(engine) -> float:
    """The window's optimizer step; returns the gradient norm before clipping, not finite when DeepSpeed
    skipped the step for it (the gradients are zeroed either way)."""
    engine.step()
    norm = engine.get_global_grad_norm()
    return math.inf if norm is None else float(norm)


def full_state_dict(core, is_main: bool) -> dict:
    """The whole float32 weights on the host of the main process (empty elsewhere), each tied tensor
    once; every process calls it. Trained weights come from DeepSpeed's float32 master copy (the module's
    own are bfloat16 under bf16), frozen ones are gathered as they are."""
    from deepspeed import zero
    from deepspeed.utils import safe_get_full_fp32_param

    whole = {}
    for name, param in core.named_parameters():  # each tied tensor once, under its first name
        value = safe_get_full_fp32_param(param) if param.requires_grad else None
        if value is None:
            with zero.GatheredParameters([param]):
                value = param.data.detach().float()
        if is_main:
            whole[name] = value.to("cpu", copy=True)
    for name, buffer in core.named_buffers():
        if is_main:
            whole[name] = buffer.detach().to("cpu", copy=True)
    return whole


def save(engine, staging: Path) -> None:
    """Every process writes its partition into ``staging`` (DeepSpeed's format, under CHECKPOINT_TAG)."""
    engine.save_checkpoint(str(staging), tag=CHECKPOINT_TAG, save_latest=False)


def written_with(folder: Path) -> bool:
    return (Path(folder) / CHECKPOINT_TAG).is_dir()


def load(engine, folder: Path) -> None:
    """Restore weights and optimizer state from ``folder`` in place (the same number of processes)."""
    from lowmem.checkpointing.checkpoint import load_state

    for path in sorted((Path(folder) / CHECKPOINT_TAG).glob("*.pt")):
        load_state(path, allowed=_record_classes())  # refuses a file holding any other object
    loaded, _ = engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                       load_lr_scheduler_states=False)
    if loaded is None:
        raise UserError(f"checkpoint {folder}: DeepSpeed found no state to load in {CHECKPOINT_TAG}/")


def _record_classes() -> list:
    """The classes DeepSpeed's optimizer checkpoints hold besides tensors and plain values: records of
    numbers (stage, loss scale, where a weight's slice lies), which build no code when read."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address]
