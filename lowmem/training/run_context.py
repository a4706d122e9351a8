"""``RunContext``: the parts of a run that every window's backward, every evaluation and the loop pass around,
built once the trainer's setup has chosen them (``LowMemTrainer.setup``), instead of a dozen arguments each.
"""

from __future__ import annotations

from dataclasses import dataclass

from config import TrainConfig
from lowmem.hardware.precision import Precision, precision_for
from lowmem.memory.guard import MemoryGuard
from lowmem.parallel.engines import Engine, PlainEngine


@dataclass(frozen=True)
class RunContext:
    """The run's options as resolved, and how it computes: the accelerator (device, processes), the engine that
    splits the work (``lowmem.parallel.engines``), the ``--mixed_precision`` (its autocast, fp16's loss scale),
    the multiple sequence lengths are padded to, and the ``--max_rss_gb`` guard read between micro-batches."""

    cfg: TrainConfig  # with the batch sizes chosen (``auto`` and the memory budget resolved)
    accelerator: object
    engine: Engine
    precision: Precision
    multiple: int = 1  # sequence lengths padded to a multiple of this (bf16 on the CPU: ``Precision.shape_multiple``)
    guard: MemoryGuard | None = None  # None: no reading between micro-batches
    criterion: object = None  # what a micro-batch's backward differentiates (``lowmem.training.criteria``; None:
    # the token loss) and how the run evaluates

    @classmethod
    def plain(cls, cfg: TrainConfig, accelerator, multiple: int = 1) -> RunContext:
        """The context of a process that only evaluates or generates (whole weights, the plain engine, no guard)."""
        return cls(cfg, accelerator, PlainEngine(), precision_for(cfg.mixed_precision, accelerator.device.type),
                   multiple)

    @property
    def device(self):
        return self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def pin(self) -> bool:
        """Whether host batches go to the device through pinned memory (--pin_memory, on CUDA)."""
        return self.cfg.pin_memory and self.device.type == "cuda"
