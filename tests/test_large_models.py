"""Large-model paths on tiny hub-shaped folders: the streamed load into the training form, checkpoints that hold
only what trains (a changed base refused on resume), LoRA exports as peft adapters, the merged export."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import REPO, synthetic_rows, write_rows
from safetensors import safe_open

from bench.hub_checkpoint import build_checkpoint

SHARD_BYTES = 300_000  # the tiny shape is 5 MB in float32: several shards


def config_for(**flags):
    from lowmem.cli.flags import load_config

    return load_config(flags)[0]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Tiny flan-t5-shaped folders: sharded float32 and bfloat16 safetensors, and sharded .bin."""
    root = tmp_path_factory.mktemp("hub")
    return {name: build_checkpoint(root / name, "tiny", dtype, SHARD_BYTES, fmt)["folder"]
            for name, dtype, fmt in (("fp32", "float32", "safetensors"), ("bf16", "bfloat16", "safetensors"),
                                     ("bin", "float32", "bin"))}


@pytest.mark.parametrize("layout", ["fp32", "bf16", "bin"])
def test_streamed_load_is_from_pretrained_in_float32(hub, layout):
    from transformers import AutoModelForSeq2SeqLM

    from lowmem.model.streamed_load import load_for_training

    folder = hub[layout]
    reference = AutoModelForSeq2SeqLM.from_pretrained(str(folder), dtype=torch.float32)
    cfg = config_for(init_from=str(folder), is_finetune=True, freeze="none")
    model, narrow, eight_bit = load_for_training(cfg, folder)
    assert (narrow, eight_bit) == (0, 0)
    expected, got = reference.state_dict(), model.state_dict()
    assert set(expected) == set(got)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    assert model.lm_head.weight is not model.shared.weight  # untied, as the checkpoint is
    assert model.encoder.embed_tokens.weight is model.shared.weight  # tied aliases stay one tensor
    assert all(p.requires_grad for p in model.parameters())


def test_streamed_load_stores_the_training_form(hub):
    """LoRA with int8: block linears 8-bit, wo and the embedding and head bf16, norms float32; the model computes
    within the 8-bit error of the float32 one."""
    from lowmem.model.quantize import is_quantized
    from lowmem.model.streamed_load import load_for_training

    cfg = config_for(init_from=str(hub["fp32"]), is_finetune=True, lora_r=4, frozen_dtype="int8")
    model, narrow, eight_bit = load_for_training(cfg, hub["fp32"])
    q = model.encoder.block[0].layer[0].SelfAttention.q.weight
    assert is_quantized(q)
    assert model.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.bfloat16
    assert model.shared.weight.dtype == model.lm_head.weight.dtype == torch.bfloat16
    assert model.encoder.final_layer_norm.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    full, _, _ = load_for_training(replace(cfg, frozen_dtype="float32"), hub["fp32"])
    ids = torch.randint(3, 8000, (2, 12))
    with torch.no_grad():
        exact = full(input_ids=ids, decoder_input_ids=ids).logits
        narrow_logits = model(input_ids=ids, decoder_input_ids=ids).logits
    assert narrow_logits.dtype == torch.float32
    error = (narrow_logits - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.05, error
    assert narrow == sum(p.numel() for n, p in model.named_parameters() if p.dtype == torch.bfloat16)
    assert eight_bit == sum(p.numel() for p in model.parameters() if is_quantized(p))


PEAK_SCRIPT = """
import sys, json
sys.path.insert(0, {repo!r})
import torch
from lowmem.cli.flags import load_config
from lowmem.hardware.memory_use import peak_rss_bytes, process_rss_bytes
from lowmem.model.build import import_transformers_models
from lowmem.model.streamed_load import load_for_training
import_transformers_models()
import optimum.quanto
cfg = load_config(dict(init_from={folder!r}, is_finetune=True, lora_r=4, frozen_dtype={dtype!r}))[0]
torch.ones(1) @ torch.ones(1)
before = process_rss_bytes()
model, _, _ = load_for_training(cfg, {folder!r})
form = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps(dict(before=before, peak=peak_rss_bytes(), after=process_rss_bytes(), form=form)))
"""


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_loading_peak_is_the_training_form_and_a_few_tensors(tmp_path, dtype, processes):
    """A model of ~100 MB in float32 on disk: the load's peak above the process before it is the training form
    plus a few of the largest tensors as read, never the whole model in float32 beside it."""
    shape = dict(vocab_size=8192, d_model=256, d_ff=1024, d_kv=32, num_heads=8, num_layers=6, num_decoder_layers=6)
    folder = Path(build_checkpoint(tmp_path / "hub", shape, "float32", 40 * 2**20)["folder"])
    file_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    largest = 8192 * 256 * 4  # the embedding (and the head), as read
    script = PEAK_SCRIPT.format(repo=str(REPO), folder=str(folder), dtype=dtype)
    out = processes.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    grown = sizes["peak"] - sizes["before"]
    assert grown <= sizes["form"] + 3 * largest + 16 * 2**20, (grown, sizes, file_bytes)
    if dtype == "int8":
        assert sizes["form"] < 0.5 * file_bytes  # 8-bit and bf16: the whole float32 model never existed
        assert grown < file_bytes  # the whole model in float32 never existed


@pytest.fixture(scope="session")
def sft_run(run_cli):
    def sft_run(corpus, out, init_from, *flags, steps=4):
        return run_cli("train", "--is_finetune=True", f"--init_from={init_from}", f"--train_file={corpus}",
                       f"--eval_file={corpus}", "--max_eval_samples=4", "--eval_generate=False", f"--output_dir={out}",
                       "--batch_size=2", "--gradient_accumulation_steps=2", "--learn_rate=5e-3", "--warmup_steps=0",
                       f"--max_steps={steps}", "--eval_steps=2", "--save_steps=2", "--logging_steps=1", *flags)
    return sft_run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("data") / "pairs.jsonl", synthetic_rows(64))


