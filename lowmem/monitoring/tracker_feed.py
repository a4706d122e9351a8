"""metrics.jsonl feeding the trackers of ``--report_to`` (``lowmem.monitoring.trackers``), so each gets the same (step,
value) series as the log, once per step, across kills and resumes.

A resume cuts metrics.jsonl back to its last checkpoint and trains the steps after it again. A live tracker
(TensorBoard) gets each record as it is written and hides, on resume, what came after the checkpoint. The others
cannot take back what they got: they get each record once the checkpoint after it is written (and the rest when
the run ends), read back from metrics.jsonl, so nothing they hold is ever cut back. OUTPUT_DIR/trackers.json keeps,
per tracker, its run's id (a resume continues that run), how far into metrics.jsonl it was fed, and the last step
it got.

A tracker whose library fails mid-run (its server down, its store unwritable) never stops training: one warning line
when it starts failing, and what it did not get is sent again from where it was at each checkpoint (and at the end),
or by a resume (trackers.json keeps how far it got); a line says when it answers again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lowmem.monitoring.metrics_log import tracker_scalars
from lowmem.monitoring.trackers import TRACKERS, check_report_to, requested
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import saved_json, write_atomic

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
        self.resume_steps: dict[str, int | None] = {}  # name -> the step its start continues from (None: a new run)
        self.opened: set[str] = set()  # the trackers whose start went through
        self.failing: dict[str, str] = {}  # name -> the error of its last call, while its library fails

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
                self.resume_steps[tracker.name] = step if self.cut_at is not None else None
                self._open(tracker)
                continue
            if mine and mine.get("last_step", -1) > step:  # it got steps past this checkpoint: an older one resumed
                self.say(f"--report_to={tracker.name}: its run {mine.get('run_id')} holds steps past step {step}, "
                         "where this run resumes; they go into a new run, with the records up to the checkpoint")
                mine = {}
            fed = min(mine.get("fed", 0), self.cut_at or 0)  # (a feed past the cut: what it got there was step's)
            self.state[tracker.name] = {"run_id": mine.get("run_id"), "fed": fed,
                                        "last_step": mine.get("last_step", -1)}
            self.resume_steps[tracker.name] = step if mine.get("run_id") else None
            if not self._open(tracker):
                continue  # (started again at the next checkpoint)
            if self.cut_at is not None:
                self._feed(tracker, log_path, self.cut_at)
            run_id = self.state[tracker.name]["run_id"]
            self.say(f"--report_to={tracker.name}: " + (f"continuing its run {run_id} from step {step}"
                                                        if self.resume_steps[tracker.name] is not None
                                                        else f"run {run_id}"))
        self.started = True
        self._save()

    def record(self, event: str, step: int, fields: dict) -> None:
        """A record just written to metrics.jsonl: to the live trackers."""
        scalars = tracker_scalars(event, fields)
        for tracker in self.trackers:
            if tracker.live and scalars and self.started and tracker.name in self.opened:
                self._call(tracker, "log", tracker.log, step, scalars, time.time())

    def committed(self, log_path: Path, length: int) -> None:
        """A checkpoint holds metrics.jsonl's first ``length`` bytes: they go to the trackers that wait for it."""
        if not self.started:
            return
        for tracker in self.trackers:
            if (tracker.name in self.opened or self._open(tracker)) and not tracker.live:
                self._feed(tracker, log_path, length)
        self._save()

    def finish(self, log_path: Path, length: int, complete: bool) -> None:
        """Close the trackers; when the run ended (``complete``) the records after its last checkpoint go first."""
        if not self.started:
            return
        self.started = False
        for tracker in self.trackers:
            if tracker.name not in self.opened and not (complete and self._open(tracker)):
                self._left_behind(tracker, complete)
                continue
            if complete and not tracker.live:
                self._feed(tracker, log_path, length)
            self._call(tracker, "finish", tracker.finish, complete)
            self._left_behind(tracker, complete)
        self._save()

    def _open(self, tracker) -> bool:
        """Start ``tracker`` (again, when it failed before): a new run, or the one trackers.json names. Whether it
        started."""
        mine = self.state.get(tracker.name, {})
        run_id = self._call(tracker, "start", tracker.start, mine.get("run_id"), self.resume_steps[tracker.name])
        if tracker.name in self.failing:
            return False
        self.opened.add(tracker.name)
        if not tracker.live:
            mine["run_id"] = run_id
        return True

    def _call(self, tracker, what: str, method, *args):
        """``method(*args)``, a call into the tracker's library; when it fails, one warning (the first failure since
        it last answered) and None: training goes on without it until the next checkpoint tries again."""
        try:
            result = method(*args)
        except UserError:  # (its package fails to import: a mistake to fix, not an outage)
            raise
        except Exception as err:  # a library and its server can fail in any way: none of them stops training
            first = (str(err).strip().splitlines() or [""])[0][:300]
            if tracker.name not in self.failing:
                later = ("records logged while it fails are lost" if tracker.live
                         else "what it did not get is sent again at each checkpoint, and by a resume")
                self.say(f"warning: --report_to={tracker.name}: its {what} failed ({type(err).__name__}: {first}); "
                         f"training goes on, {later}")
            self.failing[tracker.name] = f"{type(err).__name__}: {first}"
            return None
        if self.failing.pop(tracker.name, None) is not None:
            self.say(f"--report_to={tracker.name}: answering again")
        return result

    def _left_behind(self, tracker, complete: bool) -> None:
        """At the end: say what a tracker that still fails did not get."""
        if tracker.name in self.failing:
            got = -1 if tracker.live else self.state[tracker.name]["last_step"]
            has = "" if tracker.live else (f"; it has the records up to step {got}" if got >= 0 else
                                           "; it has no record of this run")
            self.say(f"warning: --report_to={tracker.name}: still failing at the end ({self.failing[tracker.name]})"
                     + has + ("" if complete or tracker.live else " (a resume sends it the rest)"))

    def _feed(self, tracker, log_path: Path, length: int) -> None:
        """Send ``tracker`` the records of metrics.jsonl from where it was fed up to byte ``length``."""
        mine = self.state[tracker.name]
        if length <= mine["fed"]:
            return
        with open(log_path, "rb") as fh:
            fh.seek(mine["fed"])
            chunk = fh.read(length - mine["fed"])
        for line in chunk.splitlines(keepends=True):
            record = json.loads(line)
            fields = {k: v for k, v in record.items() if k not in NOT_SCALARS}
            scalars = tracker_scalars(record["event"], fields)
            if scalars:
                self._call(tracker, "log", tracker.log, record["step"], scalars, record.get("time", 0.0))
                if tracker.name in self.failing:
                    return  # (the next feed starts at this record)
                mine["last_step"] = max(mine["last_step"], record["step"])
            mine["fed"] += len(line)  # record by record: a failure part way sends no record twice

    def _save(self) -> None:
        if self.state:
            write_atomic(self.path, json.dumps(self.state, indent=1))
