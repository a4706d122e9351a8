"""8-bit frozen weights (--frozen_dtype=int8|float8, optimum-quanto): what is quantized and how much it
stores, frozen weights that never change, exports that dequantize within the quantization error, exact
resume, and the planner's count of the same weights."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, metrics, synthetic_rows, write_rows

from lowmem.cli.flags import load_config

pytest.importorskip("optimum.quanto")


def quantized_model(folder, **flags):
    """The model as the trainer builds it: loaded, frozen, adapted, quantized (``ready_to_train``)."""
    from lowmem.model.build import load_model, ready_to_train

    cfg = load_config({"init_from": str(folder), **flags})[0]
    model, counts = ready_to_train(load_model(folder), cfg)
    return cfg, model, counts


def layers(model):
    return {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


@pytest.mark.parametrize("family, flags", [
    ("flan", {"is_finetune": True, "frozen_dtype": "int8"}),
    ("t5", {"is_finetune": True, "frozen_dtype": "float8", "quantize_wo": True}),
    ("flan", {"is_finetune": True, "lora_r": 4, "lora_target_modules": "q,wi_1", "frozen_dtype": "int8"}),
])
def test_frozen_linear_layers_are_stored_in_8_bits_and_counted_by_the_planner(family_models, family, flags):
    from lowmem.memory import plan_sizes, tensor_bytes
    from lowmem.model.build import load_model
    from lowmem.model.quantize import is_quantized

    source = load_model(family_models[family]).state_dict()
    cfg, model, counts = quantized_model(family_models[family], **flags)
    found = {name: module.weight for name, module in layers(model).items()}
    eight_bit = {name: w for name, w in found.items() if is_quantized(w)}
    assert counts["frozen_8bit"] == sum(w.numel() for w in eight_bit.values()) > 0
    for name, weight in eight_bit.items():
        # really 8 bits: one byte per element, one scale per output row
        assert weight._data.element_size() == 1 and weight._data.untyped_storage().nbytes() == weight.numel()
        assert weight._scale.numel() == weight.shape[0] and not weight.requires_grad
        plain = source[name.replace(".base_layer", "") + ".weight"]
        # within half a quantization step of the source: int8, the row's absmax / 127; float8 (e4m3, the row
        # scaled to its largest value 448), 3 mantissa bits, and the subnormals' spacing (2^-9) near zero
        rowmax = plain.abs().amax(dim=1, keepdim=True)
        step = rowmax / 127 if cfg.frozen_dtype == "int8" else plain.abs() / 8 + rowmax / 448 * 2**-9
        assert ((weight.dequantize() - plain).abs() <= step / 2 + 1e-7).all(), name
    for name, weight in found.items():
        trainable = weight.requires_grad
        is_wo = "wo" in name.split(".")
        in_frozen_stack = name.startswith("encoder.") or (cfg.lora_r > 0 and name.startswith("decoder."))
        expected = in_frozen_stack and not trainable and (cfg.quantize_wo or not is_wo) and "lora_" not in name
        assert is_quantized(weight) == expected, name
    assert not is_quantized(model.shared.weight) and not is_quantized(model.lm_head.weight)
    from lowmem.model.quantize import row_block_forward  # on the CPU, computed a block of rows at a time

    layer_of = dict(model.named_modules())
    assert all(layer_of[name.removesuffix(".weight")].forward.func is row_block_forward for name in eight_bit)
    # a resume loads the state dict back: the 8-bit weights stay frozen
    model.load_state_dict(model.state_dict())
    assert not any(w.requires_grad for w in eight_bit.values())
    # the planner counts the same elements, and what storing them in 8 bits saves
    shapes = tensor_bytes.parameter_shapes(tensor_bytes.model_dims(cfg, 0))
    assert sum(tensor_bytes.numel(s) for s in tensor_bytes.quantized_shapes(cfg, shapes)) == counts["frozen_8bit"]
    stored = sum(w._data.untyped_storage().nbytes() + w._scale.untyped_storage().nbytes() for w in eight_bit.values())
    plan = plan_sizes.step_sizes(cfg, 8000, {"max_source": 16, "max_target": 16, "mean_source": 10, "row_bytes": 100,
                                             "rows": 50, "pairs": [(16, 16)] * 50})
    assert plan.saved_8bit == pytest.approx(4 * counts["frozen_8bit"] - stored, abs=8 * len(eight_bit))


@pytest.mark.parametrize("qtype, dtype, tolerance", [
    ("qint8", torch.float32, 2e-6), ("qfloat8", torch.float32, 2e-6), ("qint8", torch.bfloat16, 2**-7),
])
def test_an_8_bit_layer_computes_as_its_dequantized_weight_a_block_of_rows_at_a_time(monkeypatch, qtype, dtype,
                                                                                      tolerance):
    """Output and input gradient against float64 math with the dequantized weight (float32: within float32
    rounding; bf16: within bf16's), never more than BLOCK_BYTES of it in float at once, no weight gradient."""
    from lowmem.model import narrow_compute, quantize

    monkeypatch.setattr(narrow_compute, "BLOCK_BYTES", 4096)  # 517 rows of 300: several blocks, the last one short
    blocks, float_blocks = [], narrow_compute.float_blocks

    def spied(data, block_dtype):
        for part, block in float_blocks(data, block_dtype):
            blocks.append((part.stop - part.start, block.untyped_storage().nbytes()))
            yield part, block

    monkeypatch.setattr(narrow_compute, "float_blocks", spied)
    torch.manual_seed(0)
    holder = torch.nn.Sequential(torch.nn.Linear(300, 517, bias=False).to(dtype).requires_grad_(False))
    frozen_dtype = {"qint8": "int8", "qfloat8": "float8"}[qtype]
    quantize.quantize_block(SimpleNamespace(frozen_dtype=frozen_dtype), holder, ["0"])
    layer = holder[0]
    x = torch.randn(2, 7, 300, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 7, 517, dtype=dtype)
    out = layer(x)
    out.backward(grad)
    assert type(out.grad_fn).__name__ == "BlockLinearBackward" and out.dtype == x.grad.dtype == dtype
    weight = layer.weight.dequantize().double()
    for got, expected in ((out, x.detach().double() @ weight.t()), (x.grad, grad.double() @ weight)):
        assert (got.double() - expected).abs().max() <= tolerance * expected.abs().max()
    assert layer.weight.grad is None and not layer.weight.requires_grad
    # forward and backward each went over every row once, in one buffer of at most BLOCK_BYTES
    assert sum(rows for rows, _ in blocks) == 2 * 517 and len(blocks) > 4
    assert max(nbytes for _, nbytes in blocks) <= 4096
    if dtype == torch.float32:  # what optimum-quanto's own path computes, within float32 rounding
        with torch.no_grad():
            assert torch.allclose(out, type(layer).forward(layer, x), rtol=0, atol=2e-6 * out.abs().max())


def test_an_export_dequantizes_and_merges_one_shard_at_a_time(family_models, tmp_path, monkeypatch):
    from transformers import AutoModelForSeq2SeqLM

    from lowmem.model import quantize
    from lowmem.model.build import export_state_dict
    from lowmem.runs.run_folder import ExportFiles, RunFolder

    cfg, model, _ = quantized_model(family_models["flan"], is_finetune=True, lora_r=4, frozen_dtype="int8")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # adapters that change the merged weights
    plain = export_state_dict(model)
    assert any(isinstance(v, quantize.Later) for v in plain.values())
    monkeypatch.setattr(quantize, "SHARD_BYTES", 2**16)  # several shards from a tiny model
    from data.tokenization import load_tokenizer

    tokenizer = load_tokenizer(family_models["flan"])
    RunFolder.export(tmp_path / "export", model, ExportFiles(tokenizer, {"kind": "sft"}), state_dict=plain)
    files = sorted(p.name for p in (tmp_path / "export").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "export" / "model.safetensors.index.json").is_file()
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "export")
    assert loaded.lm_head.weight is not loaded.shared.weight  # flan's own head, kept untied
    ids = torch.tensor([[5, 9, 13, 1]])
    decoder_ids = torch.tensor([[0, 7, 11]])
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids, decoder_input_ids=decoder_ids).logits
        got = loaded(input_ids=ids, decoder_input_ids=decoder_ids).logits
    assert torch.allclose(expected, got, rtol=1e-4, atol=1e-4)  # the trained model: 8-bit base, adapters merged


