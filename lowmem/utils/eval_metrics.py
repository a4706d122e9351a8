"""The scores an evaluation gives the generated answers (``--eval_metrics``), and the metric that picks best/.

    python train_low_mem.py train --is_finetune=True --eval_metrics=rouge,chrf --metric_for_best=rougeL
    python train_low_mem.py evaluate --init_from=runs/sft/best --is_finetune=True --eval_metrics=bleu,exact_match

Each kind of score is one ``Metric`` class, registered by its name in ``METRICS`` (``lowmem.utils.registry``): the
names it logs, which way is better, whether it needs generated answers, and how it scores (predictions, references)
on a 0-100 scale. ``EvalLoss`` is the one kind every evaluation computes without generating (evaluation measures
it; it has no ``name``: no ``--eval_metrics`` choice). Code elsewhere asks these classes (``metric_named``,
``metrics_of``), never compares a metric's name. Adding a metric: one subclass here with its ``name``.

On the ground floor, importing only ``lowmem.utils.registry`` (``config`` validates ``--eval_metrics`` through it).
"""

from __future__ import annotations

import importlib.util
import re

from lowmem.utils.registry import Registered

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
# Scripts written without spaces between words (CJK ideographs, kana, Thai, Lao, Myanmar, Khmer, CJK symbols):
# ROUGE counts them by character, as sacrebleu's "zh" tokenisation does for BLEU
_NO_SPACES = (r"[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
              r"\U00020000-\U0003ffff]")
_TOKEN = re.compile(rf"{_NO_SPACES}|[^\W_]+")


class Metric(Registered, family=True):
    """One kind of evaluation score.

    Attributes:
        name: its name in ``--eval_metrics``.
        names: the values it logs (in metrics.jsonl's ``eval`` records, the log line, the plots), each
            usable as ``--metric_for_best``.
        title: what the plot and the messages call it.
        higher_is_better: which way ``lowmem.training.evaluation.is_better`` compares its values.
        needs_generation: it scores generated answers (``--eval_generate`` must not be False to pick best/ by it).
        module: an optional package it imports (None: one the project requires anyway).
    """

    names: tuple[str, ...] = ()
    title = ""
    higher_is_better = True
    needs_generation = True
    module: str | None = None
    preference_only = False  # measured by the preference objectives' evaluation alone

    @classmethod
    def score(cls, predictions: list[str], references: list[str]) -> dict[str, float]:
        """``{name: value}`` (0-100) of ``predictions`` against one reference each."""
        raise NotImplementedError


def bleu_tokenizer(references: list[str]) -> str:
    """sacrebleu's "zh" tokenisation when any reference contains Chinese, else the standard "13a".

    "13a" leaves an unsegmented Chinese sentence one or two tokens (a reference missing one character
    scored 0), so a set of Chinese and English rows needs "zh", which tokenises everything but Chinese
    characters as "13a" does.
    """
    return "zh" if any(_CJK.search(r) for r in references) else "13a"


def bleu_score(predictions: list[str], references: list[str]) -> float:
    """Corpus BLEU-4 (0-100) of ``predictions`` against one reference each."""
    import sacrebleu

    if not references:
        return 0.0
    return sacrebleu.corpus_bleu(predictions, [references], tokenize=bleu_tokenizer(references)).score


class Bleu(Metric):
    """sacrebleu's corpus BLEU-4, tokenised "zh" when a reference holds Chinese (``bleu_tokenizer``)."""

    name, names, title = "bleu", ("bleu",), "BLEU-4"

    @classmethod
    def score(cls, predictions: list[str], references: list[str]) -> dict[str, float]:
        return {"bleu": bleu_score(predictions, references)}


class Chrf(Metric):
    """sacrebleu's corpus chrF (character 6-grams, beta 2): by character, so Chinese counts as English does."""

    name, names, title = "chrf", ("chrf",), "chrF"

    @classmethod
    def score(cls, predictions: list[str], references: list[str]) -> dict[str, float]:
        from sacrebleu.metrics import CHRF

        return {"chrf": CHRF().corpus_score(predictions, [references]).score if references else 0.0}


class RougeTokenizer:
    """Tokens for ``rouge_score``: each character of a script written without spaces (Chinese, Japanese, Thai,
    ...), lowercased words of the others. rouge_score's default keeps a-z0-9 only: Chinese would score 0."""

    @staticmethod
    def tokenize(text: str) -> list[str]:
        # Spaces around each such character first: "abc中文" is three tokens, not one word
        return _TOKEN.findall(re.sub(_NO_SPACES, r" \g<0> ", text.lower()))


