"""Preference tuning: each loss and its gradient against a computation by hand, DPO against trl's documented formula,
each answer's log-probability against separate forwards, and DPO runs that resume bit for bit (the cached
reference's pre-pass included)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, synthetic_rows, write_rows
from safetensors.torch import load_file
from transformers import T5Config, T5ForConditionalGeneration

from config import TrainConfig
from data.objectives.base import objective_class
from data.objectives.preference import PairScores
from lowmem.model.answer_logprobs import answer_logprobs

# Per-pair summed log-probabilities (policy, reference) and answer lengths of a fixture of three pairs
CHOSEN, REJECTED = [-4.0, -7.5, -2.25], [-5.5, -6.0, -9.0]
REF_CHOSEN, REF_REJECTED = [-4.5, -7.0, -3.0], [-5.0, -6.5, -8.0]
CHOSEN_TOKENS, REJECTED_TOKENS = [3.0, 5.0, 2.0], [4.0, 3.0, 6.0]


def scores() -> PairScores:
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return PairScores(t(CHOSEN).requires_grad_(), t(REJECTED).requires_grad_(), t(CHOSEN_TOKENS),
                      t(REJECTED_TOKENS), t(REF_CHOSEN), t(REF_REJECTED))


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def by_hand(name: str, cfg: TrainConfig, i: int) -> float:
    """One pair's loss from the papers' formulas, in plain floats."""
    beta = cfg.beta or objective_class(name).default_beta
    c, r, rc, rr = CHOSEN[i], REJECTED[i], REF_CHOSEN[i], REF_REJECTED[i]
    lc, lr = CHOSEN_TOKENS[i], REJECTED_TOKENS[i]
    if name == "dpo" and cfg.dpo_loss == "ipo":
        return ((c - rc) / lc - (r - rr) / lr - 1 / (2 * beta)) ** 2
    if name == "dpo":
        h = beta * ((c - rc) - (r - rr))
        return -(1 - cfg.label_smoothing) * log_sigmoid(h) - cfg.label_smoothing * log_sigmoid(-h)
    if name == "simpo":
        h = beta * c / lc - beta * r / lr - cfg.simpo_gamma
        return -(1 - cfg.label_smoothing) * log_sigmoid(h) - cfg.label_smoothing * log_sigmoid(-h)
    odds = lambda m: m - math.log(1 - math.exp(m))  # noqa: E731 (ORPO: log(p / (1 - p)) of the mean log-prob)
    return -cfg.orpo_lambda * log_sigmoid(odds(c / lc) - odds(r / lr))


CASES = [("dpo", {}), ("dpo", {"beta": 0.3, "label_smoothing": 0.2}), ("dpo", {"dpo_loss": "ipo", "beta": 0.5}),
         ("orpo", {"orpo_lambda": 0.25}), ("simpo", {}), ("simpo", {"beta": 2.5, "simpo_gamma": 1.0,
                                                                    "label_smoothing": 0.1})]


@pytest.mark.parametrize(("name", "flags"), CASES)
def test_each_loss_and_its_gradient_equal_the_papers_formula_by_hand(name, flags):
    cfg = TrainConfig(objective=name, **flags)
    objective = objective_class(name)(cfg)
    got = scores()
    losses, _, _ = objective.pair_losses(got)
    for i in range(3):
        assert losses[i].item() == pytest.approx(by_hand(name, cfg, i), abs=1e-6)
    losses.sum().backward()
    step = 1e-6  # the gradient by central differences of the hand computation
    for which, values in (("chosen", CHOSEN), ("rejected", REJECTED)):
        for i in range(3):
            values[i] += step
            up = by_hand(name, cfg, i)
            values[i] -= 2 * step
            down = by_hand(name, cfg, i)
            values[i] += step
            assert getattr(got, which).grad[i].item() == pytest.approx((up - down) / (2 * step), abs=1e-6)


def test_dpo_equals_trls_documented_formula():
    """trl's DPO (sigmoid) loss as its docs write it, on the same log-probabilities."""
    for beta, smoothing in ((0.1, 0.0), (0.5, 0.3)):
        cfg = TrainConfig(objective="dpo", beta=beta, label_smoothing=smoothing)
        got = scores()
        losses, chosen_rewards, rejected_rewards = objective_class("dpo")(cfg).pair_losses(got)
        logits = (got.chosen - got.rejected) - (got.ref_chosen - got.ref_rejected)
        trl = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
        assert torch.allclose(losses, trl, atol=1e-12)
        assert torch.allclose(chosen_rewards, beta * (got.chosen - got.ref_chosen).detach())
        assert torch.allclose(rejected_rewards, beta * (got.rejected - got.ref_rejected).detach())