def test_a_lora_export_over_8_bit_weights_with_bf16_scales_is_float32(family_models):
    """Under --mixed_precision=bf16 an 8-bit weight's scales are bf16 and the weight reports that dtype: the
    merge was cast to it on the CPU (its rounding, 1.9e-3, was most of the adapters' update, 2.8e-3)."""
    from lowmem.model import quantize
    from lowmem.model.build import export_state_dict

    _, model, _ = quantized_model(family_models["flan"], is_finetune=True, lora_r=4, frozen_dtype="int8",
                                  mixed_precision="bf16")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=1e-3)  # a small update, as a few steps make
    plain = {k: v.make() if isinstance(v, quantize.Later) else v for k, v in export_state_dict(model).items()}
    assert {v.dtype for v in plain.values()} == {torch.float32}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A"):
            base = module.get_base_layer().weight
            assert quantize.is_quantized(base) and base.dtype == torch.bfloat16, name
            expected = quantize.plain_weight(base) + module.scaling["default"] * (
                module.lora_B["default"].weight.float() @ module.lora_A["default"].weight.float())
            assert torch.allclose(plain[name.replace(".base_layer", "") + ".weight"], expected, atol=1e-6), name


def test_int8_sft_trains_keeps_frozen_weights_resumes_exactly_and_exports_plainly(family_models, tmp_path, run_cli):
    from safetensors.torch import load_file
    from transformers import AutoModelForSeq2SeqLM

    data = write_rows(tmp_path / "train.jsonl", synthetic_rows(200, seed=11))
    init = family_models["flan"]
    common = ["train", "--is_finetune=True", f"--init_from={init}", f"--train_file={data}", f"--eval_file={data}",
              "--frozen_dtype=int8", "--lr_scheduler=constant", "--warmup_steps=0", "--learn_rate=3e-3",
              "--save_steps=3", "--eval_steps=0", "--max_eval_samples=8", "--gradient_accumulation_steps=2",
              "--logging_steps=1"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    done = run_cli(*common, "--max_steps=6", f"--output_dir={straight}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "frozen weights stored in int8" in done.stdout
    losses = [r["loss"] for r in metrics(straight) if r["event"] == "train"]
    assert losses[-1] < losses[0]
    # a checkpoint holds what trains (the decoder, the untied head), never the frozen encoder or embedding: the
    # resume reads and quantizes them again from --init_from
    first, last = (load_file(str(straight / "checkpoints" / f"step_00000{n}" / "model.safetensors")) for n in (3, 6))
    assert first and not any(k.startswith("encoder.") or k == "shared.weight" for k in first)
    assert all(first[k].dtype == torch.float32 for k in first)
    assert any(not torch.equal(first[k], last[k]) for k in first if k.startswith("decoder."))
    # stopped after its first checkpoint and resumed: the very same weights
    assert run_cli(*common, "--max_steps=3", f"--output_dir={broken}").returncode == 0
    done = run_cli(*common, "--max_steps=6", f"--output_dir={broken}", "--is_keep_training=True")
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = load_file(str(broken / "checkpoints" / "step_000006" / "model.safetensors"))
    assert all(torch.equal(last[k], resumed[k]) for k in last)
    # the export: plain float32 transformers weights, the encoder within the quantization error of the source
    source = load_file(str(init / "model.safetensors"))
    exported = load_file(str(straight / "final" / "model.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.float32}
    q = "encoder.block.0.layer.0.SelfAttention.q.weight"
    step = source[q].abs().amax(dim=1, keepdim=True) / 127
    assert 0 < (exported[q] - source[q]).abs().max() and ((exported[q] - source[q]).abs() <= step / 2 + 1e-7).all()
    wo = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    assert torch.equal(exported[wo], source[wo].bfloat16().float())  # kept in bf16 beside the 8-bit layers
    model = AutoModelForSeq2SeqLM.from_pretrained(straight / "final")
    assert torch.equal(model.state_dict()[q], exported[q])


def test_a_missing_optimum_quanto_is_one_line(tmp_path, run_cli):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['optimum.quanto'] = None\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    done = run_cli("train", f"--output_dir={tmp_path / 'run'}", "--is_finetune=True", "--init_from=unused",
                   "--frozen_dtype=int8", env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "pip install '.[quant]'" in done.stderr and not (tmp_path / "run").exists()


def test_an_installed_optional_package_that_fails_to_import_is_one_line(tmp_path, family_models, run_cli):
    broken = tmp_path / "site" / "peft"  # found by the import system, broken when imported
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('cannot import name X from transformers')\n")
    env = {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"}
    for command in ("plan", "train"):  # train refuses it before the run folder is made
        done = run_cli(command, "--is_finetune=True", f"--init_from={family_models['t5']}", "--lora_r=4",
                       f"--output_dir={tmp_path / 'run'}", env=env)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
        assert "--lora_r needs peft, which is installed but fails to import" in done.stderr
    assert not (tmp_path / "run").exists()
    broken = tmp_path / "site" / "bitsandbytes"  # in pretraining too (no --init_from)
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('libbitsandbytes_cpu.so: cannot open shared object')\n")
    done = run_cli("train", "--optimizer=adamw8bit", f"--output_dir={tmp_path / 'run'}", env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert "--optimizer=adamw8bit needs bitsandbytes, which is installed but fails to import" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, message", [
    (["--frozen_dtype=int8"], "--frozen_dtype=int8 quantizes frozen linear layers and this run has none"),
    (["--is_finetune=True", "--freeze=embeddings", "--frozen_dtype=float8"], "this run has none"),
    (["--quantize_wo=True"], "--quantize_wo=True needs --frozen_dtype=int8 or float8"),
])
def test_8_bit_flags_without_frozen_layers_give_one_line(tmp_path, flags, message, cli_in_process):
    done = cli_in_process("train", f"--output_dir={tmp_path / 'run'}", "--init_from=unused", *flags)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


@pytest.mark.parametrize("family", ["flan", "t5"])
def test_int8_under_bf16_resumes_exactly(family_models, tmp_path, family, run_cli):
    # bf16 computes 8-bit layers with torch's int8 matrix product, which crashed the process (a segmentation
    # fault) on a weight loaded from a checkpoint where the file's layout left its bytes unaligned
    from safetensors.torch import load_file

    data = write_rows(tmp_path / "train.jsonl", synthetic_rows(60, seed=12))
    common = ["train", "--is_finetune=True", f"--init_from={family_models[family]}", f"--train_file={data}",
              f"--eval_file={data}", "--frozen_dtype=int8", "--mixed_precision=bf16", "--lora_r=8",
              "--lora_target_modules=q,k,v,o,wi,wo", "--save_steps=2", "--eval_steps=0", "--max_eval_samples=4",
              "--eval_generate=False", "--gradient_accumulation_steps=2"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    assert run_cli(*common, "--max_steps=4", f"--output_dir={straight}").returncode == 0
    assert run_cli(*common, "--max_steps=2", f"--output_dir={broken}").returncode == 0
    done = run_cli(*common, "--max_steps=4", f"--output_dir={broken}", "--is_keep_training=True")
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = (load_file(str(run / "checkpoints" / "step_000004" / "model.safetensors")) for run in (straight, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)
