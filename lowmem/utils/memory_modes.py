"""The memory modes' choices (optimizer, LoRA's layers, --freeze, the encoder cache) and their validation, kept out
of ``config`` (which calls ``memory_mode_problems``) so that it stays one table of options."""

from __future__ import annotations

from lowmem.utils.frozen_forms import frozen_form_problems
from lowmem.utils.optional import installed, optional_package_missing
from lowmem.utils.presets import MEMORY_PROFILES

OPTIMIZERS = ("adafactor", "adamw", "adamw8bit", "adamw_scale")
# T5's linear layers by name: attention q, k, v, o; feed-forward wi, wo (wi_0 and wi_1 on gated models:
# t5-v1_1, flan-t5, mT5, ByT5, where "wi" names both).
LORA_TARGETS = ("q", "k", "v", "o", "wi", "wo", "wi_0", "wi_1")
ENCODER_CACHE_MODES = ("off", "memory", "disk", "auto")
CACHE_DTYPES = ("float32", "bfloat16", "float16")
FREEZE_CHOICES = ("encoder", "embeddings", "none")


def memory_mode_problems(cfg) -> list[str]:
    """The memory modes' share of ``config.TrainConfig.problems``: optimizer, LoRA, --freeze, the extras they
    import, the encoder cache and the frozen form, one line per mistake."""
    problems = []
    if cfg.memory_profile is not None and cfg.memory_profile not in MEMORY_PROFILES:
        problems.append(f"--memory_profile must be one of {', '.join(MEMORY_PROFILES)} "
                        f"(got {cfg.memory_profile!r})")
    if cfg.optimizer not in OPTIMIZERS:
        problems.append(f"--optimizer must be one of {', '.join(OPTIMIZERS)} (got {cfg.optimizer!r})")
    if cfg.lora_r and not cfg.init_from:
        problems.append("--lora_r needs a model to adapt (--init_from, or --is_finetune=True): pretraining from "
                        "scratch must train every weight")
    if cfg.freeze not in FREEZE_CHOICES:
        problems.append(f"--freeze must be one of {', '.join(FREEZE_CHOICES)} (got {cfg.freeze!r})")
    elif cfg.freeze != "none" and not cfg.init_from:
        problems.append(f"--freeze={cfg.freeze} needs a trained model (--init_from, or --is_finetune=True): a "
                        "new model's weights are random, and frozen they would stay random")
    problems += [optional_package_missing(flag, m) for m, flag in cfg.extras_used() if not installed(m)]
    if cfg.lora_r and cfg.lora_alpha <= 0:
        problems.append(f"--lora_alpha must be positive (got {cfg.lora_alpha})")
    if not 0 <= cfg.lora_dropout < 1:
        problems.append(f"--lora_dropout must be in [0, 1) (got {cfg.lora_dropout})")
    targets = cfg.lora_targets
    bad = [t for t in targets if t not in LORA_TARGETS]
    if bad or not targets:
        problems.append(f"--lora_target_modules must be a comma list of {', '.join(LORA_TARGETS)} "
                        f"(got {cfg.lora_target_modules!r})")
    elif len(set(targets)) < len(targets):
        twice = sorted({t for t in targets if targets.count(t) > 1})
        problems.append(f"--lora_target_modules names {', '.join(twice)} more than once "
                        f"(got {cfg.lora_target_modules!r}): list each layer once")
    if cfg.encoder_cache not in ENCODER_CACHE_MODES:
        problems.append(f"--encoder_cache must be one of {', '.join(ENCODER_CACHE_MODES)} "
                        f"(got {cfg.encoder_cache!r})")
    elif cfg.encoder_cache != "off" and not cfg.frozen_encoder:
        problems.append("--encoder_cache needs a frozen encoder (--is_finetune=True with --freeze=encoder, the "
                        "default): a trained encoder's outputs change every step")
    problems += frozen_form_problems(cfg)
    if cfg.encoder_cache_dtype not in CACHE_DTYPES:
        problems.append(f"--encoder_cache_dtype must be one of {', '.join(CACHE_DTYPES)} "
                        f"(got {cfg.encoder_cache_dtype!r})")
    return problems
