"""The engine a launch runs: one object per way of splitting the work, asked by the trainer, the accumulation
window and the checkpointer (none of them compares an engine's name).

- ``PlainEngine``: one process, or plain data parallelism (accelerate's own path: DDP with several processes).
- ``FSDPEngine``: torch's ``fully_shard`` applied by the trainer (``lowmem.parallel.sharding``).
- ``DeepSpeedEngine``: DeepSpeed ZeRO 2 or 3, started by accelerate, driven by the trainer
  (``lowmem.parallel.deepspeed_engine``).

Each registers by its ``name`` as its class is defined (``lowmem.utils.registry``: ``ENGINES``, in the order a launch
config and a checkpoint are recognised). ``engine_for_launch()`` reads ``accelerate launch``'s config (its
``distributed_type``, passed on in the environment); ``engine_that_wrote(folder)`` tells which engine's files a
checkpoint holds. Adding an engine: one subclass here with its ``name``, ``launched`` and ``written_with``.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import torch

from lowmem.parallel import deepspeed_engine
from lowmem.parallel.layouts import UNSHARDED_TITLE
from lowmem.parallel.sharding import full_value, runs_deepspeed
from lowmem.utils.registry import Registered

FSDP_ENV = "ACCELERATE_USE_FSDP"
DEEPSPEED_ENV = "ACCELERATE_USE_DEEPSPEED"
SHARD_WEIGHTS = "model-shard{rank:05d}.safetensors"  # sharded (FSDP) checkpoints: one pair per process
SHARD_OPTIMIZER = "optimizer-shard{rank:05d}.pt"


class Engine(Registered, family=True):
    """How the processes of a run split the model and its steps. The base is the plain engine's behaviour
    where the others share it."""

    title = ""  # as messages name it ("written with FSDP")
    shards = False  # each process holds its own shard: every forward is a collective, each process writes its
    # shard into a checkpoint, exports gather the whole weights
    divides_window = True  # accelerate's backward divides the loss by the window's micro-batches

    @property
    def sharding(self) -> str | None:
        """The planner's name for the launch's sharding (``lowmem.parallel.layouts``), recorded in run_config.json."""
        return None

    @classmethod
    def launched(cls) -> bool:
        """Whether ``accelerate launch`` was given this engine's config."""
        return False

    @classmethod
    def written_with(cls, folder: Path) -> bool:
        """Whether the checkpoint ``folder`` holds this engine's files."""
        return False

    # ------------------------------------------------------------------ start
    def check(self, cfg) -> None:
        """Refuse, in one line each, the options this engine does not run with."""

    def accelerator_options(self, cpu: bool) -> dict:
        """``Accelerator``'s ``cpu`` flag (``cpu``: the CPU asked for, or the only device) and the kwargs handlers
        this engine adds to DDP's."""
        return {"cpu": cpu, "kwargs_handlers": []}

    def configure(self, accelerator, cfg) -> None:
        """Settings the trainer owns, given to the engine once accelerate is started."""

    def set_batch_sizes(self, accelerator, micro: int, accumulation: int) -> None:
        """The micro-batch and accumulation chosen for the run (``lowmem.memory.batch_budget``)."""

    def for_inference(self) -> None:
        """Leave this engine out of a process that only evaluates or generates (whole weights on every process)."""

    # ------------------------------------------------------------------ model
    def shard(self, model, device: torch.device):
        """The model as this engine trains it, before the optimizer is built."""
        return model

    def prepare(self, accelerator, model, optimizer) -> tuple:
        """(model, optimizer, the plain model inside) as accelerate prepares them: DDP-wrapped with several
        processes, or a DeepSpeed engine."""
        model, optimizer = accelerator.prepare(model, optimizer)
        return model, optimizer, inner_model(accelerator, model)

    # ------------------------------------------------------------------ one window
    def accumulating(self, accelerator, model):
        """The context of one micro-batch's forward and backward (DDP syncs only on the window's last)."""
        return accelerator.accumulate(model)

    def backward(self, accelerator, model, loss: torch.Tensor, last: bool) -> None:
        """One micro-batch's backward; ``last`` marks the window's end."""
        accelerator.backward(loss)  # all-reduce only on the window's last micro-batch

    def clip(self, accelerator, model, params: list, max_norm: float):
        """The window's gradient norm before clipping at ``max_norm`` (0 = off), the same on every process;
        not finite when the step must be skipped."""
        # The norm of the all-reduced gradient (clip at infinity = measure only) is the same on every
        # process, so all of them take the same decision; a NaN loss anywhere makes it NaN.
        return full_value(accelerator.clip_grad_norm_(params, max_norm or math.inf))

    def step(self, optimizer) -> None:
        """The optimizer step of a window whose gradient norm is finite."""
        optimizer.step()

    # ------------------------------------------------------------------ checkpoints and exports
    def saved_model(self, model, core):
        """The model a checkpoint is written from and read into (``model`` as prepared, ``core`` the plain one)."""
        return core

    def save(self, model, optimizer, staging: Path, rank: int) -> None:
        """This process's shard of weights and optimizer state, into a checkpoint's staging folder."""
        raise NotImplementedError(f"{type(self).__name__} writes no shards: the main process writes the checkpoint")

    def load(self, model, optimizer, folder: Path, rank: int) -> None:
        """Weights and optimizer state of the checkpoint ``folder``, restored in place (files checked as read)."""
        from lowmem.checkpointing import checkpoint

        optimizer_state = checkpoint.load_state(folder / "optimizer.pt")
        checkpoint.load_trained(model, folder / "model.safetensors")
        optimizer.load_state_dict(optimizer_state)

    def full_state_dict(self, core, is_main: bool) -> dict:
        """The whole weights on the host of the main process (empty elsewhere); every process calls it."""
        raise NotImplementedError(f"{type(self).__name__} holds whole weights: export them as they are")


