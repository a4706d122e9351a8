"""Micro-batch sizes from the memory budget.

The reference capped the micro-batch at 2 (and evaluation at 4) to keep a 16 GB host alive; on short
rows a micro-batch of 2 is mostly per-call overhead. Here ``--batch_size`` is the micro-batch asked for:
used as given when the planner (``lowmem.memory.planner``) predicts the run fits its budget, lowered when it
would not (the same rows per optimizer step: accumulation grows, so the gradient is the one asked
for); ``auto`` takes the largest that fits. ``--eval_batch_size`` follows the same rule. The budget is
``--max_rss_gb``'s guard, else the RAM available to this process, or the GPU's memory.

    sizes = size_batches(cfg, data, framework_mb, Placement("cpu", world=1))
    cfg = replace(cfg, **sizes.flags())

``--memory_profile=host16g`` keeps the reference's caps (``lowmem.memory.profiles.apply_caps``), within which the
same check runs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from config import TrainConfig
from lowmem.memory.guard import MEMORY_GUARD_AT
from lowmem.utils.errors import UserError
from lowmem.utils.presets import AUTO, gpu_profile_gib

if TYPE_CHECKING:
    from lowmem.memory.plan_sizes import Placement

MB = 2**20
AUTO_LIMIT = 256  # auto's largest micro-batch (rows): far past where per-call overhead stops mattering
# auto takes a size only when its plan, this much larger, still fits: measured peaks came within
# 0.88-1.00 of their plans (docs/memory.md), so the margin keeps the measured peak under the budget.
AUTO_MARGIN = 1.15
AVAILABLE_SHARE = 0.8  # of the RAM available at start, what a run without --max_rss_gb plans to use


@dataclass
class BatchSizes:
    """The sizes a run uses, the budget they were checked against and what to tell the user."""

    micro: int
    accumulation: int
    eval_batch: int
    budget_mb: float
    budget: str  # what the budget is, in words
    predicted_mb: float  # the plan's peak at these sizes
    notes: list[str] = field(default_factory=list)
    lengths: dict | None = None  # what the plan at these sizes read (plan_batches.run_lengths'), when known

    def flags(self) -> dict:
        return {"batch_size": self.micro, "gradient_accumulation_steps": self.accumulation,
                "eval_batch_size": self.eval_batch}


def nice(n: int) -> bool:
    """Sizes auto prefers: a power of two or a multiple of 8 (matrix kernels' tiles)."""
    return n & (n - 1) == 0 or n % 8 == 0


def memory_budget(cfg: TrainConfig, device: str, local_processes: int = 1) -> tuple[float, str]:
    """(MiB one process may peak at, what that is in words)."""
    if device == "gpu":
        import torch

        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / MB
        if cfg.gpu_profile:  # a profile names its GPU's size (gpu8g: 8 GiB)
            named = gpu_profile_gib(cfg.memory_profile) * 1024
            if named < total:
                return named, f"--memory_profile={cfg.memory_profile}'s {named / 1024:g} GiB"
        return total, f"the GPU's {total / 1024:.1f} GiB"
    if cfg.max_rss_gb:
        return (MEMORY_GUARD_AT * cfg.max_rss_gb * 1024,
                f"--max_rss_gb={cfg.max_rss_gb:g} (its guard stops at {MEMORY_GUARD_AT:.0%})")
    import psutil

    own = psutil.Process().memory_info().rss / MB
    free = AVAILABLE_SHARE * psutil.virtual_memory().available / MB / local_processes
    return own + free, f"{AVAILABLE_SHARE:.0%} of the RAM available to this process ({(own + free) / 1024:.1f} GiB)"


def window_rows(cfg: TrainConfig, world: int) -> int | None:
    """Rows per process per optimizer step; None for ``auto`` without ``--effective_batch_size`` (the
    micro-batch chosen times ``--gradient_accumulation_steps``)."""
    if cfg.effective_batch_size:
        if cfg.effective_batch_size % world:
            raise UserError(f"--effective_batch_size={cfg.effective_batch_size} must be a multiple of the "
                            f"{world} processes (each takes the same share of every optimizer step)")
        rows = cfg.effective_batch_size // world
        if cfg.batch_size != AUTO and rows % cfg.batch_size:
            raise UserError(f"--effective_batch_size={cfg.effective_batch_size} over {world} process(es) is {rows} "
                            f"rows each, not a multiple of --batch_size={cfg.batch_size}: pick a --batch_size "
                            f"that divides {rows}, or --batch_size=auto")
        return rows
    return None if cfg.batch_size == AUTO else cfg.batch_size * cfg.gradient_accumulation_steps


def check_request(cfg: TrainConfig) -> None:
    if cfg.batch_size == AUTO and cfg.max_tokens_per_batch:
        raise UserError("--batch_size=auto sizes micro-batches by rows and --max_tokens_per_batch by tokens: give a "
                        "number of rows (it sets the rows per step with --gradient_accumulation_steps) or leave "
                        "--max_tokens_per_batch out")


def choose(cfg: TrainConfig, peak_mb, budget_mb: float, budget: str, world: int, eval_rows: int) -> BatchSizes:
    """The sizes for ``cfg``'s request. ``peak_mb(micro, accumulation, eval_batch)``: the plan's peak
    (MiB) at those sizes; ``eval_rows``: the evaluation rows of one process (auto's eval limit)."""
    check_request(cfg)
    rows = window_rows(cfg, world)
    notes = []

    def fits(micro: int, eval_batch: int, margin: float) -> bool:
        return peak_mb(micro, (rows or micro * cfg.gradient_accumulation_steps) // micro, eval_batch) * margin \
            <= budget_mb

    eval_start = 1 if cfg.eval_batch_size == AUTO else cfg.eval_batch_size
    if cfg.batch_size == AUTO:
        if rows:  # the rows per step are fixed: divisors of them
            sizes = [m for m in range(1, min(rows, AUTO_LIMIT) + 1) if rows % m == 0]
        else:
            sizes = [m for m in range(1, AUTO_LIMIT + 1) if nice(m)]
        micro = largest(sizes, lambda m: fits(m, eval_start, AUTO_MARGIN))
        if rows:  # a power of two or a multiple of 8 unless that would halve the micro-batch
            preferred = max((m for m in sizes if m <= micro and nice(m)), default=micro)
            micro = preferred if 2 * preferred > micro else micro
    else:
        asked = cfg.batch_size
        micro = asked if fits(asked, eval_start, 1.0) else largest(  # (1 stays 1: nothing smaller)
            [m for m in range(1, asked + 1) if asked % m == 0], lambda m: fits(m, eval_start, 1.0))
    accumulation = (rows or micro * cfg.gradient_accumulation_steps) // micro
    if cfg.batch_size != AUTO and micro < cfg.batch_size:
        asked_mb = peak_mb(cfg.batch_size, rows // cfg.batch_size, eval_start)
        notes.append(f"--batch_size={cfg.batch_size}: predicted peak {asked_mb:,.0f} MiB is above the budget of "
                     f"{budget_mb:,.0f} MiB ({budget}); training micro-batches of {micro} x {accumulation} "
                     f"accumulation steps (predicted {peak_mb(micro, accumulation, eval_start):,.0f} MiB), the same "
                     f"{micro * accumulation} rows per process per optimizer step")
    eval_batch = choose_eval(cfg, lambda e: fits(micro, e, AUTO_MARGIN if cfg.eval_batch_size == AUTO else 1.0),
                             eval_rows)
    if cfg.eval_batch_size != AUTO and eval_batch < cfg.eval_batch_size:
        notes.append(f"--eval_batch_size={cfg.eval_batch_size}: predicted above the budget of {budget_mb:,.0f} MiB "
                     f"({budget}); evaluating in batches of {eval_batch}")
    predicted = peak_mb(micro, accumulation, eval_batch)
    if predicted > budget_mb:
        notes.append(f"predicted peak {predicted:,.0f} MiB is above the budget of {budget_mb:,.0f} MiB ({budget}) even "
                     "at a micro-batch of 1: see `python train_low_mem.py plan --budget_gb=...` for modes that fit")
    chosen = [f"micro-batch {micro} x {accumulation} accumulation" if cfg.batch_size == AUTO else "",
              f"eval batch {eval_batch}" if cfg.eval_batch_size == AUTO else ""]
    if any(chosen):
        notes.append(f"auto: {', '.join(c for c in chosen if c)} (predicted peak {predicted:,.0f} MiB, budget "
                     f"{budget_mb:,.0f} MiB: {budget})")
    return BatchSizes(micro, accumulation, eval_batch, budget_mb, budget, predicted, notes)


def choose_eval(cfg: TrainConfig, fits, eval_rows: int) -> int:
    if cfg.eval_batch_size != AUTO:
        asked = cfg.eval_batch_size
        return asked if fits(asked) else largest([e for e in range(1, asked + 1) if nice(e)], fits)
    limit = max(1, min(AUTO_LIMIT, eval_rows))
    return largest([e for e in range(1, limit + 1) if nice(e) or e == limit], fits)


def largest(sizes: list[int], fits) -> int:
    """The largest of the ascending ``sizes`` that fits (a binary search: the peak grows with the size);
    the smallest when none does."""
    lo, hi = 0, len(sizes) - 1
    if not fits(sizes[0]):
        return sizes[0]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(sizes[mid]):
            lo = mid
        else:
            hi = mid - 1
    return sizes[lo]


def size_batches(cfg: TrainConfig, data, framework_mb: float, placement: Placement, resuming: bool = False,
                 budget_mb: float | None = None) -> BatchSizes:
    """The sizes for this process of the run (``placement``: its device, processes and sharding), planned from
    its lengths (``plan_batches``: the sampled rows, its replayed windows cut for each size tried, its evaluation
    rows).

    ``data``: the run's ``data.pipeline.TrainData`` (its tokenizer's size is the model's vocabulary);
    ``budget_mb``: instead of ``memory_budget``'s.
    """
    from lowmem.memory import planner
    from lowmem.memory.plan_batches import eval_batches, eval_pairs, replay_epochs, sample_lengths, windows_of

    device, world, vocab_size = placement.device, placement.world, len(data.collator.tokenizer)
    check_request(cfg)
    if budget_mb == math.inf and AUTO not in (cfg.batch_size, cfg.eval_batch_size):  # nothing to check
        return choose(cfg, lambda *sizes: 0.0, math.inf, "none", world, 1)
    rows = window_rows(cfg, world)
    widest = rows or AUTO_LIMIT * cfg.gradient_accumulation_steps
    base = sample_lengths(cfg, data)
    epochs = None if resuming else replay_epochs(cfg, data, widest)
    pairs = eval_pairs(cfg, data)
    key = "gpu_peak_mb" if device == "gpu" else "host_peak_mb"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if budget_mb is None:
        budget_mb, budget = memory_budget(cfg, device, local)
    else:
        budget = f"{budget_mb / 1024:.1f} GiB"

    def lengths_for(micro: int, accumulation: int, eval_batch: int) -> dict:
        lengths = {**base, "eval": eval_batches(pairs, eval_batch)}
        if epochs is not None:
            lengths["windows"] = windows_of(epochs, micro * accumulation, cfg.max_steps)
        return lengths

    cache: dict = {}

    def peak_mb(micro: int, accumulation: int, eval_batch: int) -> float:
        if (micro, accumulation, eval_batch) not in cache:
            trial = replace(cfg, batch_size=micro, gradient_accumulation_steps=accumulation, eval_batch_size=eval_batch)
            plan = planner.predict(trial, vocab_size, lengths_for(micro, accumulation, eval_batch), framework_mb,
                                   placement)
            cache[(micro, accumulation, eval_batch)] = plan[key]
        return cache[(micro, accumulation, eval_batch)]

    sizes = choose(cfg, peak_mb, budget_mb, budget, world, len(pairs))
    if epochs is not None or resuming:  # as run_lengths reads them for these sizes: the trainer's plan reuses them
        sizes.lengths = lengths_for(sizes.micro, sizes.accumulation, sizes.eval_batch)
    return sizes


def reused(saved: dict | None, cfg: TrainConfig) -> BatchSizes | None:
    """A resumed run's sizes: those the checkpoint's run used, when it was asked for the same (the
    micro-batch split changes float rounding, and resume is bit-identical)."""
    if not saved or saved.get("batch_request") != batch_request(cfg):
        return None
    sizes = BatchSizes(saved["batch_size"], saved["gradient_accumulation_steps"], saved["eval_batch_size"],
                       0.0, "as the run began", 0.0)
    if cfg.batch_size == AUTO or cfg.eval_batch_size == AUTO:
        sizes.notes.append(f"resume: micro-batch {sizes.micro} x {sizes.accumulation} accumulation, eval batch "
                           f"{sizes.eval_batch}, as the run began")
    return sizes


def batch_request(cfg: TrainConfig) -> dict:
    """The batch flags as asked for (kept in the checkpoint's run config beside the sizes used)."""
    return {name: getattr(cfg, name) for name in ("batch_size", "gradient_accumulation_steps", "eval_batch_size",
                                                  "effective_batch_size", "max_tokens_per_batch")}


def size_run(cfg: TrainConfig, data, accelerator, engine, resume_dir=None, say=print) -> BatchSizes:
    """The trainer's sizes, its notes said, and the ``engine``'s settings set to them (DeepSpeed's bookkeeping
    checks them; ``lowmem.parallel.engines``): a resumed run's as it began (``reused``), else ``size_batches``' for
    this process, the smallest on any process (each plans its own share of the data)."""
    sizes = agreed_sizes(cfg, data, accelerator, engine.sharding, resume_dir)
    for note in sizes.notes:
        say(note)
    engine.set_batch_sizes(accelerator, sizes.micro, sizes.accumulation)
    return sizes


def agreed_sizes(cfg: TrainConfig, data, accelerator, sharding: str | None, resume_dir=None) -> BatchSizes:
    from lowmem.memory import planner
    from lowmem.memory.plan_sizes import Placement
    from lowmem.parallel.distributed import smallest
    from lowmem.utils.ownership import saved_json

    sizes = reused(saved_json(resume_dir / "run_config.json") if resume_dir else None, cfg)
    if sizes is not None:
        return sizes
    sizes = size_batches(cfg, data, planner.framework_mb(cfg), Placement.of(accelerator, sharding),
                         resuming=resume_dir is not None)
    micro, eval_batch = smallest(accelerator, [sizes.micro, sizes.eval_batch])
    if (micro, eval_batch) != (sizes.micro, sizes.eval_batch):
        sizes.lengths = None  # planned for other sizes
    if micro != sizes.micro:  # another process's share needs a smaller one (a divisor of the same rows)
        rows = window_rows(cfg, accelerator.num_processes)
        sizes.accumulation = rows // micro if rows else cfg.gradient_accumulation_steps
        sizes.micro = micro
    sizes.eval_batch = eval_batch
    return sizes


def saved_model_eval_size(cfg: TrainConfig, model_dir, collator, examples: list, device: str) -> int:
    """``--eval_batch_size=auto`` for ``evaluate`` / ``generate`` (the saved model loaded already): the
    largest batch whose evaluation (``tensor_bytes.evaluation_bytes``) fits beside what is held now."""
    import psutil

    from lowmem.memory.plan_batches import eval_batches, length_pairs
    from lowmem.memory.planner import CUDA_CONTEXT_MB
    from lowmem.memory.tensor_bytes import evaluation_bytes, model_dims

    dims = model_dims(replace(cfg, init_from=str(model_dir)), 0)
    pairs = length_pairs(collator, examples, cfg.max_source_len)
    budget_mb, _ = memory_budget(cfg, device)
    if device == "gpu":
        import torch

        held = torch.cuda.memory_reserved() / MB + CUDA_CONTEXT_MB
    else:
        held = psutil.Process().memory_info().rss / MB

    def fits(size: int) -> bool:
        need = evaluation_bytes(replace(cfg, eval_batch_size=size), dims, eval_batches(pairs, size)) / MB
        return held + AUTO_MARGIN * need <= budget_mb

    return choose_eval(cfg, fits, len(pairs) or 1)