class Rouge(Metric):
    """rouge_score's ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum (sentences split at newlines), the mean F-measure
    over the rows, with ``RougeTokenizer``."""

    name, names, title = "rouge", ("rouge1", "rouge2", "rougeL", "rougeLsum"), "ROUGE"
    module = "rouge_score"

    @classmethod
    def score(cls, predictions: list[str], references: list[str]) -> dict[str, float]:
        from rouge_score.rouge_scorer import RougeScorer

        scorer = RougeScorer(list(cls.names), tokenizer=RougeTokenizer())
        totals = dict.fromkeys(cls.names, 0.0)
        for prediction, reference in zip(predictions, references):
            for name, value in scorer.score(reference, prediction).items():
                totals[name] += value.fmeasure
        return {name: 100 * total / max(len(references), 1) for name, total in totals.items()}


class ExactMatch(Metric):
    """The share of answers equal to their reference, leading and trailing whitespace aside."""

    name, names, title = "exact_match", ("exact_match",), "exact match"

    @classmethod
    def score(cls, predictions: list[str], references: list[str]) -> dict[str, float]:
        same = sum(p.strip() == r.strip() for p, r in zip(predictions, references))
        return {"exact_match": 100 * same / max(len(references), 1)}


class EvalLoss(Metric):
    """The token-mean eval loss: every evaluation measures it (``lowmem.training.evaluation``), without generating."""

    names, title = ("eval_loss",), "eval loss"  # (no name: no --eval_metrics choice)
    higher_is_better = False
    needs_generation = False


class RewardScores(Metric):
    """A preference objective's rewards on the held-out pairs (``lowmem.training.preference_eval``): the share of
    pairs whose chosen answer gets the higher reward, the mean margin, the chosen answers' mean reward."""

    names, title = ("eval_reward_accuracy", "eval_reward_margin", "eval_rewards_chosen"), "reward"
    needs_generation = False
    preference_only = True


class ChosenNLL(Metric):
    """A preference objective's token-mean NLL of the held-out chosen answers."""

    names, title = ("eval_nll_chosen",), "chosen NLL"
    higher_is_better = False
    needs_generation = False
    preference_only = True


DEFAULT_METRICS = "bleu"  # --eval_metrics's default, and what a run computed before the option existed
METRICS: dict[str, type[Metric]] = Metric.kinds  # --eval_metrics's choices
EVAL_LOSS = EvalLoss
MEASURED = (EvalLoss, RewardScores, ChosenNLL)  # what evaluations measure without being asked (no name)


def metric_named(name: str) -> type[Metric] | None:
    """The kind of metric that logs ``name`` (eval_loss included); None for a name none logs."""
    return next((m for m in (*MEASURED, *METRICS.values()) if name in m.names), None)


def metrics_of(eval_metrics: str) -> list[type[Metric]]:
    """The metrics a ``--eval_metrics`` comma list names, in its order (unknown names left out: see
    ``metric_problems``)."""
    keys = dict.fromkeys(k.strip() for k in str(eval_metrics).split(","))
    return [METRICS[k] for k in keys if k in METRICS]


def metric_problems(eval_metrics: str, metric_for_best: str, eval_generate) -> list[str]:
    """What is wrong with ``--eval_metrics`` / ``--metric_for_best`` under ``--eval_generate`` (config's
    validation collects them)."""
    problems = []
    unknown = [k for k in (k.strip() for k in str(eval_metrics).split(",")) if k not in METRICS]
    if unknown:
        problems.append(f"--eval_metrics takes a comma list of {', '.join(METRICS)} (got {eval_metrics!r})")
    asked = metrics_of(eval_metrics)
    problems += [f"--eval_metrics={m.name} needs the {m.module} package: pip install -e . (or pip install "
                 f"{m.module.replace('_', '-')})" for m in asked if m.module and not _installed(m.module)]
    best = metric_named(metric_for_best)
    if best is None:
        names = ", ".join(n for m in (*MEASURED, *METRICS.values()) for n in m.names)
        problems.append(f"--metric_for_best must be one of {names} (got {metric_for_best!r})")
    elif best not in MEASURED and best not in asked:
        problems.append(f"--metric_for_best={metric_for_best} is a score of {best.name}, which --eval_metrics="
                        f"{eval_metrics} does not compute: add {best.name} to --eval_metrics")
    elif best.needs_generation and eval_generate is False:
        problems.append(f"--metric_for_best={metric_for_best} needs --eval_generate=True or auto ({best.title} "
                        "scores generated answers)")
    return problems


def score_answers(metrics: list[type[Metric]], predictions: list[str], references: list[str]) -> dict[str, float]:
    """Every value of ``metrics`` for ``predictions`` against ``references``, rounded to 4 decimals."""
    return {name: round(value, 4) for m in metrics for name, value in m.score(predictions, references).items()}


def scores_in(result: dict) -> dict[str, float]:
    """The scores of generated answers an evaluation's ``result`` holds, in its order (--eval_metrics's); none when
    it generated none."""
    names = {n for m in METRICS.values() for n in m.names}
    return {n: value for n, value in result.items() if n in names and value is not None}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
