"""``--objective=simpo``: Simple Preference Optimization (Meng et al. 2024): length-normalised rewards with a
target margin, no reference policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from data.objectives.preference import PairScores, PreferenceObjective, sigmoid_loss

if TYPE_CHECKING:
    import torch


class SimPOObjective(PreferenceObjective):
    """SimPO: -log σ(β (mean log π(chosen) - mean log π(rejected)) - γ) over each answer's token-mean
    log-probability, γ the target margin (--simpo_gamma); --label_smoothing as in DPO. No reference policy. The
    rewards are β times the token-mean log-probabilities."""

    name = "simpo"
    summary = "preference pairs (prompt, chosen, rejected): length-normalised rewards and a margin, no reference"
    unused_flags = (*PreferenceObjective.unused_flags, "dpo_loss", "orpo_lambda", "reference", "rpo_alpha")
    default_beta = 2.0  # the SimPO paper's range is 2.0 to 2.5

    @classmethod
    def problems(cls, cfg) -> list[str]:
        problems = super().problems(cfg)
        if not 0 <= cfg.label_smoothing < 0.5:
            problems.append(f"--label_smoothing must be in [0, 0.5) (got {cfg.label_smoothing})")
        return problems

    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen = self.beta * scores.chosen / scores.chosen_tokens.clamp(min=1)
        rejected = self.beta * scores.rejected / scores.rejected_tokens.clamp(min=1)
        losses = sigmoid_loss(chosen - rejected - self.cfg.simpo_gamma, self.cfg.label_smoothing)
        return losses, chosen.detach(), rejected.detach()

    def describe(self) -> str:
        return f"preference pairs (simpo, β {self.beta:g}, γ {self.cfg.simpo_gamma:g})"
