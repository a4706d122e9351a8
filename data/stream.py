"""The training stream: files in a seeded order each epoch, rows through a bounded shuffle buffer.

Its whole position is a small ``state_dict()``: epoch, file, row within the file, the rows held in
the shuffle buffer and the buffer's RNG state. Restoring it continues the stream exactly where it
stopped (nothing lost, nothing repeated) without passing consumed rows through the tokenizer or
the model; the current file is re-opened and its consumed Arrow rows are skipped.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from data.sources import Example, iter_rows


class ExampleStream:
    """Resumable stream of ``Example`` over epochs.

    Args:
        files: data files, in their canonical (sorted) order.
        columns: (prompt column, response column).
        seed: seeds the per-epoch file order and the shuffle buffer.
        buffer_size: rows held for shuffling; 0 streams in file order. Bounds host RAM.
        rank, world_size: this process's share. When the file count divides by the number of
            processes each one reads whole files of its own; otherwise each reads every file and
            keeps every world_size-th row. Either way each row goes to exactly one process per epoch.
    """

    def __init__(self, files: list[Path], columns: tuple[str, str], seed: int, buffer_size: int,
                 rank: int = 0, world_size: int = 1):
        self.files = list(files)
        self.columns = columns
        self.seed = seed
        self.buffer_size = buffer_size
        self.rank, self.world_size = rank, world_size
        self.whole_files = len(self.files) % world_size == 0
        self.epoch = 0
        self.file_pos = 0  # index into this epoch's file order
        self.row_pos = 0  # next unread row of that file
        self.buffer: list[Example] = []
        self.rng = random.Random(seed)
        self.skipped: Counter = Counter()  # reason -> rows skipped, over the whole run

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "file_pos": self.file_pos, "row_pos": self.row_pos,
                "buffer": [(e.prompt, e.response, e.file_index, e.row) for e in self.buffer],
                "rng": self.rng.getstate(), "skipped": dict(self.skipped),
                "files": [str(f) for f in self.files]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.file_pos, self.row_pos = state["epoch"], state["file_pos"], state["row_pos"]
        self.buffer = [Example(*e) for e in state["buffer"]]
        self.rng.setstate(state["rng"])
        self.skipped = Counter(state["skipped"])

    # --------------------------------------------------------------- iteration
    def file_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.files)))
        if self.buffer_size:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _upstream(self) -> Iterator[Example]:
        """This process's rows of the current epoch from the saved position; advances file_pos / row_pos."""
        order = self.file_order(self.epoch)
        while self.file_pos < len(order):
            index = order[self.file_pos]
            mine = not self.whole_files or self.file_pos % self.world_size == self.rank
            if mine:
                for item in iter_rows(self.files[index], index, self.columns, self.row_pos, self.skipped):
                    self.row_pos += 1
                    if item is not None and (self.whole_files or item.row % self.world_size == self.rank):
                        yield item
            self.file_pos, self.row_pos = self.file_pos + 1, 0

    def iter_epoch(self) -> Iterator[Example]:
        """Yield the rest of the current epoch, then move the position to the next epoch.

        Whenever an example has been handed out, ``state_dict()`` describes exactly the stream that
        remains, so a checkpoint can be taken between any two examples.
        """
        for example in self._upstream():
            if len(self.buffer) < self.buffer_size:
                self.buffer.append(example)
                continue
            if not self.buffer_size:
                yield example
                continue
            slot = self.rng.randrange(self.buffer_size)
            out, self.buffer[slot] = self.buffer[slot], example
            yield out
        while self.buffer:  # drain at the end of the epoch
            slot = self.rng.randrange(len(self.buffer))
            self.buffer[slot], self.buffer[-1] = self.buffer[-1], self.buffer[slot]
            yield self.buffer.pop()
        self.epoch, self.file_pos, self.row_pos = self.epoch + 1, 0, 0


def take_examples(files: list[Path], columns: tuple[str, str], limit: int,
                  skipped: Counter | None = None) -> list[Example]:
    """The first ``limit`` usable examples of ``files`` in order (the eval set; bounded by ``limit``)."""
    out: list[Example] = []
    for index, path in enumerate(files):
        for item in iter_rows(path, index, columns, skipped=skipped):
            if item is not None:
                out.append(item)
                if len(out) >= limit:
                    return out
    return out


def batched(items, size: int):
    """Group an iterable into lists of ``size`` (the last one may be shorter)."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
