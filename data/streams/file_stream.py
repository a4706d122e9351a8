"""The training stream: files in a seeded order each epoch, rows through a bounded shuffle buffer.

Its whole position is a small ``state_dict()``: epoch, file, row within the file, the rows held in
the shuffle buffer and the buffer's RNG state. Restoring it continues the stream exactly where it
stopped (nothing lost, nothing repeated) without passing consumed rows through the tokenizer or
the model; the current file is re-opened at the saved row with one seek.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from data.sources.corpus import DataProblems, Example, iter_rows
from data.sources.readers import FileIndex, index_file
from lowmem.utils.errors import UserError

_ASTRAL = re.compile("[\U00010000-\U0010ffff]")  # a character Python stores in 4 bytes (and every other then)
_TWO_BYTES = re.compile("[\u0100-\uffff]")


@dataclass(frozen=True)
class StreamSpec:
    """What a training stream reads of each row, and how it shuffles the rows (``ExampleStream``,
    ``data.streams.dataset_stream.DatasetStream``).

    Args:
        columns: (prompt column, response column), or the one raw-text column.
        seed: seeds the per-epoch file order and the shuffle buffer.
        buffer_size: rows held for shuffling; 0 streams in order (one row held ahead). Bounds host RAM.
        buffer_bytes: the most text the shuffle buffer holds (0: no bound; ``through_buffer``).
    """

    columns: tuple[str, ...]
    seed: int = 0
    buffer_size: int = 0
    buffer_bytes: int = 0


class ExampleStream:
    """Resumable stream of ``Example`` over epochs.

    Args:
        files: data files, in their canonical (sorted) order.
        spec: the columns read, the seed and the shuffle buffer's bounds (``StreamSpec``).
        rank, world_size: this process's share: the rank-th of world_size contiguous row ranges of
            every file. Each row goes to exactly one process per epoch, shares differ by at most one
            row per file, and a process seeks to its range instead of reading the rows before it.
        indexes: ``index_file()`` of each file (computed here when not given; a launcher computes
            them once on the main process and hands them to every process).
        problems: counts the bad rows of the first epoch (later epochs read the same rows again).
    """

    def __init__(self, files: list[Path], spec: StreamSpec, rank: int = 0, world_size: int = 1,
                 indexes: list[FileIndex] | None = None, problems: DataProblems | None = None):
        self.files = list(files)
        self.spec = spec
        self.columns = spec.columns
        self.seed = spec.seed
        self.buffer_size, self.buffer_bytes = spec.buffer_size, spec.buffer_bytes
        self.rank, self.world_size = rank, world_size
        self.indexes = indexes if indexes is not None else [index_file(f) for f in self.files]
        self.total_rows = sum(i.rows for i in self.indexes)
        self.problems = problems if problems is not None else DataProblems()
        self.epoch = 0
        self.file_pos = 0  # index into this epoch's file order
        self.row_pos = 0  # next unread row of that file (0 = the start of this process's range)
        self.rows_read = 0  # rows of the first epoch read by this process, bad ones included
        self.buffer: list[Example] = []
        self.rng = random.Random(spec.seed)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "file_pos": self.file_pos, "row_pos": self.row_pos,
                "rows_read": self.rows_read,
                "buffer": [e.saved() for e in self.buffer],
                "rng": self.rng.getstate(), "problems": self.problems.state_dict(),
                "files": [str(f) for f in self.files], "rows": [i.rows for i in self.indexes]}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position; the files must be those it was taken on (same names and row counts).

        Raises:
            UserError: when files were added, removed or changed since: the saved position (a file
                and a row of this epoch's file order) would point elsewhere, repeating some rows
                and never reaching others.
        """
        changed = self._data_changes(state.get("files", []), state.get("rows"))  # none: a dataset's position
        if changed:
            raise UserError(f"the training data changed since the checkpoint ({changed}), so its position would "
                            "repeat some rows and skip others; restore the files to resume, or start a new run "
                            "(another --output_dir, or --overwrite_output_dir=True)")
        self.epoch, self.file_pos, self.row_pos = state["epoch"], state["file_pos"], state["row_pos"]
        self.rows_read = state["rows_read"]
        self.buffer = [Example(*e) for e in state["buffer"]]
        self.rng.setstate(state["rng"])
        self.problems.load_state_dict(state["problems"])

    def _data_changes(self, saved_files: list[str], saved_rows: list[int] | None) -> str:
        """What differs between the saved files and these ('' when nothing). Compared by name and
        row count, so a corpus moved to another folder still resumes."""
        names, saved = [f.name for f in self.files], [Path(f).name for f in saved_files]
        if names != saved:
            added, removed = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
            parts = ([f"added {', '.join(added[:3])}"] if added else []) + (
                [f"removed {', '.join(removed[:3])}"] if removed else [])
            return "; ".join(parts) or "the files' order changed"
        for path, index, rows in zip(self.files, self.indexes, saved_rows or []):
            if index.rows != rows:
                return f"{path} has {index.rows} training rows, had {rows}"
        return ""

    # --------------------------------------------------------------- iteration
    def file_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.files)))
        if self.buffer_size:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def share(self, file_index: int) -> tuple[int, int]:
        """This process's row range [start, end) of one file."""
        return share_range(self.indexes[file_index].rows, self.rank, self.world_size)

    def finished_epoch(self, epoch: int) -> bool:
        """Whether this process has handed out every row of ``epoch`` (known without reading on: a
        window that ends exactly at the end of the share leaves its generator unfinished)."""
        if self.epoch != epoch:
            return self.epoch > epoch
        if self.buffer:
            return False
        order = self.file_order(self.epoch)
        for n, index in enumerate(order[self.file_pos:]):
            start, end = self.share(index)
            if end > (max(self.row_pos, start) if n == 0 else start):
                return False
        return True

    def close_epoch(self, epoch: int) -> None:
        """Move a stream that ``finished_epoch(epoch)`` to the start of the next epoch (the generator
        of ``epoch`` is then dropped, not read on)."""
        if self.epoch == epoch:
            self.epoch, self.file_pos, self.row_pos = epoch + 1, 0, 0

    def _upstream(self) -> Iterator[Example]:
        """This process's rows of the current epoch from the saved position; advances file_pos / row_pos."""
        order = self.file_order(self.epoch)
        while self.file_pos < len(order):
            index = order[self.file_pos]
            start, end = self.share(index)
            problems = self.problems if self.epoch == 0 else None
            self.row_pos = max(self.row_pos, start)
            for item in iter_rows(self.files[index], index, self.columns, (self.row_pos, end), self.indexes[index],
                                  problems):
                self.row_pos += 1  # before yielding: the state then describes what remains
                self.rows_read += self.epoch == 0
                if item is not None:
                    yield item
            if self.row_pos < end:
                raise UserError(f"{self.files[index]} ended at row {self.row_pos} of the {self.indexes[index].rows} "
                                "it had when the run started: it changed during training; restore it and continue "
                                "with --is_keep_training=True")
            self.file_pos, self.row_pos = self.file_pos + 1, 0

    def iter_epoch(self) -> Iterator[Example]:
        """Yield the rest of the current epoch, then move the position to the next epoch.

        Whenever an example has been handed out, ``state_dict()`` describes exactly the stream that
        remains, so a checkpoint can be taken between any two examples.
        """
        yield from through_buffer(self._upstream(), self.buffer, self.rng, self.buffer_size, self.buffer_bytes)
        self.epoch, self.file_pos, self.row_pos = self.epoch + 1, 0, 0


