"""What a run tells: log lines, ``metrics.jsonl`` records (fed to the trackers of ``--report_to``:
``lowmem.monitoring.tracker_feed``), memory probes, the consumed-examples log, the start-up summary, and the interval
meter behind each ``train`` record's loss and rates.

Log lines come from the main process (``say``) or from any process with its rank (``warn``); a
terminal gets a tqdm bar and the lines are written through it. Only the main process writes
``metrics.jsonl``; with ``--dump_consumed`` every process writes its own consumed log.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from config import SHIPPED_TOKENIZER_DIR, TrainConfig, UserError
from data.sources.corpus import bad_rows_report, file_notes, too_many_bad_rows
from lowmem.checkpointing.ownership import open_own
from lowmem.memory.probes import memory_snapshot
from lowmem.model.build import head_is_tied, lora_stacks
from lowmem.monitoring.metrics_log import AppendLog, MetricsLog, train_line
from lowmem.monitoring.tracker_feed import TrackerFeed


def on_terminal() -> bool:
    """Whether progress bars are shown (stderr is a terminal) instead of one log line per interval."""
    return sys.stderr.isatty()


class Telemetry:
    """The run's log lines and records. ``state`` is the trainer's counters: records carry its step."""

    def __init__(self, state):
        self.state = state
        self.main, self.rank, self.world = True, 0, 1  # until attach(): before setup every line is printed
        self.metrics: MetricsLog | None = None  # main process only
        self.trackers: TrackerFeed | None = None  # --report_to, fed from metrics.jsonl (main process)
        self.consumed: AppendLog | None = None  # --dump_consumed, every process
        self.pending_config: tuple | None = None  # (OUTPUT_DIR/config.json, the options), main process
        self.holding = False  # resuming: no record before the checkpoint has loaded (``open``)

    def attach(self, accelerator) -> None:
        self.main, self.rank, self.world = accelerator.is_main_process, accelerator.process_index, \
            accelerator.num_processes

    def open(self, out: Path, cfg: TrainConfig, resuming: bool = False) -> None:
        """config.json and metrics.jsonl (main process), the consumed-examples log (every process).

        Resuming, nothing is written until the checkpoint has loaded (``cut_back``): a resume refused on the
        way (another engine, other settings) leaves the run's config.json and records as they were, and the
        records made before the load would be cut back anyway."""
        if self.main:
            self.pending_config = (out / "config.json", cfg.to_dict())
            if not resuming:
                self._write_config()
            self.metrics = MetricsLog(out / "metrics.jsonl")
            self.trackers = TrackerFeed(out, cfg.report_to, cfg.to_dict(), self.say)
        self.holding = resuming
        if cfg.dump_consumed:
            self.consumed = AppendLog(out / f"consumed-rank{self.rank}.tsv")

    def resolved(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` as the run uses it (the batch sizes ``auto`` or the memory budget chose): config.json holds
        these, rewritten now (resuming: once the checkpoint has loaded)."""
        if self.main:
            self.pending_config = (self.pending_config[0], cfg.to_dict())
            if not self.holding:
                self._write_config()
        return cfg

    def _write_config(self) -> None:
        path, values = self.pending_config
        with open_own(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(values, indent=1))

    def start_trackers(self) -> None:
        """The trackers of ``--report_to``: new runs, or (resumed) the runs they continue, at the current step."""
        if self.trackers is not None:
            self.trackers.start(self.state.step, self.metrics.path)

    def checkpointed(self) -> None:
        """A checkpoint is on disk, and with it the records so far: the trackers that wait for one get them."""
        if self.trackers is not None:
            self.trackers.committed(self.metrics.path, self.metrics.tell())

    def run_ended(self) -> None:
        """The run is over: the trackers get the records after its last checkpoint and are finished."""
        if self.trackers is not None:
            self.trackers.finish(self.metrics.path, self.metrics.tell(), complete=True)

    def say(self, message: str) -> None:
        """A line from the main process."""
        if self.main:
            tqdm.write(message, file=sys.stdout)
            sys.stdout.flush()

    def warn(self, message: str) -> None:
        """A line from any process (prefixed with its rank when there are several)."""
        prefix = f"[rank {self.rank}] " if self.world > 1 else ""
        tqdm.write(prefix + message, file=sys.stdout)
        sys.stdout.flush()

    def record(self, event: str, **fields) -> None:
        """One metrics.jsonl record at the current step; its numbers also go to the trackers."""
        if self.metrics is not None and not self.holding:
            self.metrics.write(event, self.state.step, **fields)
            self.trackers.record(event, self.state.step, fields)  # the live ones (TensorBoard)

    def log_memory(self, where: str, **extra) -> None:
        self.record("memory", where=where, **memory_snapshot(), **extra)

    def log_consumed(self, examples: list, epoch: int, files: list[Path]) -> None:
        """With --dump_consumed: one line per row each example of this step was made from (epoch, rank,
        file, row); a packed chunk names every document it holds part of."""
        if self.consumed is not None:
            self.consumed.write("".join(f"{epoch}\t{self.rank}\t{files[f]}\t{row}\n"
                                        for e in examples for f, row in e.sources()))

    def offsets(self, sync: bool = True) -> dict:
        """Where this process's logs end: a resume cuts them back here, so they match an uninterrupted run.
        ``sync``: on disk first (before the checkpoint that trusts the offset is written)."""
        offsets = {}
        if self.consumed is not None:
            offsets["consumed"] = self.consumed.tell(sync=sync)
        if self.metrics is not None:
            offsets["metrics"] = self.metrics.tell(sync=sync)
        return offsets

    def cut_back(self, offsets: dict, checkpoint_record: str | None) -> None:
        """Drop what the logs got after a checkpoint; the checkpoint's own record is written again. The
        resumed run's config.json and records go out from here on."""
        self.holding = False
        if self.main:
            self._write_config()
        if self.consumed is not None and "consumed" in offsets:  # (a checkpoint of a run without the log: kept)
            self.consumed.truncate(offsets["consumed"])
        if self.metrics is not None and "metrics" in offsets:
            self.metrics.truncate(offsets["metrics"])
            if checkpoint_record:  # (checkpoints of older versions lack it)
                self.metrics.write_line(checkpoint_record)
            self.trackers.cut_back(self.metrics.tell())

    def close(self) -> None:
        if self.trackers is not None:  # (stopped: only what a checkpoint holds went to the waiting ones)
            self.trackers.finish(self.metrics.path, self.metrics.tell(), complete=False)
        for log in (self.metrics, self.consumed):
            if log is not None:
                log.close()
        self.metrics = self.consumed = self.trackers = None


