"""Which micro-batches a run will train on: token lengths sampled from, or replayed through, its stream,
and the costliest of them (``peak_batch_lengths``).

The planner (``lowmem.memory.planner``) sizes activations from these lengths. Only lengths are kept (rows are
tokenized a chunk at a time): a replay of 10,000 rows holds a few hundred KB, however long its rows.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING

from config import TrainConfig
from lowmem.hardware.precision import PRECISIONS
from lowmem.memory.tensor_bytes import batch_cost

if TYPE_CHECKING:
    from data.collate import Padding

REPLAY_ROWS = 10_000  # runs reading at most this many rows have their stream replayed (seconds)
CHUNK_ROWS = 256  # rows tokenized at a time, and at most CHUNK_BYTES of them (long rows fewer at a time)
CHUNK_BYTES = 4 * 2**20


def sample_lengths(cfg: TrainConfig, data, rows: int = 2000) -> dict:
    """Token lengths of the first training rows (capped): the longest batch sets the activation peak.
    ``data``: the run's ``data.pipeline.TrainData``. Rows are tokenized ``CHUNK_ROWS`` at a time and only
    their lengths kept: RAM stays flat however long the rows."""
    from data.sources.corpus import iter_rows
    from data.streams.file_stream import batched, example_bytes, example_parts

    files, columns = data.files.train, data.files.columns
    items = (item for index, path in enumerate(files) for item in iter_rows(path, index, columns, (0, rows))
             if item is not None)
    s, t, held, text_bytes = [], [], [], []  # what each row costs the shuffle buffer; its text in the file
    packed = bool(data.objective.chunk_length)  # examples (the eval set's too) are packed chunks, not rows
    for chunk in batched(itertools.islice(items, rows), CHUNK_ROWS, CHUNK_BYTES):
        held += [example_bytes(item) for item in chunk]
        text_bytes += [sum(len(p.encode()) for p in example_parts(item) if isinstance(p, str)) for item in chunk]
        if not packed:
            s += [len(x) for x in data.collator.token_ids([item.prompt for item in chunk], cfg.max_source_len)]
            t += data.collator.answer_sides(chunk)[0]  # (a preference pair: both answers, its longer one twice)
    if not text_bytes:
        return {"max_source": cfg.max_source_len, "max_target": cfg.max_target_len, "mean_source": 0,
                "row_bytes": 0, "rows": 0, "pairs": [], "packed": packed}
    if packed:  # packed chunks: planned at their longest (span corruption's
        s, t = ([length] * len(text_bytes) for length in data.objective.longest)  # lengths are all the same)
    mean_text = sum(text_bytes) / len(text_bytes)
    return {"max_source": max(s), "max_target": max(t), "mean_source": sum(s) / len(s),
            "row_bytes": sum(held) / len(held), "rows": estimated_rows(files, mean_text, columns),
            "pairs": list(zip(s, t)), "packed": packed}


def eval_example_bytes(cfg: TrainConfig, lengths: dict) -> float:
    """What one example of the eval set holds: a row of text like the training rows', or for raw text a packed
    chunk's token ids (data.streams.file_stream.example_bytes), however long the documents it was cut from
    (``lengths["packed"]``, from ``sample_lengths``)."""
    if not lengths.get("packed"):
        return lengths["row_bytes"] * 2 + 400
    return 2 * 56 + 36 * (lengths["max_source"] + lengths["max_target"])


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
    from data.sources.hf_datasets import DatasetRef
    from data.sources.readers import file_kind, index_file

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
    from the start of the run, or None when the run reads more than ``REPLAY_ROWS`` rows."""
    window_rows = cfg.batch_size * cfg.gradient_accumulation_steps
    epochs = replay_epochs(cfg, data, window_rows)
    return None if epochs is None else windows_of(epochs, window_rows, cfg.max_steps)


