"""What an evaluation costs, predicted before training starts, and the evaluation defaults that keep one
within --eval_budget_s.

An evaluation runs the eval loss over its rows (one forward each) and, with --eval_generate, generates answers
for --eval_metrics: up to --max_target_len decoding steps per batch, all of which a young model, which rarely
stops early, runs. ``plan_evals`` times both on one eval batch of the run's own model (``probe``: a loss
forward, then generations forced to 1 and to 1 + PROBE_STEPS tokens, whose difference is the cost of a decoding
step) and predicts an evaluation from them. When the prediction passes --eval_budget_s, ``choose`` makes
cheaper what was left at auto: with --eval_generate=auto the step-0 evaluation (the baseline, before any
training) runs the eval loss only, and with --eval_generate_samples=auto the others generate for as many of the
eval set's first rows as fit, none when not one batch fits (one batch with --eval_generate=True or
a --metric_for_best scoring answers, such as bleu, which also keep the baseline's). A value given is obeyed. A
resumed run keeps the plan it began with (the same rows scored, so the scores stay comparable), unless the
options it was made for changed.

The trainer calls ``plan_evals`` once the model is built; the start-up summary says ``EvalPlan.line``.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from config import AUTO, TrainConfig, flags_with
from lowmem.hardware.precision import compute_context
from lowmem.model.loss import batch_to_device
from lowmem.parallel.sharding import whole_root
from lowmem.training.encoder_cache import encoder_on
from lowmem.training.evaluation import (
    EvalModel,
    asked_generate_rows,
    eval_batches,
    generate_for,
    loss_and_inputs,
    loss_budget,
)
from lowmem.training.run_context import RunContext
from lowmem.utils.eval_metrics import metric_named

PROBE_STEPS = 8  # decoding steps timed (after one untimed warm-up generation and a timed one-token one)
# What a plan depends on (the flags' planned_for role): a resumed run where one of them differs plans again
PLANNED_FOR = flags_with("planned_for")


@dataclass
class EvalPlan:
    """What each evaluation of a run generates, and what it is predicted to cost (seconds on the busiest
    process, with a model that never stops generating early: an upper bound)."""

    rows: int  # eval rows (the eval loss's), over all processes
    world: int
    batch_size: int  # --eval_batch_size
    max_new_tokens: int  # --max_target_len: what evaluation generates up to
    asked_rows: int  # rows generated as the options ask (0: --eval_generate=False)
    generate_rows: int  # rows generated at an evaluation that generates (the eval set's first)
    baseline_generates: bool  # the step-0 evaluation generates too
    loss_s: float  # one evaluation's eval loss
    batch_generate_s: float  # generating one batch to --max_new_tokens
    budget_s: float  # --eval_budget_s (0: no bound)
    cheaper: bool  # the defaults were made cheaper to fit it
    planned_for: dict = field(default_factory=dict)  # PLANNED_FOR's values
    resumed: bool = False  # the plan the run began with

    def rows_at(self, step: int) -> int:
        """Rows whose answers the evaluation at optimizer step ``step`` generates."""
        return self.generate_rows if step or self.baseline_generates else 0

    def seconds(self, generate_rows: int) -> float:
        """Predicted seconds of an evaluation generating for ``generate_rows`` rows."""
        return self.loss_s + busiest_batches(generate_rows, self.world, self.batch_size) * self.batch_generate_s

    def state(self) -> dict:
        """Kept in ``TrainState.eval_plan`` (so in every checkpoint): a resumed run reads it back."""
        return {key: value for key, value in asdict(self).items() if key != "resumed"}

    def line(self) -> str:
        """The start-up summary's line: what each evaluation costs, what was chosen, why, and how to change it."""
        if not self.rows:
            return "eval: no eval rows"
        loss = f"eval loss {_s(self.loss_s)} over {self.rows} rows"
        began = " (planned when the run began)" if self.resumed else ""
        if not self.asked_rows:
            return f"eval: up to {_s(self.loss_s)} each{began} ({loss}; no generation: --eval_generate=False)"
        asked = (f"{loss} + generating {self.asked_rows} rows x up to {self.max_new_tokens} tokens "
                 f"{_s(self.seconds(self.asked_rows) - self.loss_s)}")
        bound = f"--eval_budget_s={self.budget_s:g}"
        if not self.cheaper:
            over = self.budget_s and self.seconds(self.asked_rows) > self.budget_s
            verdict = "no bound: --eval_budget_s=0" if not self.budget_s else \
                f"over {bound}: the values given are obeyed" if over else f"within {bound}"
            return f"eval: up to {_s(self.seconds(self.asked_rows))} each{began} ({asked}), {verdict}"
        later = self.rows_at(1)
        who = "every evaluation generates" if self.baseline_generates else \
            f"the step-0 evaluation runs eval loss only (up to {_s(self.loss_s)}), the others generate"
        chosen = (f"{who} {later} of the {self.rows} rows (up to {_s(self.seconds(later))} each)" if later
                  else "every evaluation runs eval loss only (not one batch of answers fits)")
        return (f"eval: as asked up to {_s(self.seconds(self.asked_rows))} each{began} ({asked}), over {bound}: "
                f"{chosen}; change with --eval_generate=True (every evaluation generates), --eval_generate_samples=N, "
                "--eval_budget_s=0 (no bound)")

    def record(self) -> dict:
        """The setup record's fields (metrics.jsonl)."""
        later = self.rows_at(1)
        return {"eval_generate_rows": later, "eval_baseline_generate_rows": self.rows_at(0),
                "eval_predicted_s": round(self.seconds(later), 2),
                "eval_predicted_baseline_s": round(self.seconds(self.rows_at(0)), 2),
                "eval_predicted_asked_s": round(self.seconds(self.asked_rows), 2),
                "eval_predicted_loss_s": round(self.loss_s, 2), "eval_budget_s": self.budget_s,
                "eval_made_cheaper": self.cheaper}


