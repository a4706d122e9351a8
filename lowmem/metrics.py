"""``metrics.jsonl`` (one JSON object per line, appended, flushed each line) and the log line."""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsLog:
    """Append-only JSON-lines log. Only the main process should create one."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, event: str, step: int, **fields) -> dict:
        record = {"event": event, "step": step, "time": round(time.time(), 3), **fields}
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()
        return record

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics.jsonl file (used by tests and tools)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def train_line(step: int, total: int, loss: float, lr: float, tokens_per_s: float, rss_mb: float) -> str:
    """The fixed-order training log line."""
    return (f"step {step}/{total} | loss {loss:.4f} | lr {lr:.2e} | tok/s {tokens_per_s:,.0f} | "
            f"rss {rss_mb / 1024:.2f} GiB")
