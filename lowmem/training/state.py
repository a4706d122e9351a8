"""The counters a training run keeps in every checkpoint (``TrainState``; never on the config), and how an
evaluation moves them."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from lowmem.training.eval_cost import rows_at
from lowmem.utils.eval_metrics import scores_in


@dataclass
class TrainState:
    """Runtime counters saved in every checkpoint (never on the config)."""

    step: int = 0
    epoch: int = 0  # epochs every process has finished
    examples: int = 0
    target_tokens: int = 0  # non-pad target tokens trained on: what the losses are averaged over
    best_metric: float | None = None
    best_step: int | None = None
    best_eval_loss: float | None = None  # of the best model (breaks BLEU ties)
    elapsed_s: float = 0.0  # trained before this process started (``now`` adds this process's part)
    nonfinite_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    nonfinite_in_a_row: int = 0
    loss_scaler: dict | None = None  # fp16's: the scaler's state and its skipped steps (lowmem.hardware.precision)
    last_eval: dict | None = None  # step, eval_loss and the scores of the latest evaluation
    eval_plan: dict | None = None  # what each evaluation generates (memory.eval_cost): planned once, kept on resume

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():  # "tokens": the name in checkpoints before 2026-11-28
            setattr(self, {"tokens": "target_tokens"}.get(key, key), value)

    def count_step(self, target_tokens: int, examples: int) -> None:
        """An optimizer step applied (a skipped one is counted by ``lowmem.training.stopping``)."""
        self.step += 1
        self.target_tokens += target_tokens
        self.examples += examples
        self.nonfinite_in_a_row = 0

    def elapsed(self, started: float) -> float:
        """Seconds trained so far, this process's part counted from ``started`` (its ``time.time()``)."""
        return self.elapsed_s + time.time() - started

    def now(self, started: float) -> dict:
        """The counters with the time trained so far, as checkpoints and exports keep them. ``elapsed_s``
        itself stays the time before this process started (storing the sum there at each checkpoint counted
        the same seconds again at the next one)."""
        return {**self.state_dict(), "elapsed_s": round(self.elapsed(started), 2)}

    def eval_generate_rows(self) -> int:
        """Eval rows whose answers the evaluation at this step generates and scores (as ``eval_plan`` chose)."""
        return rows_at(self.eval_plan, self.step)

    def note_eval(self, result: dict, best_by: str | None) -> None:
        """An evaluation at this step; ``best_by``: the metric it is the best model by (None: it is not)."""
        self.last_eval = {"step": self.step, "eval_loss": result["eval_loss"], **scores_in(result)}
        if best_by is not None:
            self.best_metric, self.best_step, self.best_eval_loss = result[best_by], self.step, result["eval_loss"]
