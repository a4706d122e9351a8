"""The planner counts the model the trainer builds, for every T5 family (tests/t5_family.py), every
--freeze choice, with and without LoRA, and for the presets trained from scratch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from t5_family import FAMILIES

from config import SHIPPED_CORPORA
from lowmem.cli.flags import load_config
from lowmem.utils.errors import UserError

FREEZES = ("encoder", "embeddings", "none")
GATED = ("flan", "v1_1", "mt5", "umt5", "byt5")
# lengths of a small run, as plan_batches gives them (the counts do not depend on them)
LENGTHS = {"max_source": 48, "max_target": 32, "mean_source": 30, "row_bytes": 300, "rows": 200,
           "pairs": [(48, 32)] * 200}


def built(cfg, tokenizer=None):
    """The model as the trainer builds it (LowMemTrainer._build_model): loaded or new, frozen, adapted."""
    from lowmem.model.build import ready_to_train
    from lowmem.model.streamed_load import model_for_run

    model, stored = model_for_run(cfg, tokenizer, "cpu")
    return ready_to_train(model, cfg, stored)[0]


def counts(model) -> tuple[int, int]:
    """(parameters, trainable) as the trainer reports them."""
    from lowmem.model.build import count_parameters

    trainable, frozen = count_parameters(model)
    return trainable + frozen, trainable


def planned(cfg, vocab_size: int = 8000) -> tuple[int, int]:
    from lowmem.memory import planner

    plan = planner.predict(cfg, vocab_size, LENGTHS, 300.0)
    return plan["parameters"], plan["trainable_parameters"]


def config(folder, **flags):
    return load_config({"init_from": str(folder), **flags})[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_counts_the_built_model_for_every_freeze_choice(family_models, family):
    folder = family_models[family]
    for flags in [{"is_finetune": True, "freeze": f} for f in FREEZES] + [
            {"is_finetune": True}, {}, {"freeze": "embeddings"}]:  # the defaults: encoder (SFT), none (pretraining)
        cfg = config(folder, **flags)
        assert planned(cfg) == counts(built(cfg)), (family, flags)


@pytest.mark.parametrize("family", ["flan", "umt5", "t5"])
@pytest.mark.parametrize("flags", [
    {"is_finetune": True, "lora_r": 4, "lora_target_modules": "q,v,wi,wo"},
    {"is_finetune": True, "lora_r": 4, "lora_target_modules": "q,k,v,o,wi,wo", "lora_dropout": 0.0},
    {"lora_r": 8, "lora_target_modules": "q,v,wi,wo"},  # --freeze=none: the encoder's layers adapt too
    {"lora_r": 2, "freeze": "embeddings", "lora_target_modules": "o,wo"},
])
def test_plan_counts_lora_adapters_and_merged_weights(family_models, family, flags):
    from peft.tuners.lora import LoraLayer

    from lowmem.memory import tensor_bytes

    cfg = config(family_models[family], **flags)
    model = built(cfg)
    assert planned(cfg) == counts(model)
    merged = sum(m.get_base_layer().weight.numel() for m in model.modules() if isinstance(m, LoraLayer))
    assert tensor_bytes.lora_merged_elements(cfg, tensor_bytes.model_dims(cfg, 0)) == merged > 0


def test_plan_counts_lora_on_one_gated_projection(family_models):
    cfg = config(family_models["flan"], is_finetune=True, lora_r=4, lora_target_modules="wi_1,wo")
    assert planned(cfg) == counts(built(cfg))
    # wi_0 names nothing on a ReLU model: the plan says so as building the model would
    relu = config(family_models["t5"], is_finetune=True, lora_r=4, lora_target_modules="q,wi_0")
    with pytest.raises(UserError, match="names wi_0, which this model does not have"):
        planned(relu)


@pytest.mark.parametrize("family", ["t5", "flan", "umt5", "byt5"])
def test_plan_counts_the_weights_stored_in_bf16(family_models, family):
    from lowmem.memory import tensor_bytes
    from lowmem.model.build import store_frozen_in_bf16

    for flags in ({"is_finetune": True}, {"freeze": "embeddings"}, {"lora_r": 4, "lora_target_modules": "q,wi"}):
        cfg = config(family_models[family], mixed_precision="bf16", frozen_dtype="bfloat16", **flags)
        dims = tensor_bytes.model_dims(cfg, 0)
        planned_half = tensor_bytes.frozen_matrix_elements(cfg, tensor_bytes.parameter_shapes(dims))
        assert planned_half == store_frozen_in_bf16(built(cfg)) > 0, (family, flags)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_plan_counts_a_new_model_from_a_preset(tokenizer, preset):
    """Each feed-forward as built (gated-gelu's wi_0 and wi_1, ReLU's wi), with about the same weights."""
    from lowmem.memory import tensor_bytes

    sizes = {}
    for proj, layers in (("gated-gelu", {"wi_0", "wi_1", "wo"}), ("relu", {"wi", "wo"})):
        cfg = load_config({"model_preset": preset, "feed_forward_proj": proj})[0]
        model = built(cfg, tokenizer)
        assert {name.split(".")[-2] for name, _ in model.named_parameters() if ".DenseReluDense." in name} == layers
        assert tensor_bytes.model_dims(cfg, len(tokenizer))["gated"] == (proj == "gated-gelu")
        assert planned(cfg, len(tokenizer)) == counts(model)
        sizes[proj] = counts(model)[0]
    assert sizes["gated-gelu"] == pytest.approx(sizes["relu"], rel=0.05)


def test_plan_reads_the_shape_the_family_builds(family_models):
    from lowmem.memory import tensor_bytes

    dims = {family: tensor_bytes.model_dims(config(family_models[family]), 0) for family in FAMILIES}
    assert dims["t5"]["tied"] and not dims["t5"]["gated"]
    assert all(dims[f]["gated"] and not dims[f]["tied"] for f in GATED)
    assert dims["umt5"]["table_every_layer"] and not dims["mt5"]["table_every_layer"]
    assert dims["flan"]["num_layers"] == 2 and dims["flan"]["num_decoder_layers"] == 3  # asymmetric
    # the embedding's own rows: padded past the tokenizer (Google's), or ByT5's 384 bytes and specials
    assert dims["flan"]["vocab_size"] % 128 == 0 and dims["byt5"]["vocab_size"] == 384
    for family in FAMILIES:
        model = built(config(family_models[family]))
        assert dims[family]["vocab_size"] == model.shared.num_embeddings
        assert dims[family]["tied"] == (model.lm_head.weight is model.shared.weight)


def test_a_gated_feed_forward_saves_more_for_backward(family_models):
    from dataclasses import replace

    from lowmem.memory import tensor_bytes

    cfg = config(family_models["flan"])
    gated = tensor_bytes.model_dims(cfg, 0)
    relu = {**gated, "gated": False}
    act = {name: tensor_bytes.activation_bytes(cfg, dims, (40, 20))
           for name, dims in (("gated", gated), ("relu", relu))}
    # each token of each layer keeps wi_1's output, the activation's output and gelu_new's intermediates
    per_token_layer = tensor_bytes.GATED_FF_SAVED * gated["d_ff"] * 4
    tokens = cfg.batch_size * (40 * gated["num_layers"] + 20 * gated["num_decoder_layers"])
    assert act["gated"]["activations"] - act["relu"]["activations"] == pytest.approx(per_token_layer * tokens)
    sft = replace(cfg, is_finetune=True, freeze="encoder")
    assert tensor_bytes.activation_bytes(sft, gated, (40, 20))["encoder_saved"] == 0


def saved_activation_bytes(module, *inputs) -> int:
    """Bytes the forward of ``module`` keeps for backward, its weights aside (saved-tensor hooks; each
    storage once)."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(*inputs)
    return sum(seen.values())


