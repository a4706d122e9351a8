"""--mixed_precision=fp16: float16 autocast with a loss scaler, T5's feed-forward output projections in float32.

The overflow is reproduced first: a T5 whose feed-forward outputs exceed float16's 65,504 (its ``wo`` weights
scaled up) gives a NaN loss under plain float16 autocast, and a loss scaler cannot help (every step is skipped).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import metrics, synthetic_rows, write_rows

from config import TrainConfig
from lowmem.utils.errors import UserError

FP16_MAX = 65504


def overflowing_copy(source: Path, folder: Path, wo: float = 50_000, head: float = 1.0) -> Path:
    """A copy of the model folder ``source`` whose feed-forward output weights are ``wo`` times larger (their outputs
    pass 1e5) and its untied head's ``head`` times (gradients that overflow float16 at the scaler's first scale)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith("DenseReluDense.wo.weight"):
            tensor.mul_(wo)
        elif name == "lm_head.weight":
            tensor.mul_(head)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def batch(tokenizer, rows: list[dict]) -> dict:
    inputs = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    labels = tokenizer([r["response"] for r in rows], return_tensors="pt", padding=True).input_ids
    return {**inputs, "labels": labels.masked_fill(labels == tokenizer.pad_token_id, -100)}


def wo_outputs_max(model, inputs: dict) -> float:
    seen = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out.float().abs().max().item()))
             for name, m in model.named_modules() if name.endswith("DenseReluDense.wo")]
    with torch.no_grad():
        model(**inputs)
    for hook in hooks:
        hook.remove()
    return max(seen)


