"""A ``--memory_profile`` put on a configuration: its flags (explicit ones win, a note says so), and under a
capped profile (host16g) the low-memory caps. ``lowmem.cli.flags.load_config`` calls both, around the
config's own resolution of its defaults; the profiles and caps themselves are data in ``lowmem.utils.presets``.

    notes = profile_flags(converted)       # converted: the flags given, by name (filled in place)
    cfg = TrainConfig(**converted); cfg.resolve_defaults()
    notes += apply_caps(cfg)
"""

from __future__ import annotations

from config import TrainConfig
from lowmem.utils.precision_names import computes_in_half
from lowmem.utils.presets import AUTO, CAPPED_PROFILES, LOW_MEMORY_CAPS, MEMORY_PROFILES


def profile_flags(converted: dict) -> list[str]:
    """Add the flags of ``converted["memory_profile"]`` that were not given to ``converted``; return the notes
    on the given ones that win over it. An unknown profile adds nothing (the validation names it)."""
    notes = []
    profile = converted.get("memory_profile")
    if profile not in MEMORY_PROFILES:
        return notes
    for name, value in MEMORY_PROFILES[profile].items():
        if name == "effective_batch_size" and "gradient_accumulation_steps" in converted:
            if "effective_batch_size" not in converted:  # the accumulation given explicitly sets it
                notes.append(f"--memory_profile={profile}: --gradient_accumulation_steps="
                             f"{converted['gradient_accumulation_steps']} given explicitly replaces the profile's "
                             f"--effective_batch_size={value}: each optimizer step takes the micro-batch the "
                             "budget allows times it (pass --effective_batch_size to fix the rows per step)")
            continue
        if name in converted and converted[name] != value:
            notes.append(f"--memory_profile={profile}: --{name}={converted[name]!r} given explicitly "
                         f"wins over the profile's {value!r}")
        elif name == "mixed_precision" and computes_in_half(value) and not converted.get("cpu"):
            # (the names' table, not the Precision classes: flags are read before torch is imported)
            value, asked = gpu_half_precision(value), value
            if value != asked:
                notes.append(f"--memory_profile={profile}: {asked} products are slow on this GPU: "
                             f"--mixed_precision={value} instead of the profile's {asked}")
        converted.setdefault(name, value)
    return notes


def gpu_half_precision(planned: str) -> str:
    """The --mixed_precision a GPU profile's half precision ``planned`` becomes on this machine's GPU
    (``lowmem.hardware``): the first half precision whose products are fast there (bf16 on Ampere on, fp16 with
    its loss scaler on T4, V100, RTX 20xx), else no. Without a GPU here (a plan for one elsewhere): ``planned``."""
    import torch

    if not torch.cuda.is_available():
        return planned
    from lowmem.hardware.precision import fast_half_precision
    from lowmem.hardware.probe import capability

    return fast_half_precision(capability("cuda"))


def apply_caps(cfg: TrainConfig) -> list[str]:
    """Under a capped profile (host16g), lower values above the low-memory caps (``auto`` becomes
    the cap); return one message per change. Other runs are sized by ``lowmem.memory.batch_budget``.

    A training batch above its cap keeps its size as micro-batches times accumulation: the
    largest micro-batch within the cap that divides it, and that many times the accumulation
    steps, so the gradient (and the learning rate tuned for it) is the one asked for.
    """
    notes = []
    if cfg.memory_profile not in CAPPED_PROFILES:
        return notes
    cap = LOW_MEMORY_CAPS["batch_size"]
    if cfg.batch_size == AUTO:
        cfg.batch_size = cap
    if isinstance(cfg.batch_size, int) and cfg.batch_size > cap:
        micro = next(m for m in range(cap, 0, -1) if cfg.batch_size % m == 0)
        times = cfg.batch_size // micro
        notes.append(f"--batch_size={cfg.batch_size} is above the low-memory cap of {cap}: training "
                     f"micro-batches of {micro} with --gradient_accumulation_steps="
                     f"{cfg.gradient_accumulation_steps * times} ({cfg.gradient_accumulation_steps} x {times}), "
                     f"the same batch of {cfg.batch_size * cfg.gradient_accumulation_steps} examples per "
                     "optimizer step")
        cfg.batch_size, cfg.gradient_accumulation_steps = micro, cfg.gradient_accumulation_steps * times
    cap = LOW_MEMORY_CAPS["eval_batch_size"]
    if cfg.eval_batch_size == AUTO:
        cfg.eval_batch_size = cap
    if isinstance(cfg.eval_batch_size, int) and cfg.eval_batch_size > cap:
        notes.append(f"--eval_batch_size={cfg.eval_batch_size} is above the low-memory cap; using {cap}")
        cfg.eval_batch_size = cap
    return notes
