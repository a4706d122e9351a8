"""The scores of --eval_metrics (lowmem.utils.eval_metrics): equal to the reference implementations (sacrebleu,
rouge_score) on English and Chinese pairs, Chinese not scored as zero by ROUGE, refused mistakes as one line, and a
real run that logs every score and picks best/ by rougeL."""

from __future__ import annotations

import json
import re

import pytest
from conftest import metrics, write_rows

from lowmem.cli.flags import load_config
from lowmem.training.evaluation import eval_log_line, is_better
from lowmem.utils.errors import UserError
from lowmem.utils.eval_metrics import METRICS, Rouge, RougeTokenizer, metric_named, score_answers

ROUGE_NAMES = ["rouge1", "rouge2", "rougeL", "rougeLsum"]
# (prediction, reference): English and Chinese, exact, close, far, empty, multi-sentence (rougeLsum's newlines)
PAIRS = [
    ("the cat sat on the mat", "the cat sat on the mat"),
    ("a quick brown fox jumps over the dog", "the quick brown fox jumped over the lazy dog"),
    ("I don't know.", "I do not know, sorry."),
    ("Lag makes me unhappy.\nIt is slow.", "It is slow.\nLag.  Lag makes me unhappy."),
    ("", "sometimes when i'm on a good power supply i feel tipsy"),
    ("今天天气很好，我们去公园。", "今天天气很好，我们去公园吧。"),
    ("我当然喜欢。", "我当然喜欢。"),
    ("哈尔有几个问题要解决。", "哈尔有几个问题需要解决。"),
    ("你好", "再见"),
    ("  yes  ", "yes"),
]
PREDICTIONS, REFERENCES = [p for p, _ in PAIRS], [r for _, r in PAIRS]


def reference_rouge(predictions: list[str], references: list[str], tokenizer=None) -> dict[str, float]:
    """rouge_score's own scorer, aggregated as the transformers examples do: the mean F-measure, times 100."""
    from rouge_score.rouge_scorer import RougeScorer

    scorer = RougeScorer(ROUGE_NAMES, tokenizer=tokenizer)
    scores = [scorer.score(r, p) for p, r in zip(predictions, references)]
    return {name: 100 * sum(s[name].fmeasure for s in scores) / len(scores) for name in ROUGE_NAMES}


def test_each_score_equals_its_reference_implementation():
    import sacrebleu
    from sacrebleu.metrics import CHRF

    scores = score_answers(list(METRICS.values()), PREDICTIONS, REFERENCES)
    assert list(scores) == ["bleu", "chrf", *ROUGE_NAMES, "exact_match"]
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(PREDICTIONS, [REFERENCES], tokenize="zh").score,
                                           abs=1e-4)
    assert scores["chrf"] == pytest.approx(CHRF().corpus_score(PREDICTIONS, [REFERENCES]).score, abs=1e-4)
    expected = reference_rouge(PREDICTIONS, REFERENCES, RougeTokenizer())
    assert {n: scores[n] for n in ROUGE_NAMES} == {n: pytest.approx(v, abs=1e-4) for n, v in expected.items()}
    assert scores["exact_match"] == pytest.approx(100 * 3 / len(PAIRS))  # the cat, 我当然喜欢, yes (spaces aside)
    assert all(0 < v < 100 for v in scores.values())
    assert scores["rougeLsum"] > scores["rougeL"]  # the sentences in another order: rougeLsum matches each one


def test_english_rouge_is_rouge_scores_own():
    """On ASCII English text the tokenizer is rouge_score's default one: lowercased words of a-z0-9."""
    from rouge_score.tokenizers import DefaultTokenizer

    english = [i for i, (p, r) in enumerate(PAIRS) if (p + r).isascii()]
    predictions, references = [PREDICTIONS[i] for i in english], [REFERENCES[i] for i in english]
    for text in predictions + references:
        assert RougeTokenizer.tokenize(text) == DefaultTokenizer().tokenize(text)
    ours = Rouge().score(predictions, references)
    assert ours == {n: pytest.approx(v, abs=1e-9) for n, v in reference_rouge(predictions, references).items()}


def test_chinese_is_scored_by_character_not_as_zero():
    chinese = ["今天天气很好，我们去公园吧。", "我当然喜欢。"]
    same = score_answers(list(METRICS.values()), chinese, chinese)
    assert same == {name: pytest.approx(100.0) for name in same}
    close = Rouge().score(["今天天气很好。", "我喜欢。"], chinese)
    assert all(0 < v < 100 for v in close.values()), close
    assert reference_rouge(chinese, chinese)["rouge1"] == 0.0  # rouge_score's default tokenizer: nothing left
    assert RougeTokenizer.tokenize("abc中文, Привет 日本語のテキスト") == [
        "abc", "中", "文", "привет", "日", "本", "語", "の", "テ", "キ", "ス", "ト"]


def test_the_best_model_is_chosen_each_metrics_way():
    assert metric_named("rougeLsum") is metric_named("rouge1") and metric_named("eval_loss").needs_generation is False
    assert metric_named("nope") is None
    assert is_better({"rougeL": 40.0, "eval_loss": 9.0}, 30.0, 2.0, "rougeL")
    assert not is_better({"chrf": 30.0, "eval_loss": 1.0}, 31.0, 2.0, "chrf")
    assert is_better({"exact_match": 0.0, "eval_loss": 7.6}, 0.0, 9.6, "exact_match")  # a tie: the lower loss
    assert not is_better({"eval_loss": 9.7}, 9.6, 9.6, "eval_loss")


