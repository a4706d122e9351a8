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

from dataclasses import dataclass

import torch

from data.packing import examples_in
from lowmem.model.loss import batch_to_device
from lowmem.parallel.sharding import equal_counts
from lowmem.training.criteria import TOKEN_LOSS
from lowmem.training.run_context import RunContext


@dataclass
class Window:
    """One accumulation window as the loop steps on it: the examples drawn (the consumed log names their rows), the
    micro-batches its step runs (one empty one on a process that drew none), ``window_counts``'s counts (local and
    summed over the processes: ``lowmem.parallel.distributed``) and the stream's epoch it was drawn in."""

    examples: list
    batches: list[dict]
    counts: dict
    epoch: int

    @property
    def last(self) -> bool:
        """The epoch's last window: no process has rows left in the epoch after it."""
        return not self.counts["rows_left"]


def start_window(accelerator, micro_batches: int) -> None:
    """Set accelerate's own accumulation counters for a window of ``micro_batches``: the one place they are set.

    accelerate counts micro-batches itself: ``Accelerator.accumulate`` lets DDP all-reduce when its ``step`` reaches
    a multiple of ``gradient_accumulation_steps``, and ``Accelerator.backward`` divides the loss by the latter. It
    assumes every window holds --gradient_accumulation_steps micro-batches; ours do not (a token budget,
    --max_tokens_per_batch, splits a window into more, an epoch's last holds fewer), and left to accelerate the
    count would drift off the windows: an all-reduce in mid-window, none at a window's end. Set before each window,
    the window's last micro-batch syncs, and the division is by the window's own count (which ``window_backward``'s
    scale accounts for)."""
    accelerator.gradient_accumulation_steps = micro_batches
    accelerator.step = 0  # a short window (end of an epoch) must still end in one sync


def window_backward(ctx: RunContext, model, core, window: list[dict], counts: dict, empty=None) -> torch.Tensor:
    """Backward over ``window`` (collated micro-batches), gradients left in place for the optimizer step.

    Args:
        ctx: the run's context: its accelerator, engine (``lowmem.parallel.engines``), precision
            (``lowmem.hardware.precision``: the autocast, fp16's loss scale), padding multiple, memory guard (read
            after each micro-batch) and options (--freeze's frozen encoder, --loss_chunk_size, --pin_memory).
        model: the model as prepared (DDP-wrapped, FSDP-sharded or a DeepSpeed engine); core: the plain one.
        counts: the window's counts on all processes (``lowmem.parallel.distributed.window_counts``): its target
            tokens, examples (a preference objective's pairs) and chosen answers' tokens, which the loss
            (``ctx.criterion``, ``lowmem.training.criteria``) is divided by.
        empty: makes a micro-batch without targets (run in place of the rest of the window once the guard tripped).

    Returns:
        The local sums the criterion logs (a device tensor: the sum of token losses, or a preference objective's
        sums).
    """
    accelerator, engine, precision, guard = ctx.accelerator, ctx.engine, ctx.precision, ctx.guard
    frozen_encoder, multiple = ctx.cfg.frozen_encoder, ctx.multiple
    # accelerator.backward divides by gradient_accumulation_steps (DeepSpeed's backward, as driven here,
    # does not), and DDP and ZeRO average over processes: this factor undoes both (the criterion divides by the
    # window's totals), so the gradient is that of sum(token losses) / tokens, however the window is split.
    divided = len(window) if engine.divides_window else 1
    factor = divided * accelerator.num_processes
    criterion = ctx.criterion or TOKEN_LOSS
    start_window(accelerator, len(window))
    loss_sum = None
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
        batch = {**batch_to_device(micro, accelerator.device, multiple, ctx.pin), "encoder_calls": encoder_calls[k]}
        with engine.accumulating(accelerator, model):
            with precision.autocast(accelerator):
                loss, logged = criterion.micro(ctx, model, core, batch, counts, factor)
            # (fp16: the loss scaled up so that small gradients do not underflow; DDP: all-reduce on the last only)
            engine.backward(accelerator, model, precision.scale(loss), last)
        loss_sum = logged if loss_sum is None else loss_sum + logged
        del batch, loss  # free this micro-batch's activations before the next one
        if guard is not None:
            guard.over(f"micro-batch {k + 1} of {len(window)}")  # (its peak too: the high-water mark rose)
    return loss_sum if loss_sum is not None else torch.zeros((), device=accelerator.device)
