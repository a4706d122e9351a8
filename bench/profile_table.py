"""The memory-profile table of docs/memory.md: the planner's expected peak for every profile and preset.

    python -m bench.profile_table

Pretraining with the shipped tokenizer, every batch at --max_source_len=128 --max_target_len=128
(the longest the defaults allow), the framework baseline measured in this process. host16g is
planned on the CPU (host RAM), the gpu* profiles on a GPU (GPU memory, plus the host RAM beside it)
at the micro-batch their ``auto`` picks for a GPU of the profile's size (``lowmem.memory.batch_budget.choose``,
an effective batch of 32; shown as micro x accumulation). Relative step time is the planner's ranking
model, not a measurement.
"""

from __future__ import annotations

from dataclasses import replace

from bench.harness import Column, Table
from config import SHIPPED_TOKENIZER_DIR
from data.tokenization import load_tokenizer
from lowmem.cli import plan_command
from lowmem.cli.flags import load_config
from lowmem.memory import planner
from lowmem.memory.batch_budget import choose
from lowmem.memory.plan_sizes import Placement
from lowmem.utils.presets import MEMORY_PROFILES, MODEL_PRESETS, gpu_profile_gib


def main() -> None:
    vocab = len(load_tokenizer(SHIPPED_TOKENIZER_DIR))
    lengths = {"max_source": 128, "max_target": 128, "mean_source": 128, "row_bytes": 1000, "rows": 100_000,
               "pairs": [(128, 128)]}
    baseline = planner.framework_mb()
    table = Table([Column("profile", "profile"), Column("flags", "flags"), *(Column(p, p) for p in MODEL_PRESETS),
                   Column("relative step time", "relative", ".2f")], markdown=True, stream=True)
    for name, flags in MEMORY_PROFILES.items():
        device = "cpu" if flags.get("cpu") else "gpu"
        cells = {}
        for preset in MODEL_PRESETS:
            cfg, _ = load_config({"memory_profile": name, "model_preset": preset, "max_source_len": 128,
                                  "max_target_len": 128})
            if cfg.batch_size == "auto":  # the profile's GPU: gpu8g has 8 GiB
                gib = gpu_profile_gib(name)

                def peak_mb(micro, accumulation, eval_batch, cfg=cfg, device=device):
                    trial = replace(cfg, batch_size=micro, gradient_accumulation_steps=accumulation,
                                    eval_batch_size=eval_batch)
                    return planner.predict(trial, vocab, lengths, baseline, Placement(device))["gpu_peak_mb"]

                sizes = choose(cfg, peak_mb, gib * 1024, f"{gib:g} GiB", 1, 100)
                cfg = replace(cfg, **sizes.flags())
            plan = planner.predict(cfg, vocab, lengths, baseline, Placement(device))
            sizes = f" ({cfg.batch_size} x {cfg.gradient_accumulation_steps})"
            if device == "cpu":
                cells[preset] = f"{plan['host_peak_mb'] / 1024:.1f} GB host{sizes}"
            else:
                cells[preset] = (f"{plan['gpu_peak_mb'] / 1024:.1f} GB GPU (+{plan['host_peak_mb'] / 1024:.1f} host)"
                                 f"{sizes}")
        shown = ", ".join(f"`{k}={v}`" for k, v in flags.items())
        table.add(name, {"profile": f"`{name}`", "flags": shown, **cells,
                         "relative": plan_command.relative_time(cfg, device)})


if __name__ == "__main__":
    main()
