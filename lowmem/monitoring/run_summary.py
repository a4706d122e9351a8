"""What the log says of a run as a whole: the start-up summary (the model, its frozen and trained
parts, the data, the memory modes, the schedule) and, at the end, a schedule that planned other steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from config import SHIPPED_TOKENIZER_DIR, TrainConfig
from data.sources.corpus import file_notes
from lowmem.hardware.probe import capability
from lowmem.model.build import head_is_tied, lora_stacks
from lowmem.utils.eval_metrics import scores_in


def frozen_summary(cfg: TrainConfig, core) -> str:
    """What --freeze keeps fixed, in the start-up line's words."""
    freeze, tied = cfg.freeze, head_is_tied(core)
    if cfg.lora_r:  # every base weight, an untied lm_head too
        return "base weights frozen, LoRA adapters train" + (
            "; encoder under no_grad, eval mode" if freeze == "encoder" else "")
    if freeze == "none":
        return "every weight trains"
    parts = ["encoder (no_grad, eval mode)"] if freeze == "encoder" else []
    parts.append("shared embedding" + (" = tied output layer" if tied else ""))
    return "frozen " + " + ".join(parts) + ("" if tied else "; the untied lm_head trains")


def schedule_note(steps: int, planned: int, last_rate: float, data) -> str:
    """Why an epochs run took another number of steps than its schedule was made for (``data``: the run's
    ``TrainData``)."""
    estimated = data.objective.chunk_length and data.epoch_rows_known and data.epoch_tokens[1] != "counted"
    basis = "an estimate of their tokens (packed text)" if estimated else "the files' row counts"
    why = ("bad rows and non-finite steps are skipped" if steps < planned and not estimated else
           "the documents held fewer tokens than estimated" if steps < planned else
           f"the documents held more tokens than estimated: the last {steps - planned} ran at the last planned "
           "step's rate")
    return (f"the epochs took {steps} optimizer steps, not the {planned} planned from {basis} ({why}): the "
            f"learning-rate schedule, made for {planned} steps, ended at {last_rate:.3g}")


@dataclass(frozen=True)
class ModelInRun:
    """The model as the run trains it, as the start-up summary tells it: the plain model (frozen, adapted, in its
    memory modes), its parameter counts (trainable, frozen, frozen_bf16, frozen_8bit:
    ``lowmem.model.build.ready_to_train``) and the encoder cache it reads instead of running its encoder (or None)."""

    core: object
    parameters: dict
    cache: object = None


def startup_summary(cfg: TrainConfig, accelerator, data, model: ModelInRun, start_step: int,
                    eval_plan) -> tuple[list[str], dict]:
    """The numbers that matter before training starts, and notes on the files: (log lines, the ``setup``
    record's fields).
    ``data``: the run's ``TrainData`` (its steps per epoch and in all: ``TrainData.steps``); ``eval_plan``: what each
    evaluation generates and costs (``lowmem.training.eval_cost.EvalPlan``)."""
    world, parameters = accelerator.num_processes, model.parameters
    per_epoch, total_steps = data.steps(cfg)
    lengths = data.objective.longest or (cfg.max_source_len, cfg.max_target_len)  # the longest example
    effective = cfg.batch_size * cfg.gradient_accumulation_steps * world
    tokenizer = ("the shipped one" if cfg.tokenizer_dir == str(SHIPPED_TOKENIZER_DIR) else cfg.tokenizer_dir
                 or "the model's own")  # (a run without --tokenizer_dir used the shipped one silently)
    lines = [
        f"device {accelerator.device} x {world} process(es) | model {cfg.init_from or cfg.model_preset} | "
        f"params trainable {parameters['trainable']:,} / frozen {parameters['frozen']:,} | tokenizer {tokenizer} "
        f"({len(data.collator.tokenizer):,} tokens)",
        f"effective batch {effective} (micro {cfg.batch_size} x accumulation {cfg.gradient_accumulation_steps} "
        f"x {world}) | tokens per optimizer step <= {effective * sum(lengths):,}"
        + (f" | micro-batches of up to {cfg.max_tokens_per_batch:,} padded tokens" if cfg.max_tokens_per_batch else "")
        + f" | eval batch {cfg.eval_batch_size}",
        data_line(cfg, data, per_epoch) + f"total steps {total_steps} | start step {start_step}",
        f"eval {data.objective.example_noun} {len(data.eval_examples):,} from " + data.eval_source,
        eval_plan.line(),
        "memory: " + ", ".join(memory_features(cfg, model)),
    ]
    lines += compute_lines(cfg, accelerator.device.type)
    if cfg.torch_compile:
        lines.append(f"torch.compile ({cfg.torch_compile_backend}): the encoder and decoder stacks, training lengths "
                     f"padded to buckets {', '.join(map(str, data.collator.pad_multiple))}; a step meeting a new "
                     "bucket compiles (tens of seconds), then runs compiled")
    if cfg.gpu_profile and accelerator.device.type == "cpu":
        lines.append(f"--memory_profile={cfg.memory_profile} is a GPU profile but this run is on the CPU: its "
                     "bf16 autocast saves no host memory there (it measured more); host16g is the CPU profile")
    if cfg.warmup_steps >= total_steps:
        lines.append(f"--warmup_steps={cfg.warmup_steps} is not below the run's {total_steps} steps: the run ends "
                     f"in the warmup, at {total_steps}/{cfg.warmup_steps + 1} of --learn_rate (lower --warmup_steps "
                     "to reach it)")
    lines += file_notes(cfg.train_file, data.files.train, data.files.eval, bool(cfg.eval_file), data.objective.formats)
    record = dict(trainable_params=parameters["trainable"], frozen_params=parameters["frozen"],
                  frozen_bf16_params=parameters["frozen_bf16"], frozen_8bit_params=parameters["frozen_8bit"],
                  effective_batch=effective, micro_batch_size=cfg.batch_size,
                  gradient_accumulation_steps=cfg.gradient_accumulation_steps, eval_batch_size=cfg.eval_batch_size,
                  max_tokens_per_batch=cfg.max_tokens_per_batch, train_rows=data.rows,
                  held_out_rows=data.held_out_rows, eval_rows=len(data.eval_examples), total_steps=total_steps,
                  world_size=world, **eval_plan.record(), hardware=capability(accelerator.device.type).record())
    return lines, record


