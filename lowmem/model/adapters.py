"""LoRA runs exported as peft adapter folders, and such folders loaded back onto their base model.

An adapter folder holds what the run trained: ``adapter_config.json`` (with ``base_model_name_or_path``,
the --init_from the run adapted) and ``adapter_model.safetensors``, a few MB where the merged model would
be 3 GB (flan-t5-large) to 45 GB (-xxl). ``peft.PeftModel.from_pretrained(base, folder)`` loads it; so do
evaluate and generate here, which read the base in the form the run trained it in (training_info.json's
``base_form``: 8-bit or bf16 frozen weights), a block at a time (``lowmem.model.streamed_load``).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

from lowmem.model.source import ADAPTER_WEIGHTS, adapter_base

PEFT_PREFIX = "base_model.model."  # how PeftModel.save_pretrained names the adapter tensors
BASE_FORM = ("frozen_dtype", "quantize_wo", "mixed_precision")  # how the base was held while training


def save_adapter(folder: Path, model, base: str) -> None:
    """Write ``model``'s LoRA adapters as peft writes them (float32, on the host)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = copy.copy(model.peft_config["default"])
    config.base_model_name_or_path, config.task_type, config.inference_mode = base, "SEQ_2_SEQ_LM", True
    config.save_pretrained(str(folder))
    state = {PEFT_PREFIX + key: value.detach().float().cpu().contiguous()
             for key, value in get_peft_model_state_dict(model).items()}
    save_file(state, str(Path(folder) / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def adapter_export(cfg) -> dict | None:
    """What a LoRA run's exports are adapters of: {"base": the --init_from given, "base_form": how the run holds
    it (training_info.json: evaluate and generate read it so)}; None where exports are whole models."""
    if not cfg.lora_r or cfg.merge_lora:
        return None
    return {"base": cfg.init_from, "base_form": {key: getattr(cfg, key) for key in BASE_FORM}}


def load_adapter_model(folder: Path, dropout_rate: float = 0.1):
    """The base model of the adapter folder, read in its training form, with the adapters applied (not merged:
    8-bit base weights cannot take them)."""
    import peft
    from safetensors.torch import load_file

    from config import TrainConfig
    from lowmem.model.source import resolve_model_dir
    from lowmem.model.streamed_load import load_for_training
    from lowmem.utils.optional import hidden
    from lowmem.utils.ownership import saved_json

    folder = Path(folder)
    with hidden("bitsandbytes"):  # (as lowmem.model.build.add_lora)
        config = peft.LoraConfig.from_pretrained(str(folder))
        form = (saved_json(folder / "training_info.json") or {}).get("base_form", {})
        cfg = replace(TrainConfig(), init_from=config.base_model_name_or_path, lora_r=config.r, freeze="none",
                      dropout_rate=dropout_rate, **{k: v for k, v in form.items() if k in BASE_FORM})
        model, *_ = load_for_training(cfg, resolve_model_dir(cfg.init_from))
        model = peft.inject_adapter_in_model(config, model)
        saved = load_file(str(folder / ADAPTER_WEIGHTS))
        peft.set_peft_model_state_dict(model, {key.removeprefix(PEFT_PREFIX): value for key, value in saved.items()})
    return model.eval()


def load_saved_model_weights(init_from):
    """What evaluate and generate run: an adapter folder's base with its adapters, or a whole model."""
    from lowmem.model.build import load_model
    from lowmem.model.source import check_weights, resolve_model_dir

    folder = resolve_model_dir(str(init_from))
    if adapter_base(folder) is None:
        return load_model(init_from)  # (checks the folder first)
    check_weights(init_from)  # the adapter's weights, then its base's: headers and config only, before any read
    return load_adapter_model(folder)
