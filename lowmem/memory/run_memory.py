"""A training run's memory: the plan made at setup, the measured peak set beside it at the end, and
the message of the ``--max_rss_gb`` guard that stops it before the host runs out (the guard itself:
``lowmem.memory.guard.MemoryGuard``; where the trainer reads it: docs/resume_and_faults.md)."""

from __future__ import annotations

from pathlib import Path

from config import TrainConfig
from lowmem.hardware.memory_use import memory_snapshot
from lowmem.memory import planner
from lowmem.memory.guard import MEMORY_GUARD_AT, MemoryGuard, StoppedForMemory
from lowmem.memory.plan_batches import run_lengths
from lowmem.memory.plan_sizes import Placement
from lowmem.parallel.distributed import any_process, first_tripped


def plan_run(cfg: TrainConfig, data, placement: Placement, resuming: bool, lengths: dict | None = None,
             say=print) -> dict:
    """The planner's prediction for this process of the run (``python train_low_mem.py plan`` prints
    the same), from the run's ``data.pipeline.TrainData``.

    Made before the model exists (the framework baseline is measured here). A run from the start
    replays this process's stream to find its costliest micro-batch; a resumed one, which starts
    mid-stream, is planned from the sampled lengths. ``placement``: ``Placement.of`` the accelerator and
    ``Engine.sharding``; ``lengths``: those already read for these sizes (``lowmem.memory.batch_budget``). A resumed
    run keeps the sizes it began with, whatever --max_rss_gb is now: a note says when they are planned above its
    guard.
    """
    lengths = lengths or run_lengths(cfg, data, replay=not resuming)
    plan = planner.predict(cfg, len(data.collator.tokenizer), lengths, planner.framework_mb(cfg), placement)
    guard_mb = MEMORY_GUARD_AT * cfg.max_rss_gb * 1024
    if resuming and cfg.max_rss_gb and placement.device == "cpu" and plan["host_peak_mb"] > guard_mb:
        say(f"note: this run resumes at micro-batch {cfg.batch_size} x {cfg.gradient_accumulation_steps}, as it "
            f"began, planned to peak at {plan['host_peak_mb']:,.0f} MiB: above the memory guard at {guard_mb:,.0f} "
            f"MiB ({MEMORY_GUARD_AT:.0%} of --max_rss_gb={cfg.max_rss_gb:g}), which will likely stop it; a smaller "
            "--batch_size with the same rows per step (--gradient_accumulation_steps) lowers the peak")
    return plan


def peak_against_plan(plan: dict, accelerator=None) -> tuple[dict, str]:
    """Predicted and measured peaks side by side: (the ``memory_peak`` event's fields, its log line). With
    several processes (``accelerator``; a collective) each figure is the largest of any process's, and the
    measured peaks are also listed per process: one process can peak above the main one."""
    snap = memory_snapshot()
    measured_gpu = snap["cuda_reserved_peak_mb"] + planner.CUDA_CONTEXT_MB if "cuda_peak_mb" in snap else 0.0
    figures = [plan["host_peak_mb"], snap["peak_rss_mb"], plan.get("gpu_peak_mb", 0.0), measured_gpu]
    world = accelerator.num_processes if accelerator is not None else 1
    if world > 1:
        import torch

        every = accelerator.gather(torch.tensor([figures], dtype=torch.float64, device=accelerator.device)).cpu()
        figures, host_peaks = every.max(dim=0).values.tolist(), [round(v, 1) for v in every[:, 1].tolist()]
    predicted, measured, predicted_gpu, measured_gpu = figures
    fields = {"predicted_host_peak_mb": predicted, "measured_host_peak_mb": measured,
              "host_ratio": round(predicted / max(measured, 1), 3)}
    line = (f"peak host RAM: predicted {predicted:,.0f} MiB, measured {measured:,.0f} MiB "
            f"(ratio {fields['host_ratio']:.2f}" + (f"; the most of {world} processes" if world > 1 else "") + ")")
    if world > 1:
        fields["measured_host_peak_mb_per_process"] = host_peaks
    if "cuda_peak_mb" in snap:
        fields.update(predicted_gpu_peak_mb=predicted_gpu, measured_gpu_peak_mb=measured_gpu,
                      gpu_ratio=round(predicted_gpu / max(measured_gpu, 1), 3))
        line += (f"; GPU: predicted {predicted_gpu:,.0f} MiB, measured {measured_gpu:,.0f} MiB "
                 "(torch's reserved peak + CUDA context)")
    return fields, line


