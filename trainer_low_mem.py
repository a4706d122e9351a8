"""LowMemTrainer: streaming, low-memory T5 pretraining and SFT on one CPU, one GPU or many.

    python train_low_mem.py train                                          # pretrain (shipped data)
    python train_low_mem.py train --is_finetune=True                       # SFT from runs/pretrain/best
    accelerate launch --multi_gpu train_low_mem.py train --is_finetune=True
    python train_low_mem.py train --is_keep_training=True                  # resume

Lifecycle: ``setup()`` (seed, accelerator, tokenizer, model, optimizer, scheduler, data, resume)
-> ``train()`` -> ``evaluate()`` -> ``save_checkpoint()`` / ``load_checkpoint()`` -> ``close()``.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from config import SHIPPED_CORPORA, TrainConfig, UserError, saved_json
from data.collate import CachedEncoderCollator, Seq2SeqCollator, shape_multiple
from data.prepare import check_manifest, manifest_of
from data.readers import TOKEN_COLUMNS, index_file
from data.sources import (
    DataProblems,
    bad_rows_report,
    check_columns,
    file_notes,
    resolve_files,
    too_many_bad_rows,
)
from data.stream import ExampleStream, batched, eval_files_of, eval_split, largest_share, steps_per_epoch, total_steps
from data.tokenization import has_tokenizer, tokenizer_sha1
from lowmem import checkpoint
from lowmem.evaluation import bleu_score, is_better
from lowmem.memory import free_memory, freeze_long_lived, memory_snapshot, process_rss_bytes, thaw_long_lived
from lowmem.metrics import AppendLog, MetricsLog, tracker_scalars, train_line
from lowmem.model_source import model_folder_config, resolve_model_dir, tokenizer_folder
from lowmem.modeling import (  # noqa: F401  (re-exported: the builders are part of this module's API)
    apply_memory_modes,
    build_model,
    build_optimizer,
    build_scheduler,
    check_lora_targets,
    count_parameters,
    export_state_dict,
    freeze_parts,
    frozen_encoder_states,
    generation_cache,
    head_is_tied,
    linear_layer_names,
    load_model,
    store_frozen_in_bf16,
    target_index,
    token_loss_sum,
    weights_in_float32,
)
from lowmem.optim import resume_schedule
from lowmem.run_folder import RunFolder
from lowmem.run_memory import guard_stop, near_limit, peak_against_plan, plan_run


class StoppedBySignal(Exception):
    """Raised after the checkpoint written on SIGTERM / SIGINT; the CLI exits cleanly."""


@dataclass
class TrainState:
    """Runtime counters saved in every checkpoint (never on the config)."""

    step: int = 0
    epoch: int = 0  # epochs every process has finished
    examples: int = 0
    tokens: int = 0
    best_metric: float | None = None
    best_step: int | None = None
    elapsed_s: float = 0.0
    nonfinite_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    nonfinite_in_a_row: int = 0
    last_eval: dict | None = None  # step, eval_loss and bleu of the latest evaluation

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


# ----------------------------------------------------------------------------- the trainer
class LowMemTrainer:
    """Streaming trainer. Optional ``tokenizer`` / ``model`` are injected as-is (the test seam)."""

    def __init__(self, cfg: TrainConfig, tokenizer=None, model=None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tokenizer_dir: Path | None = None  # the folder the tokenizer was loaded from (its files go into exports)
        self.model = model
        self.state = TrainState()
        self.out = Path(cfg.output_dir)
        self.folder = RunFolder(self.out)
        self.metrics: MetricsLog | None = None
        self.saved_step: int | None = None  # the step of the newest checkpoint written or resumed from
        self.consumed = None
        self.stop_signal = None
        self.resumed_interval = None
        self.timed = {"seconds": 0.0, "steps": 0}  # training time in this process, evaluations and saves left out
        self.bar = None
        self.encoder_cache = None
        self.frozen_bf16 = 0  # frozen weight elements stored in bf16 (--frozen_dtype)
        self.held_out_rows = 0  # rows of --train_file held out as the eval set (no --eval_file)
        self.grad_norm = self.step_lr = None  # of the last optimizer step, for its log record

    # ------------------------------------------------------------------ setup
    def setup(self) -> LowMemTrainer:
        """Check inputs, then build everything; nothing heavy is built before the checks pass."""
        cfg = self.cfg
        train_columns = self._check_inputs()
        self._start_accelerator()
        resume_dir, old_files = self.folder.check(cfg, self.rank, say=self.say)
        self.accelerator.wait_for_everyone()  # every process has looked at the folder before anything is removed
        if self.main:
            self.folder.remove(old_files)
        self.accelerator.wait_for_everyone()
        self._open_run_files()
        self.log_memory("start")
        if self.tokenizer is None:
            self.tokenizer = self._load_or_train_tokenizer()
        if self.prepared:
            check_manifest(self.prepared, tokenizer_sha1(self.tokenizer), cfg.max_source_len, cfg.max_target_len)
        self.eval_problems = DataProblems(report=self.say)
        self.eval_examples, indexes, self.held_out_rows = eval_split(
            cfg, self.eval_files, self.train_files, self._index_files(self.train_files), self.eval_problems)
        self.memory_plan = plan_run(cfg, self.tokenizer, self.train_files, self.eval_examples, indexes, self.rank,
                                    self.world, "gpu" if self.accelerator.device.type == "cuda" else "cpu",
                                    resuming=resume_dir is not None)  # before the model exists
        self._build_model()

        rows = sum(i.rows for i in indexes)
        for path, index in zip(self.train_files, indexes):
            if not index.rows:
                self.say(f"warning: {path} is empty")
        # The process with the most rows sets the epoch's steps: the others step with it on empty windows.
        share = largest_share(indexes, self.world)
        per_epoch = steps_per_epoch(share, cfg.batch_size, cfg.gradient_accumulation_steps)
        self.total_steps = total_steps(cfg, share)
        self._build_optimizer()

        self.collator = Seq2SeqCollator(self.tokenizer, cfg.max_source_len, cfg.max_target_len, self.shape_multiple)
        self.train_collator = self.collator
        self.stream = ExampleStream(self.train_files, train_columns, cfg.seed, cfg.shuffle_buffer_size,
                                    rank=self.rank, world_size=self.world, indexes=indexes,
                                    problems=DataProblems(report=self.warn))
        if resume_dir is not None:
            self.load_checkpoint(resume_dir)
        self.record("memory_plan", **self.memory_plan)  # after a resume has cut metrics.jsonl back to its checkpoint
        if cfg.report_to != "none":
            # Events go to OUTPUT_DIR/tensorboard. On resume, SummaryWriter's purge_step hides what the stopped
            # run logged after its checkpoint (metrics.jsonl is cut back there the same way).
            purge = {"purge_step": self.state.step + 1} if resume_dir is not None else {}
            self.accelerator.init_trackers("tensorboard", init_kwargs={"tensorboard": purge})
        if cfg.encoder_cache != "off":
            self._open_encoder_cache(indexes)
        self._announce(rows, per_epoch)
        return self

    def _check_inputs(self) -> tuple[str, str]:
        """The checks that need no model or process group; returns the training files' columns."""
        cfg = self.cfg
        self.train_files = resolve_files(cfg.train_file, "--train_file", cfg.output_dir)
        self.prepared = manifest_of(self.train_files)  # a corpus tokenized by `prepare`: token-id columns
        train_columns = TOKEN_COLUMNS if self.prepared else (cfg.prompt_column, cfg.response_column)
        check_columns(self.train_files, train_columns, "--train_file")
        self.eval_files = eval_files_of(cfg, self.train_files)
        if self.eval_files:
            check_columns(self.eval_files, (cfg.prompt_column, cfg.response_column), "--eval_file")
        if cfg.init_from and self.model is None:
            saved = model_folder_config(cfg.init_from)
            if cfg.lora_r:  # before the planner and the model: a name the model lacks is a typo to fix first
                check_lora_targets(cfg, linear_layer_names(saved))
        return train_columns

    def _build_model(self) -> None:
        """Build (from scratch) or load (--init_from) the model, freeze what --freeze names and apply the
        memory modes."""
        cfg = self.cfg
        if self.model is None:
            self.model = (load_model(cfg.init_from, dropout_rate=cfg.dropout_rate) if cfg.init_from
                          else build_model(cfg, self.tokenizer))
        self._check_vocabulary()
        self.run_config = self._run_config()  # the tokenizer is fixed for the run: fingerprint it once
        freeze_parts(self.model, cfg.freeze)
        self.model = apply_memory_modes(self.model, cfg)
        self.trainable, self.frozen = count_parameters(self.model)
        self.frozen_bf16 = store_frozen_in_bf16(self.model) if cfg.frozen_dtype == "bfloat16" else 0
        self.log_memory("model_built")

    def _build_optimizer(self) -> None:
        """Optimizer state for the trainable tensors only, the schedule, and accelerate's wrapping."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.cfg, params)
        self.scheduler = build_scheduler(self.cfg, self.optimizer, self.total_steps)
        # The scheduler is not prepared: accelerate's wrapper would step it once per process per call.
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        self.core = self.accelerator.unwrap_model(self.model)
        self.trainable_params = [p for p in self.core.parameters() if p.requires_grad]
        self.log_memory("prepared")

    def _check_vocabulary(self, model_dir: Path | None = None) -> None:
        """The tokenizer must fit the model: no id past its embedding (Google's checkpoints pad the
        embedding past the tokenizer, 32,128 rows for 32,100 pieces: rows never produced, which is
        fine), and it must be the one saved with the model if the model has one (a tokenizer with
        other words would feed the model wrong ids silently)."""
        cfg = self.cfg
        rows = self.model.get_input_embeddings().num_embeddings
        if len(self.tokenizer) > rows:
            raise UserError(f"the tokenizer has {len(self.tokenizer):,} tokens but the model's embedding only "
                            f"{rows:,} rows: ids past {rows - 1:,} have no embedding; pass the --tokenizer_dir the "
                            "model was trained with (or leave it out to use the model's own)")
        saved = model_dir or (resolve_model_dir(cfg.init_from) if cfg.init_from else None)
        if saved and cfg.tokenizer_dir is not None and has_tokenizer(saved) \
                and saved.resolve() != Path(cfg.tokenizer_dir).resolve():
            from data.tokenization import load_tokenizer

            if tokenizer_sha1(load_tokenizer(saved)) != tokenizer_sha1(self.tokenizer):
                raise UserError(f"--tokenizer_dir={cfg.tokenizer_dir} is not the tokenizer saved with the model "
                                f"{saved} (other words); leave --tokenizer_dir out to use that one")

    def setup_inference(self) -> LowMemTrainer:
        """Load a saved model (--init_from, default OUTPUT_DIR/best) for ``evaluate`` / ``generate``."""
        cfg = self.cfg
        model_dir = Path(cfg.init_from) if cfg.init_from else self.out / "best"
        # Without --eval_file: the rows that training on --train_file held out
        self.train_files = resolve_files(cfg.train_file, "--train_file") if cfg.eval_file is None else []
        self.eval_files = eval_files_of(cfg, self.train_files)
        self.model = load_model(model_dir)
        model_dir = resolve_model_dir(str(model_dir))
        self._start_accelerator()
        if self.tokenizer is None:
            from data.tokenization import load_tokenizer

            # The model's own tokenizer unless --tokenizer_dir names one (without --init_from it holds the
            # shipped default, which OUTPUT_DIR/best's own wins over).
            own = has_tokenizer(model_dir) and not (cfg.init_from and cfg.tokenizer_dir)
            self.tokenizer = load_tokenizer(model_dir if own else tokenizer_folder(cfg))
        self._check_vocabulary(model_dir)
        self.model = self.accelerator.prepare(self.model)
        self.core = self.accelerator.unwrap_model(self.model)
        self.collator = Seq2SeqCollator(self.tokenizer, cfg.max_source_len, cfg.max_target_len, self.shape_multiple)
        self.eval_examples, _, self.held_out_rows = eval_split(cfg, self.eval_files, self.train_files)
        trained = (saved_json(model_dir / "training_info.json") or {}).get("kind")
        shipped_eval = cfg.eval_file == str(SHIPPED_CORPORA[cfg.kind][1]) and not cfg.prompt
        if trained in SHIPPED_CORPORA and trained != cfg.kind and shipped_eval:  # e.g. an SFT model, no --is_finetune
            self.say(f"note: {model_dir} was trained by {trained}, and these are the shipped {cfg.kind} eval rows "
                     f"({cfg.eval_file}); pass --is_finetune={trained == 'sft'} for the {trained} ones")
        return self

    @torch.no_grad()
    def generate(self, prompts: list[str]) -> list[str]:
        """Answers to ``prompts`` (batched within the eval batch cap)."""
        self.model.eval()
        answers = []
        for chunk in batched(prompts, self.cfg.eval_batch_size):
            batch = self.to_device(self.collator.encode(chunk, self.cfg.max_source_len))
            with self.accelerator.autocast():
                out = self.core.generate(**batch, max_new_tokens=self.cfg.max_new_tokens, num_beams=self.cfg.num_beams,
                                         cache=generation_cache())
            answers.extend(self.tokenizer.batch_decode(out, skip_special_tokens=True))
        return answers

    def report_memory_peak(self) -> dict:
        """Predicted and measured peak memory side by side (log line and a memory_peak event)."""
        fields, line = peak_against_plan(self.memory_plan)
        self.record("memory_peak", **fields)
        self.say(line)
        return fields

    def _open_encoder_cache(self, indexes: list) -> None:
        """Build (or reuse) the frozen encoder's outputs for this process's rows; train from them."""
        from lowmem import encoder_cache

        cfg, columns = self.cfg, (self.cfg.prompt_column, self.cfg.response_column)
        shares = [self.stream.share(i) for i in range(len(self.train_files))]
        # How the encoder runs counts too: bf16 autocast (and its padding) or not, on which device.
        compute = f"{cfg.mixed_precision}/{self.accelerator.device.type}/{self.shape_multiple}"
        key = encoder_cache.fingerprint(self.core.encoder, self.run_config["tokenizer_sha1"], cfg.max_source_len,
                                        cfg.encoder_cache_dtype, self.train_files, columns, self.world, compute,
                                        [i.rows for i in indexes])  # held-out eval rows are not trained on

        rows = sum(end - start for start, end in shares)

        def build(folder: Path) -> None:
            self.say(f"encoder cache: encoding {rows:,} rows into {folder}")
            reads = (self.total_steps - self.state.step) * cfg.batch_size * cfg.gradient_accumulation_steps
            if reads <= rows:
                self.say(f"encoder cache: this run reads {reads:,} of those rows, none twice; encoding costs what "
                         "the encoder would take in its steps, so the cache saves time only in runs that read rows "
                         "again (more --epochs or --max_steps); it still frees the encoder's GPU memory")
            bar = tqdm(total=rows, desc="encoder cache", unit="row",
                       disable=not (self.main and self._tty()))
            encoder_cache.build(folder, self.rank, self.train_files, indexes, shares, columns, self._encode,
                                self.core.config.d_model, cfg.encoder_cache_dtype, bar)
            bar.close()

        self.encoder_cache = encoder_cache.open_cache(self.out / "encoder_cache", key, self.rank, cfg.encoder_cache,
                                                      shares, self.train_files, build, self.say)
        self.train_collator = CachedEncoderCollator(self.collator, self.encoder_cache)
        self.log_memory("encoder_cache")
        if self.accelerator.device.type == "cuda":
            # Training no longer runs the encoder: its blocks leave GPU memory (evaluation brings
            # them back for its duration). The shared embedding stays: the decoder reads it.
            self._move_encoder("cpu")
            free_memory()

    def _move_encoder(self, device) -> None:
        for module in (self.core.encoder.block, self.core.encoder.final_layer_norm):
            module.to(device)

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen encoder's outputs for ``prompts``, exactly as the uncached training step computes them."""
        self.core.encoder.eval()
        batch = self.to_device(self.collator.encode(prompts, self.cfg.max_source_len))
        with self.accelerator.autocast():
            hidden = frozen_encoder_states(self.core.encoder, batch["input_ids"], batch["attention_mask"],
                                           self.shape_multiple)
        return hidden, batch["attention_mask"]

    def _index_files(self, files: list[Path]) -> list:
        """Row counts and seek points of the training files, read once by the main process."""
        from accelerate.utils import broadcast_object_list

        box = [[index_file(f) for f in files] if self.main else None]
        if self.world > 1:
            broadcast_object_list(box)
        return box[0]

    def _start_accelerator(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, set_seed

        cfg = self.cfg
        if cfg.mixed_precision == "bf16" and torch.cuda.is_available() and not cfg.cpu \
                and not torch.cuda.is_bf16_supported():
            raise UserError("--mixed_precision=bf16: this GPU has no bf16 support; use --mixed_precision=no")
        # --report_to: accelerate's tracker, its files under OUTPUT_DIR (started by setup(), once the step is known)
        tracking = {} if cfg.report_to == "none" else {"log_with": cfg.report_to, "project_dir": cfg.output_dir}
        # DDP all-reduces through buckets that, by default, are a second copy of every gradient; as
        # views the gradients live in the buckets themselves (one copy fewer per process).
        ddp = DistributedDataParallelKwargs(gradient_as_bucket_view=True)
        self.accelerator = Accelerator(cpu=cfg.cpu, mixed_precision=cfg.mixed_precision,
                                       gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                       kwargs_handlers=[ddp], **tracking)
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        sharded = self.accelerator.distributed_type.value
        if sharded in ("DEEPSPEED", "FSDP"):
            raise UserError(f"{sharded} is not supported by this trainer yet: its checkpoints, exports and "
                            "uneven last windows assume whole weights on every process (see README, "
                            "'DeepSpeed ZeRO and FSDP'); launch with accelerate_configs/multi_gpu.yaml")
        self.main = self.accelerator.is_main_process
        self.shape_multiple = shape_multiple(cfg.mixed_precision, self.accelerator.device.type == "cpu")
        set_seed(cfg.seed)
        self.start_time = time.time()

    def _open_run_files(self) -> None:
        """config.json and metrics.jsonl (main process), the consumed-examples log (every process)."""
        if self.main:
            (self.out / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1), encoding="utf-8")
            self.metrics = MetricsLog(self.out / "metrics.jsonl")
        if self.cfg.dump_consumed:
            self.consumed = AppendLog(self.out / f"consumed-rank{self.rank}.tsv")

    def _load_or_train_tokenizer(self):
        from data.tokenization import load_tokenizer, train_tokenizer, vocab_shortfall

        cfg = self.cfg
        folder = self.tokenizer_dir = tokenizer_folder(cfg)
        if has_tokenizer(folder):
            return load_tokenizer(folder)
        if cfg.init_from:
            raise UserError(f"no tokenizer in --tokenizer_dir={folder}; pass the folder of the tokenizer the "
                            f"--init_from model was trained with (or leave --tokenizer_dir out to use its own)")
        if self.prepared:
            raise UserError(f"no tokenizer in --tokenizer_dir={folder}; pass the one the corpus was prepared with "
                            f"({self.prepared['tokenizer_dir']})")
        self.say(f"no tokenizer in {folder}: training one on {cfg.train_file}")
        if self.main:
            train_tokenizer(self.train_files, folder, (cfg.prompt_column, cfg.response_column),
                            cfg.vocab_size, cfg.tokenizer_max_sentences, progress=self._tty())
        self.accelerator.wait_for_everyone()
        tokenizer = load_tokenizer(folder)
        shortfall = vocab_shortfall(tokenizer, cfg.vocab_size)
        if shortfall:
            self.say(shortfall)
        return tokenizer

    def _announce(self, rows: int, per_epoch: int) -> None:
        cfg = self.cfg
        effective = cfg.batch_size * cfg.gradient_accumulation_steps * self.world
        features = [f"mixed_precision={cfg.mixed_precision}", f"optimizer={cfg.optimizer}",
                    f"gradient_checkpointing={cfg.gradient_checkpointing}",
                    f"shuffle_buffer={cfg.shuffle_buffer_size} rows", "dynamic padding", "streamed data",
                    f"gc every {cfg.gc_every_steps} steps"]
        if cfg.lora_r:
            features.append(f"LoRA r={cfg.lora_r} alpha={cfg.lora_alpha:g} on decoder {cfg.lora_target_modules}")
        if cfg.encoder_cache != "off":
            cache = self.encoder_cache
            features.append(f"encoder cache ({'RAM' if cache.in_memory else 'disk'}, {cfg.encoder_cache_dtype})")
        features.append(self._frozen_summary())
        if self.frozen_bf16:
            features.append(f"{self.frozen_bf16:,} frozen weights stored in bf16")
        lines = [
            f"device {self.accelerator.device} x {self.world} process(es) | "
            f"model {cfg.init_from or cfg.model_preset} | "
            f"params trainable {self.trainable:,} / frozen {self.frozen:,}",
            f"effective batch {effective} (micro {cfg.batch_size} x accumulation {cfg.gradient_accumulation_steps} "
            f"x {self.world}) | tokens per optimizer step <= {effective * (cfg.max_source_len + cfg.max_target_len):,}",
            f"train rows {rows:,} from {len(self.train_files)} file(s) | {per_epoch} optimizer steps per epoch | "
            f"total steps {self.total_steps} | start step {self.state.step}",
            f"eval rows {len(self.eval_examples):,} from "
            + (cfg.eval_file if cfg.eval_file else f"the last {self.held_out_rows:,} rows of --train_file, held out "
               "of training (pass --eval_file to evaluate on another set)"),
            "memory: " + ", ".join(features),
        ]
        if cfg.gpu_profile and self.accelerator.device.type == "cpu":
            lines.append(f"--memory_profile={cfg.memory_profile} is a GPU profile but this run is on the CPU: its "
                         "bf16 autocast saves no host memory there (it measured more); host16g is the CPU profile")
        if cfg.warmup_steps > self.total_steps:
            lines.append(f"--warmup_steps={cfg.warmup_steps} is more than the run's {self.total_steps} steps: the "
                         f"learning rate warms up over all {self.total_steps} and never decays")
        for line in lines + file_notes(cfg.train_file, self.train_files, self.eval_files, bool(cfg.eval_file)):
            self.say(line)
        self.record("setup", trainable_params=self.trainable, frozen_params=self.frozen,
                    frozen_bf16_params=self.frozen_bf16, effective_batch=effective,
                    train_rows=rows, held_out_rows=self.held_out_rows, eval_rows=len(self.eval_examples),
                    total_steps=self.total_steps, world_size=self.world)

    # ------------------------------------------------------------------ train
    def _frozen_summary(self) -> str:
        """What --freeze keeps fixed, in the start-up line's words."""
        freeze, tied = self.cfg.freeze, head_is_tied(self.core)
        if self.cfg.lora_r:  # every base weight, an untied lm_head too
            return "base weights frozen, LoRA adapters train" + (
                "; encoder under no_grad, eval mode" if freeze == "encoder" else "")
        if freeze == "none":
            return "every weight trains"
        parts = ["encoder (no_grad, eval mode)"] if freeze == "encoder" else []
        parts.append("shared embedding" + (" = tied output layer" if tied else ""))
        return "frozen " + " + ".join(parts) + ("" if tied else "; the untied lm_head trains")

    def train(self) -> dict:
        """Run optimizer steps until ``max_steps`` or the last epoch; evaluate and export at the end."""
        cfg, state = self.cfg, self.state
        self._install_signal_handlers()
        self._set_train_mode()
        self.bar = tqdm(total=self.total_steps, initial=state.step, desc="train", unit="step",
                        disable=not (self.main and self._tty()), dynamic_ncols=True)
        if state.step == 0 and self.cfg.eval_steps:
            self.evaluate_and_keep_best()  # the baseline every later eval is compared with
        freeze_long_lived()  # later collections skip the imports, model and tokenizer
        self._reset_interval(self.resumed_interval)  # after the baseline: tok/s and step_s time training only
        while not self._finished():
            free_memory()  # at each epoch start
            windows = self._epoch_windows()
            while True:
                epoch = self.stream.epoch  # before drawing: the last window of an epoch moves it on
                examples = next(windows, [])
                window = self.train_collator.window(examples, self.cfg.batch_size) if examples else []
                counts = self.window_counts(window)
                self.check_bad_rows(counts["bad_rows"])
                if not counts["examples"]:  # only bad rows were left
                    state.epoch += 1  # every process has finished this epoch: all agree on the count
                    break
                stepped = self.train_step(window or [self._empty_batch()], counts)
                self.log_consumed(examples, epoch)
                last = not counts["rows_left"]  # the epoch's last step: count it before eval and save see it
                if last:
                    self.stream.close_epoch(state.epoch)
                    state.epoch += 1
                if stepped:
                    self.maybe_log()
                    self.maybe_gc()
                    with self.untimed():
                        self.maybe_eval()
                        self.maybe_save()
                if self.stop_requested():  # checked after this step, not with the next window's counts,
                    self.stop_for_signal()  # which ran one more step (a scheduler's grace period may not allow it)
                if counts["memory"]:
                    self.stop_for_memory()
                if last or self._finished():
                    break
            if not state.examples:
                self.report_data_errors()
                raise UserError(f"--train_file={cfg.train_file} yields no usable rows ("
                                f"{self.stream.total_rows} rows, all bad); see the data_errors line in metrics.jsonl")
            self.log_memory("epoch_end", epoch=state.epoch)
        self.bar.close()
        return self.finish()

    def _finished(self) -> bool:
        """The same answer on every process (a process's own stream may run out of an epoch first)."""
        if self.cfg.max_steps > 0:
            return self.state.step >= self.cfg.max_steps
        return self.state.epoch >= self.cfg.epochs

    def _epoch_windows(self):
        """This process's accumulation windows (batch_size x accumulation examples) for the epoch.

        A process whose share ran out before the others' is already at the next epoch: until all
        agree the epoch is over it has nothing more (it was checkpointed in that state, or is resuming).
        """
        if self.stream.epoch > self.state.epoch:
            return iter(())
        return batched(self.stream.iter_epoch(), self.cfg.batch_size * self.cfg.gradient_accumulation_steps)

    def _set_train_mode(self) -> None:
        self.model.train()
        if self.cfg.frozen_encoder:
            self.core.encoder.eval()  # frozen: no dropout, and it runs under no_grad

    def window_counts(self, window: list[dict]) -> dict:
        """Target tokens and examples of one accumulation window: local, and summed over processes.

        Counted on host tensors (no device sync); one small all-reduce when there are several
        processes, which is also how every process learns whether any of them has rows left in this
        epoch after this window, how many bad rows all have met, and whether any is near --max_rss_gb.
        """
        local = torch.tensor([sum(int(mb["labels"].ne(-100).sum()) for mb in window),
                              sum(mb["labels"].shape[0] for mb in window),
                              self.stream.problems.total, int(near_limit(self.cfg.max_rss_gb)),
                              int(not self.stream.finished_epoch(self.state.epoch))])
        total = local
        if self.world > 1:
            total = self.accelerator.reduce(local.to(self.accelerator.device), "sum").cpu()
        source_tokens = sum(int(mb["attention_mask"].sum()) for mb in window)
        return {"local_tokens": int(local[0]), "local_all_tokens": int(local[0]) + source_tokens,
                "tokens": int(total[0]), "examples": int(total[1]), "bad_rows": int(total[2]),
                "memory": int(total[3]) > 0, "rows_left": int(total[4]) > 0}

    def _empty_batch(self) -> dict:
        """A micro-batch with no target tokens, for a process whose share of the epoch ran out
        first: its backward adds zero gradient but keeps the all-reduce in step with the others."""
        return self.train_collator.empty()

    def train_step(self, window: list[dict], counts: dict) -> bool:
        """One optimizer step over an accumulation window of collated micro-batches.

        Returns:
            False when the step was skipped because the loss or gradient was not finite.
        """
        loss_sum = self.accumulate_gradients(window, counts["tokens"])
        # The norm of the all-reduced gradient (clip at infinity = measure only) is the same on every
        # process, so all of them take the same decision; a NaN loss anywhere makes it NaN.
        self.grad_norm = self.accelerator.clip_grad_norm_(self.trainable_params, self.cfg.max_grad_norm or math.inf)
        if not math.isfinite(float(self.grad_norm)):  # one host sync per optimizer step
            self.skip_nonfinite_step()
            return False
        self.state.nonfinite_in_a_row = 0
        self.step_lr = self.scheduler.get_last_lr()[0]  # the rate this step applies (logged with it)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens += counts["tokens"]
        self.state.examples += counts["examples"]
        self.interval["loss"] += loss_sum  # stays on the device: no host sync until the log step
        self.interval["tokens"] += counts["local_tokens"]
        self.interval["all_tokens"] += counts["local_all_tokens"]
        self.interval["steps"] += 1
        self.interval["timed_steps"] += 1
        self.bar.update()
        return True

    def skip_nonfinite_step(self) -> None:
        """Drop this window's gradient without stepping; abort after --max_nonfinite_steps in a row."""
        self.optimizer.zero_grad(set_to_none=True)
        state = self.state
        state.nonfinite_steps += 1
        state.nonfinite_in_a_row += 1
        self.say(f"step {state.step + 1}: non-finite loss or gradient, optimizer step skipped "
                 f"({state.nonfinite_in_a_row} in a row, {state.nonfinite_steps} in total)")
        self.record("nonfinite_step", skipped_total=state.nonfinite_steps, in_a_row=state.nonfinite_in_a_row)
        if state.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
            raise UserError(f"{state.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or "
                            f"gradient (--max_nonfinite_steps={self.cfg.max_nonfinite_steps}); lower "
                            "--learn_rate, keep --max_grad_norm on, or use --mixed_precision=no (best/ never "
                            "holds non-finite weights)")

    def stop_for_memory(self) -> None:
        folder = self.save_checkpoint()
        self.bar.close()
        rss = process_rss_bytes() / 2**30
        self.record("memory_guard", rss_gb=rss, max_rss_gb=self.cfg.max_rss_gb)
        raise guard_stop(rss, self.cfg.max_rss_gb, self.state.step, folder)

    def accumulate_gradients(self, window: list[dict], total_tokens: int | None = None) -> torch.Tensor:
        """Backward over one window; the gradient is that of (sum of token losses) / (target tokens
        of the whole window on all processes), whatever the micro-batch split.

        Returns:
            The local sum of token losses (a device tensor).
        """
        if total_tokens is None:
            total_tokens = self.window_counts(window)["tokens"]
        # accelerator.backward divides by gradient_accumulation_steps and DDP averages over processes;
        # this scale turns that into sum(token losses) / global tokens.
        scale = len(window) * self.world / max(total_tokens, 1)
        self.accelerator.gradient_accumulation_steps = len(window)
        self.accelerator.step = 0  # a short window (end of an epoch) must still end in one sync
        loss_sum = torch.zeros((), device=self.accelerator.device)
        for micro in window:
            batch = self.to_device(micro)
            with self.accelerator.accumulate(self.model):
                with self.accelerator.autocast():
                    loss = token_loss_sum(self.model, self.core, batch, frozen_encoder=self.cfg.frozen_encoder,
                                          multiple=self.shape_multiple)
                self.accelerator.backward(loss * scale)  # all-reduce only on the window's last micro-batch
            loss_sum += loss.detach()
            del batch, loss  # free this micro-batch's activations before the next one
        return loss_sum

    def to_device(self, batch: dict) -> dict:
        """The batch on the training device, with its target positions found here on the host."""
        if "labels" in batch:
            batch = {**batch, "target_index": target_index(batch["labels"], self.shape_multiple)}
        pin = self.cfg.pin_memory and self.accelerator.device.type == "cuda"
        return {k: (v.pin_memory() if pin else v).to(self.accelerator.device, non_blocking=pin)
                for k, v in batch.items()}

    def log_consumed(self, examples: list, epoch: int) -> None:
        """With --dump_consumed: one line per example of this step (epoch, rank, file, row)."""
        if self.consumed is not None:
            self.consumed.write("".join(f"{epoch}\t{self.rank}\t{self.train_files[e.file_index]}\t{e.row}\n"
                                        for e in examples))

    def _install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT: finish the current optimizer step, checkpoint, exit cleanly."""
        self.stop_signal = None

        def request_stop(signum, _frame):
            if self.stop_signal is not None:  # a second signal: stop now
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signum).name
            self.say(f"{self.stop_signal} received: finishing this optimizer step, then saving a checkpoint")

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request_stop)

    def stop_requested(self) -> bool:
        """Whether any process got SIGTERM / SIGINT (the same answer on all: one small all-reduce)."""
        flag = torch.tensor([int(self.stop_signal is not None)])
        if self.world > 1:
            flag = self.accelerator.reduce(flag.to(self.accelerator.device), "sum").cpu()
        return int(flag[0]) > 0

    def stop_for_signal(self) -> None:
        folder = self.save_checkpoint()
        self.bar.close()
        self.say(f"stopped at step {self.state.step}; checkpoint {folder}. Continue with the same command "
                 "plus --is_keep_training=True")
        raise StoppedBySignal(self.state.step)

    # ------------------------------------------------------------------ hooks
    def maybe_log(self, force: bool = False) -> None:
        cfg, state, iv = self.cfg, self.state, self.interval
        # Every condition here is the same on all processes: the reduce below is a collective.
        if not (force or state.step % cfg.logging_steps == 0) or not iv["steps"]:
            return
        counts = torch.tensor([iv["tokens"], iv["all_tokens"]], dtype=torch.float64, device=iv["loss"].device)
        sums = torch.cat([iv["loss"].double().reshape(1), counts])
        if self.world > 1:
            sums = self.accelerator.reduce(sums, "sum")
        loss_sum, tokens, all_tokens = sums.tolist()
        seconds = max(time.time() - iv["t0"], 1e-9)
        self.timed["seconds"] += seconds
        self.timed["steps"] += iv["timed_steps"]
        lr = self.scheduler.get_last_lr()[0] if self.step_lr is None else self.step_lr
        mem = memory_snapshot()
        fields = dict(loss=round(loss_sum / max(tokens, 1), 5), lr=lr, tokens_per_s=round(all_tokens / seconds, 1),
                      step_s=round(seconds / max(iv["timed_steps"], 1), 4),
                      elapsed_s=round(self.elapsed(), 2), epoch=state.epoch, examples=state.examples,
                      tokens=state.tokens, **mem)
        if self.world > 1:  # every process's own RSS: N processes should cost about N x one
            rss = self.accelerator.gather(torch.tensor([mem["rss_mb"]], device=self.accelerator.device))
            fields["rss_mb_per_process"] = [round(v, 1) for v in rss.tolist()]
        if self.grad_norm is not None:
            fields["grad_norm"] = round(float(self.grad_norm), 7)
        self.record("train", **fields)
        if self.main:
            self.bar.set_postfix(loss=f"{fields['loss']:.3f}", lr=f"{lr:.1e}", tok_s=f"{fields['tokens_per_s']:.0f}",
                                 rss=f"{mem['rss_mb'] / 1024:.2f}G")
            if not self._tty():
                self.say(train_line(state.step, self.total_steps, fields["loss"], lr, fields["tokens_per_s"],
                                    mem["rss_mb"]))
        self._reset_interval()

    def _reset_interval(self, saved: dict | None = None) -> None:
        """Start a logging interval. ``saved`` (on resume) carries the loss and token sums of the steps
        since the last log line, so the next logged loss averages the same steps as an uninterrupted run;
        the rates (tok/s, step_s) count only steps timed in this process."""
        saved = saved or {"loss": 0.0, "tokens": 0, "steps": 0}
        self.interval = {**saved, "loss": torch.tensor(saved["loss"], device=self.accelerator.device),
                         "all_tokens": 0, "timed_steps": 0, "t0": time.time()}

    @contextlib.contextmanager
    def untimed(self):
        """Leave what runs inside (evaluation, saving) out of the interval's tok/s and step_s."""
        start = time.time()
        try:
            yield
        finally:
            self.interval["t0"] += time.time() - start

    def maybe_gc(self) -> None:
        if self.state.step % self.cfg.gc_every_steps == 0:
            free_memory()

    def maybe_eval(self) -> None:
        if self.cfg.eval_steps and self.state.step % self.cfg.eval_steps == 0 and not self._finished():
            self.evaluate_and_keep_best()

    def maybe_save(self) -> None:
        if self.cfg.save_steps and self.state.step % self.cfg.save_steps == 0 and not self._finished():
            self.save_checkpoint()

    def finish(self) -> dict:
        """Final log, evaluation, checkpoint and ``final/`` export."""
        self.maybe_log(force=True)
        # This step is evaluated already when the run resumed from its own final checkpoint.
        done = self.state.last_eval
        metrics = done if done and done["step"] == self.state.step else self.evaluate_and_keep_best()
        if self.state.step < self.total_steps:  # epochs planned from row counts; bad or skipped rows shorten them
            self.say(f"the epochs took {self.state.step} optimizer steps, not the {self.total_steps} planned from the "
                     "files' row counts (bad rows and non-finite steps are skipped): the learning-rate schedule, made "
                     f"for {self.total_steps} steps, stopped at {self.scheduler.get_last_lr()[0]:.3g}")
        self.save_checkpoint()
        self.export(self.out / "final")
        self.log_memory("end")
        self.report_memory_peak()
        errors = self.report_data_errors()
        self.accelerator.wait_for_everyone()  # no process leaves while another is still in a collective
        return {"output_dir": str(self.out), "steps": self.state.step, "step_s": self.mean_step_seconds(),
                "eval_loss": metrics["eval_loss"],
                "bleu": metrics["bleu"], "best_metric": self.state.best_metric, "best_step": self.state.best_step,
                "bad_rows": errors["bad_rows"]}

    # ------------------------------------------------------------------ bad rows
    def check_bad_rows(self, bad_rows: int) -> None:
        """Abort (on every process alike: ``bad_rows`` is summed over them) once more training rows
        are bad than --max_bad_rows_fraction allows for the whole corpus."""
        allowed = self.cfg.max_bad_rows_fraction * self.stream.total_rows
        if bad_rows > allowed:
            errors = self.report_data_errors()
            raise too_many_bad_rows(bad_rows, self.stream.total_rows, self.cfg.max_bad_rows_fraction,
                                    errors["by_reason"])

    def report_data_errors(self) -> dict:
        """Sum the bad rows of the first epoch over processes; log them and write a data_errors event.

        Collective: called at points every process reaches together.
        """
        from accelerate.utils import gather_object

        train = self.stream.problems.merge(gather_object([self.stream.problems.state_dict()]))
        rows_read = sum(gather_object([self.stream.rows_read]))
        event, line = bad_rows_report(train, rows_read, self.stream.total_rows, self.eval_problems, self.prepared)
        self.record("data_errors", **event)
        if line:
            self.say(line)
        return event

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Eval loss (token-mean) and BLEU-4 of greedy/beam generations over the eval set.

        Each process takes every world-th example; no collective runs inside the loop (ranks may
        hold different numbers of batches), and predictions are gathered once as text at the end.
        """
        from accelerate.utils import gather_object

        start = time.time()
        free_memory()  # before evaluation
        self.log_memory("eval_start")
        offloaded = self.core.encoder.final_layer_norm.weight.device != self.accelerator.device
        if offloaded:
            self._move_encoder(self.accelerator.device)  # the eval set is not in the encoder cache
        self.model.eval()
        loss_sum, tokens, pairs = 0.0, 0, []
        mine = self.eval_examples[self.rank::self.world]
        for chunk in tqdm(list(batched(mine, self.cfg.eval_batch_size)), desc="eval", leave=False,
                          disable=not (self.main and self._tty())):
            batch = self.to_device(self.collator(chunk))
            with self.accelerator.autocast():
                loss_sum += float(token_loss_sum(self.model, self.core, batch, multiple=self.shape_multiple))
                generated = self.core.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                               max_new_tokens=self.cfg.max_target_len, num_beams=self.cfg.num_beams,
                                               cache=generation_cache())
            tokens += int(batch["labels"].ne(-100).sum())
            predictions = self.tokenizer.batch_decode(generated, skip_special_tokens=True)
            pairs.extend(zip(predictions, [e.response for e in chunk]))
            del batch, generated
        totals = torch.tensor([loss_sum, tokens], dtype=torch.float64, device=self.accelerator.device)
        if self.world > 1:
            totals = self.accelerator.reduce(totals, "sum")
            pairs = gather_object(pairs)
        self._set_train_mode()
        if offloaded:
            self._move_encoder("cpu")
        free_memory()  # after evaluation: the heap generation's growing cache left goes back to the OS
        result = {"eval_loss": round(totals[0].item() / max(totals[1].item(), 1), 5),
                  "bleu": round(bleu_score([p for p, _ in pairs], [r for _, r in pairs]), 4),
                  "eval_examples": len(pairs), "eval_s": round(time.time() - start, 2)}
        self.log_memory("eval_end")
        return result

    def evaluate_and_keep_best(self) -> dict:
        result = self.evaluate()
        metric = result[self.cfg.metric_for_best]
        improved = is_better(metric, self.state.best_metric, self.cfg.metric_for_best)
        if improved and not all(bool(torch.isfinite(p).all()) for p in self.core.parameters()):
            improved = False  # never export non-finite weights as best
            self.say("the weights hold non-finite values: not saved as best")
        if improved:
            self.state.best_metric, self.state.best_step = metric, self.state.step
            self.export(self.out / "best")
        self.state.last_eval = {"step": self.state.step, "eval_loss": result["eval_loss"], "bleu": result["bleu"]}
        self.record("eval", **result, best=improved)
        self.say(f"eval step {self.state.step} | eval_loss {result['eval_loss']:.4f} | bleu {result['bleu']:.2f}"
                 + (" | new best" if improved else ""))
        return result

    # ------------------------------------------------------------------ checkpoints and exports
    def export(self, folder: Path) -> None:
        self.accelerator.wait_for_everyone()
        if self.main:
            # One dtype and no adapters: on the CPU bf16-stored weights turn float32 in place; from a
            # GPU every tensor is copied to the host as float32 (nothing new on the GPU).
            on_gpu = self.accelerator.device.type == "cuda"
            with contextlib.nullcontext() if on_gpu else weights_in_float32(self.core):
                plain = export_state_dict(self.core, to_host=on_gpu)
                self.folder.export(folder, self.core, self.tokenizer, {"kind": self.cfg.kind, **self.state_now()},
                                   state_dict=plain, tokenizer_source=self.tokenizer_dir)
                del plain
            # The export's new host tensors (LoRA's merged matrices, a GPU model's float32 copies) come
            # from the C heap, which keeps them resident once freed: trimmed, an export in mid-run does
            # not raise the RSS of the steps after it.
            free_memory()
        self.accelerator.wait_for_everyone()

    def save_checkpoint(self) -> Path:
        """Model, optimizer, scheduler, counters, and every process's RNG, data position and log offsets.

        Once per step: a stop right after a save step, or the end of a run resumed from its final
        checkpoint, finds the step's checkpoint written (and its record logged) already.
        """
        from accelerate.utils import gather_object

        folder = self.folder.checkpoint_path(self.state.step)
        if self.saved_step == self.state.step:
            return folder
        trainer_state = self.state_now()
        # The checkpoint's own record goes into the log after it is written, and with it into the
        # checkpoint, so a resume from it writes that line again where it was cut back to.
        record = MetricsLog.line("checkpoint", self.state.step, path=str(folder))
        process_states = gather_object([self._process_state(record)])  # small: RNG + data position per rank
        if self.main:
            self.folder.write_checkpoint(self.state.step, self.core, self.optimizer, self.scheduler,
                                         trainer_state, self.run_config, process_states,
                                         keep=self.cfg.save_total_limit)
            self.metrics.write_line(record)
        self.accelerator.wait_for_everyone()
        self.saved_step = self.state.step
        return folder

    def _process_state(self, checkpoint_record: str) -> dict:
        offsets = {}  # logs are cut back to these on resume, so they match an uninterrupted run
        if self.consumed is not None:
            offsets["consumed"] = self.consumed.tell(sync=True)
        if self.metrics is not None:
            offsets["metrics"] = self.metrics.tell()
        interval = {k: float(v) if k == "loss" else v for k, v in self.interval.items()
                    if k in ("loss", "tokens", "steps")}
        return {"rank": self.rank, "world_size": self.world, "rng": checkpoint.rng_state(),
                "data": self.stream.state_dict(), "log_offsets": offsets, "interval": interval,
                "checkpoint_record": checkpoint_record if self.metrics is not None else None}

    def load_checkpoint(self, folder: Path) -> None:
        """Restore weights, optimizer, scheduler, counters, RNG and this process's data position."""
        trainer_state, process_state = self.folder.read_checkpoint(
            folder, self.core, self.optimizer, self.scheduler, self.run_config, self.rank, self.world, self.say)
        resume_schedule(self.optimizer, self.scheduler, self.cfg.learn_rate, self.cfg.weight_decay)
        self.state.load_state_dict(trainer_state)
        self.saved_step = self.state.step
        self.stream.load_state_dict(process_state["data"])
        checkpoint.set_rng_state(process_state["rng"])
        offsets = process_state["log_offsets"]  # drop log lines of steps after the checkpoint
        if self.consumed is not None:
            self.consumed.truncate(offsets.get("consumed", 0))
        if self.metrics is not None and "metrics" in offsets:
            self.metrics.truncate(offsets["metrics"])
            if process_state.get("checkpoint_record"):  # (checkpoints of older versions lack it)
                self.metrics.write_line(process_state["checkpoint_record"])
        # The steps since the last log line, so the next logged loss averages the same steps.
        self.resumed_interval = process_state["interval"]
        self.say(f"resumed from {folder} at step {self.state.step} (epoch {self.state.epoch})")
        self.record("resume", path=str(folder))

    def _run_config(self) -> dict:
        """The options plus what identifies the tokenizer (checked on resume)."""
        return {**self.cfg.to_dict(), "tokenizer_size": len(self.tokenizer),
                "tokenizer_sha1": tokenizer_sha1(self.tokenizer), "held_out_rows": self.held_out_rows}

    # ------------------------------------------------------------------ logging
    def mean_step_seconds(self) -> float | None:
        """Seconds per optimizer step of this invocation's training: data, forward, backward and
        optimizer; evaluation, saving, setup and the encoder cache's build left out."""
        return round(self.timed["seconds"] / self.timed["steps"], 4) if self.timed["steps"] else None

    def state_now(self) -> dict:
        """The counters with the time trained so far. ``self.state.elapsed_s`` stays the time before
        this process started, which ``elapsed()`` adds to (storing the sum there at each checkpoint
        counted the same seconds again at the next one)."""
        return {**self.state.state_dict(), "elapsed_s": round(self.elapsed(), 2)}

    def elapsed(self) -> float:
        return self.state.elapsed_s + time.time() - self.start_time if hasattr(self, "start_time") else 0.0

    def record(self, event: str, **fields) -> None:
        if self.metrics is not None:
            self.metrics.write(event, self.state.step, **fields)
            scalars = tracker_scalars(event, fields)  # --report_to: the numbers `plot` draws
            if scalars:
                self.accelerator.log(scalars, step=self.state.step)

    def log_memory(self, where: str, **extra) -> None:
        snap = memory_snapshot()
        self.record("memory", where=where, **snap, **extra)

    def warn(self, message: str) -> None:
        """A message from any process (prefixed with its rank when there are several)."""
        prefix = f"[rank {self.rank}] " if getattr(self, "world", 1) > 1 else ""
        tqdm.write(prefix + message, file=sys.stdout)
        sys.stdout.flush()

    def say(self, message: str) -> None:
        if getattr(self, "main", True):
            tqdm.write(message, file=sys.stdout)
            sys.stdout.flush()

    @staticmethod
    def _tty() -> bool:
        return sys.stderr.isatty()

    def close(self) -> None:
        thaw_long_lived()
        if getattr(self, "folder", None) is not None:
            self.folder.release_lock()
        for log in (self.metrics, self.consumed):
            if log is not None:
                log.close()
        self.metrics = self.consumed = None
        if getattr(self, "encoder_cache", None) is not None:
            self.encoder_cache.close()
            self.encoder_cache = None
        if getattr(self, "accelerator", None) is not None:
            # Tear the process group down before interpreter exit: gloo threads left to static
            # destructors can abort a finished process ("terminate called without an active exception").
            self.accelerator.end_training()
            self.accelerator = None
