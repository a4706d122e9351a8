"""metrics.jsonl feeding the trackers, in-process: a tracker that cannot take back what it got gets each record once a
checkpoint keeps it, a resume continues its run where it was fed, and one that got steps past the checkpoint resumed
from gets a new run replaying the log. The tracker here is a real ``Tracker`` subclass: adding one is one class."""

from __future__ import annotations

import json

import pytest

from lowmem.monitoring.metrics_log import MetricsLog
from lowmem.monitoring.tracker_feed import TrackerFeed
from lowmem.monitoring.trackers import TRACKERS, Tracker

RUNS: dict[str, list] = {}  # run id -> [(step, values)] as the tracker got them


class MemoTracker(Tracker):
    """Keeps what it gets in ``RUNS``."""

    name, extra = "memo", "memo"

    @classmethod
    def modules(cls):
        return ("json",)

    def start(self, run_id, resume_step):
        self.run_id = run_id or f"run{len(RUNS)}"
        RUNS.setdefault(self.run_id, [])
        return self.run_id

    def log(self, step, values, when):
        RUNS[self.run_id].append((step, values))

    def finish(self, complete):
        RUNS[self.run_id].append(("finished", complete))


class FlakyTracker(MemoTracker):
    """A tracker whose server refuses connections while ``OUTAGE`` is set (as a stopped server's port does)."""

    name, extra = "flaky", "flaky"

    def start(self, run_id, resume_step):
        self.refuse()
        return super().start(run_id, resume_step)

    def log(self, step, values, when):
        self.refuse()
        super().log(step, values, when)

    def finish(self, complete):
        self.refuse()
        super().finish(complete)

    def refuse(self):
        if OUTAGE:
            raise ConnectionRefusedError(111, "Connection refused")


class FlakyLiveTracker(FlakyTracker):
    name, live = "flaky_live", True


OUTAGE: list = []  # non-empty: the flaky trackers' server is down


@pytest.fixture(autouse=True)
def fresh_runs():
    RUNS.clear()
    OUTAGE.clear()


def test_a_subclass_is_a_tracker_by_its_name():
    assert TRACKERS["memo"] is MemoTracker and list(TRACKERS)[:4] == ["tensorboard", "wandb", "mlflow", "trackio"]


def train(log: MetricsLog, feed: TrackerFeed, steps) -> None:
    for step in steps:
        log.write("train", step, loss=1.0 / step)
        feed.record("train", step, {"loss": 1.0 / step})


def checkpoint(log: MetricsLog, feed: TrackerFeed, step: int) -> tuple[int, str]:
    """What the checkpointer does: the offset, the checkpoint's record, then the feed."""
    offset, record = log.tell(), MetricsLog.line("checkpoint", step)
    log.write_line(record)
    feed.committed(log.path, log.tell())
    return offset, record


def resume(out, offset: int, record: str, step: int, name: str = "memo") -> tuple[MetricsLog, TrackerFeed]:
    log = MetricsLog(out / "metrics.jsonl")
    log.truncate(offset)
    log.write_line(record)
    feed = TrackerFeed(out, name, {})
    feed.cut_back(log.tell())
    feed.start(step, log.path)
    return log, feed


def test_a_tracker_gets_records_once_checkpointed_and_a_resume_continues_its_run(tmp_path):
    log, feed = MetricsLog(tmp_path / "metrics.jsonl"), TrackerFeed(tmp_path, "memo", {"seed": 1})
    feed.start(0, log.path)
    train(log, feed, [2, 4])
    assert RUNS == {"run0": []}  # nothing before a checkpoint keeps it
    offset, record = checkpoint(log, feed, 4)
    train(log, feed, [6])  # then killed: step 6 is trained again after the resume
    log.close()
    assert RUNS["run0"] == [(2, {"train/loss": 0.5}), (4, {"train/loss": 0.25})]
    log, feed = resume(tmp_path, offset, record, 4)
    train(log, feed, [6, 8])
    feed.finish(log.path, log.tell(), complete=True)
    assert [s for s, _ in RUNS["run0"]] == [2, 4, 6, 8, "finished"] and list(RUNS) == ["run0"]
    assert json.loads((tmp_path / "trackers.json").read_text())["memo"]["last_step"] == 8


def test_a_kill_between_a_checkpoint_and_its_feed_is_fed_on_resume(tmp_path):
    log, feed = MetricsLog(tmp_path / "metrics.jsonl"), TrackerFeed(tmp_path, "memo", {})
    feed.start(0, log.path)
    train(log, feed, [2])
    checkpoint(log, feed, 2)
    train(log, feed, [4])
    offset, record = log.tell(), MetricsLog.line("checkpoint", 4)
    log.write_line(record)  # killed before the feed
    log.close()
    log, feed = resume(tmp_path, offset, record, 4)
    assert [s for s, _ in RUNS["run0"]] == [2, 4]