def guard_stop(where: str, process: int | None, peak_gb: float, max_rss_gb: float, step: int,
               checkpoint: Path | None) -> StoppedForMemory:
    """The exception that ends a training run stopped by the guard, naming where it tripped, the checkpoint
    written (of ``step``, the last completed; None before the first) and the flags that lower memory.

    ``process``: which one tripped, with several; ``peak_gb``: its peak RSS, at least what tripped the guard."""
    who = "" if process is None else f" of process {process}"
    saved = (f"checkpoint {checkpoint} (step {step})" if checkpoint is not None
             else "no step was completed, so no checkpoint was written")
    then = ("continue with --is_keep_training=True" if checkpoint is not None
            else "run the same command again (it starts from step 0)")
    return StoppedForMemory(
        f"memory guard: RSS{who} (peak {peak_gb:.2f} GiB) reached {MEMORY_GUARD_AT:.0%} of "
        f"--max_rss_gb={max_rss_gb:g} {where}; {saved}. Lower memory with --shuffle_buffer_size, "
        "--batch_size (raise --gradient_accumulation_steps to keep the batch), --max_source_len / "
        "--max_target_len, --eval_batch_size or a smaller --model_preset (or raise --max_rss_gb; `python "
        f"train_low_mem.py plan --budget_gb=...` lists modes that fit), then {then}")


class MemoryStop:
    """How a training run stops for ``--max_rss_gb``, every process together.

    ``guard`` (``lowmem.memory.guard.MemoryGuard``) is read before each accumulation window (``before``: the
    reading goes into the window's all-reduce, ``window_counts``) and after each micro-batch's backward
    (``window_backward``); ``hold`` keeps this process's checkpoint position before each window is drawn;
    ``tripped_in_window`` is the processes' agreement at the window's end, before its optimizer step;
    ``stop`` drops the window's gradients, writes the last step's checkpoint from the held position and
    makes the exception. ``record``: the run's metrics.jsonl records (``Telemetry.record``).
    """

    def __init__(self, max_rss_gb: float, record):
        self.guard = MemoryGuard(max_rss_gb)
        self.record = record
        self.window_start: dict | None = None  # this process's checkpoint position before the window (guard on)

    def hold(self, checkpointer, stream, meter) -> None:
        """Keep the position a checkpoint written from within the next window holds (about 0.5 ms a window)."""
        if self.guard.active:
            self.window_start = checkpointer.position(stream, meter)

    def before(self, step: int) -> bool:
        """This process's reading before the window of optimizer step ``step + 1`` (drawn and collated already)."""
        return self.guard.over(f"before step {step + 1}")

    def tripped_in_window(self, accelerator) -> bool:
        """Whether any process's guard tripped in this window (one small all-reduce, with the guard on)."""
        return self.guard.active and any_process(accelerator, self.guard.tripped is not None)

    def stop(self, accelerator, optimizer, step: int, save, in_window: bool) -> StoppedForMemory:
        """Once every process knows one has tripped: drop the window's gradients (its optimizer step is not
        taken), write the checkpoint of ``step`` (``save(position)``; none before the first step), record the
        stop, and return the exception saying which process tripped and where. A collective."""
        optimizer.zero_grad(set_to_none=True)  # (DeepSpeed's checkpoints hold no gradients either)
        process, where, peak_gb = first_tripped(accelerator, self.guard)
        if in_window:
            where = f"in {where} of step {step + 1}, before its optimizer step (that window is dropped)"
        folder = save(self.window_start) if step else None
        max_rss_gb = self.guard.max_rss_gb
        self.record("memory_guard", rss_gb=round(peak_gb, 3), max_rss_gb=max_rss_gb, where=where, process=process)
        return guard_stop(where, process if accelerator.num_processes > 1 else None, peak_gb, max_rss_gb, step, folder)
