"""The shared base of the objectives that read raw text: documents packed into chunks of tokens
(``data.streams.packed_text``), each chunk rewritten into one example by the subclass's ``transform``."""

from __future__ import annotations

import itertools

from config import TrainConfig
from data.objectives import span_noise
from data.objectives.base import Objective
from data.sources.corpus import TEXT_FORMATS, Example
from data.streams.packed_text import PackedStream
from lowmem.utils.errors import UserError


class PackedTextObjective(Objective):
    """Raw text (``--text_column``; ``.txt`` files are one document per row) packed into chunks of
    ``chunk_length`` tokens (``data.streams.packed_text``), each chunk rewritten into one example by ``transform``
    with a generator seeded by (seed, epoch, process, chunk position): the same run gives the same
    examples, and a resumed run the ones it would have had. Subclasses set ``name``, ``chunk_length`` and
    ``fixed_lengths`` (or ``longest``), and write ``shape`` and ``transform``."""

    formats = TEXT_FORMATS
    unused_flags = ("noise_density", "mean_noise_span_length")  # span corruption's
    trained_with = ("seed", "max_source_len", "max_target_len", "text_column")  # the draws and the chunks
    noun, example_noun = "documents", "chunks"
    EVAL_EPOCH = 2**32 - 1  # the eval set's draws: a stream of their own

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.text_column, self.seed = cfg.text_column, cfg.seed

    @classmethod
    def problems(cls, cfg: TrainConfig) -> list[str]:
        if cfg.encoder_cache != "off":
            return [f"--encoder_cache caches the encoder's outputs of fixed rows; --objective={cfg.objective} "
                    "makes new inputs every epoch: leave --encoder_cache off"]
        return []

    @classmethod
    def text_columns(cls, cfg: TrainConfig) -> tuple[str]:
        return (cfg.text_column,)

    def describe(self) -> str:
        return f"packed into chunks of {self.chunk_length} tokens: {self.shape()}"

    def shape(self) -> str:
        """The examples' lengths, for the start-up log."""
        raise NotImplementedError

    def transform(self, tokenizer):
        """(chunk, rng) -> (input ids, target ids)."""
        raise NotImplementedError

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


class _ListOfDocuments:
    """A list of documents as the one-epoch stream ``PackedStream`` reads."""

    epoch, rank = 0, 0

    def __init__(self, documents: list[Example]):
        self.documents = documents

    def iter_epoch(self):
        yield from self.documents
