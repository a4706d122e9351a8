"""Saving, resuming and exporting a run, beside its folder (``lowmem.runs.run_folder`` writes the files).

A checkpoint holds the weights, optimizer and scheduler, the trainer's counters, and each process's
RNG, data position (shuffle buffer included), log offsets and the sums of the logging interval in
progress: a resume continues exactly where the run stopped, its logs cut back to match. An export
is a plain ``save_pretrained`` folder (``best/``, ``final/``).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from lowmem.checkpointing import checkpoint
from lowmem.hardware.memory_use import free_memory
from lowmem.model.build import export_state_dict, weights_in_float32
from lowmem.monitoring.metrics_log import MetricsLog
from lowmem.parallel.distributed import any_process
from lowmem.parallel.engines import Engine, PlainEngine
from lowmem.parallel.launch import runs_here
from lowmem.runs.run_folder import ExportFiles, RunFolder, eval_changes
from lowmem.training.optim import resume_schedule
from lowmem.utils.ownership import saved_json


class Checkpointer:
    """Checkpoints and exports of one run. Collective: every process calls ``save`` and ``export``."""

    def __init__(self, folder: RunFolder, accelerator, telemetry, engine: Engine | None = None):
        self.folder = folder
        # the run's engine (lowmem.parallel.engines); a sharded one: each process writes and reads its own shard,
        # exports gather the weights
        self.engine = PlainEngine() if engine is None else engine
        self.accelerator = accelerator
        self.telemetry = telemetry
        self.saved_step: int | None = None  # the step of the newest checkpoint written or resumed from

    def position(self, stream, meter, sync: bool = False) -> dict:
        """This process's part of a checkpoint as of now: RNG, data position (shuffle buffer included), log
        offsets and the logging interval's sums. Taken at a window's start, it is what a checkpoint written
        from within the window holds (the memory guard's stop): the step before it, not the rows drawn since."""
        return {"rng": checkpoint.rng_state(), "data": stream.state_dict(), "log_offsets": self.telemetry.offsets(sync),
                "interval": meter.saved()}

    def save(self, trainer_state: dict, training, stream, meter, keep: int, position: dict | None = None) -> Path:
        """Write the checkpoint of ``trainer_state``'s step (once: a stop right after a save step, or the end of a
        run resumed from its final checkpoint, finds it written and its record logged already), keeping the newest
        ``keep``.

        ``training``: (model, optimizer, scheduler, run_config) as the run holds them (the model: the
        DeepSpeed engine under DeepSpeed, else the plain model). ``position``: this process's, taken with
        ``position()`` after the step ended (the memory guard's stop); else taken now.
        """
        from accelerate.utils import gather_object

        step = trainer_state["step"]
        folder = self.folder.checkpoint_path(step)
        if self.saved_step == step:
            return folder
        # The checkpoint's own record goes into the log after it is written, and with it into the
        # checkpoint, so a resume from it writes that line again where it was cut back to.
        record = MetricsLog.line("checkpoint", step, path=str(folder))
        if position is not None:
            self.telemetry.offsets(sync=True)  # the logs on disk up to (past) the held offsets
        mine = {"rank": self.accelerator.process_index, "world_size": self.accelerator.num_processes,
                **(position or self.position(stream, meter, sync=True)),
                "checkpoint_record": record if self.telemetry.metrics is not None else None}
        process_states = gather_object([mine])  # small: RNG + data position per rank
        model, optimizer, _, _ = training
        if self.engine.shards:
            self._write_shard(folder, model, optimizer)
        if runs_here("run folder"):
            self.folder.write_checkpoint(training, trainer_state, process_states, keep, staged=self.engine.shards)
            self.telemetry.metrics.write_line(record)
            self.telemetry.checkpointed()  # the trackers that wait for a checkpoint get the records it keeps
        self.accelerator.wait_for_everyone()
        self.saved_step = step
        return folder

    def _write_shard(self, folder: Path, model, optimizer) -> None:
        """This process's weight and optimizer shards, into the staging folder the main process then
        completes and renames into place (``RunFolder.write_checkpoint``)."""
        if runs_here("run folder"):
            checkpoint.new_staging(folder)
        self.accelerator.wait_for_everyone()
        self.engine.save(model, optimizer, checkpoint.staging_path(folder), self.accelerator.process_index)
        self.accelerator.wait_for_everyone()

    def load(self, folder: Path, training, stream, learn_rate: float, weight_decay: float) -> tuple[dict, dict]:
        """Restore weights, optimizer, scheduler, RNG and this process's data position; cut the logs
        back to the checkpoint.

        Returns:
            (the trainer's counters, the interval sums since the last log line: the next logged loss
            averages the same steps as an uninterrupted run)
        """
        _, optimizer, scheduler, run_config = training
        trainer_state, process_state = self.folder.read_checkpoint(folder, training, self.accelerator, self.engine,
                                                                   self.telemetry.say)
        resume_schedule(optimizer, scheduler, learn_rate, weight_decay)
        self.saved_step = trainer_state["step"]
        # best/ set aside with a continuation --resume_from replaces (or removed): the model the state names as
        # the best is gone, and the next evaluation exports a new one. Main's look decides for every process.
        if runs_here("run folder"):
            checkpoint.restore_cut_swap(self.folder.path / "best")  # an export cut between its two renames
        gone = runs_here("run folder") and not (self.folder.path / "best").is_dir()
        changes = eval_changes(saved_json(folder / "run_config.json") or {}, run_config)
        if trainer_state.get("best_step") is not None and changes:
            self.telemetry.say(f"resume: best/ (step {trainer_state['best_step']}) was chosen on other evaluations "
                               f"({', '.join(changes)}), which the next ones cannot be compared with: the next "
                               "evaluation's model takes its place")
        if trainer_state.get("best_step") is not None and (any_process(self.accelerator, gone) or changes):
            trainer_state.update(best_metric=None, best_step=None, best_eval_loss=None)
        stream.load_state_dict(process_state["data"])
        checkpoint.set_rng_state(process_state["rng"])
        self.telemetry.cut_back(process_state["log_offsets"], process_state.get("checkpoint_record"))
        return trainer_state, process_state["interval"]

    def export(self, folder: Path, core, beside: ExportFiles, adapter: dict | None = None) -> None:
        """``core`` as a plain transformers folder (float32, LoRA merged) with ``beside`` it the tokenizer and
        training_info.json, written by the main process; with ``adapter`` (``lowmem.model.adapters.adapter_export``)
        a peft adapter folder of its base model instead."""
        self.accelerator.wait_for_everyone()
        exporting = runs_here("exports")  # (lowmem.parallel.launch: once per job, the main process)
        if adapter is not None and not self.engine.shards:
            if exporting:
                beside = replace(beside, info={**beside.info, "base_form": adapter["base_form"]})
                self.folder.export_adapter(folder, core, adapter["base"], beside, then=self.folder.how_to_continue)
        elif self.engine.shards:  # the whole weights gathered on the main process's host (all take part)
            whole = self.engine.full_state_dict(core, exporting)
            if exporting:
                self.folder.export(folder, core, beside, state_dict=whole, then=self.folder.how_to_continue)
            del whole
        elif exporting:
            # One dtype and no adapters: on the CPU bf16-stored weights turn float32 in place; from a
            # GPU every tensor is copied to the host as float32 (nothing new on the GPU).
            on_gpu = self.accelerator.device.type == "cuda"
            with contextlib.nullcontext() if on_gpu else weights_in_float32(core):
                plain = export_state_dict(core, to_host=on_gpu)
                self.folder.export(folder, core, beside, state_dict=plain, then=self.folder.how_to_continue)
                del plain
            # The export's new host tensors (LoRA's merged matrices, a GPU model's float32 copies) come
            # from the C heap, which keeps them resident once freed: trimmed, an export in mid-run does
            # not raise the RSS of the steps after it.
            free_memory()
        self.accelerator.wait_for_everyone()
