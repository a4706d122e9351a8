"""The ``plan`` command: predicted peak memory as a table or one JSON object and, for a budget, the
fastest memory modes that fit it (the prediction itself is ``lowmem.memory.planner``).

    python train_low_mem.py plan [train flags]                      # table: host RAM and GPU memory
    python train_low_mem.py plan --json                             # the same as one JSON object
    python train_low_mem.py plan --budget_gb=12 --device=gpu        # recommend flags that fit
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import dataclass, field, replace

from config import TrainConfig
from data.streams.file_stream import total_steps
from lowmem.hardware.precision import PRECISIONS, BFloat16, Precision
from lowmem.memory import planner
from lowmem.memory.plan_batches import run_lengths
from lowmem.memory.plan_sharding import SHARDINGS
from lowmem.memory.plan_sizes import Placement
from lowmem.memory.profiles import gpu_half_precision
from lowmem.memory.tensor_bytes import frozen_parts
from lowmem.utils.errors import UserError
from lowmem.utils.frozen_forms import FROZEN_FORMS, FrozenForm, Int8Form
from lowmem.utils.optional import installed
from lowmem.utils.presets import MODEL_PRESETS

RECOMMEND_HEADROOM = 0.10  # share of the budget a recommendation leaves free: peaks measured up to ~8 % over plan

# Relative step-time factors (1.0 = fp32, no checkpointing, AdamW-class optimizer) used to rank modes.
# The encoder cache's is the measured curve's short-prompt end (bench/encoder_cache_speed.py: 0.6-0.8, lower
# as prompts grow longer than the answers).
# int8 on the CPU: BlockLinear (lowmem.model.narrow_compute), on flan-t5-large's shape (bench/int8_step.py) 0.67x
# float32's step time on an AVX-512 machine, 1.29x on an AVX2 one with short rows (docs/hardware.md); on a GPU
# quanto's own kernels, not measured.
SPEED = {"checkpointing": 1.3, "bf16_gpu": 0.6, "bf16_cpu": 1.1, "adamw8bit": 1.02, "adafactor": 1.03,
         "encoder_cache": 0.8, "int8_cpu": 1.0, "int8_gpu": 1.3}


def relative_time(cfg: TrainConfig, device: str) -> float:
    """Step time relative to fp32, no checkpointing, AdamW (a ranking model, not a measurement)."""
    factor = SPEED["checkpointing"] if cfg.gradient_checkpointing else 1.0
    precision = PRECISIONS[cfg.mixed_precision]
    if precision.half:
        here = local_capability(device)  # a dtype measured slow on this machine: its measured factor
        slow = here is not None and not here.fast(precision.dtype)
        factor *= (here.slowdown(precision.dtype) if slow
                   else SPEED["bf16_gpu"] if device == "gpu" else SPEED["bf16_cpu"])
    factor *= SPEED.get(cfg.optimizer, 1.0)
    if cfg.encoder_cache != "off":
        factor *= SPEED["encoder_cache"]
    if FROZEN_FORMS[cfg.frozen_dtype].quantized:
        factor *= SPEED["int8_gpu"] if device == "gpu" else SPEED["int8_cpu"]
    return round(factor * 2 / min(cfg.batch_size, 2), 3)  # a micro-batch of 1 takes twice the steps


def local_capability(device: str):
    """This machine's capability for a plan's ``device`` (``lowmem.hardware``); None for a GPU plan made where no
    GPU is (the table's factors then, for a GPU of the planned kind)."""
    import torch

    from lowmem.hardware.probe import capability

    if device == "cpu":
        return capability("cpu")
    return capability("cuda") if torch.cuda.is_available() else None


def reads_per_row(cfg: TrainConfig, rows: int, world: int = 1) -> float:
    """How many times the run reads each of its process's rows, on average (below 1: a --max_steps run
    that stops inside the first epoch)."""
    share = max(1, math.ceil(rows / world))
    return total_steps(cfg, share) * cfg.batch_size * cfg.gradient_accumulation_steps / share


def run_time(cfg: TrainConfig, device: str, reads: float) -> float:
    """``relative_time`` over the whole run: the encoder cache first runs the encoder once per row (the
    uncached step's encoder share, 1 - SPEED["encoder_cache"]), which pays off only over rows read again."""
    factor = relative_time(cfg, device)
    if cfg.encoder_cache != "off":
        saved = 1 - SPEED["encoder_cache"]
        factor *= 1 + saved / SPEED["encoder_cache"] / max(reads, 1e-9)
    return round(factor, 3)


LAST_RESORT_LORA_R = 8  # the adapters' rank plan recommends when nothing fits without LoRA


@dataclass(frozen=True)
class Baseline:
    """The framework baseline (MiB, ``planner.framework_mb``): ``core_mb`` without the optional extras, and what
    importing each adds (``import_mb``), by the optimizer that imports it (adamw8bit for bitsandbytes) or the frozen
    forms' module (optimum.quanto): every mode ``recommend`` tries gets its own."""

    core_mb: float
    import_mb: dict[str, float] = field(default_factory=dict)

    def of(self, cfg: TrainConfig) -> float:
        """The baseline of a run of ``cfg``: the core's and its optimizer's and frozen form's imports."""
        return (self.core_mb + self.import_mb.get(cfg.optimizer, 0.0)
                + self.import_mb.get(FROZEN_FORMS[cfg.frozen_dtype].module, 0.0))


def recommend(cfg: TrainConfig, budget_gb: float, placement: Placement, vocab_size: int, lengths: dict,
              baseline: Baseline) -> dict | None:
    """The fastest combination of modes whose predicted peak fits ``budget_gb`` GiB less
    RECOMMEND_HEADROOM (None: nothing fits): one GPU's memory, or on the CPU the host RAM of the
    ``placement``'s processes on one machine together. Each mode is planned on its own ``baseline`` (its
    optimizer's and frozen form's imports added).

    Searched: checkpointing, bf16, optimizer (adamw8bit only when bitsandbytes is installed),
    the run's micro-batch (as asked, or as auto chose it), 2 or 1 (accumulation raised to keep the effective
    batch; only those that divide it), the
    encoder cache when the encoder is frozen (--freeze=encoder) and, with bf16, bf16 storage of the frozen
    weights (any --freeze but none, or LoRA); int8 frozen linear layers (--freeze=encoder or LoRA) when
    optimum-quanto is installed. Sequence lengths, LoRA and the model are never changed: they change what is
    trained. "Fastest" is over the whole run: the encoder cache wins only where the run reads its rows more
    than once. A tie goes to the larger micro-batch, then to the least host RAM, then the least peak.
    """
    device, world, sharding, import_mb = placement.device, placement.world, placement.sharding, baseline.import_mb
    optimizers = ["adamw", "adafactor"] + (["adamw8bit"] if installed("bitsandbytes") else [])
    caches = ["off", "auto"] if cfg.frozen_encoder and not cfg.packing else ["off"]
    # autocast only where its dtype is fast on this machine's GPU (a CPU's bf16 autocast measured more host memory)
    half = gpu_half_precision(BFloat16.name) if device == "gpu" else Precision.name
    precisions = list(dict.fromkeys([Precision.name, half]))
    # Frozen forms a trial may hold (8 bits where optimum-quanto's import was measured, then wo too if only that
    # fits; a sharded run holds them as loaded), where the trial's flags run them (``problem``)
    frozen = [(form, wo) for form in FROZEN_FORMS.values() for wo in ((False, True) if form.quantized else (False,))
              if form.recommended and not (sharding and form.narrow)
              and (form.module is None or form.module in import_mb)]
    reads, best = reads_per_row(cfg, lengths.get("train_rows", lengths["rows"]), world), None
    effective = cfg.batch_size * cfg.gradient_accumulation_steps  # kept: micro-batches that divide it
    batches = [b for b in dict.fromkeys((cfg.batch_size, 2, 1)) if effective % b == 0]
    for ckpt, prec, opt, batch, cache, (form, wo) in itertools.product(
            [False, True], precisions, optimizers, batches, caches, frozen):
        accumulation = effective // batch
        trial = replace(cfg, gradient_checkpointing=ckpt, mixed_precision=prec, optimizer=opt, batch_size=batch,
                        gradient_accumulation_steps=accumulation, encoder_cache=cache, frozen_dtype=form.name,
                        quantize_wo=wo, cpu=device == "cpu")
        if form.problem(trial):  # bf16 storage outside bf16 autocast, or 8 bits without frozen linear layers
            continue
        plan = planner.predict(trial, vocab_size, lengths, baseline.of(trial), placement)
        peak = plan["gpu_peak_mb"] if device == "gpu" else placement.per_machine * plan["host_peak_mb"]
        if peak > budget_gb * 1024 * (1 - RECOMMEND_HEADROOM):
            continue
        speed = run_time(trial, device, reads)
        # Of modes equally fast, the larger micro-batch, then the one needing the least memory: on a GPU the
        # least host RAM first (bf16 storage of a frozen encoder the cache parks on the host halves it: xl LoRA
        # 7.1 -> 4.8 GiB; under bf16 autocast frozen matrices are cast to bf16 at every use anyway)
        rank = (speed, -batch, plan["host_peak_mb"], peak)
        if best is None or rank < best[0]:
            best = (rank, trial, peak, plan["host_peak_mb"])
    if best is None:
        return None
    _, trial, peak, host_mb = best
    return {"flags": recommended_flags(cfg, trial, device), "predicted_peak_mb": peak,
            "relative_step_time": relative_time(trial, device), "host_peak_mb": host_mb}


def recommended_flags(cfg: TrainConfig, trial: TrainConfig, device: str) -> dict:
    """The flags that turn ``cfg`` into ``trial``, a combination of modes ``recommend`` tried: those it
    searches, the encoder cache and the frozen weights' storage only where ``cfg`` has them."""
    flags = {"gradient_checkpointing": trial.gradient_checkpointing, "mixed_precision": trial.mixed_precision,
             "optimizer": trial.optimizer, "batch_size": trial.batch_size,
             "gradient_accumulation_steps": trial.gradient_accumulation_steps}
    if cfg.frozen_encoder:
        flags["encoder_cache"] = trial.encoder_cache
    if frozen_parts(cfg):
        flags["frozen_dtype"] = trial.frozen_dtype
    if trial.quantize_wo:
        flags["quantize_wo"] = True
    if device == "cpu" or cfg.cpu:  # a GPU plan undoes --cpu=True (given, or from host16g)
        flags["cpu"] = device == "cpu"
    return flags


def format_table(plan: dict) -> str:
    """The plan by component; under the weights, the shared embedding's and an untied lm_head's share of
    them (with a large vocabulary, as mT5's 250,112 rows, they and the logits are the largest terms)."""
    def row(label, host, gpu):
        return f"{label:<22}{'' if host is None else f'{host:,.0f}':>16}{'' if gpu is None else f'{gpu:,.0f}':>12}"

    lines = [f"{'component':<22}{'host RAM (MiB)':>16}{'GPU (MiB)':>12}"]
    for key in dict.fromkeys(list(plan["host_mb"]) + list(plan["gpu_mb"])):
        host, gpu = plan["host_mb"].get(key), plan["gpu_mb"].get(key)
        lines.append(row(key, host, gpu))
        if key == "weights":
            for part in ("embedding", "lm_head"):
                if part in plan.get("model_parts_mb", {}):
                    mb = plan["model_parts_mb"][part]
                    lines.append(row(f"  of which {part}", None if host is None else mb, None if gpu is None else mb))
    gpu_total = f"{plan['gpu_peak_mb']:,.0f}" if plan["gpu_mb"] else "-"
    lines.append(f"{'total (peak)':<22}{plan['host_peak_mb']:>16,.0f}{gpu_total:>12}")
    return "\n".join(lines)


@dataclass(frozen=True)
class PlanFlags:
    """``plan``'s own flags, beside the training flags (``train_low_mem.py plan``).

    With ``num_processes`` N over ``num_machines`` M, each process reads 1/N of the data and a machine
    hosts N/M processes: the host total is theirs together (the budget of ``--device=cpu`` is the
    machine's RAM; that of ``--device=gpu`` one GPU's memory). ``sharding`` (fsdp, zero2, zero3): the
    processes shard the model (``lowmem.memory.plan_sharding``).
    """

    as_json: bool = False  # one JSON object instead of the table
    budget_gb: float | None = None  # recommend the fastest modes that fit it
    device: str | None = None  # cpu or gpu; None: a GPU where there is one (and not --cpu=True)
    num_processes: int = 1
    num_machines: int = 1
    sharding: str | None = None


def plan_command(cfg: TrainConfig, flags: PlanFlags) -> dict:
    """What ``python train_low_mem.py plan`` prints for the run of ``cfg``: the table (or JSON) and, with
    ``flags.budget_gb``, the flags that fit it."""
    import torch

    from data.tokenization import load_trained_tokenizer
    from lowmem.model.source import check_vocabulary, check_weights, model_folder_config, tokenizer_folder

    device, budget_gb, num_processes = flags.device, flags.budget_gb, flags.num_processes
    chosen = device is None
    device = device or ("gpu" if torch.cuda.is_available() and not cfg.cpu else "cpu")
    check_plan_flags(device, budget_gb, num_processes, flags.num_machines, flags.sharding)
    if chosen and device == "cpu" and cfg.gpu_profile:
        print(f"note: --memory_profile={cfg.memory_profile} is a GPU profile and this plan is for the CPU (no GPU "
              "here, or --cpu=True); add --device=gpu to plan one GPU's memory", file=sys.stderr)
    placement = Placement(device, num_processes, flags.sharding, flags.num_machines)
    per_machine = placement.per_machine
    tokenizer = load_trained_tokenizer(tokenizer_folder(cfg))
    if cfg.init_from:  # as train checks it: a plan's lengths come from the tokenizer the run would refuse
        check_vocabulary(cfg, model_folder_config(cfg.init_from)["vocab_size"], tokenizer)
        from lowmem.model.build import import_transformers_models

        import_transformers_models()  # before any model class: without scipy (the baseline measured below)
        check_weights(cfg.init_from)  # a plan of weights that are not its config's model would size another one
    data = planner.plan_data(cfg, tokenizer, num_processes)
    local_capability(device)  # probed before the baseline, as in the trainer (its products leave kernels resident)
    baselines = framework_baselines(cfg, budget_gb)  # after reading, as in the trainer
    baseline_mb = baselines.of(cfg)
    cfg = sized(cfg, data, baseline_mb, placement, budget_gb)
    lengths = run_lengths(cfg, data)
    lengths["train_rows"] = data.rows  # counted ("rows" is estimated from a sample)
    result = planner.predict(cfg, len(tokenizer), lengths, baseline_mb, placement)
    result.update(num_processes=num_processes, processes_per_machine=per_machine,
                  host_total_mb=round(per_machine * result["host_peak_mb"], 1))
    if budget_gb is not None:
        result["budget_gb"] = budget_gb
        result["recommendation"] = recommend(cfg, budget_gb, placement, len(tokenizer), lengths, baselines)
        if result["recommendation"] is None and cfg.init_from and not cfg.lora_r and not flags.sharding:
            # Nothing fits training every weight: LoRA (what is trained changes, so only as the last resort)
            lora = recommend(replace(cfg, lora_r=LAST_RESORT_LORA_R), budget_gb, placement, len(tokenizer), lengths,
                             baselines)
            if lora is not None:
                lora["flags"] = {"lora_r": LAST_RESORT_LORA_R, **lora["flags"]}
                result["recommendation"] = lora
    if flags.as_json:
        print(json.dumps(result))
    else:
        print_plan(cfg, result)
    return result


def framework_baselines(cfg: TrainConfig, budget_gb: float | None) -> Baseline:
    """The framework baseline without the optional extras, and what importing each adds (``Baseline``), for
    those the run or a recommendation may import."""
    # After reading, as in the trainer: the data readers' imports count. Taken without bitsandbytes first,
    # then what importing it adds, so every optimizer the search tries gets its own baseline.
    # Each extra's import is measured against the RSS just before it (imports pile up in this process: measured
    # against the first baseline, optimum-quanto's counted bitsandbytes' 44 MiB too).
    core = before = planner.framework_mb(replace(cfg, optimizer="adafactor", frozen_dtype=FrozenForm.name))
    import_mb = {}
    if FROZEN_FORMS[cfg.frozen_dtype].quantized or (budget_gb is not None and installed(Int8Form.module)):
        after = planner.framework_mb(replace(cfg, optimizer="adafactor", frozen_dtype=Int8Form.name))
        import_mb[Int8Form.module] = max(0.0, after - before)
        before = after
    if cfg.optimizer == "adamw8bit" or (budget_gb is not None and installed("bitsandbytes")):
        after = planner.framework_mb(replace(cfg, optimizer="adamw8bit", frozen_dtype=FrozenForm.name))
        import_mb["adamw8bit"] = max(0.0, after - before)
    return Baseline(core, import_mb)


def sized(cfg: TrainConfig, data, baseline_mb: float, placement: Placement, budget_gb: float | None) -> TrainConfig:
    """``cfg`` with the batch sizes to plan (``lowmem.memory.batch_budget``) for ``placement``'s processes. With
    --budget_gb (a machine's RAM, shared by its processes, or one GPU's memory): sizes asked for as given (the plan
    shows what they cost;
    a recommendation, what fits), ``auto`` the largest that fits it. Without: this machine's budget, as
    the trainer takes it (--max_rss_gb, the available RAM or the GPU's memory), which also lowers a size
    asked for that does not fit, as the trainer would. Its notes go to stderr."""
    import torch

    from config import AUTO
    from lowmem.memory.batch_budget import size_batches

    device, auto = placement.device, AUTO in (cfg.batch_size, cfg.eval_batch_size)
    budget_mb = math.inf
    if budget_gb is not None:
        if auto:
            budget_mb = budget_gb * 1024 / (placement.per_machine if device == "cpu" else 1)
    elif device == "gpu" and not torch.cuda.is_available():
        if auto:
            raise UserError("--batch_size=auto / --eval_batch_size=auto on --device=gpu without a GPU here: pass "
                            "--budget_gb=GPU_MEMORY_GB to size them")
    else:
        budget_mb = None  # this machine's, as the trainer takes it
    sizes = size_batches(cfg, data, baseline_mb, placement, budget_mb=budget_mb)
    for note in sizes.notes:
        print(note, file=sys.stderr)
    return replace(cfg, **sizes.flags())


def check_plan_flags(device: str, budget_gb, num_processes, num_machines, sharding=None) -> None:
    """``plan``'s own flags, each problem one line saying what to pass."""
    if sharding is not None and sharding not in SHARDINGS:
        raise UserError(f"--sharding must be one of {', '.join(SHARDINGS)} (got {sharding!r}), or left out for "
                        "plain data parallelism")
    if device not in ("cpu", "gpu"):
        raise UserError(f"--device must be cpu or gpu (got {device!r})")
    if budget_gb is not None and (not isinstance(budget_gb, (int, float)) or isinstance(budget_gb, bool)
                                  or not math.isfinite(budget_gb) or budget_gb <= 0):
        raise UserError(f"--budget_gb must be a positive number of GiB (got {budget_gb!r})")
    for name, value in (("num_processes", num_processes), ("num_machines", num_machines)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"--{name} must be a positive whole number (got {value!r})")
    if num_processes % num_machines:
        raise UserError(f"--num_processes={num_processes} is the total over all machines: it must be a multiple "
                        f"of --num_machines={num_machines}, as for accelerate launch")


def print_plan(cfg: TrainConfig, result: dict) -> None:
    """The table ``plan`` prints, and with a budget the flags it recommends."""
    device, num_processes, per_machine = result["device"], result["num_processes"], result["processes_per_machine"]
    budget_gb = result.get("budget_gb")
    processes = f"; per process, {num_processes} processes" if num_processes > 1 else ""
    rows, d = result["embedding_shape"]
    head = "tied lm_head" if result["lm_head"] == "tied" else f"untied lm_head {rows:,} x {d}"
    print(f"predicted peak memory ({device}; model {cfg.init_from or cfg.model_preset}, "
          f"{result['parameters']:,} parameters, {result['trainable_parameters']:,} trainable; embedding "
          f"{rows:,} x {d}, {head}, logits over {rows:,} classes; costliest batch "
          f"{cfg.batch_size} x {result['max_source_tokens']} source / {result['max_target_tokens']} target "
          f"tokens{processes}; a training step peaks {'in' if result['training_peak_at'] == 'backward' else 'at'} the "
          f"{result['training_peak_at']})")
    print(format_table(result))
    if per_machine > 1:
        print(f"{f'host total, {per_machine} processes':<22}{result['host_total_mb']:>16,.0f}")
    if budget_gb is not None:
        rec = result["recommendation"]
        if rec is None:
            changes = ["lower --max_source_len / --max_target_len"]
            if num_processes > 1:
                changes.append("fewer processes")
            if cfg.init_from:
                changes += ["a smaller --init_from model",
                            "fewer --lora_target_modules" if cfg.lora_r else "--lora_r (LoRA)"]
            elif cfg.model_preset != next(iter(MODEL_PRESETS)):  # the first preset is the smallest
                changes.append("a smaller --model_preset")
            print(f"nothing fits {budget_gb} GiB on the {device} with {RECOMMEND_HEADROOM:.0%} headroom: "
                  + ", ".join(changes[:-1]) + (" or " if len(changes) > 1 else "") + changes[-1])
        else:
            flags = " ".join(f"--{k}={v}" for k, v in rec["flags"].items())
            host = f", host RAM {rec['host_peak_mb']:,.0f} MiB" if device == "gpu" else ""
            print(f"fits {budget_gb} GiB ({device}, {RECOMMEND_HEADROOM:.0%} headroom): {flags}  (predicted peak "
                  f"{rec['predicted_peak_mb']:,.0f} MiB{host}, "
                  f"relative step time {rec['relative_step_time']})")
