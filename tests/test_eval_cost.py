"""Evaluation defaults sane at every model size (lowmem.training.eval_cost): the start-up line says what each evaluation
costs and what was chosen; options left at auto are made cheaper past --eval_budget_s, options given never are;
the eval loss does not depend on which rows generate; a resumed run keeps its plan."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import metrics, synthetic_rows, write_rows

from lowmem.cli.flags import load_config
from lowmem.training.eval_cost import choose

LINE = re.compile(r"^eval: .*$", re.M)
# 8 eval rows in batches of 4, answers of up to 16 tokens: a tiny model evaluates in a second or two
SMALL = ["--max_source_len=32", "--max_target_len=16", "--max_eval_samples=8", "--eval_batch_size=4",
         "--batch_size=8", "--gradient_accumulation_steps=1", "--eval_steps=1", "--save_steps=1", "--logging_steps=1"]


def cfg_with(**flags):
    return load_config({"eval_batch_size": 4, "max_eval_samples": 100, **flags})[0]


# ----------------------------------------------------------------------------- the options
def test_the_options_take_auto_or_a_value_and_refuse_anything_else():
    from lowmem.utils.errors import UserError

    cfg = load_config({})[0]
    assert (cfg.eval_generate, cfg.eval_generate_samples, cfg.eval_budget_s) == ("auto", "auto", 300.0)
    cfg = load_config({"eval_generate": "false", "eval_generate_samples": "16", "eval_budget_s": "0"})[0]
    assert (cfg.eval_generate, cfg.eval_generate_samples, cfg.eval_budget_s) == (False, 16, 0.0)
    assert load_config({"eval_generate": True, "eval_generate_samples": "AUTO"})[0].eval_generate_samples == "auto"
    for flags, fragment in [({"eval_generate": "maybe"}, "--eval_generate expects True, False or auto"),
                            ({"eval_generate_samples": 0}, "--eval_generate_samples must be at least 1 or auto"),
                            ({"eval_budget_s": -1}, "--eval_budget_s must not be negative")]:
        with pytest.raises(UserError, match=fragment):
            load_config(flags)
    notes = load_config({"eval_generate": False, "eval_generate_samples": 4})[1]
    assert "note: --eval_generate_samples has no effect with --eval_generate=False (no answers are generated)" in notes


# ----------------------------------------------------------------------------- the choice, from predicted costs
@pytest.mark.parametrize("flags, expected", [
    ({}, (48, False)),  # over: the baseline runs the loss only, the others generate the 12 batches that fit
    ({"eval_budget_s": 0}, (100, True)),  # no bound: as asked
    ({"eval_budget_s": 1000}, (100, True)),  # within: as asked
    ({"eval_generate": True}, (48, True)),  # generation asked for: every evaluation generates, on the rows that fit
    ({"eval_generate_samples": 80}, (80, False)),  # the rows given are obeyed
    ({"eval_generate": True, "eval_generate_samples": 80}, (80, True)),  # both given: as asked, whatever it costs
    ({"metric_for_best": "bleu"}, (48, True)),  # BLEU picks best/: every evaluation scores it, the same rows
    ({"eval_metrics": "rouge", "metric_for_best": "rougeL"}, (48, True)),  # as does any score of the answers
    ({"eval_generate": False}, (0, False)),
    ({"eval_budget_s": 21}, (0, False)),  # not one batch of answers fits: the loss only
    ({"eval_budget_s": 21, "eval_generate": True}, (4, True)),  # ... but generation was asked for: one batch
])
def test_choose_makes_cheaper_only_what_was_left_at_auto(flags, expected):
    # eval loss 20 s, a batch's answers 2.5 s (25 batches: 82.5 s as asked), a bound of 50 s by default here
    cfg = cfg_with(**{"eval_budget_s": 50, **flags})
    assert choose(cfg, 100, 1, 20.0, 2.5) == expected


def test_choose_counts_the_batches_of_the_busiest_process():
    # 2 processes, batches of 4: 8 rows a round of batches; 3 rounds fit in 50 - 20 = 30 s at 10 s a batch
    assert choose(cfg_with(eval_budget_s=50), 100, 2, 20.0, 10.0) == (24, False)


def plan(**fields):
    from lowmem.training.eval_cost import EvalPlan

    base = dict(rows=100, world=1, batch_size=4, max_new_tokens=128, asked_rows=100, generate_rows=100,
                baseline_generates=True, loss_s=20.0, batch_generate_s=2.5, budget_s=300.0, cheaper=False)
    return EvalPlan(**{**base, **fields})


@pytest.mark.parametrize("fields, line", [
    ({}, "eval: up to 82 s each (eval loss 20 s over 100 rows + generating 100 rows x up to 128 tokens 62 s), "
         "within --eval_budget_s=300"),
    ({"budget_s": 0.0}, "eval: up to 82 s each (eval loss 20 s over 100 rows + generating 100 rows x up to 128 "
                        "tokens 62 s), no bound: --eval_budget_s=0"),
    ({"asked_rows": 0, "generate_rows": 0, "baseline_generates": False},
     "eval: up to 20 s each (eval loss 20 s over 100 rows; no generation: --eval_generate=False)"),
    ({"budget_s": 50.0, "generate_rows": 48, "baseline_generates": False, "cheaper": True},
     "eval: as asked up to 82 s each (eval loss 20 s over 100 rows + generating 100 rows x up to 128 tokens 62 s), "
     "over --eval_budget_s=50: the step-0 evaluation runs eval loss only (up to 20 s), the others generate 48 of "
     "the 100 rows (up to 50 s each); change with --eval_generate=True (every evaluation generates), "
     "--eval_generate_samples=N, --eval_budget_s=0 (no bound)"),
    ({"rows": 0}, "eval: no eval rows"),
])
def test_the_start_up_line_says_the_cost_the_choice_and_how_to_change_it(fields, line):
    assert plan(**fields).line() == line


def test_a_plan_generates_at_the_baseline_only_where_it_said_so():
    cheap = plan(generate_rows=48, baseline_generates=False, cheaper=True)
    assert (cheap.rows_at(0), cheap.rows_at(1), cheap.seconds(0), cheap.seconds(48)) == (0, 48, 20.0, 50.0)
    assert cheap.record()["eval_predicted_baseline_s"] == 20.0 and cheap.record()["eval_predicted_s"] == 50.0


def test_the_eval_loss_does_not_depend_on_which_rows_generate(tmp_path, tokenizer):
    from accelerate import Accelerator

    from data.objectives.base import objective_for
    from data.pipeline import build_data, check_data
    from lowmem.model.build import build_model
    from lowmem.training.evaluation import EvalModel, evaluate_model
    from lowmem.training.run_context import RunContext

    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(100, seed=1))
    cfg = load_config(dict(train_file=str(train), output_dir=str(tmp_path / "run"), max_eval_samples=10,
                           eval_batch_size=3, max_target_len=8, dropout_rate=0.0))[0]
    objective = objective_for(cfg)
    data = build_data(cfg, check_data(cfg, objective), tokenizer)
    torch.manual_seed(0)
    model = build_model(cfg, tokenizer).eval()
    acc = Accelerator(cpu=True)
    at = EvalModel(RunContext.plain(cfg, acc), model, model, tokenizer, data.collator)
    run = {rows: evaluate_model(at, data.eval_examples, generate_rows=rows) for rows in (None, 4, 0)}
    assert run[None]["scored_rows"] == 10 and run[4]["scored_rows"] == 4 and "bleu" not in run[0]
    assert run[4]["eval_loss"] == pytest.approx(run[None]["eval_loss"], rel=1e-5) == run[0]["eval_loss"]
    assert all(r["eval_examples"] == 10 for r in run.values())
    no_generation = cfg_with(eval_generate=False)  # a plan generates fewer rows than the flags ask, never more
    at = EvalModel(RunContext.plain(no_generation, acc), model, model, tokenizer, data.collator)
    assert "bleu" not in evaluate_model(at, data.eval_examples, generate_rows=4)


# ----------------------------------------------------------------------------- the real entry point
def run_files(tmp_path):
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(400, seed=1))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=2))
    return [f"--train_file={train}", f"--eval_file={evals}"]


def generated(run) -> dict[int, int]:
    """Rows generated at each evaluation, by step (0: the loss only)."""
    return {r["step"]: r.get("scored_rows", 0) for r in metrics(run) if r["event"] == "eval"}


def test_within_the_budget_every_evaluation_generates_as_asked_and_the_line_says_its_cost(tmp_path, run_cli):
    run = tmp_path / "run"
    proc = run_cli("train", *run_files(tmp_path), f"--output_dir={run}", *SMALL, "--max_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = LINE.search(proc.stdout).group(0)
    numbers = re.fullmatch(r"eval: up to ([\d.,]+) s each \(eval loss ([\d.]+) s over 8 rows \+ generating 8 rows x "
                           r"up to 16 tokens ([\d.,]+) s\), within --eval_budget_s=300", line)
    assert numbers, line
    setup = next(r for r in metrics(run) if r["event"] == "setup")
    assert setup["eval_generate_rows"] == setup["eval_baseline_generate_rows"] == 8 and not setup["eval_made_cheaper"]
    assert 0 < setup["eval_predicted_loss_s"] < setup["eval_predicted_s"] == setup["eval_predicted_asked_s"] <= 300
    assert float(numbers.group(1).replace(",", "")) == pytest.approx(setup["eval_predicted_s"], abs=0.51)
    assert generated(run) == {0: 8, 1: 8, 2: 8}


def test_past_the_budget_the_auto_options_get_cheaper_and_the_options_given_are_obeyed(tmp_path, run_cli):
    files = run_files(tmp_path)
    # A bound no evaluation meets: --eval_generate=auto and --eval_generate_samples=auto give way
    auto = tmp_path / "auto"
    proc = run_cli("train", *files, f"--output_dir={auto}", *SMALL, "--max_steps=2", "--eval_budget_s=0.001")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = LINE.search(proc.stdout).group(0)
    assert re.fullmatch(r"eval: as asked up to [\d.,]+ s each \(eval loss [\d.]+ s over 8 rows \+ generating 8 rows "
                        r"x up to 16 tokens [\d.,]+ s\), over --eval_budget_s=0.001: every evaluation runs eval loss "
                        r"only \(not one batch of answers fits\); change with --eval_generate=True .*", line), line
    assert generated(auto) == {0: 0, 1: 0, 2: 0}
    assert next(r for r in metrics(auto) if r["event"] == "setup")["eval_made_cheaper"]
    assert "bleu" not in proc.stdout  # (the result holds no BLEU either)

    # The rows given stay; the baseline (--eval_generate left at auto) runs the loss only
    rows = tmp_path / "rows"
    proc = run_cli("train", *files, f"--output_dir={rows}", *SMALL, "--max_steps=2", "--eval_budget_s=0.001",
                   "--eval_generate_samples=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"the step-0 evaluation runs eval loss only \(up to [\d.]+ s\), the others generate 4 of the 8 "
                     r"rows \(up to [\d.]+ s each\)", proc.stdout), proc.stdout
    assert generated(rows) == {0: 0, 1: 4, 2: 4}
    assert "eval step 1 | eval_loss" in proc.stdout and "(4 of 8 rows)" in proc.stdout

    # Both given: every evaluation generates every row asked for, however far past the bound
    both = tmp_path / "both"
    proc = run_cli("train", *files, f"--output_dir={both}", *SMALL, "--max_steps=2", "--eval_budget_s=0.001",
                   "--eval_generate=True", "--eval_generate_samples=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert LINE.search(proc.stdout).group(0).endswith("over --eval_budget_s=0.001: the values given are obeyed")
    assert generated(both) == {0: 8, 1: 8, 2: 8}


def test_generation_asked_for_keeps_one_batch_and_a_resume_keeps_the_plan(tmp_path, run_cli):
    files = run_files(tmp_path)
    run = tmp_path / "run"
    flags = [*files, f"--output_dir={run}", *SMALL, "--eval_budget_s=0.001", "--eval_generate=True"]
    proc = run_cli("train", *flags, "--max_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every evaluation generates 4 of the 8 rows" in proc.stdout
    assert generated(run) == {0: 4, 1: 4}
    proc = run_cli("train", *flags, "--max_steps=2", "--is_keep_training=True")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(planned when the run began)" in LINE.search(proc.stdout).group(0)
    assert generated(run)[2] == 4