class IntervalMeter:
    """Sums of one logging interval: the loss (kept on the device: no host sync until the log step),
    target and all tokens, steps; and the training time of this process, evaluations and saves left
    out (``untimed``)."""

    def __init__(self):
        self.sums: dict = {}
        self.timed = {"seconds": 0.0, "steps": 0}  # every interval logged (and, resumed, the run's before)
        self.untimed_since: float | None = None  # inside ``untimed``: since when

    def start(self, device, saved: dict | None = None) -> None:
        """Start an interval. ``saved`` (on resume) carries the loss and token sums of the steps since
        the last log line, so the next logged loss and padding average the same steps as an uninterrupted
        run, and the training time of the steps before the checkpoint; the interval's rates (tok/s,
        step_s) count only steps timed in this process."""
        saved = {"loss": 0.0, "tokens": 0, "steps": 0, "real_tokens": 0, "positions": 0, **(saved or {})}
        if "timed_seconds" in saved:  # (checkpoints of earlier versions carry none: this process's alone)
            self.timed = {"seconds": saved.pop("timed_seconds"), "steps": saved.pop("timed_steps")}
        self.sums = {**saved, "loss": torch.tensor(saved["loss"], device=device), "all_tokens": 0,
                     "timed_steps": 0, "t0": time.time()}

    def add(self, loss_sum: torch.Tensor, tokens: int, all_tokens: int, padded_tokens: int) -> None:
        """One optimizer step: its local loss sum, target tokens, source + target tokens, and the
        source + target positions of its micro-batches (padding included)."""
        sums = self.sums
        sums["loss"] += loss_sum
        sums["tokens"] += tokens
        sums["all_tokens"] += all_tokens  # this process's timed tokens: tok/s
        sums["real_tokens"] += all_tokens  # with the steps before a resume: the padding share
        sums["positions"] += padded_tokens
        sums["steps"] += 1
        sums["timed_steps"] += 1

    @property
    def steps(self) -> int:
        return self.sums["steps"]

    @contextlib.contextmanager
    def untimed(self):
        """Leave what runs inside (evaluation, saving) out of the interval's tok/s and step_s."""
        self.untimed_since = start = time.time()
        try:
            yield
        finally:
            self.untimed_since = None
            self.sums["t0"] += time.time() - start

    def close(self, accelerator) -> dict:
        """The interval's loss (token mean over all processes), tokens/s, seconds per step and the share
        of the micro-batches' positions that are padding. Collective with several processes: one small
        all-reduce."""
        sums = self.sums
        counts = torch.tensor([sums["tokens"], sums["all_tokens"], sums["real_tokens"], sums["positions"]],
                              dtype=torch.float64, device=sums["loss"].device)
        totals = torch.cat([sums["loss"].double().reshape(1), counts])
        if accelerator.num_processes > 1:
            totals = accelerator.reduce(totals, "sum")
        loss_sum, tokens, all_tokens, real, padded = totals.tolist()
        seconds = max(time.time() - sums["t0"], 1e-9)
        self.timed["seconds"] += seconds
        self.timed["steps"] += sums["timed_steps"]
        return {"loss": round(loss_sum / max(tokens, 1), 5), "tokens_per_s": round(all_tokens / seconds, 1),
                "step_s": round(seconds / max(sums["timed_steps"], 1), 4),
                "padding_pct": round(100 * (1 - real / padded), 1) if padded else 0.0}

    def saved(self) -> dict:
        """The interval's sums as a checkpoint keeps them, and the training time so far (see ``start``)."""
        now = self.untimed_since or time.time()  # a checkpoint is written inside ``untimed``
        return {**{k: float(v) if k == "loss" else v for k, v in self.sums.items()
                   if k in ("loss", "tokens", "steps", "real_tokens", "positions")},
                "timed_seconds": self.timed["seconds"] + now - self.sums.get("t0", now),  # (none: not started)
                "timed_steps": self.timed["steps"] + self.sums.get("timed_steps", 0)}

    def mean_step_seconds(self) -> float | None:
        """Seconds per optimizer step of the run's training, the parts before a resume included: data,
        forward, backward and optimizer; evaluation, saving, setup and the encoder cache's build left out."""
        return round(self.timed["seconds"] / self.timed["steps"], 4) if self.timed["steps"] else None


