"""Append-only logs: ``metrics.jsonl`` (one JSON object per line) and the consumed-examples log.

Both are written in binary append mode so their byte offsets are exact: a checkpoint records them and
a resume cuts each log back to that length, which makes the logs of a killed and resumed run equal
those of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lowmem.utils.ownership import open_own


class AppendLog:
    """A text log appended line by line and flushed after every write."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open_own(self.path, "ab")

    def write(self, text: str) -> None:
        self._fh.write(text.encode("utf-8"))
        self._fh.flush()

    def tell(self, sync: bool = False) -> int:
        """Current length in bytes; with ``sync`` the content is on disk first."""
        self._fh.flush()
        if sync:
            os.fsync(self._fh.fileno())
        return self._fh.tell()

    def truncate(self, size: int) -> None:
        """Cut the log back to ``size`` bytes (on resume: forget what came after the checkpoint). Never
        longer: a log found shorter (removed, or lost in a crash) is not padded with zero bytes."""
        self._fh.flush()
        self._fh.truncate(min(size, os.fstat(self._fh.fileno()).st_size))

    def close(self) -> None:
        self._fh.close()


class MetricsLog(AppendLog):
    """``metrics.jsonl``. Only the main process creates one."""

    @staticmethod
    def line(event: str, step: int, **fields) -> str:
        """One record as its line of the log."""
        record = {"event": event, "step": step, "time": round(time.time(), 3), **fields}
        return json.dumps(record, ensure_ascii=False) + "\n"

    def write(self, event: str, step: int, **fields) -> None:  # noqa: D102
        super().write(self.line(event, step, **fields))

    def write_line(self, line: str) -> None:
        """A record made earlier by ``line``."""
        super().write(line)


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics.jsonl file (used by tests and tools)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def train_line(step: int, total: int, record: dict) -> str:
    """The fixed-order training log line of a ``train`` record's fields (``loss``, ``lr``, ``tokens_per_s``,
    ``padding_pct``, ``rss_mb``; with --packing ``examples_per_row``, the examples a row holds after the padding;
    ``mfu``, the model FLOPs utilisation, docs/mfu.md, where counted)."""
    examples_per_row, mfu = record.get("examples_per_row", 1.0), record.get("mfu")
    packed = f" ({examples_per_row:.1f} examples/row)" if examples_per_row > 1 else ""
    utilisation = f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""
    preference = (f" | acc {record['reward_accuracy']:.3f} | margin {record['reward_margin']:.4f}"
                  if "reward_accuracy" in record else "")  # (a preference objective's rewards)
    return (f"step {step}/{total} | loss {record['loss']:.4f}{preference} | lr {record['lr']:.2e} | "
            f"tok/s {record['tokens_per_s']:,.0f}{utilisation} | pad {record['padding_pct']:.1f}%{packed} | "
            f"rss {record['rss_mb'] / 1024:.2f} GiB")


def tracker_scalars(event: str, fields: dict) -> dict:
    """The numbers of one metrics.jsonl record that ``--report_to`` sends to a tracker: every number of a
    ``train`` or ``eval`` record and the predicted / measured pairs of ``memory_peak`` (what ``plot``
    draws), named ``EVENT/FIELD``; empty for the other events."""
    if event not in ("train", "eval", "memory_peak"):
        return {}
    names = [n for n in fields if event != "memory_peak" or n.endswith("_peak_mb")]
    # bool is an int subclass: eval's "best" flag is not a scalar to chart
    return {f"{event}/{n}": fields[n] for n in names
            if isinstance(fields[n], (int, float)) and not isinstance(fields[n], bool)}
