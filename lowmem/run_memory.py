"""A training run's memory: the plan made at setup, the measured peak set beside it at the end, and
the ``--max_rss_gb`` guard that checkpoints and stops before the host runs out."""

from __future__ import annotations

from pathlib import Path

from config import TrainConfig
from lowmem import planner
from lowmem.memory import memory_snapshot, process_rss_bytes
from lowmem.plan_batches import run_lengths

MEMORY_GUARD_AT = 0.9  # stop once RSS reaches this fraction of --max_rss_gb: the next step may need more


class StoppedForMemory(Exception):
    """Raised after the checkpoint written when the memory guard (--max_rss_gb) trips; exit code 3."""


def plan_run(cfg: TrainConfig, data, device: str, resuming: bool, sharding: str | None = None,
             lengths: dict | None = None, say=print) -> dict:
    """The planner's prediction for this process of the run (``python train_low_mem.py plan`` prints
    the same), from the run's ``data.pipeline.TrainData``.

    Made before the model exists (the framework baseline is measured here). A run from the start
    replays this process's stream to find its costliest micro-batch; a resumed one, which starts
    mid-stream, is planned from the sampled lengths. ``sharding``: ``lowmem.sharding.planned_sharding``;
    ``lengths``: those already read for these sizes (``lowmem.batch_budget``). A resumed run keeps the sizes
    it began with, whatever --max_rss_gb is now: a note says when they are planned above its guard.
    """
    lengths = lengths or run_lengths(cfg, data, replay=not resuming)
    plan = planner.predict(cfg, len(data.collator.tokenizer), lengths, planner.framework_mb(cfg), device, data.world,
                           sharding)
    guard_mb = MEMORY_GUARD_AT * cfg.max_rss_gb * 1024
    if resuming and cfg.max_rss_gb and device == "cpu" and plan["host_peak_mb"] > guard_mb:
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


def near_limit(max_rss_gb: float) -> bool:
    """Whether this process's RSS has reached MEMORY_GUARD_AT of --max_rss_gb (off at 0)."""
    return bool(max_rss_gb) and process_rss_bytes() >= MEMORY_GUARD_AT * max_rss_gb * 2**30


def guard_stop(rss_gb: float, max_rss_gb: float, step: int, checkpoint: Path) -> StoppedForMemory:
    """The exception that ends a run stopped by the guard, naming the flags that lower memory."""
    return StoppedForMemory(
        f"memory guard: RSS (peak {rss_gb:.2f} GiB) reached {MEMORY_GUARD_AT:.0%} of --max_rss_gb={max_rss_gb} "
        f"at step {step}; checkpoint {checkpoint}. Lower memory with --shuffle_buffer_size, "
        "--batch_size (raise --gradient_accumulation_steps to keep the batch), --max_source_len / "
        "--max_target_len, --eval_batch_size or a smaller --model_preset (or raise --max_rss_gb; `python "
        "train_low_mem.py plan --budget_gb=...` lists modes that fit), then continue with --is_keep_training=True")
