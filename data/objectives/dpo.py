"""``--objective=dpo``: Direct Preference Optimization (Rafailov et al. 2023), against a reference policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from config import TrainConfig
from data.objectives.preference import PairScores, PreferenceObjective, sigmoid_loss

if TYPE_CHECKING:
    import torch

DPO_LOSSES = ("sigmoid", "ipo")
# --reference's kinds (lowmem.training.reference: one class each) and the models each holds beside the policy
REFERENCE_MODELS = {"copy": 1, "adapter": 0, "cached": 0}
REFERENCES = ("auto", *REFERENCE_MODELS)


class DPOObjective(PreferenceObjective):
    """DPO: with h = (log π(chosen) - log π_ref(chosen)) - (log π(rejected) - log π_ref(rejected)) over the answers'
    summed token log-probabilities, the loss is -log σ(β h); with --label_smoothing ε, conservative DPO's
    -(1-ε) log σ(β h) - ε log σ(-β h). --dpo_loss=ipo: IPO's (h' - 1/(2β))², h' from the answers' token-mean
    log-probabilities (as trl computes it). The rewards are β (log π - log π_ref) of each answer."""

    name = "dpo"
    summary = "preference pairs (prompt, chosen, rejected) against a reference policy (--reference)"
    unused_flags = (*PreferenceObjective.unused_flags, "orpo_lambda", "simpo_gamma")

    @classmethod
    def problems(cls, cfg: TrainConfig) -> list[str]:
        problems = super().problems(cfg)
        if cfg.dpo_loss not in DPO_LOSSES:
            problems.append(f"--dpo_loss must be one of {', '.join(DPO_LOSSES)} (got {cfg.dpo_loss!r})")
        if not 0 <= cfg.label_smoothing < 0.5:
            problems.append(f"--label_smoothing must be in [0, 0.5) (got {cfg.label_smoothing}): past 0.5 the "
                            "rejected answers would be preferred")
        if cfg.rpo_alpha < 0:
            problems.append(f"--rpo_alpha must not be negative (got {cfg.rpo_alpha}; 0: plain DPO)")
        if cfg.reference not in REFERENCES:
            problems.append(f"--reference must be one of {', '.join(REFERENCES)} (got {cfg.reference!r})")
        elif cfg.reference == "adapter" and not cfg.lora_r:
            problems.append("--reference=adapter is the model with its LoRA adapter off: it needs --lora_r (or use "
                            "--reference=copy or cached)")
        return problems

    @property
    def reference(self) -> str:
        """The reference policy this run uses: --reference, auto resolved (adapter with LoRA, else a copy)."""
        if self.cfg.reference == "auto":
            return "adapter" if self.cfg.lora_r else "copy"
        return self.cfg.reference

    @property
    def reference_models(self) -> int:
        return REFERENCE_MODELS[self.reference]

    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen = scores.chosen - scores.ref_chosen
        rejected = scores.rejected - scores.ref_rejected
        if self.cfg.dpo_loss == "ipo":
            per_token = (chosen / scores.chosen_tokens.clamp(min=1)) - (rejected / scores.rejected_tokens.clamp(min=1))
            losses = (per_token - 1 / (2 * self.beta)) ** 2
        else:
            losses = sigmoid_loss(self.beta * (chosen - rejected), self.cfg.label_smoothing)
        return losses, self.beta * chosen.detach(), self.beta * rejected.detach()

    def nll_weight(self) -> float:
        return self.cfg.rpo_alpha
