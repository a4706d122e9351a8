"""The pieces the trainer is made of, called directly (no CLI, no trainer): the data entry point and
its objective, the interval meter and the logs, the checkpointer, evaluation and generation."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
from conftest import REPO, synthetic_rows, write_rows

from data.objectives.base import objective_for
from data.objectives.pairs import PairsObjective
from data.pipeline import DataProcess, build_data, check_data
from data.sources.readers import TOKEN_COLUMNS
from lowmem.cli.flags import load_config
from lowmem.monitoring.telemetry import IntervalMeter, Telemetry


class State:  # the counters a Telemetry reads its step from
    step = 0


def config(tmp_path, **flags):
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(200, seed=1))
    base = dict(train_file=str(train), output_dir=str(tmp_path / "run"), max_eval_samples=10, shuffle_buffer_size=16,
                batch_size=2, gradient_accumulation_steps=2, max_target_len=16, dropout_rate=0.0)
    return load_config({**base, **flags})[0]


def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


# ----------------------------------------------------------------------------- data entry point and objective
def test_build_data_holds_out_the_eval_rows_and_its_replay_is_the_stream(tmp_path, tokenizer):
    cfg = config(tmp_path)
    objective = objective_for(cfg)
    files = check_data(cfg, objective)
    assert files.eval == [] and files.prepared is None and files.columns == ("prompt", "response")
    data = build_data(cfg, files, tokenizer)
    # 200 rows, 10 held out (no --eval_file): never in the training stream
    assert (data.rows, data.held_out_rows, len(data.eval_examples)) == (190, 10, 10)
    trained = list(data.stream.iter_epoch())
    assert len(trained) == 190 and {e.row for e in trained} == set(range(190))
    assert {e.row for e in data.eval_examples} == set(range(190, 200))
    # the planner's replay reads exactly what training reads, in the same order
    assert [(e.file_index, e.row) for e in data.fresh_stream().iter_epoch()] == [(e.file_index, e.row) for e in trained]
    assert data.steps(cfg) == (48, 48)  # ceil(190 / (2 x 2)) windows, one epoch


def test_each_process_gets_its_own_share_and_the_objective_makes_the_batches(tmp_path, tokenizer):
    cfg = config(tmp_path)
    files = check_data(cfg, objective_for(cfg))
    shares = [build_data(cfg, files, tokenizer, DataProcess(rank, 2)) for rank in (0, 1)]
    rows = [{e.row for e in d.stream.iter_epoch()} for d in shares]
    assert rows[0].isdisjoint(rows[1]) and rows[0] | rows[1] == set(range(190))
    batch = shares[0].collator(shares[0].eval_examples[:3])
    assert batch["input_ids"].shape[0] == 3 and batch["labels"].shape[0] == 3
    assert int(batch["labels"].eq(tokenizer.eos_token_id).sum()) == 3  # every target ends in EOS
    assert PairsObjective(cfg).columns({"rows": 1}) == TOKEN_COLUMNS  # prepared shards: token ids


# ----------------------------------------------------------------------------- interval meter and logs
def counts(tokens: int, all_tokens: int, positions: int, rows: int = 2, examples: int = 2) -> dict:
    """A window's counts as ``lowmem.parallel.distributed.window_counts`` gives them to the meter."""
    return {"local_tokens": tokens, "local_all_tokens": all_tokens, "local_padded_tokens": positions,
            "local_rows": rows, "local_examples": examples}


