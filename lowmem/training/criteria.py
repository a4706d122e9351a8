"""What one micro-batch's backward differentiates, by the kind of objective: ``TokenLoss`` (the token-mean
cross-entropy of pretraining and SFT) or ``PreferenceLoss`` (a preference objective's pair loss, against its
reference). Each gives the micro-batch's share of the window's loss, already divided by the window's totals on
all processes, and a vector of local sums that the log interval adds up and ``fields`` turns into the log's values.

A window's gradient is then the same whatever the micro-batch split and the processes: the pair term is divided
by the window's pairs, a token term (SFT's loss, ORPO's NLL of the chosen answers) by its tokens.
"""

from __future__ import annotations

import torch

from data.objectives.preference import PairScores
from lowmem.model.answer_logprobs import answer_logprobs
from lowmem.model.loss import token_loss_sum


class TokenLoss:
    """The sum of token losses over the window's target tokens; its one sum is the loss's."""

    def micro(self, ctx, model, core, batch: dict, counts: dict, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss to differentiate, times ``factor``; the local sums to log) of one micro-batch on its device."""
        loss = token_loss_sum(model, core, batch, frozen_encoder=ctx.cfg.frozen_encoder, multiple=ctx.multiple,
                              loss_chunk=ctx.cfg.loss_chunk_size)
        return loss * (factor / max(counts["tokens"], 1)), loss.detach()

    def fields(self, sums: list[float], tokens: float) -> dict:
        return {"loss": round(sums[0] / max(tokens, 1), 5)}

    def evaluate(self, at, examples: list, **options) -> dict | None:
        """Its own evaluation (None: ``lowmem.training.evaluation.evaluate_model``'s token loss and scores)."""
        return None

    def eval_forward(self, at, batch: dict, budget: int) -> dict:
        """One eval batch's loss forward (what the eval plan times); returns the inputs ``generate`` takes for it."""
        from lowmem.training.evaluation import loss_and_inputs

        return loss_and_inputs(at, batch, budget)[1]

    def close(self) -> None:
        pass


# The local sums a preference micro-batch logs, in order
PREFERENCE_SUMS = ("pair_loss", "rewards_chosen", "rewards_rejected", "correct", "nll_chosen", "nll_rejected",
                   "pairs", "chosen_tokens", "rejected_tokens")


def wins(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """1 where the chosen answer's reward is the higher, 0.5 on a tie (no preference: a DPO policy still equal to its
    reference ties on every pair, and reads 0.5, not 0; trl counts a tie as 0), else 0."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


class PreferenceLoss:
    """A preference objective's loss (``data.objectives.preference``): each answer's summed log-probability
    (the prompt encoded once), the reference's (``lowmem.training.reference``; none for a reference-free
    objective), the objective's pair loss, and its NLL term."""

    SUMS = PREFERENCE_SUMS

    def __init__(self, objective, reference):
        self.objective, self.reference = objective, reference

    def scores(self, ctx, model, core, batch: dict, examples: list | None = None) -> PairScores:
        """The policy's and the reference's scores of a micro-batch's pairs (the policy's with a graph where
        gradients are on); ``examples``: the eval pairs the batch holds (None: training's, whose cached reference
        log-probabilities come with the batch)."""
        cfg = ctx.cfg
        sums, tokens = answer_logprobs(model, core, batch, cfg.frozen_encoder, ctx.multiple, cfg.loss_chunk_size)
        half = len(sums) // 2
        if self.reference is not None:
            ref_chosen, ref_rejected = (self.reference.scores(model, core, batch) if examples is None else
                                        self.reference.eval_scores(model, core, batch, examples))
        else:
            ref_chosen = ref_rejected = torch.zeros_like(sums[:half])
        tokens = tokens.float()
        return PairScores(sums[:half], sums[half:], tokens[:half], tokens[half:], ref_chosen.float(),
                          ref_rejected.float())

    def sums(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the pairs' summed loss, the chosen answers' summed NLL, the vector of PREFERENCE_SUMS), pairs without
        a target token (a padding micro-batch's) left out."""
        losses, chosen, rejected = self.objective.pair_losses(scores)
        real = (scores.chosen_tokens > 0).float()
        pair_loss, nll_chosen = (losses * real).sum(), -(scores.chosen * real).sum()
        logged = torch.stack([pair_loss.detach(), (chosen * real).sum(), (rejected * real).sum(),
                              (wins(chosen, rejected) * real).sum(), nll_chosen.detach(),
                              -(scores.rejected * real).sum().detach(), real.sum(), scores.chosen_tokens.sum(),
                              scores.rejected_tokens.sum()])
        return pair_loss, nll_chosen, logged

    def micro(self, ctx, model, core, batch: dict, counts: dict, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        pair_loss, nll_chosen, logged = self.sums(self.scores(ctx, model, core, batch))
        loss = pair_loss * (factor / max(counts["examples"], 1))
        weight = self.objective.nll_weight()
        if weight:
            loss = loss + nll_chosen * (weight * factor / max(counts["chosen_tokens"], 1))
        return loss, logged

    def eval_forward(self, at, batch: dict, budget: int) -> dict:
        """The policy's forward over both answers (a reference's costs about as much again, or nothing: cached)."""
        cfg = at.cfg
        answer_logprobs(at.model, at.core, batch, cfg.frozen_encoder, at.ctx.multiple, cfg.loss_chunk_size)
        return {"input_ids": batch["input_ids"]}

    def close(self) -> None:
        if self.reference is not None:
            self.reference.close()

    def evaluate(self, at, examples: list, **options) -> dict:
        """The held-out pairs' loss, rewards and reward accuracy (``lowmem.training.preference_eval``)."""
        from lowmem.training.preference_eval import evaluate_pairs

        return evaluate_pairs(at, self, examples, **options)

    def fields(self, sums: list[float], tokens: float = 0) -> dict:
        """The log's values of an interval's (or an evaluation's) PREFERENCE_SUMS, summed over processes."""
        got = dict(zip(PREFERENCE_SUMS, sums))
        pairs, chosen_tokens = max(got["pairs"], 1), max(got["chosen_tokens"], 1)
        nll = got["nll_chosen"] / chosen_tokens
        return {"loss": round(got["pair_loss"] / pairs + self.objective.nll_weight() * nll, 5),
                "rewards_chosen": round(got["rewards_chosen"] / pairs, 5),
                "rewards_rejected": round(got["rewards_rejected"] / pairs, 5),
                "reward_margin": round((got["rewards_chosen"] - got["rewards_rejected"]) / pairs, 5),
                "reward_accuracy": round(got["correct"] / pairs, 5), "nll_chosen": round(nll, 5),
                "nll_rejected": round(got["nll_rejected"] / max(got["rejected_tokens"], 1), 5)}


TOKEN_LOSS = TokenLoss()


def disable_dropout(core) -> None:
    """Dropout off in the policy (as trl's DPO does by default): the policy and its reference then score an answer
    alike, and at the first step the policy is the reference exactly (DPO's loss is log 2). T5's attention keeps
    its dropout rate as a float (``T5Attention.dropout``), not as an ``nn.Dropout``: both are set to 0."""
    for module in core.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        elif isinstance(getattr(module, "dropout", None), float):
            module.dropout = 0.0


def saved_model_criterion(cfg):
    """The criterion ``evaluate`` scores a saved model by: None (the token loss), or a reference-free preference
    objective's; ``UserError`` for dpo, whose rewards need the policy its training started from."""
    from data.objectives.base import objective_for
    from lowmem.utils.errors import UserError

    objective = objective_for(cfg)
    if not objective.preference:
        return None
    if objective.reference is not None:
        raise UserError(f"evaluate --objective={objective.name}: its rewards compare the model with the reference "
                        "policy its training started from, which a saved model does not hold; the run's own "
                        "evaluations are in its metrics.jsonl (eval records), or evaluate with --objective=simpo "
                        "(reference-free rewards)")
    return PreferenceLoss(objective, None)


def criterion_for(ctx, model, core, data, say=print):
    """The run's criterion: the token loss, or its preference objective's with the reference it asks for (built
    here: before a resume loads trained weights, the model is still the starting policy)."""
    objective = data.objective
    if not objective.preference:
        return TOKEN_LOSS
    from lowmem.training.reference import reference_for

    disable_dropout(core)
    kind = objective.reference
    return PreferenceLoss(objective, reference_for(ctx, model, core, data, kind, say) if kind else None)
