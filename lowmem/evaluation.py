"""Evaluation metrics: corpus BLEU-4 through sacrebleu, and the best-model comparison."""

from __future__ import annotations

import re

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def bleu_tokenizer(references: list[str]) -> str:
    """sacrebleu's "zh" tokenisation when most references contain Chinese, else the standard "13a"."""
    chinese = sum(1 for r in references if _CJK.search(r))
    return "zh" if references and chinese * 2 >= len(references) else "13a"


def bleu_score(predictions: list[str], references: list[str]) -> float:
    """Corpus BLEU-4 (0-100) of ``predictions`` against one reference each."""
    import sacrebleu

    if not references:
        return 0.0
    return sacrebleu.corpus_bleu(predictions, [references], tokenize=bleu_tokenizer(references)).score


def is_better(value: float, best: float | None, metric: str) -> bool:
    """Whether ``value`` beats ``best`` for ``metric`` (eval_loss: lower; bleu: higher)."""
    if value != value:  # NaN never wins
        return False
    if best is None:
        return True
    return value < best if metric == "eval_loss" else value > best