def test_lora_checkpoint_holds_what_trains_and_resumes_exactly(hub, corpus, tmp_path, sft_run):
    base = str(hub["fp32"])
    lora = ("--lora_r=4", "--frozen_dtype=int8")
    straight = sft_run(corpus, tmp_path / "straight", base, *lora)
    assert straight.returncode == 0, straight.stderr[-3000:]
    # the run as a kill after step 2 leaves it: its step-2 checkpoint the newest
    shutil.copytree(tmp_path / "straight", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_000004")
    shutil.rmtree(tmp_path / "cut" / "final")
    checkpoint = tmp_path / "cut" / "checkpoints" / "step_000002"
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in key for key in keys)  # no frozen base tensor in a checkpoint
    assert (checkpoint / "model.safetensors").stat().st_size < 200_000
    run_config = json.loads((checkpoint / "run_config.json").read_text())
    assert run_config["base_model"]["init_from"] == base and len(run_config["base_model"]["fingerprint"]) == 16
    resumed = sft_run(corpus, tmp_path / "cut", base, *lora, "--is_keep_training=True")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def adapters(run):
        from safetensors.torch import load_file

        return load_file(str(tmp_path / run / "final" / "adapter_model.safetensors"))

    a, b = adapters("straight"), adapters("cut")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical
    assert any(k.endswith("lora_B.weight") and a[k].abs().max() > 0 for k in a)  # trained


def test_a_changed_base_is_refused_on_resume(corpus, tmp_path, sft_run):
    folder = Path(build_checkpoint(tmp_path / "base", "tiny", "float32", SHARD_BYTES)["folder"])
    first = sft_run(corpus, tmp_path / "run", str(folder), "--lora_r=4", steps=2)
    assert first.returncode == 0, first.stderr[-3000:]
    for f in list(folder.iterdir()):  # the same shapes, other weights: a retrained or replaced base
        f.unlink()
    folder.rmdir()
    build_checkpoint(folder, "tiny", "float32", SHARD_BYTES, seed=1)
    resumed = sft_run(corpus, tmp_path / "run", str(folder), "--lora_r=4", "--is_keep_training=True")
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    error = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "other weights" in error[0] and "fingerprint" in error[0], resumed.stderr[-2000:]
    assert "Traceback" not in resumed.stderr


def test_adapter_export_loads_in_peft_and_the_merged_export_equals_it(hub, corpus, tmp_path, run_cli, sft_run):
    import peft
    from transformers import AutoModelForSeq2SeqLM

    base = str(hub["fp32"])
    for name, flags in (("adapter", ()), ("merged", ("--merge_lora=True",))):
        result = sft_run(corpus, tmp_path / name, base, "--lora_r=4", *flags, steps=2)
        assert result.returncode == 0, result.stderr[-3000:]
    adapter = tmp_path / "adapter" / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in adapter.iterdir()}
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    ids = torch.randint(3, 8000, (2, 10))

    def logits(model):
        with torch.no_grad():
            return model.eval()(input_ids=ids, decoder_input_ids=ids).logits

    with_peft = peft.PeftModel.from_pretrained(AutoModelForSeq2SeqLM.from_pretrained(base), str(adapter))
    merged = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "merged" / "final"))
    from lowmem.model.adapters import load_saved_model_weights

    ours = load_saved_model_weights(adapter)  # what evaluate and generate load: the base as trained, the adapters
    reference = logits(with_peft)
    assert (logits(merged) - reference).abs().max() < 1e-4
    assert (logits(ours) - reference).abs().max() < 1e-4
    assert (logits(AutoModelForSeq2SeqLM.from_pretrained(base)) - reference).abs().max() > 1e-3  # it trained
    generated = run_cli("generate", f"--init_from={adapter}", "--prompt=the cat runs", "--max_new_tokens=4",
                        "--is_finetune=True")
    assert generated.returncode == 0 and "->" in generated.stdout, generated.stderr[-2000:]


GPU_LOAD_SCRIPT = """
import sys, json
sys.path.insert(0, {repo!r})
import torch
from lowmem.cli.flags import load_config
from lowmem.hardware.memory_use import peak_rss_bytes, process_rss_bytes
from lowmem.model.build import import_transformers_models
from lowmem.model.streamed_load import load_for_training
import_transformers_models()
cfg = load_config(dict(init_from={folder!r}, is_finetune=True, lora_r=8, frozen_dtype="bfloat16",
                       mixed_precision="bf16"))[0]
torch.zeros(1, device="cuda")
before = process_rss_bytes()
model, _, _ = load_for_training(cfg, {folder!r}, torch.device("cuda"))
print(json.dumps(dict(host_grown=peak_rss_bytes() - before, gpu=torch.cuda.max_memory_allocated(),
                      form=sum(t.numel() * t.element_size() for t in model.state_dict().values()))))
"""


@pytest.mark.gpu
def test_xl_loads_straight_to_the_gpu_with_a_flat_host(tmp_path, processes):
    """flan-t5-xl's shape (bf16 on disk, 5.7 GB): the host grows by a block or two while the GPU takes the
    weights, and the GPU holds the training form."""
    folder = str(build_checkpoint(tmp_path / "xl", "xl", "bfloat16", int(9.5e9))["folder"])
    out = processes.run([sys.executable, "-c", GPU_LOAD_SCRIPT.format(repo=str(REPO), folder=folder)],
                        capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    print(sizes)
    assert sizes["host_grown"] < 2 * 2**30, sizes
    assert sizes["form"] <= sizes["gpu"] < 1.1 * sizes["form"], sizes