def busiest_batches(rows: int, world: int, batch_size: int) -> int:
    """Eval batches of the process with the most of ``rows`` (each takes every world-th row)."""
    return math.ceil(math.ceil(rows / world) / batch_size)


def choose(cfg: TrainConfig, rows: int, world: int, loss_s: float, batch_generate_s: float) -> tuple[int, bool]:
    """(rows generated at an evaluation that generates, whether the step-0 evaluation generates) for a run
    whose eval loss is predicted at ``loss_s`` seconds and the generation of a batch at ``batch_generate_s``."""
    asked = asked_generate_rows(cfg, rows)
    seconds = loss_s + busiest_batches(asked, world, cfg.eval_batch_size) * batch_generate_s
    if not asked or not cfg.eval_budget_s or seconds <= cfg.eval_budget_s:
        return asked, bool(asked)
    # Generation asked for in so many words (or needed: a score of answers picks best/) goes on at every evaluation
    kept = cfg.eval_generate is True or metric_named(cfg.metric_for_best).needs_generation
    if cfg.eval_generate_samples != AUTO:
        return asked, kept
    per_batch = cfg.eval_batch_size * world  # rows of one batch on every process
    batches = int(max(cfg.eval_budget_s - loss_s, 0) // batch_generate_s) if batch_generate_s > 0 else rows
    fitting = min(asked, batches * per_batch) or (min(asked, per_batch) if kept else 0)
    return fitting, kept and fitting > 0


@contextlib.contextmanager
def modes_kept(model):
    """Every submodule back in the train or eval mode it was in (the probe runs the model in eval mode)."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


@torch.no_grad()
def probe(at: EvalModel, examples: list, generation: bool) -> list[float]:
    """[seconds of one eval batch's loss forward, of its generation's fixed part, of one decoding step], timed on
    this process's middle eval batch of ``examples`` by source length (zeros for a process without rows), with the
    run's model ``at``. Each part runs once untimed first: the run's first forward and generation pay for
    allocations a later one does not. Sharded, every process runs the same forwards (each is a collective)."""
    cfg, accelerator, collator, sharded = at.cfg, at.ctx.accelerator, at.collator, at.sharded
    batches = eval_batches(examples, collator, cfg, accelerator, sharded, len(examples))
    if not batches:
        return [0.0, 0.0, 0.0]
    at.model.eval()
    batch = batch_to_device(collator(batches[len(batches) // 2][0]), accelerator.device, at.ctx.multiple)
    budget = loss_budget(accelerator, sharded)
    with compute_context(accelerator, cfg.mixed_precision), whole_root(at.core):
        forward = at.ctx.criterion.eval_forward if at.ctx.criterion else lambda *a: loss_and_inputs(*a)[1]
        inputs = forward(at, batch, budget)  # (a preference objective's: both answers')
        loss_s = _timed(lambda: forward(at, batch, budget))
        if not generation:
            return [loss_s, 0.0, 0.0]
        generate_for(at, inputs, batch, 1, forced=True)
        short = _timed(lambda: generate_for(at, inputs, batch, 1, forced=True))
        long = _timed(lambda: generate_for(at, inputs, batch, 1 + PROBE_STEPS, forced=True))
    step = max(long - short, 0.0) / PROBE_STEPS
    return [loss_s, max(short - step, 0.0), step]


def slowest(accelerator, values: list[float]) -> list[float]:
    """Each of ``values``' largest over processes (the same answer on all)."""
    if accelerator.num_processes == 1:
        return values
    gathered = accelerator.gather(torch.tensor([values], dtype=torch.float64, device=accelerator.device)).cpu()
    return gathered.max(dim=0).values.tolist()


def plan_evals(ctx: RunContext, model, core, data, state) -> EvalPlan:
    """The run's ``EvalPlan``, kept in ``state.eval_plan`` (the trainer's ``TrainState``): a resumed run's when
    planned for the same options, else timed by ``probe`` on the model (``model`` as prepared, ``core`` inside it;
    ``data``: the run's ``TrainData``) and chosen by ``choose`` (the same on every process)."""
    cfg, accelerator = ctx.cfg, ctx.accelerator
    planned_for = {key: getattr(cfg, key) for key in PLANNED_FOR}
    saved = state.eval_plan or {}
    if saved.get("planned_for") == planned_for and saved.keys() == EvalPlan.__dataclass_fields__.keys() - {"resumed"}:
        return EvalPlan(**saved, resumed=True)
    examples = data.eval_examples
    rows, world = len(examples), accelerator.num_processes
    asked = asked_generate_rows(cfg, rows)
    timings = [0.0, 0.0, 0.0]
    if rows:
        with encoder_on(core, accelerator.device), modes_kept(model):  # (the encoder cache takes it off the GPU)
            timings = probe(EvalModel(ctx, model, core, None, data.collator), examples, bool(asked))  # (no text)
    loss_per_batch, fixed, step = slowest(accelerator, timings)
    batches = busiest_batches(rows, world, cfg.eval_batch_size)
    batch_generate_s = fixed + step * cfg.max_target_len
    generate_rows, baseline = choose(cfg, rows, world, loss_per_batch * batches, batch_generate_s)
    cheaper = (generate_rows, baseline) != (asked, bool(asked))
    plan = EvalPlan(rows, world, cfg.eval_batch_size, cfg.max_target_len, asked, generate_rows, baseline,
                    loss_per_batch * batches, batch_generate_s, cfg.eval_budget_s, cheaper, planned_for)
    state.eval_plan = plan.state()
    return plan


def rows_at(plan_state: dict, step: int) -> int:
    """Rows whose answers the evaluation at optimizer step ``step`` generates, by a plan's ``state()``."""
    return EvalPlan(**plan_state).rows_at(step)


def _s(seconds: float) -> str:
    return f"{seconds:,.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