def test_a_resume_from_an_older_checkpoint_replays_the_log_into_a_new_run(tmp_path):
    log, feed = MetricsLog(tmp_path / "metrics.jsonl"), TrackerFeed(tmp_path, "memo", {})
    feed.start(0, log.path)
    train(log, feed, [2])
    offset, record = checkpoint(log, feed, 2)
    train(log, feed, [4])
    checkpoint(log, feed, 4)
    feed.finish(log.path, log.tell(), complete=True)
    log.close()
    log, feed = resume(tmp_path, offset, record, 2)  # --resume_from the step-2 checkpoint
    train(log, feed, [4])
    feed.finish(log.path, log.tell(), complete=True)
    assert [s for s, _ in RUNS["run0"]] == [2, 4, "finished"]  # the old run as it was
    assert [s for s, _ in RUNS["run1"]] == [2, 4, "finished"]  # the log up to step 2, then the continuation


def warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("warning: ")]


def test_a_tracker_down_mid_run_gets_every_record_once_when_it_answers_again(tmp_path):
    said: list[str] = []
    log, feed = MetricsLog(tmp_path / "metrics.jsonl"), TrackerFeed(tmp_path, "flaky", {}, say=said.append)
    feed.start(0, log.path)
    train(log, feed, [2])
    checkpoint(log, feed, 2)
    OUTAGE.append(True)
    for step in (4, 6):  # two checkpoints while it is down: training goes on, one warning
        train(log, feed, [step])
        checkpoint(log, feed, step)
    assert warnings(said) == ["warning: --report_to=flaky: its log failed (ConnectionRefusedError: [Errno 111] "
                              "Connection refused); training goes on, what it did not get is sent again at each "
                              "checkpoint, and by a resume"]
    assert json.loads((tmp_path / "trackers.json").read_text())["flaky"]["last_step"] == 2
    OUTAGE.clear()
    train(log, feed, [8])
    checkpoint(log, feed, 8)
    feed.finish(log.path, log.tell(), complete=True)
    assert [s for s, _ in RUNS["run0"]] == [2, 4, 6, 8, "finished"] and list(RUNS) == ["run0"]
    assert "--report_to=flaky: answering again" in said and len(warnings(said)) == 1


def test_a_tracker_down_at_the_start_and_at_the_stop_is_fed_by_the_resume(tmp_path):
    said: list[str] = []
    OUTAGE.append(True)
    log, feed = MetricsLog(tmp_path / "metrics.jsonl"), TrackerFeed(tmp_path, "flaky", {}, say=said.append)
    feed.start(0, log.path)  # its start fails: training goes on
    train(log, feed, [2])
    offset, record = checkpoint(log, feed, 2)
    train(log, feed, [4])
    feed.finish(log.path, log.tell(), complete=False)  # stopped (to be resumed) while it is still down
    log.close()
    assert RUNS == {} and len(warnings(said)) == 2, said
    assert said[-1] == ("warning: --report_to=flaky: still failing at the end (ConnectionRefusedError: [Errno 111] "
                        "Connection refused); it has no record of this run (a resume sends it the rest)")
    assert json.loads((tmp_path / "trackers.json").read_text())["flaky"] == {"run_id": None, "fed": 0, "last_step": -1}
    OUTAGE.clear()
    log, feed = resume(tmp_path, offset, record, 2, "flaky")
    train(log, feed, [4, 6])
    feed.finish(log.path, log.tell(), complete=True)
    assert [s for s, _ in RUNS["run0"]] == [2, 4, 6, "finished"] and list(RUNS) == ["run0"]


def test_a_live_tracker_that_fails_never_stops_training(tmp_path):
    said: list[str] = []
    log, feed = MetricsLog(tmp_path / "metrics.jsonl"), TrackerFeed(tmp_path, "flaky_live", {}, say=said.append)
    feed.start(0, log.path)
    train(log, feed, [2])
    OUTAGE.append(True)
    train(log, feed, [4, 6])
    checkpoint(log, feed, 6)
    OUTAGE.clear()
    train(log, feed, [8])
    feed.finish(log.path, log.tell(), complete=True)
    assert [s for s, _ in RUNS["run0"]] == [2, 8, "finished"]  # (what it missed while failing is lost: it is live)
    assert len(warnings(said)) == 1 and "records logged while it fails are lost" in warnings(said)[0]
