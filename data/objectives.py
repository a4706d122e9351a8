"""Training objectives: what turns the rows a stream reads into ``(input_ids, labels)`` micro-batches.

The data entry point (``data.pipeline.build_data``) is given one objective and asks it which columns
to read and which collator makes its batches; the trainer, the planner's replay and evaluation take
the collator from there, so an objective is one class here and nothing else changes around it.
Today there is one: prompt -> response pairs (SFT, and pretraining on pairs such as the shipped
pinyin corpus).
"""

from __future__ import annotations

from config import TrainConfig
from data.collate import Seq2SeqCollator
from data.readers import TOKEN_COLUMNS


class PairsObjective:
    """Each row is one example: the prompt column is the encoder's input, the response the labels
    (prepared shards hold both as token ids already)."""

    name = "pairs"

    def __init__(self, cfg: TrainConfig):
        self.text_columns = (cfg.prompt_column, cfg.response_column)
        self.max_source_len, self.max_target_len = cfg.max_source_len, cfg.max_target_len

    def columns(self, prepared: dict | None) -> tuple[str, str]:
        """The columns a training stream reads: token ids from prepared shards, else the text columns."""
        return TOKEN_COLUMNS if prepared else self.text_columns

    def collator(self, tokenizer, pad_multiple: int = 1) -> Seq2SeqCollator:
        """Batches of this objective: each side padded to its micro-batch's longest row."""
        return Seq2SeqCollator(tokenizer, self.max_source_len, self.max_target_len, pad_multiple)


def objective_for(cfg: TrainConfig) -> PairsObjective:
    """The objective a run trains with."""
    return PairsObjective(cfg)