def log_interval(telemetry: Telemetry, meter: IntervalMeter, accelerator, lr: float, grad_norm, elapsed: float,
                 total_steps: int, bar) -> None:
    """The ``train`` record of an interval (and its log line, or the bar's numbers on a terminal).
    Collective: every process calls it at the same step."""
    state = telemetry.state
    mem = memory_snapshot()
    interval = meter.close(accelerator)
    fields = dict(loss=interval["loss"], lr=lr, tokens_per_s=interval["tokens_per_s"], step_s=interval["step_s"],
                  padding_pct=interval["padding_pct"],
                  elapsed_s=round(elapsed, 2), epoch=state.epoch, examples=state.examples,
                  target_tokens=state.target_tokens, **mem)
    if accelerator.num_processes > 1:  # every process's own RSS: N processes should cost about N x one
        rss = accelerator.gather(torch.tensor([mem["rss_mb"]], device=accelerator.device))
        fields["rss_mb_per_process"] = [round(v, 1) for v in rss.tolist()]
    if grad_norm is not None:
        fields["grad_norm"] = round(float(grad_norm), 7)
    telemetry.record("train", **fields)
    if telemetry.main:
        bar.set_postfix(loss=f"{fields['loss']:.3f}", lr=f"{lr:.1e}", tok_s=f"{fields['tokens_per_s']:.0f}",
                        rss=f"{mem['rss_mb'] / 1024:.2f}G")
        if not on_terminal():
            telemetry.say(train_line(state.step, total_steps, fields["loss"], lr, fields["tokens_per_s"],
                                     fields["padding_pct"], mem["rss_mb"]))


def frozen_summary(cfg: TrainConfig, core) -> str:
    """What --freeze keeps fixed, in the start-up line's words."""
    freeze, tied = cfg.freeze, head_is_tied(core)
    if cfg.lora_r:  # every base weight, an untied lm_head too
        return "base weights frozen, LoRA adapters train" + (
            "; encoder under no_grad, eval mode" if freeze == "encoder" else "")
    if freeze == "none":
        return "every weight trains"
    parts = ["encoder (no_grad, eval mode)"] if freeze == "encoder" else []
    parts.append("shared embedding" + (" = tied output layer" if tied else ""))
    return "frozen " + " + ".join(parts) + ("" if tied else "; the untied lm_head trains")


