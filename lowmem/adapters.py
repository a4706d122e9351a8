"""LoRA runs exported as peft adapter folders, and such folders loaded back onto their base model.

An adapter folder holds what the run trained: ``adapter_config.json`` (with ``base_model_name_or_path``,
the --init_from the run adapted) and ``adapter_model.safetensors``, a few MB where the merged model would
be 3 GB (flan-t5-large) to 45 GB (-xxl). ``peft.PeftModel.from_pretrained(base, folder)`` loads it; so do
evaluate and generate here, which read the base in the form the run trained it in (training_info.json's
``base_form``: 8-bit or bf16 frozen weights), a block at a time (``lowmem.streamed_load``).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # how PeftModel.save_pretrained names the adapter tensors
BASE_FORM = ("frozen_dtype", "quantize_wo", "mixed_precision")  # how the base was held while training


def adapter_base(folder: Path) -> str | None:
    """The base model an adapter folder adapts (its ``base_model_name_or_path``); None for any other folder."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or (folder / "config.json").is_file():
        return None
    try:
        return json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (ValueError, KeyError, TypeError):
        return None


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


def base_form(cfg) -> dict:
    """How a run holds its base model (written in an adapter export's training_info.json)."""
    return {key: getattr(cfg, key) for key in BASE_FORM}


def load_adapter_model(folder: Path, dropout_rate: float = 0.1):
    """The base model of the adapter folder, read in its training form, with the adapters applied (not merged:
    8-bit base weights cannot take them)."""
    import peft
    from safetensors.torch import load_file

    from config import TrainConfig, saved_json
    from lowmem.memory import hidden
    from lowmem.model_source import resolve_model_dir
    from lowmem.streamed_load import load_for_training

    folder = Path(folder)
    with hidden("bitsandbytes"):  # (as lowmem.modeling.add_lora)
        config = peft.LoraConfig.from_pretrained(str(folder))
        form = (saved_json(folder / "training_info.json") or {}).get("base_form", {})
        cfg = replace(TrainConfig(), init_from=config.base_model_name_or_path, lora_r=config.r, freeze="none",
                      dropout_rate=dropout_rate, **{k: v for k, v in form.items() if k in BASE_FORM})
        model, *_ = load_for_training(cfg, resolve_model_dir(cfg.init_from))
        model = peft.inject_adapter_in_model(config, model)
        saved = load_file(str(folder / ADAPTER_WEIGHTS))
        peft.set_peft_model_state_dict(model, {key.removeprefix(PEFT_PREFIX): value for key, value in saved.items()})
    return model.eval()
