"""The shared base of the preference objectives (``dpo``, ``orpo``, ``simpo``: one file each): rows of a prompt, a
chosen and a rejected answer, and the maths that turns the policy's (and a reference's) summed log-probabilities of
the two answers into a loss per pair.

A micro-batch (``PreferenceCollator``) holds the B prompts once (``input_ids``: one encoder pass per prompt) and the
2B answers as ``labels``: the chosen ones in rows 0..B-1, the rejected ones in rows B..2B-1, each decoded against
its prompt's encoder output. The trainer computes each answer's summed token log-probability and asks the objective
for the loss (``pair_losses``); code elsewhere asks these classes, never compares their names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from config import TrainConfig
from data.collate import Padding, Seq2SeqCollator
from data.objectives.base import Objective
from data.sources.corpus import Example


@dataclass
class PairScores:
    """What the policy (and the reference) give one micro-batch's pairs, each a float32 tensor [B]: the summed
    log-probabilities of the chosen and rejected answers, their token counts, and the reference's sums (zeros for a
    reference-free objective)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor


class PreferenceObjective(Objective):
    """Rows of a prompt (``--prompt_column``), a chosen (``--chosen_column``) and a rejected answer
    (``--rejected_column``); a subclass gives ``pair_losses``."""

    unused_flags = ("text_column", "response_column", "noise_density", "mean_noise_span_length")
    trained_with = ("max_source_len", "max_target_len", "prompt_column", "chosen_column", "rejected_column")
    preference = True
    needs_reference: ClassVar[bool] = True  # its loss reads a reference policy's log-probabilities
    default_beta: ClassVar[float] = 0.1  # --beta=0 takes this
    noun = example_noun = "pairs"

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.beta = cfg.beta or self.default_beta

    @classmethod
    def problems(cls, cfg: TrainConfig) -> list[str]:
        columns = (cfg.prompt_column, cfg.chosen_column, cfg.rejected_column)
        problems = [] if len(set(columns)) == 3 else [
            "--prompt_column, --chosen_column and --rejected_column must name three different columns"]
        if cfg.beta < 0:
            problems.append(f"--beta must not be negative (got {cfg.beta}; 0: the objective's own)")
        return problems

    @classmethod
    def text_columns(cls, cfg: TrainConfig) -> tuple[str, str, str]:
        return cfg.prompt_column, cfg.chosen_column, cfg.rejected_column

    def collator(self, tokenizer, pad_multiple: Padding = 1) -> PreferenceCollator:
        return PreferenceCollator(tokenizer, self.max_source_len, self.max_target_len, pad_multiple)

    def stream(self, documents, tokenizer):
        return documents

    def eval_examples(self, rows: list[Example], tokenizer, limit: int) -> list[Example]:
        return rows

    def describe(self) -> str:
        return f"preference pairs ({self.name}, β {self.beta:g})"

    @property
    def reference(self) -> str | None:
        """The --reference kind this run uses (None: the objective reads none)."""
        return None

    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss of each pair [B], reward of the chosen [B], reward of the rejected [B]): the rewards are what the
        objective prefers by (the reward accuracy counts the pairs whose chosen one is higher)."""
        raise NotImplementedError

    def nll_weight(self) -> float:
        """The weight of the chosen answers' token-mean NLL beside the pair loss (ORPO's SFT term; 0: none)."""
        return 0.0


def sigmoid_loss(logits: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """-log σ(logits), with ``label_smoothing`` the share of pairs taken as flipped (conservative DPO)."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


class PreferenceCollator(Seq2SeqCollator):
    """Micro-batches of preference pairs: each prompt once (``input_ids``, ``attention_mask`` [B, S]) and its two
    answers as ``labels`` [2B, T] (chosen rows first), grouped by the longer answer. With a reference cache
    (``reference``: reads each pair's cached log-probabilities, ``lowmem.training.reference``) a batch carries them
    as ``reference`` [B, 2]."""

    reference = None  # set when the reference's log-probabilities come from the pre-pass's cache

    def targets(self, examples: list[Example]) -> list[list[int]]:
        """The chosen answers' token ids (what SFT on the chosen answers would train on)."""
        return self.token_ids([e.response for e in examples], self.max_target_len)

    def answers(self, examples: list[Example]) -> tuple[list[list[int]], list[list[int]]]:
        """(chosen, rejected) token ids of ``examples``, in one tokenizer call."""
        ids = self.token_ids([e.response for e in examples] + [e.rejected for e in examples], self.max_target_len)
        return ids[:len(examples)], ids[len(examples):]

    def answer_sides(self, examples: list[Example]):
        """(each pair's decoder length for grouping: its longer answer twice, as two decoder rows hold it; ``side``:
        a micro-batch's labels, chosen rows first, and the cached reference's log-probabilities)."""
        chosen, rejected = self.answers(examples)

        def side(rows: list[int]) -> dict:
            out = {"labels": self.labels([chosen[i] for i in rows] + [rejected[i] for i in rows])}
            if self.reference is not None:
                out["reference"] = self.reference.pair_logprobs([examples[i] for i in rows])
            return out

        return [2 * max(len(c), len(r)) for c, r in zip(chosen, rejected)], side

    def empty(self) -> dict[str, torch.Tensor]:
        """A pair with no target tokens: its backward adds zero gradient."""
        batch = {"input_ids": torch.tensor([[self.tokenizer.eos_token_id]]), "attention_mask": torch.tensor([[1]]),
                 "labels": torch.tensor([[-100], [-100]])}
        if self.reference is not None:
            batch["reference"] = torch.zeros(1, 2)
        return batch