def through_buffer(upstream: Iterator[Example], buffer: list[Example], rng: random.Random,
                   buffer_size: int, max_bytes: int = 0) -> Iterator[Example]:
    """``upstream``'s examples through a shuffle buffer of ``buffer_size`` rows, then the buffer drained.

    ``buffer`` and ``rng`` are the stream's own (its state holds them), changed in place before each
    example is handed out. Without shuffling (0) one row is still held: reading up to the next usable
    row (past any bad ones) before handing one out is how the epoch's end is known with its last
    usable row. ``max_bytes`` (0: none) also bounds the buffer's text: past it, rows drawn at random
    are handed out until it fits again (one row is always held), so long documents shuffle among fewer
    rows instead of holding ``buffer_size`` of them. Where it never binds, the order is the rows' bound's alone.
    """
    capacity = max(buffer_size, 1)
    held = sum(map(example_bytes, buffer))
    while True:
        # First: a buffer restored from a checkpoint taken inside this loop goes on as it would have
        while max_bytes and held > max_bytes and len(buffer) > 1:
            out = _pop_at_random(buffer, rng)
            held -= example_bytes(out)
            yield out
        example = next(upstream, None)
        if example is None:
            break
        held += example_bytes(example)
        if len(buffer) < capacity:
            buffer.append(example)
            continue
        slot = rng.randrange(capacity) if buffer_size else 0
        out, buffer[slot] = buffer[slot], example
        held -= example_bytes(out)
        yield out
    while buffer:  # drain at the end of the epoch
        yield _pop_at_random(buffer, rng) if buffer_size else buffer.pop()