def test_interval_meter_gives_the_token_mean_and_leaves_untimed_work_out():
    acc = accelerator()
    meter = IntervalMeter()
    meter.start(acc.device)
    meter.add(torch.tensor(6.0), counts(3, 10, 16))
    meter.add(torch.tensor(2.0), counts(1, 4, 4))
    saved = meter.saved()
    sums = {k: saved[k] for k in ("loss", "tokens", "steps", "real_tokens", "positions")}
    assert sums == {"loss": 8.0, "tokens": 4, "steps": 2, "real_tokens": 14, "positions": 20}
    assert saved["timed_steps"] == 2 and 0 <= saved["timed_seconds"] < 0.1
    with meter.untimed():
        time.sleep(0.3)
        inside = meter.saved()  # a checkpoint is written inside untimed(): its time is not training time
    assert inside["timed_seconds"] < 0.1
    logged = meter.close(acc)
    assert logged["loss"] == pytest.approx(8.0 / 4)  # sum of token losses / target tokens, not a mean of means
    assert logged["padding_pct"] == 30.0  # 6 of 20 positions
    resumed = IntervalMeter()  # an interval a checkpoint cut in two: the padding of both parts
    resumed.start(acc.device, saved)
    resumed.add(torch.tensor(1.0), counts(1, 6, 20, rows=1, examples=5))  # (a packed row of 5 examples)
    closed = resumed.close(acc)
    assert closed["padding_pct"] == 50.0  # 20 of 40 positions (the second part alone: 70.0)
    assert closed["examples_per_row"] == 1.8 and logged["examples_per_row"] == 1.0  # 9 examples in 5 rows
    carried = IntervalMeter()  # the summary's step_s covers the run's steps before the checkpoint too
    carried.start(acc.device, {**saved, "timed_seconds": 10.0, "timed_steps": 2})
    carried.add(torch.tensor(1.0), counts(1, 6, 20))
    carried.close(acc)
    assert carried.mean_step_seconds() == pytest.approx(10.0 / 3, abs=0.05)
    assert logged["step_s"] < 0.1  # the 0.3 s inside untimed() is not training time
    assert logged["padding_pct"] == pytest.approx(100 * 6 / 20, abs=0.05)  # 14 tokens in 20 positions
    assert meter.mean_step_seconds() == pytest.approx(logged["step_s"], abs=1e-3)
    # a resumed interval continues the sums it was saved with
    meter.start(acc.device, saved)
    meter.add(torch.tensor(4.0), counts(4, 8, 8))
    assert meter.close(acc)["loss"] == pytest.approx(12.0 / 8)


def test_a_checkpoint_from_before_target_tokens_was_named_restores_the_count():
    from lowmem.training.state import TrainState

    state = TrainState()
    state.load_state_dict({"step": 3, "tokens": 517})  # the counter's name in checkpoints before 2026-11-28
    assert (state.step, state.target_tokens) == (3, 517) and "tokens" not in state.state_dict()


def test_logs_are_cut_back_to_a_checkpoint_and_its_record_written_again(tmp_path):
    cfg = config(tmp_path, dump_consumed=True)
    (tmp_path / "run").mkdir()
    state = State()
    telemetry = Telemetry(state)
    telemetry.attach(accelerator())
    telemetry.open(tmp_path / "run", cfg)
    telemetry.record("train", loss=1.0)
    offsets = telemetry.offsets()
    state.step = 5
    telemetry.record("train", loss=0.5)
    telemetry.consumed.write("0\t0\tf\t1\n")
    telemetry.cut_back(offsets, json.dumps({"event": "checkpoint", "step": 1}))
    telemetry.close()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in lines] == [("train", 0), ("checkpoint", 1)]
    assert (tmp_path / "run" / "consumed-rank0.tsv").read_text() == ""


