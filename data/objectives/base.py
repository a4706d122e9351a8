"""Training objectives: what turns the rows a stream reads into ``(input_ids, labels)`` micro-batches.

The data entry point (``data.pipeline.build_data``) is given one objective and asks it which columns
to read and which collator makes its batches; the trainer, the planner's replay and evaluation take
the collator from there, so an objective is one class here and nothing else changes around it:
prompt -> response pairs (SFT, and pretraining on pairs such as the shipped pinyin corpus), and on raw
text packed into chunks, T5's span corruption (``--objective=span_corruption``) and prefix language
modelling (``--objective=prefix_lm``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from config import TrainConfig, UserError
from data.objectives import span_noise
from data.sources.corpus import Example
from data.sources.readers import TOKEN_COLUMNS
from data.streams.packed_text import PackedStream

if TYPE_CHECKING:  # imported where a collator is made: it needs torch
    from data.collate import Seq2SeqCollator


class PairsObjective:
    """Each row is one example: the prompt column is the encoder's input, the response the labels
    (prepared shards hold both as token ids already)."""

    name = "pairs"
    fixed_lengths = None  # (source, target) tokens of every example, when they are fixed
    longest = None  # (source, target) tokens of the longest example, when the objective bounds them
    chunk_length = 0  # tokens per packed chunk (0: rows are examples, nothing is packed)

    def __init__(self, cfg: TrainConfig):
        self.text_columns = (cfg.prompt_column, cfg.response_column)
        self.max_source_len, self.max_target_len = cfg.max_source_len, cfg.max_target_len

    def columns(self, prepared: dict | None) -> tuple[str, str]:
        """The columns a training stream reads: token ids from prepared shards, else the text columns."""
        return TOKEN_COLUMNS if prepared else self.text_columns

    def collator(self, tokenizer, pad_multiple: int = 1) -> Seq2SeqCollator:
        """Batches of this objective: each side padded to its micro-batch's longest row."""
        from data.collate import Seq2SeqCollator

        return Seq2SeqCollator(tokenizer, self.max_source_len, self.max_target_len, pad_multiple)

    def stream(self, documents, tokenizer):
        """The training stream: each row is an example."""
        return documents

    def eval_examples(self, rows: list[Example], tokenizer, limit: int) -> list[Example]:
        """The eval rows are the examples."""
        return rows


class PackedTextObjective:
    """Raw text (``--text_column``; ``.txt`` files are one document per row) packed into chunks of
    ``chunk_length`` tokens (``data.streams.packed_text``), each chunk rewritten into one example by ``transform``
    with a generator seeded by (seed, epoch, process, chunk position): the same run gives the same
    examples, and a resumed run the ones it would have had."""

    name = ""
    EVAL_EPOCH = 2**32 - 1  # the eval set's draws: a stream of their own
    fixed_lengths: tuple[int, int] | None = None
    chunk_length = 0

    def __init__(self, cfg: TrainConfig):
        self.text_column = cfg.text_column
        self.seed, self.max_source_len, self.max_target_len = cfg.seed, cfg.max_source_len, cfg.max_target_len

    @property
    def longest(self) -> tuple[int, int]:
        """(input, target) tokens of the longest example: what the planner plans for."""
        return self.fixed_lengths

    def describe(self) -> str:
        """The examples' shape, for the start-up log."""
        raise NotImplementedError

    def transform(self, tokenizer):
        """(chunk, rng) -> (input ids, target ids)."""
        raise NotImplementedError

    def columns(self, prepared: dict | None) -> tuple[str]:
        return (self.text_column,)

    def collator(self, tokenizer, pad_multiple: int = 1) -> Seq2SeqCollator:
        """The examples are token ids already: the collator only pads micro-batches."""
        from data.collate import Seq2SeqCollator

        return Seq2SeqCollator(tokenizer, self.max_source_len, self.max_target_len, pad_multiple)

    def _maker(self, tokenizer, rank: int):
        transform = self.transform(tokenizer)

        def make_example(chunk: list[int], epoch: int, position: int, sources: list[tuple[int, int]]) -> Example:
            rng = span_noise.example_rng(self.seed, epoch, (rank << 40) + position)
            inputs, targets = transform(chunk, rng)
            return Example(inputs, targets, *sources[0], also=tuple(sources[1:]))

        return make_example

    def stream(self, documents, tokenizer) -> PackedStream:
        """This process's training chunks from its stream of documents."""
        return PackedStream(documents, tokenizer, self.chunk_length, self._maker(tokenizer, documents.rank))

    def eval_examples(self, documents: list[Example], tokenizer, limit: int) -> list[Example]:
        """The first ``limit`` chunks of the eval documents (draws of their own, the same in every run)."""
        make = self._maker(tokenizer, 0)
        packed = PackedStream(_ListOfDocuments(documents), tokenizer, self.chunk_length,
                              lambda chunk, _epoch, position, sources: make(chunk, self.EVAL_EPOCH, position, sources))
        chunks = list(itertools.islice(packed.iter_epoch(), limit))
        if documents and not chunks:  # an eval loss over no example would read 0
            raise UserError(f"the {len(documents)} eval document(s) hold {len(packed.carry)} tokens, fewer than one "
                            f"chunk of {self.chunk_length}: pass an --eval_file with more text")
        return chunks


