"""The training stream of a Hugging Face dataset (``data.sources.hf_datasets``): the stream
``data.streams.file_stream.ExampleStream`` is for files, with the same interface, so the trainer, ``PackedStream`` and
the planner take either.

This process's rows come from ``datasets``' own ``IterableDataset`` (split between processes by
``split_dataset_by_node``: ``data.sources.hf_datasets.process_share``) and go through our bounded shuffle buffer, as
rows of files do. ``datasets``' own ``shuffle`` is not used: its buffer is not part of its ``state_dict()``,
so a resumed run would lose the rows it held. The position is the dataset's ``state_dict()`` after the last
row read plus the rows in our buffer and the buffer's RNG state: a resumed run continues exactly (nothing
lost, nothing repeated), the dataset seeking to its position (a save_to_disk dataset jumps to it; a streamed
one reopens the shard it was in and skips to the row).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from data.sources.corpus import DataProblems, Example
from data.sources.hf_datasets import DatasetRef, process_share, row_count, split_name
from data.sources.readers import row_problem
from data.streams.file_stream import StreamSpec, through_buffer
from lowmem.utils.errors import UserError

UNKNOWN_ROWS_FLOOR = 1000  # --max_bad_rows_fraction of an unknown row count: of the rows read, at least this many


class DatasetStream:
    """Resumable stream of ``Example`` over epochs from a dataset (see the module's docstring).

    Args:
        source: the dataset (``DatasetRef``; its split is the training split).
        spec: the columns read, the seed of the shuffle buffer and its bounds (``StreamSpec``; a buffer of 0 rows
            streams in the dataset's order, one row held ahead).
        rank, world_size: this process's disjoint share (``process_share``).
        skip: rows at the start of the split that are not trained on (the eval set held out there).
        problems: counts the bad rows of the first epoch (later epochs read the same rows again).
    """

    def __init__(self, source: DatasetRef, spec: StreamSpec, rank: int = 0, world_size: int = 1, skip: int = 0,
                 problems: DataProblems | None = None):
        self.source = source
        self.files = [source]  # the run's one "file": the consumed log and the preview name it
        self.spec = spec
        self.columns = tuple(spec.columns)
        self.buffer_size, self.buffer_bytes = spec.buffer_size, spec.buffer_bytes
        self.rank, self.world_size = rank, world_size
        self.skip = skip
        self.share_of = process_share(source, skip, rank, world_size)
        total = row_count(source)
        self.known_rows = None if total is None else max(total - skip, 0)  # training rows of all processes
        self.problems = problems if problems is not None else DataProblems()
        self.epoch = 0
        self.position = 0  # rows of this epoch this process has read from the dataset, bad ones included
        self.exhausted = False  # this epoch's rows have all been read from the dataset (some may be buffered)
        self.dataset_state: dict | None = None  # the dataset's state_dict() after the last row read
        self.rows_read = 0  # rows of the first epoch read by this process, bad ones included
        self.buffer: list[Example] = []
        self.rng = random.Random(spec.seed)

    @property
    def total_rows(self) -> int:
        """Training rows of all processes; when the dataset does not say, an estimate from the rows read so
        far (at least ``UNKNOWN_ROWS_FLOOR``), which --max_bad_rows_fraction is taken of."""
        if self.known_rows is not None:
            return self.known_rows
        return max(self.rows_read * self.world_size, UNKNOWN_ROWS_FLOOR)

    @property
    def share_rows(self) -> int | None:
        """Rows this process reads per epoch (None: unknown)."""
        return self.share_of.rows

    # ------------------------------------------------------------------ state
    def fingerprint(self) -> dict:
        """What the saved position is a position in (a dataset moved to another folder still matches)."""
        name = Path(self.source.spec).name if self.source.kind != "hub" else self.source.spec
        return {"dataset": name, "config": self.source.config, "split": split_name(self.source),
                "skip": self.skip, "rows": self.known_rows, "world_size": self.world_size,
                "strategy": self.share_of.strategy}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "exhausted": self.exhausted,
                "dataset": self.dataset_state, "rows_read": self.rows_read,
                "buffer": [e.saved() for e in self.buffer],
                "rng": self.rng.getstate(), "problems": self.problems.state_dict(), "source": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position taken on the same dataset (same name, configuration, split and rows).

        Raises:
            UserError: the checkpoint's position is one in other data (or in a file-based run).
        """
        saved, now = state.get("source"), self.fingerprint()
        if saved != now:
            changed = (", ".join(f"{key} {saved.get(key)!r} -> {now[key]!r}" for key in now
                                 if saved.get(key) != now[key]) if saved else "it read files, not a dataset")
            raise UserError(f"the training data changed since the checkpoint ({changed}), so its position would "
                            "repeat some rows and skip others; restore the data to resume, or start a new run "
                            "(another --output_dir, or --overwrite_output_dir=True)")
        self.epoch, self.position, self.exhausted = state["epoch"], state["position"], state["exhausted"]
        self.dataset_state, self.rows_read = state["dataset"], state["rows_read"]
        self.buffer = [Example(*e) for e in state["buffer"]]
        self.rng.setstate(state["rng"])
        self.problems.load_state_dict(state["problems"])

    # --------------------------------------------------------------- iteration
    def share(self, file_index: int = 0) -> tuple[int, int]:
        """This process's rows [start, end) of the split, where they are contiguous.

        Raises:
            UserError: they are not (one row in world_size, or whole shards of a streamed dataset).
        """
        if self.share_of.span is None:
            raise UserError(f"{self.source.flag}={self.source.spec}: this process's rows are not one range of the "
                            f"dataset (split '{self.share_of.strategy}'), which this feature needs")
        return self.share_of.span

    def finished_epoch(self, epoch: int) -> bool:
        """Whether this process has handed out every row of ``epoch`` (the dataset's end is known once
        read: the buffer holds at least one row until then)."""
        if self.epoch != epoch:
            return self.epoch > epoch
        return self.exhausted and not self.buffer

    def close_epoch(self, epoch: int) -> None:
        """Move a stream that ``finished_epoch(epoch)`` to the start of the next epoch."""
        if self.epoch == epoch:
            self.epoch, self.position, self.exhausted, self.dataset_state = epoch + 1, 0, False, None

    def _upstream(self) -> Iterator[Example]:
        """This process's rows of the current epoch from the saved position."""
        if self.exhausted:
            return
        dataset = self.share_of.open()
        if self.dataset_state is not None:
            dataset.load_state_dict(self.dataset_state)
        problems = self.problems if self.epoch == 0 else None
        for record in dataset:
            row = self.share_of.row_of(self.position)
            self.position += 1  # before yielding: the state then describes what remains
            self.rows_read += self.epoch == 0
            self.dataset_state = dataset.state_dict()
            problem = row_problem(record, self.columns)
            if problem:
                if problems is not None:
                    problems.add(self.source, "dataset", row, *problem)
                continue
            yield Example.of(record, self.columns, 0, row)
        self.exhausted = True

    def iter_epoch(self) -> Iterator[Example]:
        """Yield the rest of the current epoch, then move the position to the next epoch.

        Whenever an example has been handed out, ``state_dict()`` describes exactly the stream that
        remains, so a checkpoint can be taken between any two examples.
        """
        epoch = self.epoch
        yield from through_buffer(self._upstream(), self.buffer, self.rng, self.buffer_size, self.buffer_bytes)
        self.close_epoch(epoch)