# ----------------------------------------------------------------------------- checkpointer
def test_checkpointer_restores_weights_optimizer_data_position_and_rng(tmp_path, tokenizer):
    from lowmem.model.build import build_model
    from lowmem.runs.checkpointer import Checkpointer
    from lowmem.runs.run_folder import RunFolder
    from lowmem.training.optim import build_optimizer, build_scheduler

    cfg = config(tmp_path, model_preset="tiny", optimizer="adamw")
    objective = objective_for(cfg)
    data = build_data(cfg, check_data(cfg, objective), tokenizer)
    acc, state = accelerator(), State()
    telemetry = Telemetry(state)
    telemetry.attach(acc)
    (tmp_path / "run").mkdir()
    telemetry.open(tmp_path / "run", cfg)

    def parts(seed):
        torch.manual_seed(seed)
        model = build_model(cfg, tokenizer)
        optimizer = build_optimizer(cfg, list(model.parameters()))
        return model, optimizer, build_scheduler(cfg, optimizer, 10), {"tokenizer_sha1": "x"}

    model, optimizer, scheduler, run_config = parts(0)
    model(**data.collator(data.eval_examples[:2])).loss.backward()
    optimizer.step()
    scheduler.step()
    epoch_rows = data.stream.iter_epoch()
    for _ in range(7):
        next(epoch_rows)
    meter = IntervalMeter()
    meter.start(acc.device, {"loss": 3.5, "tokens": 7, "steps": 1})
    checkpointer = Checkpointer(RunFolder(tmp_path / "run"), acc, telemetry)
    random.seed(11)
    folder = checkpointer.save({"step": 1}, (model, optimizer, scheduler, run_config), data.stream, meter, keep=2)
    assert checkpointer.save({"step": 1}, None, data.stream, meter, keep=2) == folder  # once per step
    expected_next = [e.row for e in data.stream.iter_epoch()][:5]
    expected_random = random.random()

    fresh = build_data(cfg, check_data(cfg, objective), tokenizer)
    other = parts(1)
    random.seed(99)
    trainer_state, interval = Checkpointer(RunFolder(tmp_path / "run"), acc, telemetry).load(
        folder, other, fresh.stream, cfg.learn_rate, cfg.weight_decay)
    assert trainer_state == {"step": 1} and interval == {"loss": 3.5, "tokens": 7, "steps": 1, "real_tokens": 0,
                                                         "positions": 0, "rows": 0, "row_examples": 0, "timed_steps": 0,
                                                         "timed_seconds": interval["timed_seconds"]}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other[0].state_dict().values()))
    assert other[1].state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert other[2].last_epoch == scheduler.last_epoch == 1
    assert [e.row for e in fresh.stream.iter_epoch()][:5] == expected_next
    assert random.random() == expected_random
    telemetry.close()


# ----------------------------------------------------------------------------- evaluation and generation
def test_evaluate_and_generate_take_a_model_and_a_tokenizer(tmp_path, tokenizer):
    from lowmem.model.build import build_model
    from lowmem.training.evaluation import EvalModel, answer_text, evaluate_model, generate_answers, generation_options
    from lowmem.training.run_context import RunContext

    cfg = config(tmp_path, model_preset="tiny", eval_batch_size=3, max_new_tokens=5)
    objective = objective_for(cfg)
    data = build_data(cfg, check_data(cfg, objective), tokenizer)
    torch.manual_seed(0)
    model = build_model(cfg, tokenizer).eval()
    acc = accelerator()
    at = EvalModel(RunContext.plain(cfg, acc), model, model, tokenizer, data.collator)
    result = evaluate_model(at, data.eval_examples)
    batch = data.collator(data.eval_examples)  # one batch: the token mean over all 10 rows
    with torch.no_grad():
        logits = model(**batch).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="mean")
    assert result["eval_loss"] == pytest.approx(float(expected), rel=1e-4)
    assert result["eval_examples"] == 10 and 0 <= result["bleu"] <= 100
    prompts = ["the cat runs", "a dog"]
    answers = generate_answers(at, prompts)
    # at most --max_new_tokens=5 tokens each, read from the ids (the text of random tokens re-tokenizes longer)
    with torch.no_grad():
        ids = model.generate(**data.collator.encode(prompts, cfg.max_source_len), **generation_options(cfg, 5))
    assert ids.shape[1] <= 1 + 5 and answers == [answer_text(tokenizer, row) for row in ids.tolist()]


# ----------------------------------------------------------------------------- exports
def test_a_lora_export_leaves_unused_packages_unimported(tmp_path, processes):
    """Packages our dependencies import whenever installed, for features no run here uses, stay out of a fresh
    process that adds LoRA adapters and exports, and stay importable for whoever wants them:
    - DeepSpeed: accelerate's unwrapping, inside every ``save_pretrained``, imported it (0.5 s, 22 MiB) to ask
      whether the model is an engine; a process that never imported DeepSpeed has none.
    - boto3: accelerate imported it for its config wizard (0.4 s, 9 MiB).
    - bitsandbytes: peft imported it, and asked for it again while injecting adapters, for its 8-bit layers
      (1.9 s, 44 MiB)."""
    import importlib.util
    import sys

    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    script = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from config import SHIPPED_TOKENIZER_DIR