def schedule_note(steps: int, planned: int, last_rate: float, data) -> str:
    """Why an epochs run took another number of steps than its schedule was made for (``data``: the run's
    ``TrainData``)."""
    estimated = data.objective.chunk_length and data.epoch_rows_known and data.epoch_tokens[1] != "counted"
    basis = "an estimate of their tokens (packed text)" if estimated else "the files' row counts"
    why = ("bad rows and non-finite steps are skipped" if steps < planned and not estimated else
           "the documents held fewer tokens than estimated" if steps < planned else
           f"the documents held more tokens than estimated: the last {steps - planned} ran at the last planned "
           "step's rate")
    return (f"the epochs took {steps} optimizer steps, not the {planned} planned from {basis} ({why}): the "
            f"learning-rate schedule, made for {planned} steps, ended at {last_rate:.3g}")


def startup_summary(cfg: TrainConfig, accelerator, parameters: dict, data, per_epoch: int, total_steps: int,
                    start_step: int, cache, core, eval_plan) -> tuple[list[str], dict]:
    """The numbers that matter before training starts, and notes on the files: (log lines, the ``setup``
    record's fields).
    ``parameters``: trainable, frozen, frozen_bf16 and frozen_8bit counts; ``data``: the run's ``TrainData``;
    ``eval_plan``: what each evaluation generates and costs (``lowmem.memory.eval_cost.EvalPlan``)."""
    world = accelerator.num_processes
    lengths = data.objective.longest or (cfg.max_source_len, cfg.max_target_len)  # the longest example
    effective = cfg.batch_size * cfg.gradient_accumulation_steps * world
    tokenizer = ("the shipped one" if cfg.tokenizer_dir == str(SHIPPED_TOKENIZER_DIR) else cfg.tokenizer_dir
                 or "the model's own")  # (a run without --tokenizer_dir used the shipped one silently)
    lines = [
        f"device {accelerator.device} x {world} process(es) | model {cfg.init_from or cfg.model_preset} | "
        f"params trainable {parameters['trainable']:,} / frozen {parameters['frozen']:,} | tokenizer {tokenizer} "
        f"({len(data.collator.tokenizer):,} tokens)",
        f"effective batch {effective} (micro {cfg.batch_size} x accumulation {cfg.gradient_accumulation_steps} "
        f"x {world}) | tokens per optimizer step <= {effective * sum(lengths):,}"
        + (f" | micro-batches of up to {cfg.max_tokens_per_batch:,} padded tokens" if cfg.max_tokens_per_batch else "")
        + f" | eval batch {cfg.eval_batch_size}",
        data_line(cfg, data, per_epoch) + f"total steps {total_steps} | start step {start_step}",
        f"eval {data.objective.example_noun} {len(data.eval_examples):,} from " + data.eval_source,
        eval_plan.line(),
        "memory: " + ", ".join(memory_features(cfg, parameters, cache, core)),
    ]
    if cfg.gpu_profile and accelerator.device.type == "cpu":
        lines.append(f"--memory_profile={cfg.memory_profile} is a GPU profile but this run is on the CPU: its "
                     "bf16 autocast saves no host memory there (it measured more); host16g is the CPU profile")
    if cfg.warmup_steps >= total_steps:
        lines.append(f"--warmup_steps={cfg.warmup_steps} is not below the run's {total_steps} steps: the run ends "
                     f"in the warmup, at {total_steps}/{cfg.warmup_steps + 1} of --learn_rate (lower --warmup_steps "
                     "to reach it)")
    lines += file_notes(cfg.train_file, data.files.train, data.files.eval, bool(cfg.eval_file), data.objective.formats)
    record = dict(trainable_params=parameters["trainable"], frozen_params=parameters["frozen"],
                  frozen_bf16_params=parameters["frozen_bf16"], frozen_8bit_params=parameters["frozen_8bit"],
                  effective_batch=effective, micro_batch_size=cfg.batch_size,
                  gradient_accumulation_steps=cfg.gradient_accumulation_steps, eval_batch_size=cfg.eval_batch_size,
                  max_tokens_per_batch=cfg.max_tokens_per_batch, train_rows=data.rows,
                  held_out_rows=data.held_out_rows, eval_rows=len(data.eval_examples), total_steps=total_steps,
                  world_size=world, **eval_plan.record())
    return lines, record


