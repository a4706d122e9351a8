"""``--objective=pairs``: each row is one prompt -> response example (SFT, and pretraining on pairs such as
the shipped pinyin corpus)."""

from __future__ import annotations

from config import TrainConfig
from data.objectives.base import Objective
from data.sources.corpus import Example
from data.sources.readers import TOKEN_COLUMNS


class PairsObjective(Objective):
    """Each row is one example: the prompt column is the encoder's input, the response the labels
    (prepared shards hold both as token ids already)."""

    name = "pairs"
    summary = "each row a prompt -> response example"
    prepared_data = True
    packs = True
    unused_flags = ("text_column", "noise_density", "mean_noise_span_length")  # raw text's, span corruption's
    trained_with = ("max_source_len", "max_target_len", "prompt_column", "response_column")

    @classmethod
    def text_columns(cls, cfg: TrainConfig) -> tuple[str, str]:
        return cfg.prompt_column, cfg.response_column

    def columns(self, prepared: dict | None) -> tuple[str, str]:
        """The columns a training stream reads: token ids from prepared shards, else the text columns."""
        return TOKEN_COLUMNS if prepared else self.text_columns(self.cfg)

    def stream(self, documents, tokenizer):
        """The training stream: each row is an example."""
        return documents

    def eval_examples(self, rows: list[Example], tokenizer, limit: int) -> list[Example]:
        """The eval rows are the examples."""
        return rows