def test_the_gated_feed_forward_term_is_what_torch_saves():
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5LayerFF

    from lowmem.memory import tensor_bytes
    from lowmem.model.build import fuse_gelu

    def saved(proj, dropout, fused=True):
        torch.manual_seed(0)
        layer = T5LayerFF(T5Config(d_model=64, d_ff=1024, feed_forward_proj=proj, dropout_rate=dropout)).train()
        if fused:  # as the trainer runs it (ready_to_train)
            assert fuse_gelu(layer) == (proj == "gated-gelu")
        return saved_activation_bytes(layer, torch.randn(2, 100, 64, requires_grad=True)) / (2 * 100 * 1024 * 4)

    for dropout, gated in ((0.1, tensor_bytes.GATED_FF_SAVED), (0.0, tensor_bytes.GATED_FF_SAVED_NO_DROPOUT)):
        relu = saved("relu", dropout)  # in d_ff values a token
        assert relu == pytest.approx(tensor_bytes.FF_SAVED if dropout else tensor_bytes.FF_SAVED_NO_DROPOUT, abs=0.3)
        assert saved("gated-gelu", dropout) - relu == pytest.approx(gated, abs=0.05)
    # transformers' own gelu_new keeps 3 more values a unit and token: what fusing it saves
    assert saved("gated-gelu", 0.1, fused=False) - saved("gated-gelu", 0.1) == pytest.approx(3.0, abs=0.05)