def tiny_t5() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, num_decoder_layers=2,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    return T5ForConditionalGeneration(config)


def test_each_answer_scored_with_one_encoder_pass_equals_separate_forwards():
    """Both answers decoded against one encoder output: each row's summed log-probability and the gradient of a
    pair loss equal two ordinary forwards (prompt -> chosen, prompt -> rejected), within 1e-5."""
    model = tiny_t5()
    prompts = torch.tensor([[5, 6, 7, 1], [8, 9, 1, 0]])
    mask = prompts.ne(0).long()
    chosen = torch.tensor([[10, 11, 1], [12, 1, -100]])
    rejected = torch.tensor([[13, 1, -100], [14, 15, 1]])
    batch = {"input_ids": prompts, "attention_mask": mask, "labels": torch.cat([chosen, rejected])}
    counts = encoder_calls(model)
    sums, tokens = answer_logprobs(model, model, batch, loss_chunk=2)
    assert counts == [1] and tokens.tolist() == [3, 2, 2, 3]  # the encoder ran once, over the two prompts
    (sums[:2] - sums[2:]).sum().backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    separate = []
    for labels in (chosen, rejected):
        out = model(input_ids=prompts, attention_mask=mask, labels=labels)
        logp = torch.log_softmax(out.logits.float(), -1).gather(2, labels.clamp(min=0).unsqueeze(2)).squeeze(2)
        separate.append((logp * labels.ne(-100)).sum(1))
    assert torch.allclose(sums, torch.cat(separate), atol=1e-5)
    (separate[0] - separate[1]).sum().backward()
    for mine, theirs in zip(ours, (p.grad for p in model.parameters())):
        assert torch.allclose(mine, theirs, atol=1e-5)


def encoder_calls(model) -> list[int]:
    calls = [0]
    model.encoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def preference_rows(n: int, seed: int) -> list[dict]:
    """Pairs of the synthetic corpus: chosen reverses the prompt's words (learnable), rejected repeats them."""
    return [{"prompt": r["prompt"], "chosen": r["response"], "rejected": r["prompt"]} for r in synthetic_rows(n, seed)]


def dpo_args(tmp_path, rows: int = 192, **extra) -> list[str]:
    train = write_rows(tmp_path / "pairs.jsonl", preference_rows(rows, 1))
    evals = write_rows(tmp_path / "pairs_eval.jsonl", preference_rows(16, 2))
    flags = {"objective": "dpo", "train_file": train, "eval_file": evals, "max_steps": 6, "save_steps": 2,
             "eval_steps": 3, "logging_steps": 1, "batch_size": 4, "gradient_accumulation_steps": 2,
             "eval_generate": False, "max_target_len": 16, "max_source_len": 16, **extra}
    return [f"--{k}={v}" for k, v in flags.items()]


