"""The export command: a LoRA adapter merged into its base, a run's checkpoint and a model folder written as plain
transformers model folders, in the dtype asked for; and the folders and inputs it refuses (one line, exit code 2)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import folder_state, shared_folder, synthetic_rows, write_rows

FAST = ["--eval_steps=0", "--max_eval_samples=8", "--logging_steps=5", "--eval_generate=False",
        "--gradient_accumulation_steps=2", "--max_steps=4", "--save_steps=2"]
IDS, DECODER_IDS = torch.tensor([[5, 6, 7, 8, 9, 1], [10, 11, 12, 1, 0, 0]]), torch.tensor([[0, 13, 14], [0, 15, 16]])


@pytest.fixture(scope="session")
def runs(request, tmp_path_factory, run_cli):
    """Tiny runs made by the real train command, once a session (read only): ``pre`` pretrains a preset (whole
    checkpoints), ``lora`` adapts q, v and the gated wi of both stacks (an adapter folder, checkpoints of adapters),
    ``frozen`` fine-tunes the decoder and head with the encoder frozen (checkpoints of the trained tensors alone)."""
    def build(folder):
        data = write_rows(folder / "train.jsonl", synthetic_rows(200, seed=1))
        common = [f"--train_file={data}", f"--eval_file={data}", *FAST]
        for name, flags in (("pre", []),
                            ("lora", ["--is_finetune=True", f"--init_from={folder / 'pre' / 'final'}", "--lora_r=4",
                                      "--lora_alpha=8", "--freeze=none", "--lora_target_modules=q,v,wi",
                                      "--learn_rate=1e-2"]),
                            ("frozen", ["--is_finetune=True", f"--init_from={folder / 'pre' / 'final'}"])):
            done = run_cli("train", f"--output_dir={folder / name}", *common, *flags)
            assert done.returncode == 0, done.stderr[-3000:]

    return shared_folder(request, tmp_path_factory, "export-runs", build)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS, decoder_input_ids=DECODER_IDS).logits


def tensors(folder) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_an_adapter_exported_through_the_cli_is_its_base_plus_adapter(tmp_path, runs, run_cli):
    from peft import PeftModel
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    adapter, out = runs / "lora" / "final", tmp_path / "merged"
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    done = run_cli("export", f"--init_from={adapter}", f"--export_dir={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    merged = T5ForConditionalGeneration.from_pretrained(out)
    assert merged.dtype == torch.float32 and not any("lora" in name for name, _ in merged.named_parameters())
    assert type(merged.decoder.block[0].layer[0].SelfAttention.q) is torch.nn.Linear
    base = T5ForConditionalGeneration.from_pretrained(runs / "pre" / "final")
    plain = logits(base)
    adapted = logits(PeftModel.from_pretrained(base, adapter))
    assert (adapted - plain).abs().max() > 1e-3  # the adapters matter (B trained away from zero)
    assert torch.allclose(logits(merged), adapted, atol=1e-5, rtol=0)
    # a plain folder: the head as the base has it (untied), the run's tokenizer, what evaluate adopts
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["dtype"] == "float32"
    assert AutoTokenizer.from_pretrained(out)("the cat").input_ids == AutoTokenizer.from_pretrained(adapter)(
        "the cat").input_ids
    info = json.loads((out / "training_info.json").read_text())
    assert info["exported_from"]["kind"] == "adapter" and "base_form" not in info and info["trained_with"]
    assert "lora_merged" in done.stdout and "error" not in done.stderr


def test_a_lora_checkpoint_exports_as_the_adapter_of_its_step(tmp_path, runs, cli_in_process):
    from transformers import T5ForConditionalGeneration

    latest = runs / "lora" / "checkpoints" / "latest"  # step 4, the last: the weights final/ holds
    done = cli_in_process("export", f"--init_from={latest}", f"--export_dir={tmp_path / 'step'}")
    assert done.returncode == 0, done.stderr
    done = cli_in_process("export", f"--init_from={runs / 'lora' / 'final'}", f"--export_dir={tmp_path / 'final'}")
    assert done.returncode == 0, done.stderr
    step, final = tensors(tmp_path / "step"), tensors(tmp_path / "final")
    assert sorted(step) == sorted(final) and all(torch.equal(step[k], final[k]) for k in step)
    assert json.loads((tmp_path / "step" / "training_info.json").read_text())["step"] == 4
    # the earlier step is another model
    done = cli_in_process("export", f"--init_from={runs / 'lora' / 'checkpoints' / 'step_000002'}",
                          f"--export_dir={tmp_path / 'two'}")
    assert done.returncode == 0, done.stderr
    two = T5ForConditionalGeneration.from_pretrained(tmp_path / "two")
    assert not torch.allclose(logits(two), logits(T5ForConditionalGeneration.from_pretrained(tmp_path / "step")))


@pytest.mark.parametrize("run", ["pre", "frozen"])
def test_a_checkpoint_exports_the_model_its_run_exported(tmp_path, runs, cli_in_process, run):
    """A preset's whole checkpoint, and a frozen-encoder run's (its trained tensors over the base's), give the
    weights and config of the run's own final/ export, bit for bit."""
    done = cli_in_process("export", f"--init_from={runs / run / 'checkpoints'}", f"--export_dir={tmp_path / 'out'}")
    assert done.returncode == 0, done.stderr
    got, want = tensors(tmp_path / "out"), tensors(runs / run / "final")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in got)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (runs / run / "final" / "config.json").read_text())