def scaler_steps(model, inputs: dict, steps: int) -> tuple[list[float], int]:
    """``steps`` AdamW steps under float16 autocast with a GradScaler; (losses, optimizer steps applied)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses, applied = [], 0
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**inputs).loss
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        applied += scaler.get_scale() >= before  # a skipped step lowers the scale
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, applied


@pytest.mark.parametrize("family", ["t5", "flan"])  # v1.0 (ReLU, tied head) and flan (gated-gelu, untied)
def test_plain_fp16_autocast_overflows_t5_and_float32_feed_forward_outputs_train(family, family_models, tmp_path):
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    from lowmem.hardware.precision import float32_feed_forward_outputs

    folder = overflowing_copy(family_models[family], tmp_path / family)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = batch(tokenizer, synthetic_rows(8))
    plain = T5ForConditionalGeneration.from_pretrained(folder)
    assert wo_outputs_max(plain, inputs) > FP16_MAX
    reference = plain(**inputs).loss.item()  # float32
    losses, applied = scaler_steps(plain, inputs, 6)
    assert not any(math.isfinite(v) for v in losses) and applied == 0  # NaN every step: the scaler only skips

    ours = T5ForConditionalGeneration.from_pretrained(folder)
    assert float32_feed_forward_outputs(ours) == ours.config.num_layers + ours.config.num_decoder_layers
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert ours(**inputs).loss.item() == pytest.approx(reference, rel=2e-3)
    losses, applied = scaler_steps(ours, inputs, 12)
    assert all(math.isfinite(v) for v in losses) and applied >= 10 and losses[-1] < 0.8 * losses[0]
    assert set(ours.state_dict()) == set(plain.state_dict())  # the wrapped forward leaves the weights' names


def test_fp16_trains_a_t5_that_overflows_float16_and_resumes_bit_identically(tmp_path, family_models, run_cli,
                                                                            kill_at_first_checkpoint_and_resume):
    model = overflowing_copy(family_models["flan"], tmp_path / "model", head=30)
    data = write_rows(tmp_path / "train.jsonl", synthetic_rows(300))
    args = ["--is_finetune=True", "--freeze=none", f"--init_from={model}", f"--train_file={data}",
            f"--eval_file={data}", "--max_eval_samples=16", "--eval_generate=False", "--max_steps=8", "--save_steps=4",
            "--eval_steps=8", "--logging_steps=1", "--batch_size=4", "--gradient_accumulation_steps=2",
            "--warmup_steps=0", "--learn_rate=1e-3", "--dropout_rate=0"]
    straight = tmp_path / "straight"
    done = run_cli("train", f"--output_dir={straight}", "--mixed_precision=fp16", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics(straight)
    train = [r for r in records if r["event"] == "train"]
    skips = [r for r in records if r["event"] == "scaler_skip"]
    assert [r["step"] for r in train] == list(range(1, 9))  # a window whose gradients overflowed ran again
    assert skips and not [r for r in records if r["event"] == "nonfinite_step"]
    assert all(math.isfinite(r["loss"]) for r in train) and train[-1]["loss"] < train[0]["loss"]
    assert train[-1]["loss_scale"] == 65536 / 2 ** len(skips) and train[-1]["scaler_skipped_steps"] == len(skips)
    saved = json.loads((straight / "checkpoints" / "step_000008" / "trainer_state.json").read_text())
    assert saved["loss_scaler"]["scaler"]["scale"] == train[-1]["loss_scale"]

    full = tmp_path / "float32"
    done = run_cli("train", f"--output_dir={full}", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    evals = [[r["eval_loss"] for r in metrics(run) if r["event"] == "eval"][-1] for run in (straight, full)]
    assert evals[0] == pytest.approx(evals[1], rel=0.02)

    broken = tmp_path / "broken"
    kill_at_first_checkpoint_and_resume(broken, ["--mixed_precision=fp16", *args], tmp_path / "log", wait_s=300)
    from safetensors.torch import load_file

    a, b = (load_file(run / "final" / "model.safetensors") for run in (straight, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)
    series = [[(r["step"], r["loss"], r["loss_scale"]) for r in metrics(run) if r["event"] == "train"]
              for run in (straight, broken)]
    assert series[0] == series[1]


def test_fp16_is_refused_where_it_cannot_run():
    from lowmem.parallel.deepspeed_engine import check_deepspeed

    with pytest.raises(UserError, match="fp16 is not supported with DeepSpeed"):
        check_deepspeed(TrainConfig(mixed_precision="fp16"))
    problems = TrainConfig(mixed_precision="fp16", frozen_dtype="int8", lora_r=4, freeze="none").problems()
    assert any("does not run with --mixed_precision=fp16" in p for p in problems)
    assert not TrainConfig(mixed_precision="fp16", freeze="none").problems()


@pytest.mark.parametrize("half, chosen", [({"bfloat16": False, "float16": True}, "fp16"),  # T4, V100
                                          ({"bfloat16": True, "float16": True}, "bf16"),  # Ampere on
                                          ({"bfloat16": False, "float16": False}, "no")])  # GTX 10xx
def test_gpu_profiles_and_plan_choose_the_half_precision_the_gpu_computes_fast(monkeypatch, half, chosen):
    from lowmem.hardware import probe
    from lowmem.hardware.capability import Capability
    from lowmem.memory.profiles import profile_flags

    rates = {"float32": 1e13, **{name: 1e14 if fast else 1e12 for name, fast in half.items()}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "_KNOWN", {"cuda": Capability("cuda", "a GPU", rates, "datasheet")})
    converted = {"memory_profile": "gpu8g"}
    notes = profile_flags(converted)
    assert converted["mixed_precision"] == chosen
    assert any("bf16 products are slow on this GPU" in n for n in notes) == (chosen != "bf16")
    explicit = {"memory_profile": "gpu8g", "mixed_precision": "bf16"}
    profile_flags(explicit)
    assert explicit["mixed_precision"] == "bf16"  # the user's own choice stands (the run then warns)


def test_the_planner_prices_fp16_like_bf16_plus_the_float32_feed_forward_input():
    from lowmem.memory.tensor_bytes import gpu_layer_bytes, model_dims

    dims = model_dims(TrainConfig(model_preset="small"), 32128)
    sizes = {p: gpu_layer_bytes(TrainConfig(mixed_precision=p), dims, 4, 128, 64) for p in ("no", "bf16", "fp16")}
    assert sizes["bf16"][0] < sizes["fp16"][0] < sizes["no"][0]
    assert sizes["fp16"][0] - sizes["bf16"][0] == 4 * 128 * 2 * dims["d_ff"]  # rows x tokens x 2 bytes x d_ff


def test_a_window_run_again_after_an_overflow_draws_the_same_dropout_masks():
    from lowmem.hardware.precision import Float16
    from lowmem.training.state import TrainState
    from lowmem.training.stopping import NonfiniteSteps, WindowRandomness

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    precision = Float16("cpu")
    drawn = WindowRandomness(torch.device("cpu"))
    first = torch.nn.functional.dropout(torch.ones(256), 0.5)  # the window's first attempt
    precision.scale((weight * float("inf")).sum()).backward()  # its scaled gradients overflow
    precision.unscale(optimizer)
    assert NonfiniteSteps(TrainState(), 3).again(precision, lambda: True, drawn)
    again = torch.nn.functional.dropout(torch.ones(256), 0.5)
    assert torch.equal(first, again) and precision.scaler.get_scale() == 65536 / 2
    assert not torch.equal(again, torch.nn.functional.dropout(torch.ones(256), 0.5))  # (masks do differ otherwise)
