"""Training objectives: what turns the rows a stream reads into ``(input_ids, labels)`` micro-batches.

The data entry point (``data.pipeline.build_data``) is given one objective and asks it which columns
to read and which collator makes its batches; the trainer, the planner's replay and evaluation take
the collator from there, so an objective is one class here and nothing else changes around it:
prompt -> response pairs (SFT, and pretraining on pairs such as the shipped pinyin corpus), and T5's
span corruption on raw text (``--objective=span_corruption``).
"""

from __future__ import annotations

import itertools

from config import TrainConfig, UserError
from data import span_corruption
from data.collate import Seq2SeqCollator
from data.packing import PackedStream
from data.readers import TOKEN_COLUMNS
from data.sources import Example


class PairsObjective:
    """Each row is one example: the prompt column is the encoder's input, the response the labels
    (prepared shards hold both as token ids already)."""

    name = "pairs"
    fixed_lengths = None  # (source, target) tokens of every example, when they are fixed

    def __init__(self, cfg: TrainConfig):
        self.text_columns = (cfg.prompt_column, cfg.response_column)
        self.max_source_len, self.max_target_len = cfg.max_source_len, cfg.max_target_len

    def columns(self, prepared: dict | None) -> tuple[str, str]:
        """The columns a training stream reads: token ids from prepared shards, else the text columns."""
        return TOKEN_COLUMNS if prepared else self.text_columns

    def collator(self, tokenizer, pad_multiple: int = 1) -> Seq2SeqCollator:
        """Batches of this objective: each side padded to its micro-batch's longest row."""
        return Seq2SeqCollator(tokenizer, self.max_source_len, self.max_target_len, pad_multiple)

    def stream(self, documents, tokenizer):
        """The training stream: each row is an example."""
        return documents

    def eval_examples(self, rows: list[Example], tokenizer, limit: int) -> list[Example]:
        """The eval rows are the examples."""
        return rows


class SpanCorruptionObjective:
    """T5's pretraining objective on raw text (``--text_column``; ``.txt`` files are one document per row):
    documents packed into chunks of the raw length that corrupts to exactly ``--max_source_len`` input
    tokens; in each chunk ``--noise_density`` of the tokens, in spans of ``--mean_noise_span_length`` on
    average, are replaced by sentinels in the inputs and make up the targets (``data.span_corruption``).
    Masks come from (seed, epoch, process, chunk position): the same run gives the same examples, and a
    resumed run the ones it would have had."""

    name = "span_corruption"
    EVAL_EPOCH = 2**32 - 1  # the eval set's masks: a stream of their own

    def __init__(self, cfg: TrainConfig):
        self.text_column = cfg.text_column
        self.seed, self.max_source_len, self.max_target_len = cfg.seed, cfg.max_source_len, cfg.max_target_len
        self.noise = (cfg.noise_density, cfg.mean_noise_span_length)
        self.chunk_length, self.targets_length = span_corruption.corrupted_lengths(cfg.max_source_len, *self.noise)
        self.fixed_lengths = (cfg.max_source_len, self.targets_length)
        if self.targets_length > cfg.max_target_len:
            raise UserError(f"--objective=span_corruption with --max_source_len={cfg.max_source_len} makes targets of "
                            f"{self.targets_length} tokens: set --max_target_len={self.targets_length} (it is "
                            f"{cfg.max_target_len})")

    def columns(self, prepared: dict | None) -> tuple[str]:
        return (self.text_column,)

    def collator(self, tokenizer, pad_multiple: int = 1) -> Seq2SeqCollator:
        """The examples are token ids already (exact lengths): the collator only pads micro-batches."""
        return Seq2SeqCollator(tokenizer, self.max_source_len, self.max_target_len, pad_multiple)

    def _maker(self, tokenizer, rank: int):
        spans = span_corruption.span_counts(self.chunk_length, *self.noise)[1]  # sentinels a chunk needs
        sentinels, eos = span_corruption.sentinel_ids(tokenizer, spans), tokenizer.eos_token_id

        def make_example(chunk: list[int], epoch: int, position: int, source: tuple[int, int]) -> Example:
            rng = span_corruption.example_rng(self.seed, epoch, (rank << 40) + position)
            mask = span_corruption.noise_mask(len(chunk), rng, *self.noise)
            inputs, targets = span_corruption.corrupt(chunk, mask, sentinels, eos)
            return Example(inputs, targets, *source)

        return make_example

    def stream(self, documents, tokenizer) -> PackedStream:
        """This process's training chunks from its stream of documents."""
        return PackedStream(documents, tokenizer, self.chunk_length, self._maker(tokenizer, documents.rank))

    def eval_examples(self, documents: list[Example], tokenizer, limit: int) -> list[Example]:
        """The first ``limit`` chunks of the eval documents (masks of their own, the same in every run)."""
        make = self._maker(tokenizer, 0)
        packed = PackedStream(_ListOfDocuments(documents), tokenizer, self.chunk_length,
                              lambda chunk, _epoch, position, source: make(chunk, self.EVAL_EPOCH, position, source))
        return list(itertools.islice(packed.iter_epoch(), limit))


class _ListOfDocuments:
    """A list of documents as the one-epoch stream ``PackedStream`` reads."""

    epoch, rank = 0, 0

    def __init__(self, documents: list[Example]):
        self.documents = documents

    def iter_epoch(self):
        yield from self.documents


OBJECTIVES = {"pairs": PairsObjective, "span_corruption": SpanCorruptionObjective}


def objective_for(cfg: TrainConfig):
    """The objective a run trains with (``--objective``)."""
    return OBJECTIVES[cfg.objective](cfg)