def test_a_model_folder_in_bfloat16(tmp_path, runs, cli_in_process):
    from transformers import T5ForConditionalGeneration

    source, out = runs / "pre" / "final", tmp_path / "bf16"
    done = cli_in_process("export", f"--init_from={source}", f"--export_dir={out}", "--dtype=bfloat16")
    assert done.returncode == 0, done.stderr
    written, original = tensors(out), tensors(source)
    assert {v.dtype for v in written.values()} == {torch.bfloat16}
    assert all(torch.equal(written[k], original[k].to(torch.bfloat16)) for k in original)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert T5ForConditionalGeneration.from_pretrained(out).dtype == torch.bfloat16


def test_a_peft_adapter_of_another_kind_merges_too(tmp_path, runs, cli_in_process):
    """An adapter made by peft itself: rsLoRA's scaling, every linear layer and the head, random B, no tokenizer of
    its own (the base's is taken); its base moved, then found with --base."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import T5ForConditionalGeneration

    base = T5ForConditionalGeneration.from_pretrained(runs / "pre" / "final")
    torch.manual_seed(0)  # B drawn at random (init_lora_weights=False), scaled by alpha / sqrt(r) = 0.5
    config = LoraConfig(r=4, lora_alpha=1, use_rslora=True, init_lora_weights=False,
                        target_modules=["q", "k", "v", "o", "wi_0", "wi_1", "wo", "lm_head"])
    get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    adapter_config = tmp_path / "adapter" / "adapter_config.json"
    assert json.loads(adapter_config.read_text())["base_model_name_or_path"] == str(runs / "pre" / "final")
    settings = json.loads(adapter_config.read_text())
    adapter_config.write_text(json.dumps({**settings, "base_model_name_or_path": str(tmp_path / "moved")}))
    done = cli_in_process("export", f"--init_from={tmp_path / 'adapter'}", f"--export_dir={tmp_path / 'out'}")
    assert done.returncode == 2 and "moved" in done.stderr and "--base=" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    done = cli_in_process("export", f"--init_from={tmp_path / 'adapter'}", f"--export_dir={tmp_path / 'out'}",
                          f"--base={runs / 'pre' / 'final'}")
    assert done.returncode == 0, done.stderr
    plain = logits(T5ForConditionalGeneration.from_pretrained(runs / "pre" / "final"))
    adapted = logits(PeftModel.from_pretrained(T5ForConditionalGeneration.from_pretrained(runs / "pre" / "final"),
                                               tmp_path / "adapter"))
    assert (adapted - plain).abs().max() > 0.1
    assert torch.allclose(logits(T5ForConditionalGeneration.from_pretrained(tmp_path / "out")), adapted, atol=1e-5,
                          rtol=0)


def test_an_export_dir_with_files_is_refused_and_left_as_it_was(tmp_path, runs, run_cli):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = folder_state(out)
    done = run_cli("export", f"--init_from={runs / 'pre' / 'final'}", f"--export_dir={out}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: --export_dir=") and "notes.txt" in done.stderr
    assert folder_state(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_an_empty_export_dir_is_filled(tmp_path, runs, cli_in_process):
    (tmp_path / "empty").mkdir()
    done = cli_in_process("export", f"--init_from={runs / 'pre' / 'final'}", f"--export_dir={tmp_path / 'empty'}")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # its staging folder renamed into place


@pytest.mark.parametrize("case, expected", [
    ("missing", "does not exist"),
    ("not a model", "is not a model folder"),
    ("run folder", "pass --init_from="),
    ("dtype", "--dtype must be one of float32, bfloat16, float16"),
    ("no export_dir", "export needs --export_dir"),
    ("export_dir inside", "is inside"),
    ("damaged checkpoint", "is not a complete checkpoint"),
])
def test_bad_input_is_one_error_line(tmp_path, runs, cli_in_process, case, expected):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "data.csv").write_text("a,b\n")
    damaged = tmp_path / "step_000004"
    if case == "damaged checkpoint":
        import shutil

        shutil.copytree(runs / "pre" / "checkpoints" / "step_000004", damaged)
        with open(damaged / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    init_from = {"missing": tmp_path / "nowhere", "not a model": tmp_path / "odd", "run folder": runs / "pre",
                 "damaged checkpoint": damaged}.get(case, runs / "pre" / "final")
    export_dir = {"export_dir inside": runs / "pre" / "final" / "sub"}.get(case, tmp_path / "out")
    args = [f"--init_from={init_from}"] + ([] if case == "no export_dir" else [f"--export_dir={export_dir}"])
    done = cli_in_process("export", *args, *(["--dtype=int4"] if case == "dtype" else []))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], done.stderr
    assert not (tmp_path / "out").exists() and not (runs / "pre" / "final" / "sub").exists()


def test_flags_export_does_not_read_get_a_note(tmp_path, runs, cli_in_process):
    done = cli_in_process("export", f"--init_from={runs / 'pre' / 'final'}", f"--export_dir={tmp_path / 'out'}",
                          "--learn_rate=0.1")
    assert done.returncode == 0, done.stderr
    assert "note: --learn_rate has no effect on export" in done.stderr
    done = cli_in_process("export", f"--init_from={runs / 'pre' / 'final'}", f"--export_dirr={tmp_path / 'x'}")
    assert done.returncode == 2 and "did you mean --export_dir" in done.stderr


def peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def test_a_merge_holds_about_one_shard_not_the_base(tmp_path, tokenizer, runs, cli_in_process):
    """The base is read a shard at a time: merging an adapter into a small-preset model (198 MiB in float32) raises
    the process's peak RSS by about one 64 MiB shard and its write (98 MiB measured), where loading the base once
    would take all of it (peft's merge_and_unload and save_pretrained: +338 MiB)."""
    from peft import LoraConfig, get_peft_model

    from lowmem.cli.flags import load_config
    from lowmem.model.build import build_model

    cfg, _ = load_config({"model_preset": "small"})
    model = build_model(cfg, tokenizer)
    base_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    get_peft_model(model, LoraConfig(r=8, target_modules=["q", "v"], init_lora_weights=False)).save_pretrained(
        tmp_path / "adapter")
    del model
    done = cli_in_process("export", f"--init_from={runs / 'lora' / 'final'}", f"--export_dir={tmp_path / 'warm'}")
    assert done.returncode == 0, done.stderr  # every import an export makes, done before the peak is reset
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # (Linux: the peak RSS starts again from the current RSS)
    before = peak_rss_mib()
    done = cli_in_process("export", f"--init_from={tmp_path / 'adapter'}", f"--export_dir={tmp_path / 'out'}",
                          f"--base={tmp_path / 'base'}")  # (a model built, not loaded, names no base in its adapter)
    assert done.returncode == 0, done.stderr
    grown = peak_rss_mib() - before
    assert base_mib > 190 and grown < 0.7 * base_mib, (grown, base_mib)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) == 4  # 64 MiB shards
