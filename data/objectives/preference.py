"""The shared base of the preference objectives (``dpo``, ``orpo``, ``simpo``: one file each): rows of a prompt, a
chosen and a rejected answer, and the maths that turns the policy's (and a reference's) summed log-probabilities of
the two answers into a loss per pair.

A micro-batch (``data.collate.PreferenceCollator``) holds the B prompts once (``input_ids``: one encoder pass per
prompt) and the 2B answers as ``labels``: the chosen ones in rows 0..B-1, the rejected ones in rows B..2B-1, each
decoded against its prompt's encoder output. The trainer computes each answer's summed token log-probability and
asks the objective for the loss (``pair_losses``); code elsewhere asks these classes, never compares their names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from config import TrainConfig
from data.objectives.base import Objective
from data.sources.corpus import Example

if TYPE_CHECKING:  # (torch is imported where a loss or a collator is made: validation runs without it)
    import torch

    from data.collate import Padding, PreferenceCollator


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
        from data.collate import PreferenceCollator

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
    import torch.nn.functional as F

    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