class SpanCorruptionObjective(PackedTextObjective):
    """T5's pretraining objective: chunks of the raw length that corrupts to exactly ``--max_source_len``
    input tokens; in each chunk ``--noise_density`` of the tokens, in spans of ``--mean_noise_span_length``
    on average, are replaced by sentinels in the inputs and make up the targets (``data.objectives.span_noise``)."""

    name = "span_corruption"

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.noise = (cfg.noise_density, cfg.mean_noise_span_length)
        if cfg.max_source_len < 3:
            raise UserError("--objective=span_corruption needs --max_source_len of at least 3 (a kept token, a "
                            f"sentinel and the end of the sequence; got {cfg.max_source_len}): T5 uses 512")
        self.chunk_length, self.targets_length = span_noise.corrupted_lengths(cfg.max_source_len, *self.noise)
        self.fixed_lengths = (cfg.max_source_len, self.targets_length)
        noise_tokens, spans = span_noise.span_counts(self.chunk_length, *self.noise)
        if spans > self.chunk_length - noise_tokens:  # the kept tokens separate the spans: one run between two
            kept = self.chunk_length - noise_tokens
            raise UserError(f"--noise_density={cfg.noise_density} with --mean_noise_span_length="
                            f"{cfg.mean_noise_span_length} drops {noise_tokens} of a chunk's {self.chunk_length} "
                            f"tokens in {spans} spans, more than the {kept} tokens kept to separate them: lower "
                            "--noise_density or raise --mean_noise_span_length (T5: 0.15 and 3)")
        if self.targets_length > cfg.max_target_len:
            raise UserError(f"--objective=span_corruption with --max_source_len={cfg.max_source_len} makes targets of "
                            f"{self.targets_length} tokens: set --max_target_len={self.targets_length} (it is "
                            f"{cfg.max_target_len})")

    def describe(self) -> str:
        return (f"{self.max_source_len} input / {self.targets_length} target tokens after span_corruption, "
                "no padding")

    def transform(self, tokenizer):
        spans = span_noise.span_counts(self.chunk_length, *self.noise)[1]  # sentinels a chunk needs
        has = span_noise.sentinels_in(tokenizer, spans)
        if 0 < has < spans:
            longest = span_noise.longest_source_for(has, *self.noise)
            names = ("the top byte ids no UTF-8 text holds, counting down as ByT5 was pretrained; its recipe: "
                     "--mean_noise_span_length=20" if span_noise.is_byt5(tokenizer)
                     else f"<extra_id_0>..<extra_id_{has - 1}>")
            raise UserError(f"a chunk of --max_source_len={self.max_source_len} tokens gets {spans} noise spans, each "
                            f"named by a sentinel, and the tokenizer has {has} ({names}): "
                            f"set --max_source_len={longest} or less, or raise --mean_noise_span_length")
        sentinels, eos = span_noise.sentinel_ids(tokenizer, spans), tokenizer.eos_token_id

        def corrupt(chunk: list[int], rng) -> tuple[list[int], list[int]]:
            mask = span_noise.noise_mask(len(chunk), rng, *self.noise)
            return span_noise.corrupt(chunk, mask, sentinels, eos)

        return corrupt


class PrefixLMObjective(PackedTextObjective):
    """The T5 paper's prefix language modelling: each chunk of ``--max_source_len`` tokens is split at a
    random point, drawn uniformly from the points that leave both sides at least one token and the rest
    within ``--max_target_len``; the prefix is the input, the rest the target (both end with EOS, so the
    input has at most ``--max_source_len`` tokens). Lengths vary with the split, so micro-batches are
    padded to their longest row."""

    name = "prefix_lm"

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.chunk_length = cfg.max_source_len
        # split points s: input chunk[:s] + EOS, target chunk[s:] + EOS of at most --max_target_len tokens
        self.splits = (max(1, self.chunk_length - (cfg.max_target_len - 1)), self.chunk_length - 1)
        if self.chunk_length < 2 or cfg.max_target_len < 2:
            raise UserError("--objective=prefix_lm needs --max_source_len and --max_target_len of at least 2 "
                            f"(got {cfg.max_source_len} and {cfg.max_target_len})")

    @property
    def longest(self) -> tuple[int, int]:
        return self.splits[1] + 1, self.chunk_length - self.splits[0] + 1

    def describe(self) -> str:
        low, high = self.splits
        return (f"split at a random point into {low + 1}..{high + 1} input and "
                f"{self.chunk_length - high + 1}..{self.chunk_length - low + 1} target tokens (prefix_lm)")

    def transform(self, tokenizer):
        eos = tokenizer.eos_token_id

        def split(chunk: list[int], rng) -> tuple[list[int], list[int]]:
            at = int(rng.integers(self.splits[0], self.splits[1] + 1))
            return chunk[:at] + [eos], chunk[at:] + [eos]

        return split


class _ListOfDocuments:
    """A list of documents as the one-epoch stream ``PackedStream`` reads."""

    epoch, rank = 0, 0

    def __init__(self, documents: list[Example]):
        self.documents = documents

    def iter_epoch(self):
        yield from self.documents


OBJECTIVES = {"pairs": PairsObjective, "span_corruption": SpanCorruptionObjective, "prefix_lm": PrefixLMObjective}


def objective_for(cfg: TrainConfig):
    """The objective a run trains with (``--objective``)."""
    return OBJECTIVES[cfg.objective](cfg)