def replay_epochs(cfg: TrainConfig, data, window_rows: int) -> list[list[tuple[int, int]]] | None:
    """The (source, target) token lengths of the rows this process reads in each epoch, in stream
    order, for windows of up to ``window_rows`` rows; None when that is more than ``REPLAY_ROWS`` rows.

    The training stream is deterministic (seeded file order and shuffle buffer, this process's share
    of each file), so the planner replays a fresh copy of it (``TrainData.fresh_stream``) instead of
    guessing: the costliest micro-batch is then known exactly. Only lengths are kept.
    """
    from data.streams.file_stream import batched

    share = math.ceil(data.rows / data.world)
    steps = cfg.max_steps if cfg.max_steps > 0 else math.inf
    epochs = cfg.epochs if cfg.max_steps <= 0 else math.inf
    if min(steps * window_rows, epochs * share) > REPLAY_ROWS:
        return None
    stream, collator = data.fresh_stream(), data.collator
    out, windows_left = [], steps
    while windows_left > 0 and stream.epoch < epochs:
        take = None if windows_left == math.inf else windows_left * window_rows
        lengths = []
        for rows in batched(itertools.islice(stream.iter_epoch(), take), CHUNK_ROWS, CHUNK_BYTES):  # lengths kept
            sources = collator.token_ids([e.prompt for e in rows], cfg.max_source_len)
            lengths += [(len(s), t) for s, t in zip(sources, collator.answer_sides(rows)[0])]
        if not lengths:  # an epoch without a usable row: the trainer stops there too
            break
        out.append(lengths)
        windows_left -= math.ceil(len(lengths) / window_rows)  # an epoch's last window may be short
    return out


def windows_of(epochs: list[list[tuple[int, int]]], window_rows: int, max_steps: int = -1) -> list:
    """The accumulation windows of ``window_rows`` rows the trainer cuts the replayed epochs into (an
    epoch's last one short), the first ``max_steps`` of them when that is positive."""
    from data.streams.file_stream import batched

    windows = [list(w) for rows in epochs for w in batched(rows, window_rows)]
    return windows[:max_steps] if max_steps > 0 else windows


def micro_batch_lengths(windows: list[list[tuple[int, int]]], batch_size: int, max_tokens: int = 0,
                        multiple: Padding = 1,
                        capacity: tuple[int, int] | None = None) -> list[tuple[int, int, int, int]]:
    """(longest source, longest target, target tokens, rows) of each micro-batch, grouped as the
    trainer's collator does (the LM head runs at the target tokens only: see ``logits_only_at``); with
    ``capacity`` (--packing: ``packing_capacity``) each window's examples packed into rows as the trainer packs
    them (``data.packing.packed_rows``)."""
    from data.collate import micro_batches
    from data.packing import packed_rows, row_sizes

    out = []
    for window in windows:
        if capacity is not None:
            window = row_sizes(window, packed_rows(window, capacity))
        for rows in micro_batches([s for s, _ in window], [t for _, t in window], batch_size, max_tokens, multiple):
            out.append((max(window[i][0] for i in rows), max(window[i][1] for i in rows),
                        sum(window[i][1] for i in rows), len(rows)))
    return out


def peak_batch_lengths(cfg: TrainConfig, dims: dict, lengths: dict, device: str, world: int) -> tuple[int, ...]:
    """Source and target lengths (and, when replayed, target tokens) of the costliest micro-batch the
    run is expected to meet.

    When the run's stream was replayed (``lengths["windows"]``, see ``replay_windows``), that
    is the costliest micro-batch it will train on. Otherwise a run that reads every row meets the
    longest source and the longest target (rows of similar length share a micro-batch, so both can
    meet in one), and a shorter run (``--max_steps``) reading n of the m sampled rows meets the
    median of the costliest of n draws: the row at rank ``m * 0.5 ** (1 / n)`` when the sample is
    sorted by the activation bytes a row costs.
    """
    cost = batch_cost(cfg, dims, device)
    if lengths.get("windows"):
        return max(micro_batch_lengths(lengths["windows"], cfg.batch_size, cfg.max_tokens_per_batch,
                                       padding_multiple(cfg, device), packing_capacity(cfg)), key=cost)
    if cfg.packing:  # packed rows: planned full (they are filled to within a few tokens of it)
        return token_budget_rows(cfg, packing_capacity(cfg))
    pairs = lengths["pairs"]
    share = lengths["rows"] / world  # the rows each process reads per epoch
    read = share * cfg.epochs
    if cfg.max_steps > 0:
        read = min(read, cfg.max_steps * cfg.batch_size * cfg.gradient_accumulation_steps)
    if not pairs or read >= share:
        return token_budget_rows(cfg, (lengths["max_source"], lengths["max_target"]))
    ranked = sorted(pairs, key=cost)
    rank = math.ceil(len(ranked) * 0.5 ** (1 / max(read, 1)))
    return token_budget_rows(cfg, ranked[min(max(rank, 1), len(ranked)) - 1])


