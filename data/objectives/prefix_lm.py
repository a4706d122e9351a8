"""``--objective=prefix_lm``: the T5 paper's prefix language modelling on raw text."""

from __future__ import annotations

from config import TrainConfig
from data.objectives.packed_text import PackedTextObjective
from lowmem.utils.errors import UserError


class PrefixLMObjective(PackedTextObjective):
    """The T5 paper's prefix language modelling: each chunk of ``--max_source_len`` tokens is split at a
    random point, drawn uniformly from the points that leave both sides at least one token and the rest
    within ``--max_target_len``; the prefix is the input, the rest the target (both end with EOS, so the
    input has at most ``--max_source_len`` tokens). Lengths vary with the split, so micro-batches are
    padded to their longest row."""

    name = "prefix_lm"
    packs = True
    summary = ("raw text in --text_column packed into chunks as for span_corruption, each split at a random "
               "point: prefix -> rest")

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

    def shape(self) -> str:
        low, high = self.splits
        return (f"split at a random point into {low + 1}..{high + 1} input and "
                f"{self.chunk_length - high + 1}..{self.chunk_length - low + 1} target tokens (prefix_lm)")

    def transform(self, tokenizer):
        eos = tokenizer.eos_token_id

        def split(chunk: list[int], rng) -> tuple[list[int], list[int]]:
            at = int(rng.integers(self.splits[0], self.splits[1] + 1))
            return chunk[:at] + [eos], chunk[at:] + [eos]

        return split