def test_dpo_with_a_cached_reference_killed_in_training_resumes_bit_for_bit(tmp_path, run_cli,
                                                                           kill_at_first_checkpoint_and_resume):
    args = dpo_args(tmp_path, reference="cached")
    straight = tmp_path / "straight"
    done = run_cli("train", f"--output_dir={straight}", *args, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["event"] == "eval")
    assert first["eval_loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at step 0
    train = next(r for r in records if r["event"] == "train")
    assert {"reward_accuracy", "reward_margin", "nll_chosen"} <= train.keys()
    # the first step's loss too: dropout (0.1 here, attention's included) is off in the policy
    assert train["step"] == 1 and train["loss"] == pytest.approx(math.log(2), abs=1e-4)
    broken = tmp_path / "broken"
    kill_at_first_checkpoint_and_resume(broken, args, tmp_path / "broken.log", 600)
    a, b = (load_file(str(run / "final" / "model.safetensors")) for run in (straight, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_pre_pass_killed_midway_continues_and_ends_bit_for_bit(tmp_path, run_cli, processes):
    """SIGKILL while the reference pre-pass writes (after its first chunk), then --is_keep_training: the pre-pass
    continues from its last chunk, and the run ends with the uninterrupted run's cache and weights."""
    import subprocess
    import sys

    args = dpo_args(tmp_path, rows=3000, reference="cached", max_steps=2, save_steps=0, eval_steps=0)
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    done = run_cli("train", f"--output_dir={straight}", *args, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "broken.log", "w") as log:
        child = processes.popen([sys.executable, str(REPO / "train_low_mem.py"), "train", f"--output_dir={broken}",
                                 *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    started = time.time()
    while not list(broken.glob("reference/*/progress-rank0.json")):
        assert child.poll() is None and time.time() < started + 600, (tmp_path / "broken.log").read_text()[-2000:]
        time.sleep(0.05)
    child.kill()
    child.wait()
    assert not list(broken.glob("reference/*/done-rank0.json"))  # killed inside the pre-pass
    resumed = run_cli("train", f"--output_dir={broken}", *args, "--is_keep_training=True", timeout=1200)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    cached = [next(run.glob("reference/*/logprobs-rank0.bin")).read_bytes() for run in (straight, broken)]
    assert cached[0] == cached[1] and len(cached[0]) == 8 * 3000
    a, b = (load_file(str(run / "final" / "model.safetensors")) for run in (straight, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_reference_free_objectives_train_and_log_their_rewards(tmp_path, run_cli, objective):
    args = dpo_args(tmp_path, objective=objective, save_steps=0)
    done = run_cli("train", f"--output_dir={tmp_path / 'run'}", *args, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reference" not in [p.name for p in (tmp_path / "run").iterdir()]
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"event": "eval"' in line]
    assert 0 <= evals[-1]["eval_reward_accuracy"] <= 1 and evals[-1]["eval_examples"] == 16


def test_two_processes_ddp_and_fsdp_match_one_within_float_error(tmp_path, run_cli, processes):
    """DPO with a cached reference, one optimizer step over the same 32 pairs on one process and on two (DDP, and
    FSDP: accelerate's configs): the per-pair sums are divided by the window's pairs on every process, so the
    weights agree to float error."""
    import os
    import sys

    args = dpo_args(tmp_path, rows=32, reference="cached", max_steps=1, save_steps=0, eval_steps=0, dropout_rate=0,
                    shuffle_buffer_size=0, warmup_steps=0, lr_scheduler="constant")
    one = run_cli("train", f"--output_dir={tmp_path / 'one'}", *args, "--gradient_accumulation_steps=8", timeout=900)
    assert one.returncode == 0, one.stderr[-3000:]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    for config, port in (("cpu_2proc", 29871), ("fsdp_cpu", 29873)):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "accelerate_configs" / f"{config}.yaml"), "--main_process_port", str(port),
                   str(REPO / "train_low_mem.py"), "train", "--cpu=True", f"--output_dir={tmp_path / config}", *args,
                   "--gradient_accumulation_steps=4"]
        two = processes.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
        assert two.returncode == 0, two.stderr[-4000:]
        assert len(list((tmp_path / config).glob("reference/*/done-rank*.json"))) == 2  # each process its share
        a, b = (load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("one", config))
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5, config


def test_reward_accuracy_counts_a_tie_as_half_and_leaves_out_padding_pairs():
    from lowmem.training.criteria import PREFERENCE_SUMS, PreferenceLoss

    criterion = PreferenceLoss(objective_class("dpo")(TrainConfig(objective="dpo")), None)
    t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    # pairs: chosen higher, a tie, rejected higher, and a padding pair (no target token) that would count as a win
    got = PairScores(t([-1.0, -2.0, -5.0, 0.0]), t([-3.0, -2.0, -4.0, -1.0]), t([2, 2, 2, 0]), t([2, 2, 2, 0]),
                     t([-1.0, -2.0, -4.5, 0.0]), t([-1.0, -2.0, -4.5, 0.0]))
    fields = criterion.fields(criterion.sums(got)[2].tolist())
    sums = dict(zip(PREFERENCE_SUMS, criterion.sums(got)[2].tolist()))
    assert sums["pairs"] == 3 and sums["correct"] == 1.5 and fields["reward_accuracy"] == 0.5


def test_lora_dpo_uses_the_adapter_off_as_reference_and_exports_a_peft_adapter(tmp_path, run_cli):
    """--lora_r with the default --reference (auto: the adapter switched off): the step-0 evaluation is log 2 (the
    adapters start at zero), the run holds no reference cache, and final/ is an adapter peft loads on its base."""
    base = tmp_path / "base"
    sft = write_rows(tmp_path / "sft.jsonl", synthetic_rows(64, 3))
    built = run_cli("train", f"--output_dir={base}", f"--train_file={sft}", f"--eval_file={sft}", "--max_steps=2",
                    "--eval_steps=0", "--max_source_len=16", "--max_target_len=16", timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    run = tmp_path / "dpo"
    done = run_cli("train", f"--output_dir={run}", *dpo_args(tmp_path, save_steps=0), f"--init_from={base / 'final'}",
                   "--lora_r=4", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"event": "eval"' in line]
    assert evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-5) and evals[0]["eval_reward_accuracy"] == 0.5
    assert not (run / "reference").exists() and (run / "final" / "adapter_config.json").is_file()
    import peft

    model = peft.PeftModel.from_pretrained(T5ForConditionalGeneration.from_pretrained(base / "final"), run / "final")
    ids = torch.tensor([[5, 6, 7, 1]])
    with torch.no_grad():
        tuned = model(input_ids=ids, decoder_input_ids=torch.tensor([[0, 8]])).logits
        with model.disable_adapter():
            plain = model(input_ids=ids, decoder_input_ids=torch.tensor([[0, 8]])).logits
    assert not torch.allclose(tuned, plain)  # the adapter trained
    evals_file = tmp_path / "pairs_eval.jsonl"
    refused = run_cli("evaluate", f"--init_from={run / 'final'}", f"--eval_file={evals_file}", timeout=600)
    assert refused.returncode == 2 and "error: evaluate --objective=dpo" in refused.stderr
    scored = run_cli("evaluate", f"--init_from={run / 'final'}", f"--eval_file={evals_file}", "--objective=simpo",
                     "--eval_generate=False", timeout=600)
    assert scored.returncode == 0 and "eval_reward_accuracy" in scored.stdout, scored.stderr[-2000:]


@pytest.mark.parametrize(("name", "flags", "weight"), [("dpo", {}, 0.0), ("dpo", {"rpo_alpha": 0.5}, 0.5),
                                                        ("orpo", {}, 1.0)])
def test_the_loss_adds_the_chosen_answers_token_mean_nll_by_its_weight(name, flags, weight):
    """RPO (--rpo_alpha: DPO plus α · the chosen answers' NLL, as trl's rpo_alpha) and ORPO's SFT term: the logged
    loss is the mean pair loss plus the weight times the chosen answers' NLL per target token."""
    from lowmem.training.criteria import PreferenceLoss

    cfg = TrainConfig(objective=name, **flags)
    criterion = PreferenceLoss(objective_class(name)(cfg), None)
    pair_loss, nll, logged = criterion.sums(scores())
    pairs = sum(by_hand(name, cfg, i) for i in range(3))
    assert pair_loss.item() == pytest.approx(pairs) and nll.item() == pytest.approx(-sum(CHOSEN))
    expected = pairs / 3 - weight * sum(CHOSEN) / sum(CHOSEN_TOKENS)
    assert criterion.fields(logged.tolist())["loss"] == pytest.approx(expected, abs=1e-5)


def test_rpo_alpha_is_refused_negative_and_noted_unused_by_the_reference_free_objectives():
    assert any("--rpo_alpha" in p for p in objective_class("dpo").problems(TrainConfig(objective="dpo",
                                                                                      rpo_alpha=-1)))
    assert all("rpo_alpha" in objective_class(name).unused_flags for name in ("orpo", "simpo"))
