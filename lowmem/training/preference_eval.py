"""Evaluation of a preference objective on held-out pairs: the pair loss, the rewards, the reward accuracy (the
share of pairs whose chosen answer gets the higher reward) and the answers' NLLs, each named ``eval_*``; and, when
asked, the scores of --eval_metrics of answers generated for the prompts against the chosen answers."""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from lowmem.model.loss import batch_to_device
from lowmem.parallel.distributed import any_process
from lowmem.parallel.sharding import whole_root
from lowmem.training.evaluation import EvalModel, asked_generate_rows, eval_batches, generate_for
from lowmem.utils.eval_metrics import metrics_of, score_answers


@torch.no_grad()
def evaluate_pairs(at: EvalModel, criterion, examples: list, progress: bool = False, interrupted=None,
                   generate_rows: int | None = None) -> dict:
    """``lowmem.training.evaluation.evaluate_model`` for preference pairs (``criterion``: the run's
    ``PreferenceLoss``): every world-th pair on each process, the sums reduced once at the end."""
    from accelerate.utils import gather_object

    start, cfg, accelerator = time.time(), at.cfg, at.ctx.accelerator
    at.model.eval()
    asked = asked_generate_rows(cfg, len(examples))
    generate_rows = asked if generate_rows is None else min(generate_rows, asked)
    sums, answers = torch.zeros(len(criterion.SUMS), dtype=torch.float64, device=accelerator.device), []
    for chunk, generate, real in tqdm(eval_batches(examples, at.collator, cfg, accelerator, at.sharded, generate_rows),
                                      desc="eval", leave=False, disable=not progress):
        if interrupted is not None and (any_process(accelerator, interrupted()) if at.sharded else interrupted()):
            break
        batch = batch_to_device(at.collator(chunk), accelerator.device, at.ctx.multiple)
        with at.ctx.precision.autocast(accelerator), whole_root(at.core):
            logged = pair_sums(at, criterion, batch, chunk)
            prompts = {"input_ids": batch["input_ids"]}
            generated = generate_for(at, prompts, batch, cfg.max_target_len) if generate else None
        if not real:
            continue
        sums += logged.double()
        if generated is not None:
            predictions = at.tokenizer.batch_decode(generated, skip_special_tokens=True)
            answers.extend(zip(predictions, [e.response for e in chunk]))
    if accelerator.num_processes > 1:
        sums = accelerator.reduce(sums, "sum")
        answers = gather_object(answers)
    values = sums.tolist()
    result = {f"eval_{k}" if k != "loss" else "eval_loss": v for k, v in criterion.fields(values).items()}
    if generate_rows:
        result.update(score_answers(metrics_of(cfg.eval_metrics), [p for p, _ in answers], [r for _, r in answers]))
        result["scored_rows"] = len(answers)
    pairs = int(values[criterion.SUMS.index("pairs")])
    return {**result, "eval_examples": pairs, "eval_s": round(time.time() - start, 2)}


def pair_sums(at: EvalModel, criterion, batch: dict, examples: list) -> torch.Tensor:
    """The criterion's SUMS of one eval batch of ``examples``: the policy's scores and the reference's of its pairs."""
    return criterion.sums(criterion.scores(at.ctx, at.model, at.core, batch, examples))[2]
