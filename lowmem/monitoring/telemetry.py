"""What a run tells: log lines, ``metrics.jsonl`` records (fed to the trackers of ``--report_to``:
``lowmem.monitoring.tracker_feed``), memory probes, the consumed-examples log, and the interval meter behind each
``train`` record's loss and rates (the start-up summary: ``lowmem.monitoring.run_summary``; bad rows:
``lowmem.monitoring.bad_rows``).

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

from config import TrainConfig
from lowmem.hardware.memory_use import memory_snapshot
from lowmem.hardware.probe import capability
from lowmem.monitoring.metrics_log import AppendLog, MetricsLog, train_line
from lowmem.monitoring.tracker_feed import TrackerFeed
from lowmem.utils.ownership import open_own


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
        self.hardware: dict = {}  # what the run's device computes fast (lowmem.hardware), written into config.json

    def attach(self, accelerator) -> None:
        self.main, self.rank, self.world = accelerator.is_main_process, accelerator.process_index, \
            accelerator.num_processes
        self.hardware = capability(accelerator.device.type).record()  # probed (or read from its cache) once

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
            fh.write(json.dumps({**values, "hardware": self.hardware} if self.hardware else values, indent=1))

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

    def progress(self, total: int, done: int):
        """The training's progress bar (tqdm), shown on the main process's terminal (elsewhere disabled: log lines
        say the numbers instead)."""
        return tqdm(total=total, initial=done, desc="train", unit="step", disable=not (self.main and on_terminal()),
                    dynamic_ncols=True)

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
        self.flops = None  # counts a window's model FLOPs (``count_flops``): FLOP/s and MFU in the records
        self.peak = 0.0  # FLOP/s of one device in the run's compute dtype (lowmem.hardware)
        # the log's values from the interval's loss sums (summed over processes) and target tokens: the run's
        # criterion's ``fields`` (lowmem.training.criteria; a preference objective logs its rewards too)
        self.describe = lambda sums, tokens: {"loss": round(sums[0] / max(tokens, 1), 5)}

    def count_flops(self, core, cfg: TrainConfig, multiple: int, device_type: str, dtype: torch.dtype) -> None:
        """Count each window's model FLOPs (``lowmem.monitoring.flops``; ``core``: the model as trained, after its
        memory modes), against one ``device_type`` device's peak in the compute ``dtype`` for the MFU."""
        from lowmem.monitoring.flops import StepFlops

        self.flops = (StepFlops.of(core, cfg.gradient_checkpointing), cfg.frozen_encoder, multiple)
        self.peak = capability(device_type).peak(dtype)

    def start(self, device, saved: dict | None = None) -> None:
        """Start an interval. ``saved`` (on resume) carries the loss and token sums of the steps since
        the last log line, so the next logged loss and padding average the same steps as an uninterrupted
        run, and the training time of the steps before the checkpoint; the interval's rates (tok/s,
        step_s) count only steps timed in this process."""
        saved = {"loss": 0.0, "tokens": 0, "steps": 0, "real_tokens": 0, "positions": 0, "rows": 0, "row_examples": 0,
                 **(saved or {})}
        if "timed_seconds" in saved:  # (checkpoints of earlier versions carry none: this process's alone)
            self.timed = {"seconds": saved.pop("timed_seconds"), "steps": saved.pop("timed_steps")}
        self.sums = {**saved, "loss": torch.tensor(saved["loss"], device=device), "all_tokens": 0,
                     "timed_steps": 0, "flops": 0, "t0": time.time()}

    def add(self, loss_sum: torch.Tensor, counts: dict, window: list[dict] = ()) -> None:
        """One optimizer step: its local loss sum, and ``counts`` (``lowmem.parallel.distributed.window_counts``):
        target tokens, source + target tokens, the source + target positions of its micro-batches (padding
        included), their rows and the examples they hold (more than the rows when packed); ``window``: its
        micro-batches as collated (on the host), whose model FLOPs are counted."""
        sums = self.sums
        if self.flops is not None:
            counter, frozen_encoder, multiple = self.flops
            sums["flops"] += sum(counter.micro_batch(micro, frozen_encoder, multiple) for micro in window)
        sums["loss"] = sums["loss"] + loss_sum  # (a vector of sums for a preference objective)
        sums["tokens"] += counts["local_tokens"]
        sums["all_tokens"] += counts["local_all_tokens"]  # this process's timed tokens: tok/s
        sums["real_tokens"] += counts["local_all_tokens"]  # with the steps before a resume: the padding share
        sums["positions"] += counts["local_padded_tokens"]
        sums["rows"] += counts["local_rows"]
        sums["row_examples"] += counts["local_examples"]
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
        counts = torch.tensor([sums["tokens"], sums["all_tokens"], sums["real_tokens"], sums["positions"],
                               sums["rows"], sums["row_examples"], sums["flops"]],
                              dtype=torch.float64, device=sums["loss"].device)
        losses = sums["loss"].double().reshape(-1)
        totals = torch.cat([losses, counts])
        if accelerator.num_processes > 1:
            totals = accelerator.reduce(totals, "sum")
        values = totals.tolist()
        tokens, all_tokens, real, padded, rows, examples, flops = values[len(losses):]
        seconds = max(time.time() - sums["t0"], 1e-9)
        self.timed["seconds"] += seconds
        self.timed["steps"] += sums["timed_steps"]
        rates = {}
        if self.flops is not None:  # model FLOPs of every process's steps over the interval's time
            rates["flops_per_s"] = round(flops / seconds, 1)
            rates["mfu"] = round(flops / (seconds * accelerator.num_processes * self.peak), 4) if self.peak else None
        return {**self.describe(values[:len(losses)], tokens), "tokens_per_s": round(all_tokens / seconds, 1),
                "step_s": round(seconds / max(sums["timed_steps"], 1), 4),
                "padding_pct": round(100 * (1 - real / padded), 1) if padded else 0.0,
                "examples_per_row": round(examples / rows, 2) if rows else 1.0, **rates}  # (above 1: --packing)

    def saved(self) -> dict:
        """The interval's sums as a checkpoint keeps them, and the training time so far (see ``start``)."""
        now = self.untimed_since or time.time()  # a checkpoint is written inside ``untimed``
        return {**{k: v.tolist() if k == "loss" else v for k, v in self.sums.items()
                   if k in ("loss", "tokens", "steps", "real_tokens", "positions", "rows", "row_examples")},
                "timed_seconds": self.timed["seconds"] + now - self.sums.get("t0", now),  # (none: not started)
                "timed_steps": self.timed["steps"] + self.sums.get("timed_steps", 0)}

    def mean_step_seconds(self) -> float | None:
        """Seconds per optimizer step of the run's training, the parts before a resume included: data,
        forward, backward and optimizer; evaluation, saving, setup and the encoder cache's build left out."""
        return round(self.timed["seconds"] / self.timed["steps"], 4) if self.timed["steps"] else None