def _pop_at_random(buffer: list[Example], rng: random.Random) -> Example:
    """Remove and return a row of ``buffer`` drawn with ``rng`` (the last row moved into its place)."""
    slot = rng.randrange(len(buffer))
    buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
    return buffer.pop()


def example_parts(example: Example) -> tuple:
    """The prompt and the response (and a preference pair's rejected answer); a raw-text row's one document (read
    as both) once."""
    parts = (example.prompt,) if example.response == example.prompt else (example.prompt, example.response)
    return parts if example.rejected is None else (*parts, example.rejected)


def example_bytes(example: Example) -> int:
    """What an example's ``example_parts`` cost the shuffle buffer, from their content alone. Not
    ``sys.getsizeof``: a list's spare capacity and a string's cached UTF-8 differ between a row as read and
    the same row restored from a checkpoint, and a resumed run would then shuffle otherwise."""
    return sum(_text_bytes(part) if isinstance(part, str) else 56 + 36 * len(part)  # token ids: int objects
               for part in example_parts(example))


def _text_bytes(text: str) -> int:
    """The larger of a string's size in Python (1, 2 or 4 bytes a character, by its widest: one emoji makes
    every character 4) and in UTF-8 (as files and a checkpoint's data position hold it)."""
    if text.isascii():
        return 49 + len(text)
    width = 4 if _ASTRAL.search(text) else 2 if _TWO_BYTES.search(text) else 1
    return 74 + max(width * len(text), len(text.encode("utf-8", "surrogatepass")))


def steps_per_epoch(rows: int, batch_size: int, accumulation: int) -> int:
    """Optimizer steps to take ``rows`` (the largest process share) in micro-batches of ``batch_size``."""
    return max(1, math.ceil(math.ceil(rows / batch_size) / accumulation))


def total_steps(cfg, rows: int) -> int:
    """A run's optimizer steps: ``--max_steps`` when set, else ``--epochs`` over ``rows`` (the largest
    process share)."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    return cfg.epochs * steps_per_epoch(rows, cfg.batch_size, cfg.gradient_accumulation_steps)


def largest_share(indexes: list[FileIndex], world_size: int) -> int:
    """The most rows any process reads in an epoch (``ExampleStream.share`` splits each file, so a
    process can hold up to one more row per file than another)."""
    return max(sum(end - start for start, end in (share_range(i.rows, rank, world_size) for i in indexes))
               for rank in range(world_size))


def share_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Process ``rank``'s contiguous row range [start, end) of a file of ``rows`` rows."""
    return rows * rank // world_size, rows * (rank + 1) // world_size


def batched(items, size: int, max_bytes: int = 0):
    """Group an iterable into lists of ``size`` (the last one may be shorter); with ``max_bytes``, of examples
    whose ``example_bytes`` stay within it (or one example alone): long rows are then grouped fewer at a time."""
    batch, held = [], 0
    for item in items:
        weight = example_bytes(item) if max_bytes else 0
        if batch and held + weight > max_bytes > 0:
            yield batch
            batch, held = [], 0
        batch.append(item)
        held += weight
        if len(batch) == size:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch
