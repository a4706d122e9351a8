"""``--objective=orpo``: Odds Ratio Preference Optimization (Hong et al. 2024): SFT and preference in one loss,
with no reference policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from data.objectives.preference import PairScores, PreferenceObjective

if TYPE_CHECKING:
    import torch


def log_odds(mean_logprob: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(mean token log-probability); ``expm1`` keeps 1 - p exact near p = 1 (and p is
    held below 1 - 1e-6, where the odds would be infinite)."""
    import torch

    mean_logprob = mean_logprob.clamp(max=-1e-6)
    return mean_logprob - torch.log(-torch.expm1(mean_logprob))


class ORPOObjective(PreferenceObjective):
    """ORPO: the chosen answers' token-mean NLL plus λ (--orpo_lambda) times -log σ(log odds(chosen) - log
    odds(rejected)), the odds from each answer's token-mean log-probability. No reference policy. The rewards are
    the answers' token-mean log-probabilities."""

    name = "orpo"
    summary = "preference pairs (prompt, chosen, rejected): the chosen answer's NLL, an odds-ratio term, no reference"
    unused_flags = (*PreferenceObjective.unused_flags, "beta", "label_smoothing", "dpo_loss", "simpo_gamma",
                    "reference", "rpo_alpha")

    @classmethod
    def problems(cls, cfg) -> list[str]:
        problems = super().problems(cfg)
        if cfg.orpo_lambda < 0:
            problems.append(f"--orpo_lambda must not be negative (got {cfg.orpo_lambda})")
        return problems

    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen = scores.chosen / scores.chosen_tokens.clamp(min=1)
        rejected = scores.rejected / scores.rejected_tokens.clamp(min=1)
        import torch.nn.functional as F

        losses = -self.cfg.orpo_lambda * F.logsigmoid(log_odds(chosen) - log_odds(rejected))
        return losses, chosen.detach(), rejected.detach()

    def nll_weight(self) -> float:
        return 1.0

    def describe(self) -> str:
        return f"preference pairs (orpo, λ {self.cfg.orpo_lambda:g})"