class PlainEngine(Engine):
    """One process, or plain data parallelism: accelerate's own path."""

    name = "plain"
    title = UNSHARDED_TITLE  # in "written with ... and this run uses ..."


class FSDPEngine(Engine):
    """FSDP2 (``fully_shard``), applied by the trainer (``lowmem.parallel.sharding``'s docstring says why not
    through accelerate); accelerate itself runs as plain data parallelism."""

    name, title = "fsdp", "FSDP"
    shards = True

    def __init__(self):
        self.settings: dict = {}  # the launch config's FSDP options, taken when accelerate starts

    @property
    def sharding(self) -> str | None:
        return "fsdp"

    @classmethod
    def launched(cls) -> bool:
        return os.environ.get(FSDP_ENV, "false").lower() == "true"

    @classmethod
    def written_with(cls, folder: Path) -> bool:
        return (Path(folder) / SHARD_WEIGHTS.format(rank=0)).is_file()

    def check(self, cfg) -> None:
        check_shardable(cfg, self.title)

    def accelerator_options(self, cpu: bool) -> dict:
        """Also takes the launch config's FSDP options (``fsdp_settings``) out of the environment, so that
        accelerate does not start its own FSDP."""
        self.settings = fsdp_settings()
        return super().accelerator_options(cpu)

    def shard(self, model, device: torch.device):
        from lowmem.hardware.memory_use import free_memory
        from lowmem.parallel.sharding import shard_model

        model = shard_model(model, self.settings, device)  # before the optimizer: sharding replaces the parameters
        free_memory()  # the whole weights each process built go back to the OS
        return model

    def prepare(self, accelerator, model, optimizer) -> tuple:
        # the model is sharded already: accelerate would wrap it for DDP too
        return model, accelerator.prepare(optimizer), model

    def save(self, model, optimizer, staging: Path, rank: int) -> None:
        from safetensors.torch import save_file

        from lowmem.parallel.sharding import local_state

        weights, optimizer_state = local_state(model, optimizer)
        save_file(weights, str(staging / SHARD_WEIGHTS.format(rank=rank)))
        torch.save(optimizer_state, staging / SHARD_OPTIMIZER.format(rank=rank))

    def load(self, model, optimizer, folder: Path, rank: int) -> None:
        from safetensors.torch import load_file

        from lowmem.checkpointing import checkpoint
        from lowmem.parallel.sharding import load_local_state

        optimizer_state = checkpoint.load_state(folder / SHARD_OPTIMIZER.format(rank=rank))
        load_local_state(model, optimizer, load_file(str(folder / SHARD_WEIGHTS.format(rank=rank))), optimizer_state)

    def full_state_dict(self, core, is_main: bool) -> dict:
        from lowmem.parallel.sharding import full_state_dict

        return full_state_dict(core)


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO, built by accelerate from the launch config and driven by the trainer: it clips, skips a
    non-finite step and zeroes the gradients itself (``lowmem.parallel.deepspeed_engine``)."""

    name, title = "deepspeed", "DeepSpeed"
    shards = True
    divides_window = False  # its backward, as driven here, uses the loss as given

    @property
    def sharding(self) -> str | None:
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")  # accelerate's own default
        return "zero3" if stage == "3" else "zero2"  # stage 1 splits less: planned as 2, a little low

    @classmethod
    def launched(cls) -> bool:
        return os.environ.get(DEEPSPEED_ENV, "false").lower() == "true"

    @classmethod
    def written_with(cls, folder: Path) -> bool:
        return deepspeed_engine.written_with(folder)

    def check(self, cfg) -> None:
        check_shardable(cfg, self.title)
        deepspeed_engine.check_deepspeed(cfg)

    def accelerator_options(self, cpu: bool) -> dict:
        # accelerate's CPU flag would mean MULTI_CPU (plain data parallelism): DeepSpeed finds the device
        # itself, and CPU processes talk over gloo
        return {"cpu": False, "kwargs_handlers": deepspeed_engine.process_group_kwargs()}

    def configure(self, accelerator, cfg) -> None:
        deepspeed_engine.configure(accelerator, cfg)

    def set_batch_sizes(self, accelerator, micro: int, accumulation: int) -> None:
        deepspeed_engine.set_batch_sizes(accelerator, micro, accumulation)

    def for_inference(self) -> None:
        # accelerate would start a DeepSpeed engine, which needs a training batch: whole weights on every
        # process, as under FSDP
        os.environ[DEEPSPEED_ENV] = "false"

    def prepare(self, accelerator, model, optimizer) -> tuple:
        deepspeed_engine.size_buckets(accelerator, model.config.d_model)
        deepspeed_engine.import_muon_uncompiled()
        model, optimizer = accelerator.prepare(model, optimizer)
        deepspeed_engine.share_master_weights(model)
        deepspeed_engine.describe_partitions(model)
        return model, optimizer, model.module

    def accumulating(self, accelerator, model):
        return contextlib.nullcontext()

    def backward(self, accelerator, model, loss: torch.Tensor, last: bool) -> None:
        deepspeed_engine.backward(model, loss, last=last)

    def clip(self, accelerator, model, params: list, max_norm: float):
        """DeepSpeed's step: it clips (at ``--max_grad_norm``, set by ``configure``), skips a non-finite step,
        steps the optimizer and zeroes the gradients; the norm it measured."""
        return deepspeed_engine.step(model)

    def step(self, optimizer) -> None:
        pass  # stepped within DeepSpeed's own step (``clip``)

    def saved_model(self, model, core):
        return model  # DeepSpeed saves and loads through its engine

    def save(self, model, optimizer, staging: Path, rank: int) -> None:
        deepspeed_engine.save(model, staging)

    def load(self, model, optimizer, folder: Path, rank: int) -> None:
        deepspeed_engine.load(model, folder)

    def full_state_dict(self, core, is_main: bool) -> dict:
        return deepspeed_engine.full_state_dict(core, is_main)


ENGINES: dict[str, type[Engine]] = Engine.kinds  # by name, in the order a launch config and a checkpoint are recognised


def engine_for_launch() -> Engine:
    """The engine ``accelerate launch`` was given (its config's ``distributed_type``): FSDP, DeepSpeed, or the
    plain one."""
    return next((kind() for kind in ENGINES.values() if kind.launched()), PlainEngine())


def engine_that_wrote(folder: Path) -> type[Engine]:
    """The engine whose files the checkpoint ``folder`` holds."""
    return next((kind for kind in ENGINES.values() if kind.written_with(folder)), PlainEngine)


def fsdp_settings() -> dict:
    """The FSDP options of the launch config that apply to ``fully_shard``, taken out of the
    environment so that accelerate does not start its own FSDP (see ``lowmem.parallel.sharding``'s docstring)."""
    os.environ.pop(FSDP_ENV, None)
    return {"reshard_after_forward": os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true",
            "offload_params": os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true",
            "version": os.environ.get("FSDP_VERSION", "2")}


def check_shardable(cfg, title: str) -> None:
    """Refuse, in one line each, the options a sharded engine (``title``: FSDP or DeepSpeed) does not run with."""
    from lowmem.utils.errors import UserError
    from lowmem.utils.frozen_forms import FROZEN_FORMS

    refused = {"--lora_r": cfg.lora_r > 0, "--encoder_cache": cfg.encoder_cache != "off",
               f"--frozen_dtype={cfg.frozen_dtype}": FROZEN_FORMS[cfg.frozen_dtype].narrow,
               "--torch_compile": cfg.torch_compile}
    for flag, on in refused.items():
        if on:
            raise UserError(f"{flag} is not supported with {title}: leave it out, or launch without the {title} "
                            "config (accelerate_configs/multi_gpu.yaml, cpu_2proc.yaml)")


def inner_model(accelerator, model):
    """The plain model inside what ``accelerator.prepare`` returned: the ``module`` of a DDP wrapper or a
    DeepSpeed engine, else the model itself. Not ``accelerator.unwrap_model``: it imports DeepSpeed
    wherever it is installed (0.6 s, 25 MiB and a warning line on CPU machines) before training starts
    (exports keep it out too: ``deepspeed_engine.unwrapped_without_import``)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or runs_deepspeed(accelerator):
        return model.module
    return model

