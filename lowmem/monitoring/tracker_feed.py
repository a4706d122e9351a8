"""metrics.jsonl feeding the trackers of ``--report_to`` (``lowmem.monitoring.trackers``), so each gets the same (step,
value) series as the log, once per step, across kills and resumes.

A resume cuts metrics.jsonl back to its last checkpoint and trains the steps after it again. A live tracker
(TensorBoard) gets each record as it is written and hides, on resume, what came after the checkpoint. The others
cannot take back what they got: they get each record once the checkpoint after it is written (and the rest when
the run ends), read back from metrics.jsonl, so nothing they hold is ever cut back. OUTPUT_DIR/trackers.json keeps,
per tracker, its run's id (a resume continues that run), how far into metrics.jsonl it was fed, and the last step
it got.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from config import saved_json
from lowmem.checkpointing.ownership import write_atomic
from lowmem.monitoring.metrics_log import tracker_scalars
from lowmem.monitoring.trackers import TRACKERS, check_report_to, requested

STATE_FILE = "trackers.json"
NOT_SCALARS = ("event", "step", "time")  # a record's own fields, beside the numbers


class TrackerFeed:
    """The run's trackers (main process only). ``start`` once the checkpoint (if any) has loaded, ``record`` at
    each record, ``committed`` after each checkpoint, ``finish`` at the end."""

    def __init__(self, out: Path, report_to: str, config: dict, say=print):
        check_report_to(report_to)
        self.path = Path(out) / STATE_FILE
        self.trackers = [TRACKERS[name](out, config) for name in requested(report_to)]
        self.say = say
        self.state: dict[str, dict] = {}  # name -> {"run_id", "fed", "last_step"} of the trackers started
        self.cut_at: int | None = None  # resumed: metrics.jsonl's length once cut back to the checkpoint
        self.started = False

    def cut_back(self, length: int) -> None:
        """metrics.jsonl was cut back to the checkpoint the run resumes from: ``length`` bytes."""
        self.cut_at = length

    def start(self, step: int, log_path: Path) -> None:
        """Start each tracker: a new run, or (resuming) the one trackers.json names, then feed a late one what the
        checkpoint holds that it has not got (a kill between a checkpoint and its feed; a tracker added on resume)."""
        saved = (saved_json(self.path) or {}) if self.cut_at is not None else {}
        for tracker in self.trackers:
            mine = saved.get(tracker.name) or {}
            if tracker.live:
                tracker.start(None, step if self.cut_at is not None else None)
                continue
            if mine and mine.get("last_step", -1) > step:  # it got steps past this checkpoint: an older one resumed
                self.say(f"--report_to={tracker.name}: its run {mine.get('run_id')} holds steps past step {step}, "
                         "where this run resumes; they go into a new run, with the records up to the checkpoint")
                mine = {}
            run_id = tracker.start(mine.get("run_id"), step if mine else None)
            fed = min(mine.get("fed", 0), self.cut_at or 0)  # (a feed past the cut: what it got there was step's)
            self.state[tracker.name] = {"run_id": run_id, "fed": fed, "last_step": mine.get("last_step", -1)}
            if self.cut_at is not None:
                self._feed(tracker, log_path, self.cut_at)
            self.say(f"--report_to={tracker.name}: " + (f"continuing its run {run_id} from step {step}" if mine
                                                        else f"run {run_id}"))
        self.started = True
        self._save()

    def record(self, event: str, step: int, fields: dict) -> None:
        """A record just written to metrics.jsonl: to the live trackers."""
        scalars = tracker_scalars(event, fields)
        for tracker in self.trackers:
            if tracker.live and scalars and self.started:
                tracker.log(step, scalars, time.time())

    def committed(self, log_path: Path, length: int) -> None:
        """A checkpoint holds metrics.jsonl's first ``length`` bytes: they go to the trackers that wait for it."""
        if not self.started:
            return
        for tracker in self.trackers:
            if not tracker.live:
                self._feed(tracker, log_path, length)
        self._save()

    def finish(self, log_path: Path, length: int, complete: bool) -> None:
        """Close the trackers; when the run ended (``complete``) the records after its last checkpoint go first."""
        if not self.started:
            return
        self.started = False
        for tracker in self.trackers:
            if complete and not tracker.live:
                self._feed(tracker, log_path, length)
            tracker.finish(complete)
        self._save()

    def _feed(self, tracker, log_path: Path, length: int) -> None:
        """Send ``tracker`` the records of metrics.jsonl from where it was fed up to byte ``length``."""
        mine = self.state[tracker.name]
        if length <= mine["fed"]:
            return
        with open(log_path, "rb") as fh:
            fh.seek(mine["fed"])
            chunk = fh.read(length - mine["fed"])
        for line in chunk.splitlines():
            record = json.loads(line)
            fields = {k: v for k, v in record.items() if k not in NOT_SCALARS}
            scalars = tracker_scalars(record["event"], fields)
            if scalars:
                tracker.log(record["step"], scalars, record.get("time", 0.0))
                mine["last_step"] = max(mine["last_step"], record["step"])
        mine["fed"] = length

    def _save(self) -> None:
        if self.state:
            write_atomic(self.path, json.dumps(self.state, indent=1))
