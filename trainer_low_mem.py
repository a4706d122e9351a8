"""LowMemTrainer: streaming, low-memory T5 pretraining and SFT on one CPU, one GPU or many.

    python train_low_mem.py train                                          # pretrain (shipped data)
    python train_low_mem.py train --is_finetune=True                       # SFT from runs/pretrain/best
    accelerate launch --multi_gpu train_low_mem.py train --is_finetune=True
    python train_low_mem.py train --is_keep_training=True                  # resume

Lifecycle: ``setup()`` (check the inputs, then the accelerator, run folder, tokenizer, data, plan, model, optimizer,
criterion, resume) -> ``train()`` (the loop; one step is ``train_step``) -> ``close()``. Everything else has its own
module (``data.pipeline``: the data; ``lowmem/__init__.py`` maps the rest); docs/architecture.md walks one step.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from config import TrainConfig
from data.collate import train_padding
from data.objectives.base import objective_for
from data.pipeline import DataFiles, DataProcess, TrainData, build_data, check_data
from data.tokenization import tokenizer_fingerprint, tokenizer_for_run
from lowmem.hardware.memory_use import free_memory
from lowmem.hardware.precision import Precision, precision_for
from lowmem.memory.batch_budget import batch_request, size_run
from lowmem.memory.collector import freeze_long_lived, imports_done, thaw_long_lived
from lowmem.memory.plan_sizes import Placement
from lowmem.memory.run_memory import MemoryStop, peak_against_plan, plan_run
from lowmem.model.adapters import adapter_export
from lowmem.model.build import check_init_from, ready_to_train
from lowmem.model.compiled import CompiledStacks
from lowmem.model.source import check_vocabulary, tokenizer_folder, tokenizer_for_model
from lowmem.model.streamed_load import base_model_identity, model_for_run
from lowmem.monitoring.bad_rows import check_bad_rows, check_no_examples, report_data_errors
from lowmem.monitoring.run_summary import ModelInRun, run_result, schedule_note, startup_summary
from lowmem.monitoring.telemetry import IntervalMeter, Telemetry, log_interval
from lowmem.parallel import deepspeed_engine
from lowmem.parallel.distributed import indexes_from_main, start_accelerator, window_counts
from lowmem.parallel.engines import Engine
from lowmem.parallel.launch import runs_here
from lowmem.parallel.sharding import padded_window, weights_finite
from lowmem.runs.checkpointer import Checkpointer
from lowmem.runs.run_folder import ExportFiles, RunFolder, training_info
from lowmem.training import encoder_cache
from lowmem.training.accumulation import Window, window_backward
from lowmem.training.criteria import criterion_for
from lowmem.training.eval_cost import plan_evals
from lowmem.training.evaluation import EvalModel, eval_log_line, evaluate_in_run, is_better
from lowmem.training.optim import optimizer_for_run
from lowmem.training.run_context import RunContext
from lowmem.training.state import TrainState
from lowmem.training.stopping import NonfiniteSteps, SignalWatch, StoppedBySignal, WindowRandomness, all_finite


class LowMemTrainer:
    """Streaming trainer. Optional ``tokenizer`` / ``model`` are injected as-is (the test seam)."""

    def __init__(self, cfg: TrainConfig, tokenizer=None, model=None, files=None, tokenizer_dir=None):
        self.cfg, self.out = cfg, Path(cfg.output_dir)
        self.state = TrainState()
        self.telemetry = Telemetry(self.state)
        self.say, self.warn = self.telemetry.say, self.telemetry.warn
        self.meter = IntervalMeter()  # the logging interval in progress
        self.signals = SignalWatch(self.say)
        self.nonfinite = NonfiniteSteps(self.state, cfg.max_nonfinite_steps, self.say, self.telemetry.record)
        self.folder = RunFolder(self.out)
        self.start_time = time.time()  # of this process's part of the run (state.elapsed_s: the parts before)
        self.memory = MemoryStop(cfg.max_rss_gb, self.telemetry.record)  # --max_rss_gb's guard (memory.run_memory)
        # Built by setup(), in this order:
        self.files: DataFiles | None = files  # checked before anything heavy (by the CLI, before its imports)
        self.accelerator = None
        self.engine: Engine | None = None  # plain, FSDP or DeepSpeed, as the launch config asks
        self.precision: Precision | None = None  # --mixed_precision: its autocast, fp16's loss scaler
        self.ctx: RunContext | None = None  # these and the resolved config, as the step and evaluation take them
        self.shape_multiple = 1  # sequence lengths padded to a multiple of this (bf16 on the CPU)
        self.compiled = CompiledStacks(cfg.torch_compile, cfg.torch_compile_backend)  # and the graphs compiled
        self.checkpointer: Checkpointer | None = None
        self.tokenizer = tokenizer
        self.tokenizer_dir: Path | None = tokenizer_dir  # where the tokenizer came from (its files go into exports)
        self.data: TrainData | None = None
        self.memory_plan, self.batch_request = {}, {}  # the batch flags as asked (the config holds the sizes used)
        self.model = model  # prepared by accelerate (DDP-wrapped with several processes)
        self.core = None  # the unwrapped model: generation, checkpoints, exports
        self.run_config: dict = {}  # the options and the tokenizer's fingerprint, checked on resume
        self.parameters = {"trainable": 0, "frozen": 0, "frozen_bf16": 0, "frozen_8bit": 0}
        self.total_steps = 0
        self.optimizer = self.scheduler = None
        self.trainable_params: list = []
        self.train_collator = None  # the objective's collator, or the encoder cache's
        self.encoder_cache = None
        self.resumed_interval: dict | None = None  # the interval sums a checkpoint carried
        self.bar = self.grad_norm = self.step_lr = None  # the progress bar; the last step's, for its log record

    @property
    def main(self) -> bool:
        return self.telemetry.main

    # ------------------------------------------------------------------ setup
    def setup(self) -> LowMemTrainer:
        """Check inputs, then build everything; nothing heavy is built before the checks pass."""
        cfg = self.cfg
        self.files = self.files or check_data(cfg, objective_for(cfg))
        if self.model is None:
            check_init_from(cfg)
        self.accelerator, self.engine = start_accelerator(cfg)
        self.precision = precision_for(cfg.mixed_precision, self.accelerator.device.type)
        self.telemetry.attach(self.accelerator)
        self.shape_multiple = self.precision.shape_multiple(self.accelerator.device.type == "cpu")
        self.start_time = time.time()
        if self.model is None and cfg.init_from:  # checked before the run folder is made: a refusal leaves nothing
            self.tokenizer_dir, self.tokenizer = tokenizer_for_model(cfg, self.files, self.tokenizer,
                                                                     self.tokenizer_dir)
        resume_dir, old_files = self.folder.check(cfg, self.accelerator, say=self.say)  # one folder, every machine
        if self.tokenizer is None:  # before a stopped run's files go: a tokenizer folder refused loses nothing
            self.tokenizer_dir = tokenizer_folder(cfg)
            self.tokenizer = tokenizer_for_run(cfg, self.tokenizer_dir, self.files, runs_here("tokenizer"),
                                               self.accelerator.wait_for_everyone, self.say)
        self.folder.claim(self.accelerator, old_files, resume_dir, bool(cfg.resume_from), self.say)
        self.checkpointer = Checkpointer(self.folder, self.accelerator, self.telemetry, engine=self.engine)
        self.telemetry.open(self.out, cfg, resuming=resume_dir is not None)
        self.telemetry.log_memory("start")
        self.data = build_data(cfg, self.files, self.tokenizer, DataProcess(
            self.accelerator.process_index, self.accelerator.num_processes,
            indexes_from_main(self.accelerator, self.files.train), report=self.say, warn=self.warn),
            pad_multiple=train_padding(cfg, self.shape_multiple))  # (--torch_compile: buckets)
        self.batch_request = batch_request(cfg)  # the sizes used, from here on in the config (memory.batch_budget)
        sizes = size_run(cfg, self.data, self.accelerator, self.engine, resume_dir, self.say)
        cfg = self.cfg = self.telemetry.resolved(replace(cfg, **sizes.flags()))  # planned before the model exists:
        self.memory_plan = plan_run(cfg, self.data, Placement.of(self.accelerator, self.engine.sharding),
                                    resume_dir is not None, sizes.lengths, self.say)
        self.ctx = RunContext(cfg, self.accelerator, self.engine, self.precision, self.shape_multiple,
                              self.memory.guard)
        imports_done()  # before the weights: lowmem.memory.collector
        self._build_model()
        self.total_steps = self.data.steps(cfg)[1]
        self._build_optimizer()  # then the criterion (a preference objective's reference: from the starting policy)
        self.ctx = replace(self.ctx, criterion=criterion_for(self.ctx, self.model, self.core, self.data, self.say))
        self.meter.describe = self.ctx.criterion.fields  # (the log's values of the interval's sums)
        self.compiled.install(self.core, self.data.collator.pad_multiple, self.say)  # (--torch_compile=True)
        self.train_collator = self.data.train_collator or self.data.collator  # (a cached reference's reads it)
        if resume_dir is not None:
            self.load_checkpoint(resume_dir)
        self.telemetry.record("memory_plan", **self.memory_plan)  # after a resume has cut metrics.jsonl back
        self.telemetry.start_trackers()  # a resume continues their runs (lowmem.monitoring.tracker_feed)
        if cfg.encoder_cache != "off":  # train from the frozen encoder's outputs, computed once per row
            self.encoder_cache, self.train_collator = encoder_cache.train_from_cache(
                self.ctx, self.core, self.data, self.run_config["tokenizer_json_sha1"],
                self.total_steps - self.state.step, self.telemetry)
        plan = plan_evals(self.ctx, self.model, self.core, self.data, self.state)
        model = ModelInRun(self.core, self.parameters, self.encoder_cache)
        lines, record = startup_summary(cfg, self.accelerator, self.data, model, self.state.step, plan)
        self.say("\n".join(lines))
        self.telemetry.record("setup", **record)
        return self

    def _build_model(self) -> None:
        """Build (from scratch) or load (--init_from) the model, freeze what --freeze names, apply the memory modes."""
        cfg = self.cfg
        stored = None  # (bf16, 8-bit) elements of a model read in its training form
        if self.model is None:
            with deepspeed_engine.loading_whole(self.accelerator):  # under ZeRO-3 too: not into partitions
                self.model, stored = model_for_run(cfg, self.tokenizer, self.accelerator.device, self.engine.shards,
                                                   self.memory.guard.check)
        else:  # a model handed in; --init_from's was checked in setup, and a new one is sized to the tokenizer
            check_vocabulary(cfg, self.model.get_input_embeddings().num_embeddings, self.tokenizer)
        self.run_config = {**cfg.to_dict(), "batch_request": self.batch_request, "sharding": self.engine.sharding,
                           **tokenizer_fingerprint(self.tokenizer), "held_out_rows": self.data.held_out_rows,
                           **base_model_identity(cfg)}
        self.model, self.parameters = ready_to_train(self.model, cfg, stored)
        self.meter.count_flops(self.model, cfg, self.shape_multiple, self.accelerator.device.type, self.precision.dtype)
        self.precision.prepare(self.model)
        self.model = self.engine.shard(self.model, self.accelerator.device)  # FSDP's: before the optimizer
        self.telemetry.log_memory("model_built")

    def _build_optimizer(self) -> None:
        """Optimizer state for the trainable tensors only, the schedule, and accelerate's wrapping."""
        self.optimizer, self.scheduler, group_sizes = optimizer_for_run(self.cfg, self.model, self.total_steps)
        self.run_config["parameter_group_sizes"] = group_sizes  # checked on resume
        # The scheduler is not prepared: accelerate's wrapper would step it once per process per call.
        self.model, self.optimizer, self.core = self.engine.prepare(self.accelerator, self.model, self.optimizer)
        self.trainable_params = [p for p in self.core.parameters() if p.requires_grad]
        self.telemetry.log_memory("prepared")

    # ------------------------------------------------------------------ train
    def train(self) -> dict:
        """Run optimizer steps until ``max_steps`` or the last epoch; evaluate and export at the end."""
        self.signals.install()
        self._set_train_mode()
        self.bar = self.telemetry.progress(self.total_steps, self.state.step)
        self.maybe_eval()  # the baseline every later eval is compared with (step 0, or one a signal cut short)
        freeze_long_lived()  # later collections skip the imports, model and tokenizer
        self.meter.start(self.accelerator.device, self.resumed_interval)  # after the baseline: rates time training
        while not self._finished():  # one epoch
            free_memory()  # at each epoch start
            for window in self.windows():
                stepped = self.train_step(window.batches, window.counts)
                self.telemetry.log_consumed(window.examples, window.epoch, self.files.train)
                if window.last:  # the epoch's last step: counted before eval and save see it
                    self.end_epoch()
                if stepped:
                    self.maybe_log()
                    if self.state.step % self.cfg.gc_every_steps == 0:
                        free_memory()
                    with self.meter.untimed():
                        self.maybe_eval()
                        self.maybe_save()
                if self.signals.requested(self.accelerator):  # checked after this step, not with the next
                    self.stop_for_signal()  # window's counts, which ran one more step (a grace period may not allow it)
        self.bar.close()
        return self.finish()

    def windows(self):
        """This epoch's accumulation windows (``Window``), each drawn, collated and counted over every process, up to
        the epoch's last or the run's end; an epoch whose rows run out first (bad rows) ends here."""
        cfg, state, stream = self.cfg, self.state, self.data.stream
        drawn = self.data.epoch_windows(state.epoch, cfg.batch_size * cfg.gradient_accumulation_steps)
        while True:
            epoch = stream.epoch  # before drawing: the last window of an epoch moves it on
            self.memory.hold(self.checkpointer, stream, self.meter)  # what a stop within the window saves
            examples = next(drawn, [])
            batches = self.train_collator.window(examples, cfg.batch_size, cfg.max_tokens_per_batch) if examples else []
            counts = window_counts(self.accelerator, batches, stream, state.epoch, self.memory.before(state.step))
            check_bad_rows(self.telemetry, self.data, counts["bad_rows"], cfg.max_bad_rows_fraction)
            if counts["memory"]:  # a process reached the guard since the last reading: before the window's work
                self.stop_for_memory()
            if not counts["examples"]:  # only bad rows were left
                self.end_epoch()
                break
            window = Window(examples, batches or [self.train_collator.empty()], counts, epoch)
            yield window
            if window.last or self._finished():
                break
        if not state.examples:
            check_no_examples(self.telemetry, self.data, cfg, counts["rows_not_read"], self._finished())

    def end_epoch(self) -> None:
        """Every process has finished this epoch, and all agree on the count: the one place epochs are counted,
        before the step's checkpoint (which a resume cuts the log back to) records it."""
        self.data.stream.close_epoch(self.state.epoch)  # (a no-op for a stream that ran out: it moved on itself)
        self.state.epoch += 1
        self.telemetry.log_memory("epoch_end", epoch=self.state.epoch)

    def _finished(self) -> bool:
        """The same answer on every process (a process's own stream may run out of an epoch first)."""
        if self.cfg.max_steps > 0:
            return self.state.step >= self.cfg.max_steps
        return self.state.epoch >= self.cfg.epochs

    def _set_train_mode(self) -> None:
        self.model.train()
        if self.cfg.frozen_encoder:
            self.core.encoder.eval()  # frozen: no dropout, and it runs under no_grad

    def train_step(self, window: list[dict], counts: dict) -> bool:
        """One optimizer step over an accumulation window of collated micro-batches. False: it was skipped (a
        non-finite loss or gradient); fp16's overflow of the loss scale runs the window again at the lower scale."""
        if self.engine.shards:  # every forward is a collective: as many on every process
            window = padded_window(window, self.train_collator.empty, self.accelerator.num_processes)
        drawn = WindowRandomness(self.accelerator.device)  # run again (fp16), the window draws the same dropout
        while True:
            loss_sum = self.accumulate_gradients(window, counts)
            if self.memory.tripped_in_window(self.accelerator):  # before the optimizer step: the window is
                self.stop_for_memory(in_window=True)  # dropped on every process
            self.precision.unscale(self.optimizer)  # (fp16's) then the same norm on every process (DeepSpeed
            params, clip = self.trainable_params, self.cfg.max_grad_norm  # clips, skips a non-finite step itself)
            self.grad_norm = self.engine.clip(self.accelerator, self.model, params, clip)
            if math.isfinite(float(self.grad_norm)):  # one host sync per optimizer step
                break
            self.optimizer.zero_grad(set_to_none=True)  # the gradient dropped, the skip counted
            finite = functools.partial(all_finite, self.accelerator, loss_sum)  # a collective, asked when needed
            if not self.nonfinite.again(self.precision, finite, drawn):
                return False
        self.step_lr = self.scheduler.get_last_lr()[0]  # the rate this step applies (logged with it)
        self.precision.step(self.engine, self.optimizer)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.count_step(counts["tokens"], counts["examples"])
        self.meter.add(loss_sum, counts, window)
        self.bar.update()
        return True

    def accumulate_gradients(self, window: list[dict], counts: dict | None = None) -> torch.Tensor:
        """Backward over one window; the gradient is that of (sum of token losses) / (target tokens of the whole
        window on all processes), whatever the micro-batch split. Returns the local sums the criterion logs."""
        counts = counts or window_counts(self.accelerator, window, self.data.stream, self.state.epoch)
        return window_backward(self.ctx, self.model, self.core, window, counts, self.train_collator.empty)

    # ------------------------------------------------------------------ hooks between steps
    def maybe_log(self, force: bool = False) -> None:
        # Every condition here is the same on all processes: the interval's reduce is a collective.
        if (force or self.state.step % self.cfg.logging_steps == 0) and self.meter.steps:
            lr = self.scheduler.get_last_lr()[0] if self.step_lr is None else self.step_lr
            step = {"lr": lr, "grad_norm": self.grad_norm, "elapsed_s": self.state.elapsed(self.start_time),
                    **self.precision.log_fields(), **self.compiled.log_fields()}
            log_interval(self.telemetry, self.meter, self.accelerator, self.bar, self.total_steps, step)
            self.meter.start(self.accelerator.device)

    def maybe_eval(self) -> None:
        step, cfg = self.state.step, self.cfg  # (a step's evaluation done, a run resumed after it does not repeat)
        if cfg.eval_steps and step % cfg.eval_steps == 0 and not self._finished() \
                and (self.state.last_eval or {}).get("step") != step:
            self.evaluate_and_keep_best()

    def maybe_save(self) -> None:
        if self.cfg.save_steps and self.state.step % self.cfg.save_steps == 0 and not self._finished():
            self.save_checkpoint()

    def stop_for_signal(self) -> None:
        self.bar.close()
        folder = self.save_checkpoint()
        self.say(f"stopped at step {self.state.step}; checkpoint {folder}. Continue with the same command "
                 "plus --is_keep_training=True")
        raise StoppedBySignal(self.state.step, self.signals.exit_code())

    def stop_for_memory(self, in_window: bool = False) -> None:  # every process together (MemoryStop.stop)
        self.bar.close()
        raise self.memory.stop(self.accelerator, self.optimizer, self.state.step, self.save_checkpoint, in_window)

    def finish(self) -> dict:
        """Final log, evaluation, checkpoint and ``final/`` export."""
        self.maybe_log(force=True)
        with self.meter.untimed():  # out of step_s; this step is evaluated already when the run resumed from
            done = self.state.last_eval  # its own final checkpoint
            metrics = done if done and done["step"] == self.state.step else self.evaluate_and_keep_best()
            self.save_checkpoint()
        if self.state.step != self.total_steps:  # epochs planned from row counts, or from a sample's tokens
            self.say(schedule_note(self.state.step, self.total_steps, self.scheduler.get_last_lr()[0], self.data))
        self.export(self.out / "final")
        self.telemetry.log_memory("end")
        fields, line = peak_against_plan(self.memory_plan, self.accelerator)  # predicted and measured peak side by side
        self.telemetry.record("memory_peak", **fields)
        self.say(line)
        errors = report_data_errors(self.telemetry, self.data)
        self.telemetry.run_ended()  # the trackers get what came after the last checkpoint
        self.accelerator.wait_for_everyone()  # no process leaves while another is still in a collective
        return run_result(self.out, self.state, self.meter.mean_step_seconds(), metrics, errors)

    # ------------------------------------------------------------------ evaluation, checkpoints, exports
    def evaluate(self) -> dict:
        """Eval loss and --eval_metrics on the eval set (``lowmem.training.evaluation.evaluate_in_run``)."""
        model = EvalModel(self.ctx, self.model, self.core, self.tokenizer, self.data.collator)
        result = evaluate_in_run(model, self.data.eval_examples, self.state.eval_generate_rows(), self.signals.pending,
                                 self.telemetry.log_memory)
        self._set_train_mode()
        if self.signals.requested(self.accelerator):  # cut short: a resume runs this evaluation again
            self.stop_for_signal()
        return result

    def evaluate_and_keep_best(self) -> dict:
        result = self.evaluate()
        improved = is_better(result, self.state.best_metric, self.state.best_eval_loss, self.cfg.metric_for_best)
        if improved and not weights_finite(self.core):
            improved = False  # never export non-finite weights as best
            self.say("the weights hold non-finite values: not saved as best")
        self.state.note_eval(result, self.cfg.metric_for_best if improved else None)
        if improved:  # the export's training_info.json holds the state: this evaluation, this best
            self.export(self.out / "best")
        self.telemetry.record("eval", **result, best=improved)
        self.say(eval_log_line(self.state.step, result, improved))
        return result

    def export(self, folder: Path) -> None:
        info = training_info(self.cfg, self.data.held_out_rows, self.state.now(self.start_time))
        self.checkpointer.export(folder, self.core, ExportFiles(self.tokenizer, info, self.tokenizer_dir),
                                 adapter_export(self.cfg))

    def _checkpointed(self) -> tuple:
        """What a checkpoint holds: (model, optimizer, scheduler, run_config); DeepSpeed saves through its engine."""
        return self.engine.saved_model(self.model, self.core), self.optimizer, self.scheduler, self.run_config

    def save_checkpoint(self, position: dict | None = None) -> Path:  # position: held at a window's start
        self.state.loss_scaler = self.precision.state_dict()
        return self.checkpointer.save(self.state.now(self.start_time), self._checkpointed(), self.data.stream,
                                      self.meter, keep=self.cfg.save_total_limit, position=position)

    def load_checkpoint(self, folder: Path) -> None:
        trainer_state, self.resumed_interval = self.checkpointer.load(folder, self._checkpointed(), self.data.stream,
                                                                      self.cfg.learn_rate, self.cfg.weight_decay)
        self.state.load_state_dict(trainer_state)
        self.precision.load_state_dict(self.state.loss_scaler)
        self.say(f"resumed from {folder} at step {self.state.step} (epoch {self.state.epoch})")
        self.telemetry.record("resume", path=str(folder))

    def close(self) -> None:
        thaw_long_lived()
        self.folder.release_lock()
        self.telemetry.close()
        for cache in (self.encoder_cache, self.ctx and self.ctx.criterion):  # (a preference run's reference too)
            if cache is not None:
                cache.close()
        self.encoder_cache = None
        if self.accelerator is not None:
            # gloo threads left to static destructors can abort a finished process: tear the group down first
            self.accelerator.end_training()
            self.accelerator = None