def test_plan_json_and_table_for_an_init_from_model(family_models, run_cli):
    """The CLI's plan counts the built model (SFT and continued pretraining) and shows the large-vocabulary
    terms: the embedding, an untied lm_head, the logits."""
    folder = family_models["flan"]
    sft_file, _ = SHIPPED_CORPORA["sft"]
    pretrain_file, _ = SHIPPED_CORPORA["pretrain"]
    no_export = ["--eval_steps=0", "--save_steps=0"]  # nothing reads the whole model before the final save
    for flags, data in ((["--is_finetune=True", *no_export], sft_file), (["--is_finetune=True"], sft_file),
                        (no_export, pretrain_file)):
        done = run_cli("plan", "--json", f"--init_from={folder}", f"--train_file={data}", "--max_steps=4", *flags)
        assert done.returncode == 0, done.stderr[-2000:]
        plan = json.loads(done.stdout.strip().splitlines()[-1])
        cfg = config(folder, **({"is_finetune": True} if "--is_finetune=True" in flags else {}))
        assert (plan["parameters"], plan["trainable_parameters"]) == counts(built(cfg))
        rows, d = plan["embedding_shape"]
        assert plan["lm_head"] == "untied" and rows % 128 == 0 and d == 64
        assert plan["model_parts_mb"]["lm_head"] == round(rows * d * 4 / 2**20, 1)
        # --init_from is read whole into the run's own memory (lowmem.model.streamed_load): every row of the embedding
        assert plan["model_parts_mb"]["embedding"] == round(rows * d * 4 / 2**20, 1)
        assert plan["model_parts_mb"]["logits"] > 0
    table = run_cli("plan", f"--init_from={folder}", f"--train_file={pretrain_file}", "--max_steps=4")
    assert table.returncode == 0, table.stderr[-2000:]
    assert "of which embedding" in table.stdout and "of which lm_head" in table.stdout
    assert "logits_loss" in table.stdout and f"untied lm_head {rows:,} x {d}" in table.stdout


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads the process's mappings (Linux)")
def test_the_loaded_model_holds_no_page_of_its_checkpoint(tmp_path, family_models):
    """The plan counts every weight in the run's own memory, once: the streamed load copies each tensor it keeps,
    so nothing of the checkpoint file stays mapped (a view of it would keep every page read resident beside)."""
    folder = family_models["flan"]
    cfg = load_config({"init_from": str(folder), "is_finetune": True})[0]
    model = built(cfg)
    files = sorted(folder.glob("*.safetensors"))
    assert files and sum(mapped_kib(f) for f in files) == 0
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())


def mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path``."""
    total, current = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:
            current = fields[5] if len(fields) > 5 else None
        elif fields and fields[0] == "Rss:" and current == str(path):
            total += int(fields[1])
    return total