def test_the_eval_line_says_every_score_and_the_rows_they_scored():
    result = {"eval_loss": 2.5, "chrf": 12.345, "rouge1": 50.0, "rougeL": 40.0, "scored_rows": 16,
              "eval_examples": 100}
    assert eval_log_line(4, result, True) == ("eval step 4 | eval_loss 2.5000 | chrf 12.35 | rouge1 50.00 | "
                                              "rougeL 40.00 (16 of 100 rows) | new best")
    assert eval_log_line(0, {"eval_loss": 2.5, "eval_examples": 100}, False) == "eval step 0 | eval_loss 2.5000"


@pytest.mark.parametrize("flags, fragment", [
    ({"eval_metrics": "foo"}, "--eval_metrics takes a comma list of bleu, chrf, rouge, exact_match (got 'foo')"),
    ({"eval_metrics": "bleu,"}, "--eval_metrics takes a comma list"),
    ({"metric_for_best": "rougeL"}, "--metric_for_best=rougeL is a score of rouge, which --eval_metrics=bleu does "
                                    "not compute: add rouge to --eval_metrics"),
    ({"metric_for_best": "rouge"}, "--metric_for_best must be one of eval_loss, eval_reward_accuracy, "
     "eval_reward_margin, eval_rewards_chosen, eval_nll_chosen, bleu, chrf, rouge1, rouge2, rougeL"),
    ({"eval_metrics": "rouge", "metric_for_best": "rougeL", "eval_generate": False},
     "--metric_for_best=rougeL needs --eval_generate=True or auto (ROUGE scores generated answers)"),
])
def test_a_metric_mistake_is_refused_before_anything_runs(flags, fragment):
    with pytest.raises(UserError) as err:
        load_config(flags)
    assert fragment in str(err.value)


def test_the_metric_options_accepted():
    cfg, notes = load_config({"eval_metrics": ("rouge", "chrf"), "metric_for_best": "rougeLsum"})  # fire's tuple
    assert cfg.eval_metrics == "rouge,chrf" and not notes
    assert load_config({"eval_metrics": "exact_match", "metric_for_best": "eval_loss", "eval_generate": False})[1] == [
        "note: --eval_metrics has no effect with --eval_generate=False (no answers are generated)"]


@pytest.mark.parametrize("flags", [["--eval_metrics=foo"], ["--metric_for_best=rougeL"]])
def test_a_metric_mistake_on_the_command_line_is_one_error_line(tmp_path, flags, cli_in_process):
    proc = cli_in_process("train", f"--output_dir={tmp_path / 'run'}", *flags)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "--eval_metrics" in lines[0] and not (tmp_path / "run").exists()


def chinese_pairs(root) -> tuple:
    """Chinese prompts answered by one sentence (a tiny model learns it in a few steps); half the eval rows want
    another, so ROUGE is neither 0 nor 100."""
    import random

    rng = random.Random(0)
    words = "天地人你我他山水火木金土日月风雨花草鱼鸟"

    def prompt():
        return "".join(rng.choice(words) for _ in range(rng.randint(3, 8))) + "？"

    learnt, other = "好的，我知道了。", "我不知道。"
    train = write_rows(root / "train.jsonl", [{"prompt": prompt(), "response": learnt} for _ in range(400)])
    evals = write_rows(root / "eval.jsonl", [{"prompt": prompt(), "response": learnt if i % 2 else other}
                                             for i in range(8)])
    return train, evals


def test_a_run_logs_rouge_and_chrf_and_picks_best_by_rouge_l(tmp_path, run_cli):
    train, evals = chinese_pairs(tmp_path)
    run = tmp_path / "run"
    proc = run_cli("train", f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={run}",
                   "--eval_metrics=rouge,chrf", "--metric_for_best=rougeL", "--max_steps=20", "--eval_steps=10",
                   "--logging_steps=10", "--save_steps=0", "--max_eval_samples=8", "--max_source_len=16",
                   "--max_target_len=12", "--learn_rate=1e-2", "--warmup_steps=2", "--batch_size=16",
                   "--gradient_accumulation_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in metrics(run) if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [0, 10, 20]
    for record in evals:
        assert {"chrf", *ROUGE_NAMES} <= set(record) and "bleu" not in record and record["scored_rows"] == 8
    assert max(r["rougeL"] for r in evals) > 0  # Chinese answers: not scored as zero
    # best/ is the model of the highest rougeL (a tie: the lower eval loss), and says so
    best = max(evals, key=lambda r: (r["rougeL"], -r["eval_loss"]))
    assert [r["step"] for r in evals if r["best"]][-1] == best["step"]
    info = json.loads((run / "best" / "training_info.json").read_text())
    assert (info["best_step"], info["best_metric"]) == (best["step"], best["rougeL"])
    assert f"| rougeL {best['rougeL']:.2f} |" in proc.stdout
    # the values in --eval_metrics's order, in the log line as in the record
    line = r"^eval step 0 \| eval_loss \S+ \| rouge1 \S+ \| rouge2 \S+ \| rougeL \S+ \| rougeLsum \S+ \| chrf "
    assert re.search(line, proc.stdout, re.M), proc.stdout
    assert [k for k in evals[0] if k in ("chrf", *ROUGE_NAMES)] == [*ROUGE_NAMES, "chrf"]

    plots = run_cli("plot", f"--output_dir={run}")
    assert plots.returncode == 0, plots.stderr[-3000:]
    charts = {p.name for p in (run / "plots").glob("*.png")}
    assert {"rouge.png", "chrf.png"} <= charts and "bleu.png" not in charts
