"""One accumulation window's backward, the same gradient whatever runs it: one process, DDP, FSDP or
DeepSpeed, and however the window is split into micro-batches.

The gradient is that of (sum of token losses) / (target tokens of the whole window on all processes).
DDP all-reduces once per window (no sync until the window's last micro-batch): its processes hold whole
gradients anyway. The sharded engines reduce-scatter in every backward instead, which sums to the same
gradient: ZeRO has no ``no_sync``, and FSDP without sync would accumulate whole (unsharded) gradients
on every process over the window, the memory sharding is there to save (a third of AdamW's model state).

With ``--max_rss_gb`` the memory guard is read after every micro-batch's backward. A process over it does
none of the window's remaining work: alone it stops there; with others, whose forwards and backwards may
be collectives (every one under FSDP and ZeRO, DDP's all-reduce at the window's last), it runs each
remaining micro-batch as an empty one (one token, no target: as ``padded_window`` does), so every process
makes the same calls. The trainer then agrees with the others and drops the window (``LowMemTrainer.train_step``).
"""

from __future__ import annotations

import torch

from data.packing import examples_in
from lowmem.hardware.precision import Precision
from lowmem.memory.guard import MemoryGuard
from lowmem.model.loss import batch_to_device, token_loss_sum
from lowmem.parallel.engines import Engine
from lowmem.parallel.sharding import equal_counts


def window_backward(model, core, window: list[dict], total_tokens: int, accelerator, engine: Engine,
                    precision: Precision, frozen_encoder: bool, multiple: int, pin: bool,
                    guard: MemoryGuard | None = None, empty=None, loss_chunk: int | str = 0) -> torch.Tensor:
    """Backward over ``window`` (collated micro-batches), gradients left in place for the optimizer step.

    Args:
        model: the model as prepared (DDP-wrapped, FSDP-sharded or a DeepSpeed engine); core: the plain one.
        total_tokens: target tokens of the window on all processes.
        engine: the run's engine (``lowmem.parallel.engines``); precision: its ``--mixed_precision``
            (``lowmem.hardware.precision``: the autocast, fp16's loss scale).
        guard: the memory guard, read after each micro-batch; empty: makes a micro-batch without targets.
        loss_chunk: --loss_chunk_size (``lowmem.model.chunked_loss``).

    Returns:
        The local sum of token losses (a device tensor).
    """
    # accelerator.backward divides by gradient_accumulation_steps (DeepSpeed's backward, as driven here,
    # does not), and DDP and ZeRO average over processes: this scale makes it sum(token losses) / tokens.
    divided = len(window) if engine.divides_window else 1
    scale = divided * accelerator.num_processes / max(total_tokens, 1)
    accelerator.gradient_accumulation_steps = len(window)
    accelerator.step = 0  # a short window (end of an epoch) must still end in one sync
    loss_sum = torch.zeros((), device=accelerator.device)
    # A frozen encoder runs one row at a time (frozen_encoder_states), and under a sharded engine each of
    # its calls gathers weights from every process: each process makes as many calls as the one with the
    # most rows in that micro-batch (token budgets, an epoch's last window and skipped rows make them differ).
    rows = [examples_in(micro) for micro in window]  # (packed rows: their examples, each encoded alone)
    encoder_calls = equal_counts(rows, accelerator.num_processes) if engine.shards and frozen_encoder else rows
    for k, micro in enumerate(window):
        if guard is not None and guard.tripped is not None:  # over the memory budget: none of the window's work
            if accelerator.num_processes == 1:
                break  # nothing waits on this process; the trainer drops the window
            micro = empty()  # but the other processes' collectives go on
        last = k == len(window) - 1
        batch = batch_to_device(micro, accelerator.device, multiple, pin)
        with engine.accumulating(accelerator, model):
            with precision.autocast(accelerator):
                loss = token_loss_sum(model, core, batch, frozen_encoder=frozen_encoder, multiple=multiple,
                                      encoder_calls=encoder_calls[k], loss_chunk=loss_chunk)
            # (fp16: the loss scaled up so that small gradients do not underflow; DDP: all-reduce on the last only)
            engine.backward(accelerator, model, precision.scale(loss * scale), last)
        loss_sum += loss.detach()
        del batch, loss  # free this micro-batch's activations before the next one
        if guard is not None:
            guard.over(f"micro-batch {k + 1} of {len(window)}")  # (its peak too: the high-water mark rose)
    return loss_sum
