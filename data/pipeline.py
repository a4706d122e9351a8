"""The one entry point from files to what training reads.

    files = check_data(cfg, objective)             # resolve and check: before anything heavy is built
    data = build_data(cfg, files, tokenizer, rank, world)

``check_data`` resolves ``--train_file`` / ``--eval_file`` and checks their columns; ``build_data``
indexes the training files (or takes the indexes the main process read), splits off the eval set,
and opens this process's stream and the objective's collator. The trainer and the planner both take
their data from here: the planner replays ``TrainData.fresh_stream()`` instead of rebuilding the
pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from config import TrainConfig, UserError
from data.eval_set import eval_files_of, eval_split
from data.prepare import check_manifest
from data.readers import FileIndex, index_file, manifest_of
from data.sources import DataProblems, Example, check_columns, formats_for, resolve_files
from data.stream import ExampleStream, largest_share, steps_per_epoch, total_steps
from data.text_files import layout_note
from data.tokenization import tokenizer_sha1


@dataclass
class DataFiles:
    """The run's files, resolved and checked (no row read beyond the column check's sample)."""

    train: list[Path]
    eval: list[Path]  # empty: the eval set is held out of ``train``
    prepared: dict | None  # the manifest when ``train`` are the shards of a prepared corpus
    columns: tuple[str, str]  # what the training stream reads (token-id columns for prepared shards)


def check_data(cfg: TrainConfig, objective) -> DataFiles:
    """Resolve and check the data flags; ``UserError`` names what to change."""
    train = resolve_files(cfg.train_file, "--train_file", cfg.output_dir, formats_for(cfg))
    prepared = manifest_of(train)  # a corpus tokenized by `prepare`: token-id columns
    if prepared and objective.name != "pairs":
        raise UserError(f"--train_file holds prepared shards (prompt/response token ids); --objective={objective.name} "
                        "reads raw text: pass the text corpus")
    columns = objective.columns(prepared)
    check_columns(train, columns, "--train_file")
    return DataFiles(train, eval_files_of(cfg, train), prepared, columns)


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

    @property
    def rows(self) -> int:
        return sum(i.rows for i in self.indexes)

    def steps(self, cfg: TrainConfig) -> tuple[int, int]:
        """(optimizer steps per epoch, total steps). The process with the most rows sets an epoch's
        steps: the others step with it on empty windows."""
        if self.objective.fixed_lengths and cfg.max_steps <= 0:
            raise UserError(f"--objective={self.objective.name} needs --max_steps: an epoch's chunks are known only "
                            "once its text is tokenized, and the learning-rate schedule is made for a number of steps")
        share = largest_share(self.indexes, self.world)
        return steps_per_epoch(share, cfg.batch_size, cfg.gradient_accumulation_steps), total_steps(cfg, share)

    def fresh_stream(self, rank: int | None = None) -> ExampleStream:
        """A new stream of process ``rank`` (default: this one) from the start of the run: the planner
        replays it to find the costliest micro-batch."""
        rank = self.rank if rank is None else rank
        cfg = self.cfg
        documents = ExampleStream(self.files.train, self.files.columns, cfg.seed, cfg.shuffle_buffer_size, rank=rank,
                                  world_size=self.world, indexes=self.indexes)
        return self.objective.stream(documents, self.collator.tokenizer)


def build_data(cfg: TrainConfig, files: DataFiles, tokenizer, rank: int = 0, world: int = 1, *, objective,
               pad_multiple: int = 1, indexes: list[FileIndex] | None = None, report=print,
               warn=print) -> TrainData:
    """Open the run's data for process ``rank`` of ``world``.

    Args:
        indexes: the training files' ``index_file()``, read once by a launcher's main process and
            handed to all; read here when None.
        report, warn: where the eval set's bad rows are reported (main process) and the training
            stream's (every process).
    """
    if files.prepared:
        check_manifest(files.prepared, tokenizer_sha1(tokenizer), cfg.max_source_len, cfg.max_target_len)
    eval_problems = DataProblems(report=report)
    eval_examples, indexes, held = eval_split(cfg, files.eval, files.train, indexes, eval_problems)
    if indexes is None:  # an --eval_file run indexes its training files here
        indexes = [index_file(f) for f in files.train]
    for path, index in zip(files.train, indexes):
        if not index.rows:
            report(f"warning: {path} is empty")
        elif index.kind.startswith("txt"):
            report(layout_note(path, index.kind))
    documents = ExampleStream(files.train, files.columns, cfg.seed, cfg.shuffle_buffer_size, rank=rank,
                              world_size=world, indexes=indexes, problems=DataProblems(report=warn))
    eval_examples = objective.eval_examples(eval_examples, tokenizer, cfg.max_eval_samples)
    return TrainData(files, objective, objective.collator(tokenizer, pad_multiple), indexes, eval_examples, held,
                     eval_problems, objective.stream(documents, tokenizer), rank, world, cfg)
