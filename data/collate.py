"""Tokenization and dynamic padding of a micro-batch, in one batched tokenizer call per side."""

from __future__ import annotations

import torch

from data.sources import Example

# sentencepiece pieces are at most 16 characters, so cutting the text to 16 characters per allowed
# token never changes the truncated result, and a megabyte-long row costs no more than a short one.
_CHARS_PER_TOKEN_BOUND = 16


class Seq2SeqCollator:
    """Turn examples into ``input_ids``, ``attention_mask`` and ``labels`` tensors.

    Each side is padded to the longest row of this batch (not to a fixed length); label padding is
    -100 so it never counts in the loss.
    """

    def __init__(self, tokenizer, max_source_len: int, max_target_len: int):
        self.tokenizer = tokenizer
        self.max_source_len = max_source_len
        self.max_target_len = max_target_len

    def encode(self, texts: list[str], max_len: int) -> dict:
        cut = max_len * _CHARS_PER_TOKEN_BOUND
        return self.tokenizer([t[:cut] for t in texts], max_length=max_len, truncation=True,
                              padding="longest", return_tensors="pt")

    def labels(self, examples: list[Example]) -> torch.Tensor:
        target = self.encode([e.response for e in examples], self.max_target_len)
        return target["input_ids"].masked_fill(target["attention_mask"] == 0, -100)

    def __call__(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        source = self.encode([e.prompt for e in examples], self.max_source_len)
        return {"input_ids": source["input_ids"], "attention_mask": source["attention_mask"],
                "labels": self.labels(examples)}

    def empty(self) -> dict[str, torch.Tensor]:
        """A micro-batch with no target tokens (one source token): its backward adds zero gradient."""
        return {"input_ids": torch.tensor([[self.tokenizer.eos_token_id]]), "attention_mask": torch.tensor([[1]]),
                "labels": torch.tensor([[-100]])}


class CachedEncoderCollator:
    """Training batches for SFT with ``--encoder_cache``: the targets are tokenized as usual, the
    source side is the cached encoder output (no source tokenization, no encoder forward)."""

    def __init__(self, collator: Seq2SeqCollator, cache):
        self.collator = collator
        self.cache = cache

    def __call__(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        hidden, mask = self.cache.hidden_states(examples)
        return {"encoder_hidden_states": hidden, "attention_mask": mask, "labels": self.collator.labels(examples)}

    def empty(self) -> dict[str, torch.Tensor]:
        """A micro-batch with no target tokens (one zero encoder state): its backward adds zero gradient."""
        return {"encoder_hidden_states": torch.zeros(1, 1, self.cache.d_model), "attention_mask": torch.tensor([[1]]),
                "labels": torch.tensor([[-100]])}
