"""Which micro-batches a run will train on: token lengths sampled from, or replayed through, its stream.

The planner (``lowmem.planner``) sizes activations from these lengths. Only lengths are kept: a replay
of 10,000 rows holds a few hundred KB.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from config import TrainConfig

REPLAY_ROWS = 10_000  # runs reading at most this many rows have their stream replayed (seconds)


def sample_lengths(cfg: TrainConfig, data, rows: int = 2000) -> dict:
    """Token lengths of the first training rows (capped): the longest batch sets the activation peak.
    ``data``: the run's ``data.pipeline.TrainData``."""
    from data.readers import TOKEN_COLUMNS
    from data.sources import iter_rows

    files, columns = data.files.train, data.files.columns
    src, tgt, text_bytes = [], [], []
    for index, path in enumerate(files):
        for item in iter_rows(path, index, columns, 0, rows - len(src)):
            if item is not None:
                src.append(item.prompt)
                tgt.append(item.response)
                # held in the shuffle buffer as text, or as Python lists of ints (~36 bytes a token)
                text_bytes.append(36 * (len(item.prompt) + len(item.response)) if columns == TOKEN_COLUMNS
                                  else len(item.prompt.encode()) + len(item.response.encode()))
        if len(src) >= rows:
            break
    if not src:
        return {"max_source": cfg.max_source_len, "max_target": cfg.max_target_len, "mean_source": 0,
                "row_bytes": 0, "rows": 0, "pairs": []}
    if data.objective.chunk_length:  # packed chunks: planned at their longest (span corruption's
        s, t = ([length] * len(src) for length in data.objective.longest)  # lengths are all the same)
    else:
        s = [len(x) for x in data.collator.token_ids(src, cfg.max_source_len)]
        t = [len(x) for x in data.collator.token_ids(tgt, cfg.max_target_len)]
    mean_row = sum(text_bytes) / len(text_bytes)
    return {"max_source": max(s), "max_target": max(t), "mean_source": sum(s) / len(s),
            "row_bytes": mean_row, "rows": estimated_rows(files, mean_row, columns), "pairs": list(zip(s, t))}


def run_lengths(cfg: TrainConfig, data, replay: bool = True) -> dict:
    """Every length the plan of one process reads: the sampled rows, the replayed windows of its share
    (``replay``: a run from the start; a resumed one starts mid-stream) and its evaluation batches.
    ``train`` and ``plan`` both take them from here, given the ``data.pipeline.TrainData`` of that
    process, so the two predictions agree."""
    lengths = sample_lengths(cfg, data)
    if replay:
        lengths["windows"] = replay_windows(cfg, data)
    lengths["eval"] = eval_batch_lengths(cfg, data)
    return lengths


def estimated_rows(files: list[Path], mean_row_bytes: float, columns: tuple[str, str]) -> int:
    """Rows in ``files`` without reading them: parquet footers hold the count (their bytes are
    compressed); text files are estimated from their size, the sampled rows' mean text size and
    what each row adds around its text (JSON keys and quotes, CSV separators)."""
    from data.hf_datasets import DatasetRef
    from data.readers import file_kind, index_file

    rows = 0
    for path in files:
        if isinstance(path, DatasetRef):  # a dataset's metadata holds its count (0 when it does not)
            rows += index_file(path).rows
            continue
        kind = file_kind(Path(path))
        if kind == "parquet":
            import pyarrow.parquet as pq

            rows += pq.ParquetFile(path).metadata.num_rows
        else:
            framing = 4 if kind == "csv" else sum(len(c) for c in columns) + 16
            rows += int(Path(path).stat().st_size / max(mean_row_bytes + framing, 1))
    return rows


def replay_windows(cfg: TrainConfig, data) -> list[list[tuple[int, int]]] | None:
    """The (source, target) token lengths of every accumulation window this process will train on,
    from the start of the run, or None when the run reads more than ``REPLAY_ROWS`` rows.

    The training stream is deterministic (seeded file order and shuffle buffer, this process's share
    of each file), so the planner replays a fresh copy of it (``TrainData.fresh_stream``) instead of
    guessing: the costliest micro-batch is then known exactly. Only lengths are kept.
    """
    from data.stream import batched

    share = math.ceil(data.rows / data.world)
    steps = cfg.max_steps if cfg.max_steps > 0 else math.inf
    epochs = cfg.epochs if cfg.max_steps <= 0 else math.inf
    window_rows = cfg.batch_size * cfg.gradient_accumulation_steps
    if min(steps * window_rows, epochs * share) > REPLAY_ROWS:
        return None
    stream, collator = data.fresh_stream(), data.collator
    windows, pending = [], []  # pending: windows read but not tokenized yet (one tokenizer call per ~1k rows)

    def tokenize_pending() -> None:
        rows = [e for window in pending for e in window]
        if not rows:  # a corpus with no usable row: the trainer says so after planning
            return
        pairs = zip(collator.token_ids([e.prompt for e in rows], cfg.max_source_len), collator.targets(rows))
        for window in pending:
            windows.append([(len(s), len(t)) for s, t in itertools.islice(pairs, len(window))])
        pending.clear()

    read = 0  # windows read so far
    while read < steps and stream.epoch < epochs:
        before = read
        for window in batched(stream.iter_epoch(), window_rows):
            pending.append(window)
            read += 1
            if len(pending) * window_rows >= 1024:
                tokenize_pending()
            if read >= steps:
                break
        if read == before:  # an epoch without a usable row: the trainer stops there too
            break
    tokenize_pending()
    return windows


def micro_batch_lengths(windows: list[list[tuple[int, int]]], batch_size: int) -> list[tuple[int, int, int]]:
    """(longest source, longest target, target tokens) of each micro-batch, grouped as the trainer's
    collator does (the LM head runs at the target tokens only: see ``logits_only_at``)."""
    from data.collate import by_length

    out = []
    for window in windows:
        for rows in by_length([s + t for s, t in window], batch_size):
            out.append((max(window[i][0] for i in rows), max(window[i][1] for i in rows),
                        sum(window[i][1] for i in rows)))
    return out


def eval_batch_lengths(cfg: TrainConfig, data) -> list[tuple[int, int, int, int]]:
    """(rows, longest source, longest target, target tokens) of each evaluation batch this process runs:
    every world-th of the eval examples (``take_examples``' first ``--max_eval_samples`` rows), in
    batches of ``--eval_batch_size``, as ``lowmem.inference.evaluate`` takes them."""
    from data.stream import batched

    mine = data.eval_examples[data.rank::data.world]
    if not mine:
        return []
    collator = data.collator
    pairs = zip(collator.token_ids([e.prompt for e in mine], cfg.max_source_len), collator.targets(mine))
    out = []
    for batch in batched([(len(s), len(t)) for s, t in pairs], cfg.eval_batch_size):
        out.append((len(batch), max(s for s, _ in batch), max(t for _, t in batch), sum(t for _, t in batch)))
    return out