def compute_lines(cfg: TrainConfig, device_type: str) -> list[str]:
    """What the run's device computes fast (``lowmem.hardware``), and a warning when ``--mixed_precision`` asks for a
    dtype it measured slow (the run goes on as asked)."""
    from lowmem.hardware.precision import PRECISIONS, slow_here

    found = capability(device_type)
    slow = slow_here(PRECISIONS[cfg.mixed_precision], found)
    return [found.line(), *([f"warning: {slow}"] if slow else [])]


def data_line(cfg: TrainConfig, data, per_epoch: int) -> str:
    """The start-up line on the training data, in its objective's words, and an epoch's steps where known."""
    known = data.epoch_rows_known  # else the source says its count is unknown (a dataset without one)
    objective, rows, shape = data.objective, f" {data.rows:,}" if known else "", data.objective.describe()
    line = f"train {objective.noun}{rows} from {data.source}" + (f", {shape}" if shape else "") + " | "
    if not objective.chunk_length:  # rows are examples: an epoch's steps are counted from the files
        return line + (f"{per_epoch} optimizer steps per epoch | " if known else "")
    # packed text: steps counted or estimated from its tokens; not at all when --max_steps ends the run
    counted = data.epoch_tokens[1] if cfg.max_steps <= 0 else ""
    return line + (f"{per_epoch} optimizer steps per epoch (tokens {counted}) | " if counted else "")


def memory_features(cfg: TrainConfig, model: ModelInRun) -> list[str]:
    """Which memory features the run has on, in the start-up line's words."""
    parameters, cache = model.parameters, model.cache
    features = [f"mixed_precision={cfg.mixed_precision}", f"optimizer={cfg.optimizer}",
                f"gradient_checkpointing={cfg.gradient_checkpointing}",
                f"shuffle_buffer={cfg.shuffle_buffer_size} rows / {cfg.shuffle_buffer_mb} MiB",
                f"packing (each step's examples several to a row of up to {cfg.max_source_len} + {cfg.max_target_len} "
                "tokens; padding and examples per row in each train record)" if cfg.packing else "dynamic padding",
                "streamed data", f"gc every {cfg.gc_every_steps} steps"]
    if cfg.lora_r:
        features.append(f"LoRA r={cfg.lora_r} alpha={cfg.lora_alpha:g} on {' and '.join(lora_stacks(cfg))} "
                        f"{cfg.lora_target_modules}")
    if cache is not None:
        features.append(f"encoder cache ({'RAM' if cache.in_memory else 'disk'}, {cfg.encoder_cache_dtype})")
    features.append(frozen_summary(cfg, model.core))
    if parameters["frozen_bf16"]:
        features.append(f"{parameters['frozen_bf16']:,} frozen weights stored in bf16")
    if parameters["frozen_8bit"]:
        features.append(f"{parameters['frozen_8bit']:,} frozen weights stored in {cfg.frozen_dtype} (optimum-quanto"
                        f"{', wo included' if cfg.quantize_wo else '; wo and embeddings in bf16'}; norms float32)")
    return features


def run_result(out, state, step_s: float, metrics: dict, errors: dict) -> dict:
    """What ``train`` returns (and the CLI prints): where the run is, its steps, its last evaluation, its best."""
    return {"output_dir": str(out), "steps": state.step, "step_s": step_s, "eval_loss": metrics["eval_loss"],
            **scores_in(metrics), "best_metric": state.best_metric, "best_step": state.best_step,
            "bad_rows": errors["bad_rows"] + errors.get("prepared_bad_rows", 0)}