def data_line(cfg: TrainConfig, data, per_epoch: int) -> str:
    """The start-up line on the training data, in its objective's words, and an epoch's steps where known."""
    known = data.epoch_rows_known  # else the source says its count is unknown (a dataset without one)
    objective, rows, shape = data.objective, f" {data.rows:,}" if known else "", data.objective.describe()
    line = f"train {objective.noun}{rows} from {data.source}" + (f", {shape}" if shape else "") + " | "
    if not objective.chunk_length:  # rows are examples: an epoch's steps are counted from the files
        return line + (f"{per_epoch} optimizer steps per epoch | " if known else "")
    # packed text: steps counted or estimated from its tokens; not at all when --max_steps ends the run
    counted = data.epoch_tokens[1] if cfg.max_steps <= 0 else ""
    return line + (f"{per_epoch} optimizer steps per epoch (tokens {counted}) | " if counted else "")


def memory_features(cfg: TrainConfig, parameters: dict, cache, core) -> list[str]:
    """Which memory features the run has on, in the start-up line's words."""
    features = [f"mixed_precision={cfg.mixed_precision}", f"optimizer={cfg.optimizer}",
                f"gradient_checkpointing={cfg.gradient_checkpointing}",
                f"shuffle_buffer={cfg.shuffle_buffer_size} rows / {cfg.shuffle_buffer_mb} MiB", "dynamic padding",
                "streamed data", f"gc every {cfg.gc_every_steps} steps"]
    if cfg.lora_r:
        features.append(f"LoRA r={cfg.lora_r} alpha={cfg.lora_alpha:g} on {' and '.join(lora_stacks(cfg))} "
                        f"{cfg.lora_target_modules}")
    if cache is not None:
        features.append(f"encoder cache ({'RAM' if cache.in_memory else 'disk'}, {cfg.encoder_cache_dtype})")
    features.append(frozen_summary(cfg, core))
    if parameters["frozen_bf16"]:
        features.append(f"{parameters['frozen_bf16']:,} frozen weights stored in bf16")
    if parameters["frozen_8bit"]:
        features.append(f"{parameters['frozen_8bit']:,} frozen weights stored in {cfg.frozen_dtype} (optimum-quanto"
                        f"{', wo included' if cfg.quantize_wo else '; wo and embeddings in bf16'}; norms float32)")
    return features


def report_data_errors(telemetry: Telemetry, data) -> dict:
    """Sum the bad rows of the first epoch over processes; log them and write a ``data_errors`` record.

    Collective: called at points every process reaches together. ``data``: the run's ``TrainData``.
    """
    from accelerate.utils import gather_object

    stream = data.stream
    train = stream.problems.merge(gather_object([stream.problems.state_dict()]))
    rows_read = sum(gather_object([stream.rows_read]))
    event, line = bad_rows_report(train, rows_read, stream.total_rows, data.eval_problems, data.files.prepared)
    telemetry.record("data_errors", **event)
    if line:
        telemetry.say(line)
    return event


def check_no_examples(telemetry: Telemetry, data, cfg: TrainConfig, bad_rows: int, run_over: bool) -> None:
    """After an epoch, with no training example yet: stop with one line when every row was bad (``bad_rows``:
    summed over processes), or when the run is over. Raw text shorter than one chunk in an epoch carries its
    tokens over to the next epoch, so the run goes on while epochs remain."""
    stream = data.stream
    if bad_rows >= stream.total_rows:
        report_data_errors(telemetry, data)
        raise UserError(f"--train_file={cfg.train_file} yields no usable rows ({stream.total_rows} rows, all bad); see "
                        "the data_errors line in metrics.jsonl")
    if run_over:
        chunk = getattr(stream, "chunk_length", None)
        raise UserError(f"--train_file={cfg.train_file} gave no training example in {cfg.epochs} epoch(s): its "
                        f"text is shorter than one chunk of {chunk} tokens; raise --epochs (each adds the text "
                        "again), add text, or lower --max_source_len")


def check_bad_rows(telemetry: Telemetry, data, bad_rows: int, max_fraction: float) -> None:
    """Abort (on every process alike: ``bad_rows`` is summed over them) once more training rows are bad
    than ``max_fraction`` (--max_bad_rows_fraction) allows for the whole corpus."""
    total_rows = data.stream.total_rows
    if bad_rows > max_fraction * total_rows:
        errors = report_data_errors(telemetry, data)
        raise too_many_bad_rows(bad_rows, total_rows, max_fraction, errors["by_reason"])