def log_interval(telemetry: Telemetry, meter: IntervalMeter, accelerator, bar, total_steps: int, step: dict) -> None:
    """The ``train`` record of an interval (and its log line, or the bar's numbers on a terminal). ``step``: what the
    trainer knows of the interval's last optimizer step: ``lr`` (the rate it applied), ``grad_norm`` (None: none
    measured yet), ``elapsed_s`` (the run's seconds so far), and any more fields for the record (fp16's loss scale,
    the graphs compiled). Collective: every process calls it at the same step."""
    state = telemetry.state
    mem = memory_snapshot()
    interval = meter.close(accelerator)
    extra = dict(step)
    lr, grad_norm, elapsed = extra.pop("lr"), extra.pop("grad_norm"), extra.pop("elapsed_s")
    fields = dict(loss=interval["loss"], lr=lr, tokens_per_s=interval["tokens_per_s"], step_s=interval["step_s"],
                  **{key: interval[key] for key in ("flops_per_s", "mfu") if key in interval},
                  padding_pct=interval["padding_pct"], examples_per_row=interval["examples_per_row"],
                  elapsed_s=round(elapsed, 2), epoch=state.epoch, examples=state.examples,
                  target_tokens=state.target_tokens, **mem)
    if accelerator.num_processes > 1:  # every process's own RSS: N processes should cost about N x one
        rss = accelerator.gather(torch.tensor([mem["rss_mb"]], device=accelerator.device))
        fields["rss_mb_per_process"] = [round(v, 1) for v in rss.tolist()]
    if grad_norm is not None:
        fields["grad_norm"] = round(float(grad_norm), 7)
    fields.update({k: v for k, v in interval.items() if k not in fields and k not in ("tokens_per_s", "step_s")})
    fields.update(extra)
    telemetry.record("train", **fields)
    if telemetry.main:
        bar.set_postfix(loss=f"{fields['loss']:.3f}", lr=f"{lr:.1e}", tok_s=f"{fields['tokens_per_s']:.0f}",
                        **({"mfu": f"{100 * fields['mfu']:.1f}%"} if fields.get("mfu") is not None else {}),
                        rss=f"{mem['rss_mb'] / 1024:.2f}G")
        if not on_terminal():
            telemetry.say(train_line(state.step, total_steps, fields))
