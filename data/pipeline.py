"""The one entry point from files to what training reads.

    files = check_data(cfg, objective)             # resolve and check: before anything heavy is built
    data = build_data(cfg, files, tokenizer, DataProcess(rank, world))

``check_data`` resolves ``--train_file`` / ``--eval_file`` and checks their columns; ``build_data``
indexes the training files (or takes the indexes the main process read), splits off the eval set,
and opens this process's stream and the objective's collator. A Hugging Face dataset as
``--train_file`` (``data.sources.hf_datasets``) is the run's one "file", read by a ``DatasetStream`` (the
interface of ``ExampleStream``) instead. The trainer and the planner both take
their data from here: the planner replays ``TrainData.fresh_stream()`` instead of rebuilding the
pipeline.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from config import TrainConfig
from data.prepare import check_manifest
from data.sources.corpus import DataProblems, Example, check_columns, resolve_files
from data.sources.eval_set import eval_files_of, eval_source, eval_split
from data.sources.hf_datasets import DatasetRef, dataset_of, describe, has_rows
from data.sources.readers import FileIndex, index_file, manifest_of
from data.sources.text_files import layout_note
from data.streams.dataset_stream import DatasetStream
from data.streams.file_stream import (
    ExampleStream,
    StreamSpec,
    batched,
    largest_share,
    share_range,
    steps_per_epoch,
    total_steps,
)
from data.streams.packed_text import text_slices
from data.tokenization import tokenizer_fingerprint
from lowmem.utils.errors import UserError

SAMPLE_DOCUMENTS = 512  # documents tokenized to count (small corpora) or estimate an epoch's packed chunks


@dataclass
class DataFiles:
    """The run's files, resolved and checked (no row read beyond the column check's sample)."""

    train: list[Path]
    eval: list[Path]  # empty: the eval set is held out of ``train``
    prepared: dict | None  # the manifest when ``train`` are the shards of a prepared corpus
    columns: tuple[str, str]  # what the training stream reads (token-id columns for prepared shards)
    objective: object  # what they were checked for (its formats and columns): ``build_data`` opens its stream

    @property
    def dataset(self) -> DatasetRef | None:
        """The Hugging Face dataset ``train`` names (its one entry), or None for files."""
        return dataset_of(self.train)


def check_data(cfg: TrainConfig, objective, eval_set: bool = True) -> DataFiles:
    """Resolve and check the data flags (``eval_set``: the eval set's too); ``UserError`` names what to change."""
    train = resolve_files(cfg.train_file, "--train_file", cfg.output_dir, objective.formats, cfg.dataset_config)
    if dataset_of(train) is not None:
        _check_dataset(cfg, dataset_of(train))
    elif cfg.dataset_config is not None:
        raise UserError(f"--dataset_config={cfg.dataset_config} names a configuration of a hub dataset, but "
                        f"--train_file={cfg.train_file} is files; leave --dataset_config out")
    prepared = manifest_of(train)  # a corpus tokenized by `prepare`: token-id columns
    if prepared and not objective.prepared_data:
        raise UserError(f"--train_file holds prepared shards (prompt/response token ids); --objective={objective.name} "
                        "reads raw text: pass the text corpus")
    columns = objective.columns(prepared)
    check_columns(train, columns, "--train_file")
    return DataFiles(train, eval_files_of(cfg, train) if eval_set else [], prepared, columns, objective)


def _check_dataset(cfg: TrainConfig, source: DatasetRef) -> None:
    """What a dataset --train_file needs that files do not (checked before anything heavy is built)."""
    if cfg.encoder_cache != "off":
        raise UserError(f"--encoder_cache reads rows of files by position; --train_file={cfg.train_file} is a "
                        "dataset: leave --encoder_cache off")
    if not has_rows(source):
        raise UserError(f"--train_file={cfg.train_file} is empty ({describe(source)} has no rows)")


@dataclass
class TrainData:
    """What a run reads: this process's stream, the eval set, the collator, and the counts the
    schedule and the planner need."""

    files: DataFiles
    objective: object
    collator: object  # the objective's: examples -> micro-batches
    indexes: list[FileIndex]  # the training rows of each file (the held-out eval rows left out)
    eval_examples: list[Example]
    held_out_rows: int  # rows of --train_file held out as the eval set (0 with --eval_file)
    eval_problems: DataProblems
    stream: ExampleStream  # this process's share from the start (the objective's: packed chunks for raw text)
    rank: int
    world: int
    cfg: TrainConfig
    epoch_rows_known: bool = True  # False: a dataset that cannot say how many rows a process reads per epoch
    # training's own collator where it differs from ``collator`` (the eval set's and the planner's): one that reads
    # the cached reference's log-probabilities of the training rows (lowmem.training.reference)
    train_collator: object | None = None

    @property
    def rows(self) -> int:
        """Training rows (0 for a dataset that does not say how many it has)."""
        return sum(i.rows for i in self.indexes)

    @property
    def source(self) -> str:
        """What the training rows come from, for the log: the files, or the dataset."""
        if self.files.dataset is None:
            return f"{len(self.files.train)} file(s)"
        return describe(self.files.dataset) + ("" if self.epoch_rows_known else " (its row count unknown)")

    @property
    def eval_source(self) -> str:
        """Where the eval set comes from, for the log."""
        return eval_source(self.cfg, self.files.train, self.held_out_rows)

    def epoch_windows(self, epoch: int, size: int):
        """This process's accumulation windows of ``size`` examples for the run's epoch ``epoch`` (the one
        every process is in). A process whose share ran out before the others' is at the next epoch already:
        until all agree the epoch is over it has nothing more (it was checkpointed so, or is resuming)."""
        if self.stream.epoch > epoch:
            return iter(())
        return batched(self.stream.iter_epoch(), size)

    def steps(self, cfg: TrainConfig) -> tuple[int, int]:
        """(optimizer steps per epoch, total steps). The process with the most rows (or packed chunks)
        sets an epoch's steps: the others step with it on empty windows. Packed text with --max_steps:
        (0, max_steps), the epoch's chunks not counted."""
        if not self.epoch_rows_known and cfg.max_steps <= 0:
            raise UserError(f"--train_file={cfg.train_file}: {self.source} does not say how many rows each of the "
                            f"{self.world} process(es) reads, so an epoch's steps are unknown: set --max_steps (the "
                            "learning-rate schedule is made for a number of steps)")
        batch, accumulation = cfg.batch_size, cfg.gradient_accumulation_steps
        if not self.objective.chunk_length:
            share = largest_share(self.indexes, self.world)
            return steps_per_epoch(share, batch, accumulation), total_steps(cfg, share)
        if cfg.max_steps > 0:  # no epoch count needed: the sample of documents is not tokenized (the log omits it)
            return 0, cfg.max_steps
        # Packed text: the tokens left at an epoch's end (fewer than a chunk) start the next epoch's first
        # chunk, so epoch k of a process with T tokens per epoch holds floor(kT/L) - floor((k-1)T/L) chunks.
        tokens, length = self.epoch_tokens[0], self.objective.chunk_length
        chunks = [max(int(k * t // length) - int((k - 1) * t // length) for t in tokens)
                  for k in range(1, cfg.epochs + 1)]
        per_epoch = steps_per_epoch(max(int(t // length) for t in tokens), batch, accumulation)
        planned = sum(steps_per_epoch(n, batch, accumulation) for n in chunks)
        return per_epoch, cfg.max_steps if cfg.max_steps > 0 else planned

    @functools.cached_property
    def epoch_tokens(self) -> tuple[list[float], str]:
        """(tokens each process packs in an epoch, EOS included; how that is known) for an objective packing
        raw text. Counted when the first ``SAMPLE_DOCUMENTS`` documents are the whole corpus, else estimated
        from their tokens per row: a document's tokens are known only once its text is tokenized, and the
        learning-rate schedule is made for a number of steps."""
        documents = _documents(self.cfg, self.files, self.indexes, self.held_out_rows)  # the whole corpus
        counts = self._document_tokens(documents, SAMPLE_DOCUMENTS)
        world = self.world
        if documents.finished_epoch(0) and self.files.dataset is None:
            return [sum(n for (f, row), n in counts.items()
                        if share_range(self.indexes[f].rows, rank, world)[0] <= row
                        < share_range(self.indexes[f].rows, rank, world)[1]) for rank in range(world)], "counted"
        if self.files.dataset is not None:
            sampled = documents.rows_read - len(documents.buffer)  # bad rows count too; the row read ahead does not
            return [sum(counts.values()) / max(sampled, 1) * -(-self.rows // world)] * world, \
                f"estimated from the first {sampled:,} documents"
        # Files: each file's own tokens per row, from its first rows (files of short and of long documents
        # differ several-fold; the corpus's first documents come from one or two of them).
        sampled, per_row = 0, []
        for path, index in zip(self.files.train, self.indexes):
            first = ExampleStream([path], StreamSpec(self.files.columns), indexes=[index])
            tokens = sum(self._document_tokens(first, max(1, SAMPLE_DOCUMENTS // len(self.files.train))).values())
            per_row.append(tokens / max(first.rows_read - len(first.buffer), 1))
            sampled += first.rows_read - len(first.buffer)
        return [sum(rate * (share_range(index.rows, rank, world)[1] - share_range(index.rows, rank, world)[0])
                    for rate, index in zip(per_row, self.indexes)) for rank in range(world)], \
            f"estimated from {sampled:,} documents, the first of each file"

    def _document_tokens(self, documents, limit: int) -> dict:
        """(file index, row) -> the tokens (and EOS) the packer reads of each of the first ``limit`` documents."""
        counts = {}
        for document in itertools.islice(documents.iter_epoch(), limit):
            pieces = text_slices(document.prompt)  # a long document a slice at a time, as the packer reads it
            counts[document.file_index, document.row] = 1 + sum(
                len(self.collator.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in pieces)
        return counts

    def fresh_stream(self, rank: int | None = None) -> ExampleStream:
        """A new stream of process ``rank`` (default: this one) from the start of the run: the planner
        replays it to find the costliest micro-batch."""
        rank = self.rank if rank is None else rank
        cfg = self.cfg
        documents = _documents(cfg, self.files, self.indexes, self.held_out_rows, (rank, self.world))
        return self.objective.stream(documents, self.collator.tokenizer)


@dataclass(frozen=True)
class DataProcess:
    """The process ``build_data`` opens the data for: process ``rank`` of ``world``, and where its notes go.

    Args:
        indexes: the training files' ``index_file()``, read once by a launcher's main process and
            handed to all; read by ``build_data`` when None.
        report, warn: where the eval set's bad rows (and the notes on the files) are reported (main process)
            and the training stream's (every process).
    """

    rank: int = 0
    world: int = 1
    indexes: list[FileIndex] | None = None
    report: Callable[[str], None] = print
    warn: Callable[[str], None] = print


def build_data(cfg: TrainConfig, files: DataFiles, tokenizer, process: DataProcess = DataProcess(),
               pad_multiple: int = 1, eval_set: bool = True) -> TrainData:
    """Open the run's data, checked by ``check_data`` for its objective, for ``process``.

    Args:
        pad_multiple: what the collator rounds lengths up to (``data.collate.Padding``).
        eval_set: False: no eval set, none held out (the training stream alone: ``preview`` of prepared shards).
    """
    objective, report, indexes = files.objective, process.report, process.indexes
    if files.prepared:
        check_manifest(files.prepared, tokenizer_fingerprint(tokenizer), cfg.max_source_len, cfg.max_target_len)
    eval_problems = DataProblems(report=report)
    eval_examples, held = [], 0
    if eval_set:
        eval_examples, indexes, held = eval_split(cfg, files.eval, files.train, indexes, eval_problems)
    if indexes is None:  # an --eval_file run indexes its training files here
        indexes = [index_file(f) for f in files.train]
    for path, index in zip(files.train, indexes):
        if not index.rows and files.dataset is None:
            report(f"warning: {path} has no training rows" + (" (empty, or every row held out as the eval set)"
                                                              if held else " (empty)"))
        elif index.kind.startswith("txt"):
            report(layout_note(path, index.kind))
    documents = _documents(cfg, files, indexes, held, (process.rank, process.world), DataProblems(report=process.warn))
    if isinstance(documents, DatasetStream):
        report(_dataset_note(cfg, documents))
    eval_examples = objective.eval_examples(eval_examples, tokenizer, cfg.max_eval_samples)
    return TrainData(files, objective, objective.collator(tokenizer, pad_multiple), indexes, eval_examples, held,
                     eval_problems, objective.stream(documents, tokenizer), process.rank, process.world, cfg,
                     not isinstance(documents, DatasetStream) or documents.share_rows is not None)


def _documents(cfg: TrainConfig, files: DataFiles, indexes: list[FileIndex], held: int,
               share: tuple[int, int] = (0, 1), problems: DataProblems | None = None):
    """The stream of training rows of process ``rank`` of ``world`` (``share``; default: the whole corpus): of the
    files, or of the dataset (its first ``held`` rows, the eval set, left out)."""
    rank, world = share
    spec = StreamSpec(files.columns, cfg.seed, cfg.shuffle_buffer_size, cfg.shuffle_buffer_mb * 2**20)
    if files.dataset is not None:
        return DatasetStream(files.dataset, spec, rank, world, held, problems)
    return ExampleStream(files.train, spec, rank=rank, world_size=world, indexes=indexes, problems=problems)


def _dataset_note(cfg: TrainConfig, documents: DatasetStream) -> str:
    """The log line on how a dataset is read."""
    split = {"shards": f"whole shards per process, of {documents.world_size}",
             "examples": f"one row in {documents.world_size} per process"}[documents.share_of.strategy]
    return (f"training rows from {describe(documents.source)}, streamed through datasets.IterableDataset"
            + (f" ({split})" if documents.world_size > 1 else "") + f", shuffle buffer {cfg.shuffle_buffer_size}")
