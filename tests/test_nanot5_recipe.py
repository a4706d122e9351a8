"""nanoT5's pretraining recipe (recipes/nanot5.yaml, docs/nanot5.md): the file loads through the CLI's config
loading with the shape and flags it names, ``AdamWScale`` steps as nanoT5's formula says, and a run with it
trains and resumes bit-identically."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import REPO, metrics, synthetic_rows, write_rows
from safetensors.torch import load_file

from config import TrainConfig
from data.objectives.span_corruption import SpanCorruptionObjective
from lowmem.checkpointing import checkpoint
from lowmem.cli.flags import load_config
from lowmem.memory.tensor_bytes import optimizer_bytes
from lowmem.training.optim import AdamWScale, build_optimizer
from lowmem.utils.presets import preset_shape

RECIPE = REPO / "recipes" / "nanot5.yaml"


def test_the_recipe_loads_as_the_cli_reads_it_with_nanot5s_shape_and_settings():
    cfg, notes = load_config({}, str(RECIPE))
    assert notes == []
    shape = preset_shape(cfg.model_preset, cfg.feed_forward_proj)
    assert shape == dict(d_model=768, d_ff=2048, num_heads=12, d_kv=64, num_layers=12, num_decoder_layers=12,
                         feed_forward_proj="gated-gelu")  # google/t5-v1_1-base's config.json
    assert (cfg.tie_word_embeddings, cfg.dropout_rate) == (False, 0.0)
    assert (cfg.objective, cfg.max_source_len, cfg.noise_density, cfg.mean_noise_span_length) == \
        ("span_corruption", 512, 0.15, 3.0)
    objective = SpanCorruptionObjective(cfg)  # refuses a --max_target_len that cannot hold the targets
    assert (objective.chunk_length, objective.targets_length, cfg.max_target_len) == (568, 114, 114)
    assert (cfg.optimizer, cfg.learn_rate, cfg.weight_decay, cfg.max_grad_norm) == ("adamw_scale", 0.02, 0.0, 1.0)
    assert (cfg.batch_size, cfg.gradient_accumulation_steps, cfg.max_steps, cfg.warmup_steps, cfg.lr_scheduler) == \
        (128, 1, 65536, 10000, "cosine")
    assert (cfg.mixed_precision, cfg.torch_compile, cfg.eval_steps, cfg.eval_generate) == ("bf16", True, 0, False)
    assert (cfg.train_file, cfg.dataset_config, cfg.text_column) == ("allenai/c4", "en", "text")
    # every setting says which of nanoT5's it mirrors
    settings = [line for line in RECIPE.read_text().splitlines() if re.match(r"^[a-z_]+:", line)]
    assert len(settings) >= 30 and all("#" in line for line in settings)


def test_the_preset_has_t5_v1_1_bases_parameter_count():
    from transformers import T5Config, T5ForConditionalGeneration

    with torch.device("meta"):  # transformers ties the head on a fresh model: the untied one adds its matrix
        model = T5ForConditionalGeneration(T5Config(vocab_size=32128, **preset_shape("t5-v1_1-base", "gated-gelu")))
    untied = sum(p.numel() for p in model.parameters()) + 32128 * 768
    assert untied == 247_577_856  # nanoT5's README: 248M parameters


def test_adamw_scale_takes_nanot5s_steps():
    """Two steps against the formula worked by hand in float64: a weight whose RMS scales its step and one at
    zero (the 1e-3 floor), with decoupled weight decay on the first group only."""
    generator = torch.Generator().manual_seed(0)
    starts = [0.05 * torch.randn(4, 6, generator=generator), torch.zeros(5)]
    grads = [[torch.randn(w.shape, generator=generator) for w in starts] for _ in range(2)]
    params = [torch.nn.Parameter(w.clone()) for w in starts]
    lr, decays = 0.02, (0.1, 0.0)
    optimizer = AdamWScale([{"params": [params[0]], "weight_decay": decays[0]},
                            {"params": [params[1]], "weight_decay": decays[1]}], lr=lr)
    by_hand = [w.double() for w in starts]
    moments = [[torch.zeros_like(w) for w in by_hand] for _ in range(2)]
    for t, step_grads in enumerate(grads, start=1):
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
        for i, g in enumerate(step_grads):
            g, w = g.double(), by_hand[i]
            m = moments[0][i] = 0.9 * moments[0][i] + 0.1 * g
            v = moments[1][i] = 0.999 * moments[1][i] + 0.001 * g * g
            rms = max(1e-3, math.sqrt(float((w * w).mean())))
            w = w - lr * math.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t) * rms * m / (v.sqrt() + 1e-6)
            by_hand[i] = w - lr * decays[i] * w
        for p, w in zip(params, by_hand):
            assert (p.double() - w).abs().max().item() <= 1e-6
    # the RMS scale matters: the zero weight moved by about lr x 1e-3 a step, the other by about lr x its RMS
    assert 1e-5 < params[1].abs().max().item() < 1e-4 < (params[0] - starts[0]).abs().max().item()
    assert sorted(optimizer.state[params[0]]) == ["exp_avg", "exp_avg_sq", "step"]
    assert isinstance(build_optimizer(TrainConfig(optimizer="adamw_scale"), params), AdamWScale)


def test_the_planner_prices_adamw_scale_as_adamw_state_with_one_temporary():
    shape = [(2048, 2048)]
    adamw, scaled = (optimizer_bytes(TrainConfig(optimizer=name), shape) for name in ("adamw", "adamw_scale"))
    assert scaled[0] == adamw[0] == 8 * 2048 * 2048  # two float32 moments
    assert scaled[1] == adamw[1] // 2  # its denominator alone (measured: 48 MiB a step on this 16 MiB matrix)


@pytest.fixture(scope="module")
def tiny_args(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("nanot5-data")
    train = write_rows(folder / "train.jsonl", synthetic_rows(120, seed=3))
    return ["--model_preset=tiny", "--optimizer=adamw_scale", "--learn_rate=0.02", "--warmup_steps=1",
            "--lr_scheduler=cosine", f"--train_file={train}", f"--eval_file={train}", "--max_steps=4",
            "--save_steps=2", "--eval_steps=0", "--max_eval_samples=4", "--eval_generate=False",
            "--gradient_accumulation_steps=1", "--batch_size=4", "--logging_steps=1", "--dump_consumed=True"]


def test_adamw_scale_trains_and_a_killed_run_resumes_bit_identically(tmp_path, tiny_args, run_cli,
                                                                      kill_at_first_checkpoint_and_resume):
    straight = tmp_path / "straight"
    done = run_cli("train", f"--output_dir={straight}", *tiny_args)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [r["loss"] for r in metrics(straight) if r["event"] == "train"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    at_2 = straight / "checkpoints" / "step_000002"
    before, after = load_file(str(at_2 / "model.safetensors")), load_file(str(straight / "final" / "model.safetensors"))
    common = set(before) & set(after)  # (the embedding is named by another of its modules in one of them)
    assert len(common) > 20 and all(not torch.equal(before[k], after[k]) for k in common)  # steps 3, 4 moved each
    state = checkpoint.load_state(at_2 / "optimizer.pt")
    assert {tuple(sorted(s)) for s in state["state"].values()} == {("exp_avg", "exp_avg_sq", "step")}
    assert {s["step"] for s in state["state"].values()} == {2}

    broken = tmp_path / "broken"
    kill_at_first_checkpoint_and_resume(broken, tiny_args, tmp_path / "killed.log", wait_s=300)
    resumed = load_file(str(broken / "final" / "model.safetensors"))
    assert all(torch.equal(after[k], resumed[k]) for k in after)
    assert [r["loss"] for r in metrics(broken) if r["event"] == "train"] == losses


def _sharded_steps(rank: int, init_file: str, results) -> None:
    """Two steps of AdamWScale on weights sharded by rows over two gloo processes, beside the same steps on the
    whole weights; the largest difference of the gathered weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    generator = torch.Generator().manual_seed(0)
    starts = [0.05 * torch.randn(6, 4, generator=generator), 3 * torch.randn(5, 3, generator=generator)]
    whole = [torch.nn.Parameter(w.clone()) for w in starts]
    sharded = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in starts]
    optimizers = [AdamWScale(params, lr=0.02, weight_decay=0.1) for params in (whole, sharded)]
    for _ in range(2):
        grads = [torch.randn(w.shape, generator=generator) for w in starts]
        for p, q, g in zip(whole, sharded, grads):
            p.grad, q.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
        for optimizer in optimizers:
            optimizer.step()
    results[rank] = max(float((p.detach() - q.detach().full_tensor()).abs().max()) for p, q in zip(whole, sharded))
    dist.destroy_process_group()


def test_adamw_scale_steps_a_sharded_weight_by_the_whole_weights_rms(tmp_path, processes):
    """Under FSDP2 each process holds some rows of a weight: their own RMS would give each process another step
    (its own rows' RMS: 1.4e-2 apart after two steps, measured); the whole weight's, summed over the processes,
    gives the steps of the unsharded run (2e-9)."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    processes.spawn(_sharded_steps, (str(tmp_path / "init"), results), nprocs=2)
    assert max(results.values()) <= 1e-6
