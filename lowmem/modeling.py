"""Pure builders: model, optimizer, schedule and the token-summed loss. No trainer needed."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from config import MODEL_PRESETS, TrainConfig, UserError


def build_model(cfg: TrainConfig, tokenizer):
    """A fresh T5 from a ``T5Config`` of the chosen preset (never a hub download)."""
    from transformers import GenerationConfig, T5Config, T5ForConditionalGeneration

    t5_config = T5Config(vocab_size=len(tokenizer), dropout_rate=cfg.dropout_rate,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         decoder_start_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
                         **MODEL_PRESETS[cfg.model_preset])
    model = T5ForConditionalGeneration(t5_config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, max_new_tokens=cfg.max_target_len, num_beams=cfg.num_beams)
    return model


def load_model(path: str | Path, **config_overrides):
    """Load a saved model folder (``save_pretrained`` layout); ``config_overrides`` such as
    ``dropout_rate`` replace values of its saved config."""
    from transformers import T5ForConditionalGeneration

    if not (Path(path) / "config.json").is_file():
        raise UserError(f"--init_from={path} is not a model folder (no config.json); "
                        "point it at a run's best/ or final/ folder")
    return T5ForConditionalGeneration.from_pretrained(str(path), **config_overrides)


def freeze_for_sft(model) -> None:
    """Freeze the shared embedding (and so the tied output layer) and the whole encoder."""
    for module in (model.shared, model.encoder, model.lm_head):
        for param in module.parameters():
            param.requires_grad_(False)


def count_parameters(model) -> tuple[int, int]:
    """(trainable, frozen) parameter counts; tied tensors are counted once."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) - trainable


def build_optimizer(cfg: TrainConfig, params):
    """Adafactor with the learning rate applied as given (no relative step, no parameter scaling)."""
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=cfg.learn_rate, relative_step=False, scale_parameter=False,
                     warmup_init=False, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: TrainConfig, optimizer, total_steps: int):
    """Linear warmup, then linear / cosine decay to 0 at ``total_steps`` (or constant)."""
    from transformers import get_scheduler

    name = "constant_with_warmup" if cfg.lr_scheduler == "constant" else cfg.lr_scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=min(cfg.warmup_steps, total_steps),
                         num_training_steps=total_steps)


def token_loss_sum(model, core, batch: dict, frozen_encoder: bool = False) -> torch.Tensor:
    """Sum of the cross-entropy over the batch's target tokens (labels == -100 are ignored).

    ``model`` is what to call (possibly wrapped for DDP), ``core`` the plain T5 inside it. With a
    frozen encoder it runs under ``no_grad`` so none of its activations are kept.
    """
    labels = batch["labels"]
    decoder_input_ids = core._shift_right(labels)
    if frozen_encoder:
        with torch.no_grad():
            encoded = core.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        out = model(encoder_outputs=encoded, attention_mask=batch["attention_mask"],
                    decoder_input_ids=decoder_input_ids, use_cache=False)
    else:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    decoder_input_ids=decoder_input_ids, use_cache=False)
    return F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def steps_per_epoch(rows: int, batch_size: int, accumulation: int) -> int:
    return max(1, math.ceil(math.ceil(rows / batch_size) / accumulation))