def runner_up_lengths(cfg: TrainConfig, dims: dict, lengths: dict, device: str) -> tuple[int, ...] | None:
    """The second costliest micro-batch of a replayed run (None when not replayed, or only one).

    The heap the allocator keeps from earlier micro-batches sits beside the costliest one at the
    peak: it was shaped by the other batches. A long batch met once leaves less than a run of them.
    """
    if not lengths.get("windows"):
        return None
    batches = micro_batch_lengths(lengths["windows"], cfg.batch_size, cfg.max_tokens_per_batch,
                                  padding_multiple(cfg, device), packing_capacity(cfg))
    if len(batches) < 2:
        return None
    return sorted(batches, key=batch_cost(cfg, dims, device))[-2]


def padded_peak_batches(cfg: TrainConfig, dims: dict, lengths: dict, device: str,
                        world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The lengths of the costliest micro-batch and of the runner-up, padded as the trainer pads them."""
    from data.collate import round_up

    peak = peak_batch_lengths(cfg, dims, lengths, device, world)
    runner_up = runner_up_lengths(cfg, dims, lengths, device) or peak
    multiple = padding_multiple(cfg, device)
    if multiple != 1:  # the lengths padded as the trainer pads them (not the token and row counts)
        peak, runner_up = ((*(round_up(n, multiple) for n in batch[:2]), *batch[2:]) for batch in (peak, runner_up))
    return peak, runner_up


def token_budget_rows(cfg: TrainConfig, batch: tuple[int, int]) -> tuple[int, ...]:
    """With --max_tokens_per_batch, the micro-batch of rows at these lengths the budget lets in (as many
    as fit, within one window); without, the lengths as given (--batch_size rows)."""
    if not cfg.max_tokens_per_batch:
        return tuple(batch)
    rows = max(1, min(cfg.batch_size * cfg.gradient_accumulation_steps, cfg.max_tokens_per_batch // max(sum(batch), 1)))
    return batch[0], batch[1], rows * batch[1], rows


def packing_capacity(cfg: TrainConfig) -> tuple[int, int] | None:
    """The source and target tokens a packed row holds at most (--packing=True), else None."""
    return (cfg.max_source_len, cfg.max_target_len) if cfg.packing else None


def padding_multiple(cfg: TrainConfig, device: str) -> Padding:
    """What the trainer rounds training lengths up to (``data.collate.train_padding``)."""
    from data.collate import train_padding

    return train_padding(cfg, PRECISIONS[cfg.mixed_precision].shape_multiple(device == "cpu"))


def eval_pairs(cfg: TrainConfig, data) -> list[tuple[int, int]]:
    """(source, target) token lengths of the evaluation rows this process runs: every world-th of the
    eval examples (``take_examples``' first ``--max_eval_samples`` rows)."""
    return length_pairs(data.collator, data.eval_examples[data.rank::data.world], cfg.max_source_len)


def length_pairs(collator, examples: list, max_source_len: int) -> list[tuple[int, int]]:
    """(source, target) token lengths of ``examples`` as ``collator`` cuts them."""
    if not examples:
        return []
    return [(len(s), len(t)) for s, t in zip(collator.token_ids([e.prompt for e in examples], max_source_len),
                                             collator.targets(examples))]


def eval_batches(pairs: list[tuple[int, int]], batch_size: int) -> list[tuple[int, int, int, int]]:
    """(rows, longest source, longest target, target tokens) of each evaluation batch, grouped as
    ``lowmem.training.evaluation.evaluate_model`` groups them (``data.collate.by_source_length``)."""
    from data.collate import by_source_length

    out = []
    for rows in by_source_length([s for s, _ in pairs], batch_size):
        batch = [pairs[i] for i in rows]
        out.append((len(batch), max(s for s, _ in batch), max(t for _, t in batch), sum(t for _, t in batch)))
    return out


def eval_batch_lengths(cfg: TrainConfig, data) -> list[tuple[int, int, int, int]]:
    """``eval_batches`` of this process's evaluation rows in batches of ``--eval_batch_size``."""
    return eval_batches(eval_pairs(cfg, data), cfg.eval_batch_size)
