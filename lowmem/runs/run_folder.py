"""The run folder on disk: the checks before a run starts, checkpoint files, and model exports.

    OUTPUT_DIR/config.json, metrics.jsonl, consumed-rank{R}.tsv
    OUTPUT_DIR/checkpoints/step_NNNNNN/   model.safetensors optimizer.pt scheduler.pt trainer_state.json
                                          run_config.json process_{R}.pt manifest.json
    OUTPUT_DIR/checkpoints/latest
    OUTPUT_DIR/best/  OUTPUT_DIR/final/   save_pretrained folders
    OUTPUT_DIR/tensorboard/               event files (--report_to=tensorboard)
    OUTPUT_DIR/wandb/, mlflow.db          --report_to=wandb, mlflow (unless WANDB_DIR, MLFLOW_TRACKING_URI are set)
    OUTPUT_DIR/trackers.json              the trackers' run ids and how far they were fed
    (lowmem.monitoring.tracker_feed) OUTPUT_DIR/plots/                     charts of metrics.jsonl (the plot command)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from config import TrainConfig, flags_with
from lowmem.checkpointing import checkpoint, checksums
from lowmem.parallel import deepspeed_engine
from lowmem.parallel.distributed import decided_on_main
from lowmem.parallel.engines import Engine, engine_that_wrote
from lowmem.parallel.launch import runs_here
from lowmem.parallel.layouts import layout_title
from lowmem.runs.run_start import LOCK_FILE, check_owned, in_use_error, starting_point
from lowmem.runs.shared_folder import made_here, record_launchers, seen_by_every_process
from lowmem.utils.errors import UserError
from lowmem.utils.eval_metrics import metric_named
from lowmem.utils.frozen_forms import FROZEN_FORMS, FrozenForm
from lowmem.utils.ownership import check_closed, open_own, saved_json, write_atomic

# What a resume does with a setting that changed is its flag's ``resume`` role (config.py); any other change is
# logged. Refused: "shape", the model's shape, the optimizer and LoRA's (they decide what the checkpoint's weights
# and optimizer state are), with the tokenizer, recorded beside the flags; "preset", a --model_preset model's shape
# (--init_from's model has its own); "fixed", what the checkpoint's state is counted in: the order of the rows its
# data position counts (the seed shuffles each epoch's files and the buffer, the buffer's size decides whether they
# are shuffled at all), the stream that position belongs to (pairs count rows, the text objectives documents and
# packed tokens) and the metric its best model was chosen by. "run" (how this run starts) is never compared.
SHAPE_SETTINGS = (*flags_with("resume", "shape", "preset"), "tokenizer_size", "tokenizer_sha1", "tokenizer_json_sha1")
PRESET_SHAPE = flags_with("resume", "preset")
FIXED_ON_RESUME = flags_with("resume", "fixed")
FIXED_WHY = {"metric_for_best": "its best model was chosen by that metric, whose values the new one's cannot be "
                                "compared with",
             "objective": "its data position is one in that objective's stream, which another one reads differently",
             "shuffle_buffer_mb": "the rows its data position holds would come out in another order (the same rows: "
                                  "the run would not be the one it began as)"}
# Settings added since runs began to be written, with the value in effect before: a checkpoint without one had it
BEFORE_IT_EXISTED = {name: TrainConfig.__dataclass_fields__[name].metadata["before"] for name in flags_with("before")}
RUN_ONLY_SETTINGS = flags_with("resume", "run")
# What an evaluation's numbers depend on besides the model: a best/ chosen under other values is not comparable
EVAL_SETTINGS = flags_with("scores", "eval")
GENERATION_SETTINGS = flags_with("scores", "answers")
# What a run records beside its flags (compared above where it matters; the flags behind it are logged)
NOT_FLAGS = ("batch_request", "held_out_rows", "parameter_group_sizes", "sharding", "base_model")


class RunFolder:
    """Files of one run. The main process writes them, but for what each process must write itself (the
    check that it can write there, a sharded checkpoint's own shard); the trainer adds the barriers."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.lock = None  # the open OUTPUT_DIR/.lock while this process runs here (main process)

    def check(self, cfg: TrainConfig, accelerator, say=print) -> tuple[Path | None, list[Path]]:
        """Decide where the run starts, before anything heavy is built (``run_start``'s checks, again now that the
        processes are up), on the main process, which holds the folder's lock; then check that every process sees
        the folder it made (``lowmem.runs.shared_folder``: one run folder for all machines).

        Returns:
            The checkpoint to resume from (None: step 0) and the old run files to remove first.

        Raises:
            UserError: on every process: a folder of files not ours, unwritable, in use, a run already there,
                nothing to resume, a folder some machine cannot see.
        """
        def decide():
            check_owned(cfg, self.path)
            probe = made_here(self.path, "--output_dir")
            self.hold_lock(cfg.output_dir)
            return (*starting_point(cfg, self.path, say, states=True), probe)  # torch is imported by now

        resume_dir, old_files, probe = decided_on_main(accelerator, decide)
        seen_by_every_process(accelerator, self.path, probe, "--output_dir")
        return resume_dir, old_files

    def hold_lock(self, output_dir: str) -> None:
        """Hold OUTPUT_DIR/.lock for as long as this process runs (the OS drops it when the process
        ends, however it ends): a second run started on the same folder stops here, before it
        removes or overwrites anything of the first."""
        import fcntl

        if self.lock is not None:
            return
        handle = open_own(self.path / LOCK_FILE, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            owner = handle.read().strip() or "?"
            handle.close()
            raise in_use_error(output_dir, owner) from None
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        self.lock = handle

    def release_lock(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def claim(self, accelerator, old_files: list[Path], resume_dir: Path | None, set_aside: bool, say=print) -> None:
        """Remove a stopped run's files (``check`` listed them) and, with ``set_aside`` (--resume_from), set aside
        the checkpoints newer than the one resumed from: on the main process, once every process has looked."""
        accelerator.wait_for_everyone()
        if runs_here("run folder"):
            check_closed(self.path)  # again, just before: a link planted since check() is refused, its target kept
            self.remove(old_files)
            self.set_aside_newer(resume_dir if set_aside else None, say)
        record_launchers(accelerator, self.path)  # a process an elastic agent restarts continues this run

    @staticmethod
    def remove(paths: list[Path]) -> None:
        for path in paths:
            checkpoint.remove_ours_in(path) if path.is_dir() else path.unlink()

    def set_aside_newer(self, resume_dir: Path | None, say=print) -> None:
        """Checkpoints newer than ``resume_dir`` (the one --resume_from names), and best/ and final/ when
        exported after it, hold the continuation this run abandons: moved, kept, into
        ``checkpoints/abandoned-<time>/``, so that a later --is_keep_training continues this run, not the one
        it replaces, and best/ is never a model of the other continuation."""
        if resume_dir is None:
            return
        step = checkpoint.step_number(resume_dir)
        newer = [f for f in checkpoint.step_folders(self.checkpoints) if checkpoint.step_number(f) > step]
        newer += [self.path / name for name in ("best", "final")
                  if (saved_json(self.path / name / "training_info.json") or {}).get("step", -1) > step]
        if not newer:
            return
        aside = self.checkpoints / time.strftime("abandoned-%Y%m%d-%H%M%S")
        aside.mkdir(parents=True, exist_ok=True)
        for folder in newer:
            os.replace(folder, aside / folder.name)
        say(f"resuming from {resume_dir.name}: {', '.join(f.name for f in newer)} belong to the continuation this "
            f"run replaces; moved to {aside}")

    # ------------------------------------------------------------------ checkpoints
    def how_to_continue(self) -> str:
        """What continues this run after a failed write: its last checkpoint, when it has one."""
        if checkpoint.find_latest_valid(self.checkpoints, warn=lambda _: None, contents=False) is None:
            return "start the run again with --overwrite_output_dir=True (it has no checkpoint to continue from)"
        return checkpoint.CONTINUE + " (a lower --save_total_limit keeps fewer checkpoints)"

    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints / f"{checkpoint.PREFIX}{step:06d}"

    def write_checkpoint(self, training, trainer_state: dict, process_states: list[dict], keep: int,
                         staged: bool = False) -> Path:
        """Everything the run depends on, written atomically as the checkpoint of ``trainer_state``'s step; then
        ``latest`` moves to it and all but the newest ``keep`` go. ``training``: (model, optimizer, scheduler,
        run_config) as the run holds them; ``staged``: the processes wrote their weight and optimizer shards into
        the staging folder already."""
        model, optimizer, scheduler, run_config = training
        folder = self.checkpoint_path(trainer_state["step"])
        # Each file's checksum is taken as it is written (no second read); the sharded engines' files, written by
        # their libraries, are read once for theirs as the manifest is written (checksums.record)
        sums = {}
        with checkpoint.atomic_folder(folder, staged=staged, then=self.how_to_continue, sums=sums) as tmp:
            if not staged:
                checkpoint.save_trained(model, tmp / "model.safetensors", sums)
                checksums.save_torch(optimizer.state_dict(), tmp, "optimizer.pt", sums)
            checksums.save_torch(scheduler.state_dict(), tmp, "scheduler.pt", sums)
            checksums.save_json(trainer_state, tmp, "trainer_state.json", sums)
            checksums.save_json(run_config, tmp, "run_config.json", sums)
            for rank, process_state in enumerate(process_states):
                checksums.save_torch(process_state, tmp, f"process_{rank}.pt", sums)
        write_atomic(self.checkpoints / checkpoint.LATEST, folder.name)
        checkpoint.prune(self.checkpoints, keep, protect=folder)
        return folder

    @staticmethod
    def read_checkpoint(folder: Path, training, accelerator, engine: Engine, say=print) -> tuple[dict, dict]:
        """Load weights, optimizer and scheduler of ``folder`` in place (``training``: model, optimizer, scheduler and
        run_config, as ``write_checkpoint`` takes them), this process's (``accelerator``'s) own part.

        Returns:
            (trainer state, this process's state: RNG, data position, log offsets)
        """
        model, optimizer, scheduler, run_config = training
        rank, world = accelerator.process_index, accelerator.num_processes
        compare_settings(json.loads((folder / "run_config.json").read_text()), run_config, folder, say)
        saved_world = len(list(folder.glob("process_*.pt")))
        if saved_world != world:
            raise UserError(f"checkpoint {folder} was written by {saved_world} process(es); resume with the same "
                            f"number (this run has {world})")
        # Tensors and plain values only, all read before anything is restored: a checkpoint from
        # elsewhere holding other objects is refused whole, and none of its code runs.
        written = engine_that_wrote(folder)
        if not isinstance(engine, written):
            raise UserError(f"checkpoint {folder} was written with {written.title} and this run uses "
                            f"{engine.title}; resume with the launch config the run began with")
        scheduler_state, process_state = (checkpoint.load_state(folder / name)
                                          for name in ("scheduler.pt", f"process_{rank}.pt"))
        engine.load(model, optimizer, folder, rank)  # weights and optimizer: whole, or this process's shard
        scheduler.load_state_dict(scheduler_state)
        trainer_state = json.loads((folder / "trainer_state.json").read_text())
        return trainer_state, process_state

    # ------------------------------------------------------------------ exports
    @staticmethod
    def export(folder: Path, model, beside: ExportFiles, state_dict: dict | None = None, then=None) -> None:
        """A plain transformers model folder: safetensors weights, config, generation config, and ``beside`` them
        the tokenizer and training_info.json.

        ``state_dict`` replaces the model's own weights (LoRA: the merged plain weights; 8-bit ones:
        dequantized, written in shards). ``then``: what a failed write says to do next (``checkpoint.atomic_folder``).
        """
        from lowmem.model.quantize import Later, save_in_shards
        from lowmem.model.weight_check import check_export

        with checkpoint.atomic_folder(folder, then=then) as tmp, deepspeed_engine.unwrapped_without_import():
            if state_dict is not None and any(isinstance(v, Later) for v in state_dict.values()):
                save_in_shards(tmp, model, state_dict)  # 8-bit weights dequantized a shard at a time
            else:
                model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
            mark_head_tying(tmp / "config.json", model)
            beside.write(tmp)
            check_export(tmp, folder)  # headers against the written config: one transformers cannot load is not kept


    @staticmethod
    def export_adapter(folder: Path, model, base: str, beside: ExportFiles, then=None) -> None:
        """A peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors`` in float32, the
        ``base_model_name_or_path`` the --init_from given) with ``beside`` it the tokenizer and training_info.json:
        ``peft.PeftModel.from_pretrained(base_model, folder)`` loads it, and so do evaluate and generate."""
        from lowmem.model.adapters import save_adapter
        from lowmem.model.source import ADAPTER_WEIGHTS
        from lowmem.model.weight_check import check_export

        with checkpoint.atomic_folder(folder, then=then) as tmp:
            save_adapter(tmp, model, base)
            beside.write(tmp)
            check_export(tmp, folder, ADAPTER_WEIGHTS)  # the adapters' header against their rank, before the rename


def training_info(cfg: TrainConfig, held_out_rows: int, counters: dict) -> dict:
    """An export's training_info.json: the kind, the training files and the rows held out of them for evaluation,
    the flags it was trained with (which evaluate and generate adopt), and the run's ``counters``
    (``TrainState.now``)."""
    return {"kind": cfg.kind, "train_file": cfg.train_file, "held_out_rows": held_out_rows,
            "trained_with": {key: getattr(cfg, key) for key in flags_with("trained_with")}, **counters}


@dataclass(frozen=True)
class ExportFiles:
    """What an export writes beside the weights: the tokenizer (with the files of the folder it came from,
    ``tokenizer_source``, such as ``spiece.model``) and ``info`` as training_info.json."""

    tokenizer: object
    info: dict
    tokenizer_source: Path | None = None

    def write(self, folder: Path) -> None:
        from lowmem.model.source import copy_tokenizer_files

        self.tokenizer.save_pretrained(folder)
        if self.tokenizer_source is not None:
            copy_tokenizer_files(Path(self.tokenizer_source), folder)
        (folder / "training_info.json").write_text(json.dumps(self.info, indent=1))


def mark_head_tying(config_path: Path, model) -> None:
    """Write whether the output layer is tied to the embedding as the model has it.

    transformers 5's T5Config always says ``tie_word_embeddings: true`` (an untied head then shows
    only as ``scale_decoder_outputs: false``); any other reader, transformers 4 included, would tie
    an untied flan-t5 / v1.1 / mT5 head on load and scale its output: another model.
    """
    from lowmem.model.build import head_is_tied

    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tie_word_embeddings"] = head_is_tied(model)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _setting(key: str, value):
    """A setting as compared on resume: adapter targets as a set ("v,q" is "q,v")."""
    return sorted(v.strip() for v in str(value).split(",")) if key == "lora_target_modules" else value


def compare_settings(saved: dict, current: dict, folder: Path, say=print) -> None:
    """Refuse a resume whose model shape or tokenizer differ; say which value wins for the others."""
    held, holds = saved.get("held_out_rows", 0), current.get("held_out_rows", 0)
    if held != holds and all(saved.get(k) == current.get(k) for k in ("eval_file", "max_eval_samples")):
        raise UserError(f"checkpoint {folder} held out {held} rows of --train_file={saved.get('train_file')} for "
                        f"evaluation, and the same eval flags hold out {holds} of --train_file="
                        f"{current.get('train_file')}: the training data is not the run's; resume on the data it "
                        "began with, or use a new --output_dir")
    if held != holds:  # the rows the run trains on would change
        same = (f"--eval_file={saved.get('eval_file')}" if not held else
                f"no --eval_file and --max_eval_samples={saved.get('max_eval_samples')}")
        raise UserError(f"checkpoint {folder} held out {held} rows of --train_file for evaluation, this run would hold "
                        f"out {holds}; resume with {same} as before, or use a new --output_dir")
    for key in SHAPE_SETTINGS:
        if key == "lora_alpha" and not current.get("lora_r") or key in PRESET_SHAPE and current.get("init_from"):
            continue  # read only with adapters; only a preset's shape (--init_from's model has its own)
        was = saved.get(key, BEFORE_IT_EXISTED.get(key))
        known = key in saved or key in BEFORE_IT_EXISTED
        if known and key in current and _setting(key, was) != _setting(key, current[key]):
            flag = "tokenizer_dir" if key.startswith("tokenizer_") else key
            raise UserError(f"checkpoint {folder} was written with {key}={was} but this run has "
                            f"{current[key]}; resume with the --{flag} the run began with (model, tokenizer, "
                            "optimizer and LoRA shape cannot change), or use a new --output_dir")
    if "sharding" in saved and saved["sharding"] != current.get("sharding"):  # each engine its own files
        raise UserError(f"checkpoint {folder} was written with {layout_title(saved['sharding'])} and this run uses "
                        f"{layout_title(current.get('sharding'))}; resume with the launch config the run began with")
    _compare_parameter_groups(saved, current, folder)
    _compare_rows_per_step(saved, current, folder)
    _compare_base_model(saved, current, folder)
    quantized = FROZEN_FORMS.get(current.get("frozen_dtype"), FrozenForm).quantized
    if quantized and saved.get("mixed_precision", current["mixed_precision"]) != current["mixed_precision"]:
        # the 8-bit weights' scales are stored in the compute dtype
        raise UserError(f"checkpoint {folder} holds {current['frozen_dtype']} weights with scales in the dtype of "
                        f"--mixed_precision={saved['mixed_precision']}; resume with it, or use a new --output_dir")
    for key in FIXED_ON_RESUME:
        was = saved.get(key, BEFORE_IT_EXISTED.get(key, current.get(key)))
        if key in current and was != current[key]:
            why = FIXED_WHY.get(key, "its data position counts rows in the order that gave: another order would "
                                     "repeat some rows and skip others")
            raise UserError(f"checkpoint {folder} was written with --{key}={was}, and {why}; resume with "
                            f"--{key}={was}, or use a new --output_dir")
    for key, value in current.items():
        if key not in SHAPE_SETTINGS + FIXED_ON_RESUME + RUN_ONLY_SETTINGS + NOT_FLAGS and key in saved \
                and saved[key] != value:
            say(f"resume: --{key} was {saved[key]!r} in the checkpoint; using {value!r} from this command")


def _compare_base_model(saved: dict, current: dict, folder: Path) -> None:
    """Refuse a resume onto another base model: a checkpoint holds only what trains, and the frozen rest is
    read again from --init_from, which must be the very weights the run began with."""
    was, now = saved.get("base_model"), current.get("base_model")
    if was and now and was["fingerprint"] != now["fingerprint"]:
        raise UserError(f"checkpoint {folder} trained on --init_from={was['init_from']} (weights fingerprint "
                        f"{was['fingerprint']}), and --init_from={now['init_from']} now holds other weights "
                        f"(fingerprint {now['fingerprint']}); the checkpoint holds only the trained tensors, so "
                        "resume with the base model the run began with, or use a new --output_dir")


def _compare_parameter_groups(saved: dict, current: dict, folder: Path) -> None:
    """Refuse a resume whose optimizer state is laid out in other parameter groups: one group without weight
    decay, the decayed tensors and the exempt ones with it (``lowmem.training.optim.parameter_groups``)."""
    sizes = current.get("parameter_group_sizes")
    if sizes is None:
        return
    # Checkpoints written before the exemption hold one group of every trainable tensor.
    saved_sizes = saved.get("parameter_group_sizes", [sum(sizes)])
    if saved_sizes == sizes:
        return
    if "parameter_group_sizes" not in saved:
        raise UserError(f"checkpoint {folder} was written by an earlier version, which decayed every trainable tensor "
                        "(layer norms too) in one parameter group, where this one exempts layer norms and biases; "
                        "resume it with --weight_decay=0, or use a new --output_dir")
    before = saved.get("weight_decay", 0.0)
    raise UserError(f"checkpoint {folder} was written with --weight_decay={before}, this run has "
                    f"--weight_decay={current['weight_decay']}: weight decay on or off decides the optimizer's "
                    f"parameter groups (layer norms and biases are exempt from it); resume with "
                    f"{'a non-zero' if before else 'a zero'} --weight_decay, or use a new --output_dir")


def _compare_rows_per_step(saved: dict, current: dict, folder: Path) -> None:
    """Refuse an epochs run (no --max_steps) resumed at another number of rows per optimizer step: its
    schedule is planned in steps of this run's size, while the steps done were of the old one, so it would
    end before the data does (the rest at learning rate 0) or after it."""
    try:
        before = saved["batch_size"] * saved["gradient_accumulation_steps"]
        now = current["batch_size"] * current["gradient_accumulation_steps"]
    except (KeyError, TypeError):  # sizes not recorded
        return
    if current.get("max_steps", 0) > 0 or before == now:
        return
    raise UserError(f"checkpoint {folder} was written at {before} rows per optimizer step and process "
                    f"(--batch_size={saved['batch_size']} x --gradient_accumulation_steps="
                    f"{saved['gradient_accumulation_steps']}), this run has {now}: an --epochs run's "
                    "schedule counts steps of one size; resume with the same rows per step "
                    "(--effective_batch_size keeps them whatever the micro-batch), or give --max_steps")


def eval_changes(saved: dict, current: dict) -> list[str]:
    """The settings of the metric that picks best/ that differ from the checkpoint's (``--name=old -> new``)."""
    best = metric_named(current.get("metric_for_best", "eval_loss"))
    keys = EVAL_SETTINGS + (GENERATION_SETTINGS if best is not None and best.needs_generation else ())
    return [f"--{key}={saved[key]} -> {current[key]}" for key in keys
            if key in saved and key in current and saved[key] != current[key]]