from data.tokenization import load_tokenizer
from lowmem.cli.flags import load_config
from lowmem.model.build import add_lora, build_model, export_state_dict
from lowmem.runs.run_folder import ExportFiles, RunFolder

tokenizer = load_tokenizer(SHIPPED_TOKENIZER_DIR)
cfg = load_config({{"model_preset": "tiny", "is_finetune": True, "init_from": "unused", "lora_r": 4,
                    "tie_word_embeddings": True}})[0]
model = add_lora(build_model(cfg, tokenizer), cfg)
print("adapters:", sum(p.numel() for p in model.parameters() if p.requires_grad))
RunFolder.export({str(tmp_path / "final")!r}, model, ExportFiles(tokenizer, {{}}), state_dict=export_state_dict(model))
for package in ("deepspeed", "boto3", "bitsandbytes"):
    print(package, "imported:", package in sys.modules)
for package in ("boto3", "bitsandbytes"):
    try:
        __import__(package)
        print(package, "importable")
    except ImportError as error:
        print(package, "not importable:", error)
"""
    done = processes.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "adapters: 0" not in done.stdout, done.stderr[-3000:]
    for package in ("deepspeed", "boto3", "bitsandbytes"):
        assert f"{package} imported: False" in done.stdout, done.stdout + done.stderr[-3000:]
    for package in ("boto3", "bitsandbytes"):
        if importlib.util.find_spec(package) is not None:
            assert f"{package} importable" in done.stdout, done.stdout
        else:  # nothing to hide here: the script's own import of it fails
            assert f"No module named '{package}'" in done.stdout, done.stdout
    from transformers import T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(tmp_path / "final")
    assert model.lm_head.weight is model.shared.weight


def test_bleu_reads_chinese_rows_by_character_in_a_mixed_set():
    from lowmem.utils.eval_metrics import bleu_score, bleu_tokenizer

    english = ["the cat sat on the mat", "a quick brown fox jumps"]
    chinese = ["哈尔有几个问题需要解决。", "今天天气很好，我们去公园吧。"]
    assert bleu_tokenizer(english * 5 + chinese[:1]) == "zh" and bleu_tokenizer(english) == "13a"
    # Perfect English answers and empty Chinese ones: 83 when each Chinese row was one or two tokens
    assert bleu_score(english + ["", ""], english + chinese) < 50
    # Chinese answers missing one character each: 96 then
    assert 70 < bleu_score(english + ["哈尔有几个问题要解决。", "今天天气很好，我们去公园。"], english + chinese) < 90
    assert bleu_score(english, english) == pytest.approx(100.0)


def test_the_best_model_is_chosen_by_its_metric_and_a_bleu_tie_by_the_eval_loss():
    from lowmem.training.evaluation import is_better

    assert is_better({"eval_loss": 2.0}, 3.0, 3.0, "eval_loss")
    assert not is_better({"eval_loss": 3.0}, 3.0, 3.0, "eval_loss")
    assert is_better({"bleu": 1.0, "eval_loss": 9.0}, 0.0, 2.0, "bleu")
    assert is_better({"bleu": 0.0, "eval_loss": 7.6}, 0.0, 9.6, "bleu")  # every young model scores 0
    assert not is_better({"bleu": 0.0, "eval_loss": 9.7}, 0.0, 9.6, "bleu")
    assert not is_better({"bleu": 0.0, "eval_loss": 7.6}, 0.0, None, "bleu")  # a checkpoint from before: as then
    assert not is_better({"bleu": float("nan"), "eval_loss": 1.0}, 0.0, 9.6, "bleu") and is_better(
        {"bleu": 0.0, "eval_loss": 9.0}, None, None, "bleu")


def test_cuda_attention_stays_off_cudnn_unless_the_user_prefers_it(monkeypatch):
    # cuDNN's attention builds a plan per shape (start_accelerator calls this on CUDA); torch's own
    # TORCH_CUDNN_SDPA_PREFERRED=1 keeps it
    from lowmem.parallel.distributed import attention_without_shape_plans

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        monkeypatch.setenv("TORCH_CUDNN_SDPA_PREFERRED", "1")
        attention_without_shape_plans()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.delenv("TORCH_CUDNN_SDPA_PREFERRED")
        attention_without_shape_plans()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
