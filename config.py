"""Typed run configuration for t5-lowmem.

Resolution order: dataclass defaults -> optional YAML file (``--config=FILE.yaml``) -> CLI flags ->
a --memory_profile's flags -> run-dependent defaults (output folders, shipped data) -> low-memory caps
(``lowmem.memory.profiles``) -> one validation pass that collects every problem (``TrainConfig.problems``,
and the objective's own from its class in ``data.objectives``) and raises a single ``UserError``. Reading
the YAML file and the flags, that pass and the ``--help`` listing live in ``lowmem.cli.flags`` (``load_config``).

Each field's ``help`` says what it does and, where it matters, which way saves memory; its roles
(``lowmem.utils.flag_roles``) say what else the flag does, and every list of flags comes from them (``flags_with``).
Runtime state (step, examples seen, ...) never lives here: see ``lowmem.training.state.TrainState``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from lowmem.utils.eval_metrics import DEFAULT_METRICS, metric_problems
from lowmem.utils.flag_roles import COMMANDS, RUN_COMMANDS, TOKENIZER_TOO, names_with
from lowmem.utils.flag_roles import option as _f  # a field that the commands building a run read
from lowmem.utils.flag_roles import training_option as _t  # a field that only training reads
from lowmem.utils.frozen_forms import FROZEN_FORMS
from lowmem.utils.memory_modes import memory_mode_problems
from lowmem.utils.precision_names import PRECISION_DTYPES, precision_choices
from lowmem.utils.presets import AUTO, FEED_FORWARD_WIDTHS, MEMORY_PROFILES, MODEL_PRESETS

REPO_DIR = Path(__file__).resolve().parent
SHIPPED_DATA_DIR = REPO_DIR / "data"
SHIPPED_TOKENIZER_DIR = SHIPPED_DATA_DIR / "tokenizer"
SHIPPED_CORPORA = {
    # (train, eval) for pretraining and for SFT; built by data/build_shipped_data.py.
    "pretrain": (SHIPPED_DATA_DIR / "pinyin" / "train.jsonl", SHIPPED_DATA_DIR / "pinyin" / "eval.jsonl"),
    "sft": (SHIPPED_DATA_DIR / "chatterbot" / "train.jsonl", SHIPPED_DATA_DIR / "chatterbot" / "eval.jsonl"),
}


FROZEN_DTYPES = tuple(FROZEN_FORMS)  # --frozen_dtype's choices (lowmem.utils.frozen_forms)


@dataclass
class TrainConfig:
    """Every option of every command, with its roles. Field order is the order of ``--help``."""

    is_finetune: bool = _f(False, "SFT: start from --init_from and train on prompt/response pairs with "
                                  "--freeze=encoder (the encoder and shared embedding fixed; the decoder and an untied "
                                  "lm_head train).", reads=(*RUN_COMMANDS, "plot"), resume="shape",
                                  section="run mode and paths")
    is_keep_training: bool = _t(False, "Resume from the latest valid checkpoint in --output_dir.", resume="run")
    resume_from: str | None = _t(None, "Resume from this checkpoint folder instead of the latest one (newer "
                                       "checkpoints move, kept, into checkpoints/abandoned-<time>/).", resume="run",
                                       path=True)
    output_dir: str | None = _f(None, "Run folder. Default: runs/pretrain, or runs/sft with --is_finetune.",
                                      reads=(*RUN_COMMANDS, "plot"), path=True)
    overwrite_output_dir: bool = _t(False, "Start over in an --output_dir that already holds a run (deletes it).",
                                           resume="run")
    peer_timeout_s: float = _t(30.0, "Launched processes: one silent this long (a lost or hung machine) stops every "
                                     "other with one line and exit code 4 (0 = off: they wait in the collective).",
                                     resume="run")
    init_from: str | None = _f(None, "Model to start from: a folder (a run's best/ or final/, a downloaded T5, "
                                     "flan-t5, t5-v1_1, mT5, umT5 or ByT5) or a hub id such as google/flan-t5-small "
                                     "(the Hugging Face cache first, then the hub). Without --is_finetune: continued "
                                     "pretraining. Default for SFT: runs/pretrain/best.",
                                     reads=(*RUN_COMMANDS, "export"), path=True)
    tokenizer_dir: str | None = _f(None, "Tokenizer folder. Default: the --init_from model's own (tokenizer.json, "
                                         "spiece.model or ByT5's), else the shipped data/tokenizer (trained from "
                                         "--train_file into a new or empty folder if missing).",
                                         reads=(*RUN_COMMANDS, "train_tokenizer", "export"), path=True)
    freeze: str = _t("auto", "What stays fixed: encoder (the encoder, the shared embedding and a tied output layer; "
                             "auto's choice with --is_finetune), embeddings (the shared embedding, a tied output), "
                             "none (full fine-tuning; auto's choice otherwise). An untied lm_head always trains. More "
                             "frozen saves gradient and optimizer memory.", resume="shape")
    seed: int = _f(42, "Seed for model init, shuffling and dropout.", resume="fixed", trained_with=True)
    train_file: str | None = _f(None, "Training file, glob or folder (jsonl/json/parquet/csv, txt: raw text), or a HF "
                                      "dataset: a save_to_disk folder or a hub id (streamed). Default: shipped.",
                                      reads=TOKENIZER_TOO, path=True, section="data")
    dataset_config: str | None = _f(None, "Configuration of a hub dataset --train_file (allenai/c4: en).",
                                          reads=TOKENIZER_TOO)
    eval_file: str | None = _f(None, "Eval file, glob or folder. Default: the shipped eval split with the shipped "
                                     "training data; with your own --train_file, its last --max_eval_samples rows (10% "
                                     "of them at most), held out of training.", path=True, scores="eval")
    prompt_column: str = _f("prompt", "Column holding the model input.", reads=TOKENIZER_TOO, trained_with=True)
    response_column: str = _f("response", "Column holding the target text.", reads=TOKENIZER_TOO, trained_with=True)
    objective: str = _f("pairs", "What the model learns: one of the objectives of data/objectives/, listed below "
                                 "(those reading raw text take --text_column, and .txt files).", reads=TOKENIZER_TOO,
                                 resume="fixed", trained_with=True)
    text_column: str = _f("text", "Column holding the raw text for --objective=span_corruption / prefix_lm.",
                                  reads=TOKENIZER_TOO, trained_with=True)
    noise_density: float = _f(0.15, "span_corruption: share of a chunk's tokens masked (T5: 0.15).", trained_with=True)
    mean_noise_span_length: float = _f(3.0, "span_corruption: mean length of a masked span (T5: 3).", trained_with=True)
    max_source_len: int = _f(128, "Truncate inputs to this many tokens. Lower saves activation memory.",
                                  trained_with=True, scores="eval")
    max_target_len: int = _f(128, "Truncate targets to this many tokens. Lower saves activation and logits memory.",
                                  trained_with=True, planned_for=True, scores="eval")
    shuffle_buffer_size: int = _f(1000, "Rows held to shuffle (0: no shuffle). Lower saves host RAM.", resume="fixed")
    shuffle_buffer_mb: int = _f(64, "Most text the shuffle buffer holds, in MiB (0: no bound), whatever its rows: long "
                                    "rows shuffle among fewer. Bounds its host RAM and the checkpoints' size.",
                                    resume="fixed", before=0)
    num_workers: int = _f(0, "Loader worker processes. Only 0: the data position must live in the trainer.")
    pin_memory: bool = _f(False, "Pin batches in page-locked host memory before a CUDA copy. False saves host RAM.")
    chosen_column: str = _f("chosen", "Preference objectives (dpo, orpo, simpo): column holding the preferred answer.",
                                      reads=TOKENIZER_TOO, trained_with=True, section="preference tuning")
    rejected_column: str = _f("rejected", "Preference objectives: column holding the dispreferred answer.",
                                          reads=TOKENIZER_TOO, trained_with=True)
    beta: float = _t(0.0, "dpo / simpo: β, how far the policy may move for a preference (0: the objective's own, dpo "
                          "0.1, simpo 2.0).")
    label_smoothing: float = _t(0.0, "dpo / simpo: share of pairs taken as mislabelled (conservative DPO; 0: none).")
    dpo_loss: str = _t("sigmoid", "dpo: sigmoid (the DPO paper's loss) or ipo (IPO's squared loss).")
    rpo_alpha: float = _t(0.0, "dpo: weight α of the chosen answers' token-mean NLL beside the DPO loss (RPO, Pang "
                               "et al. 2024; 0: plain DPO).")
    orpo_lambda: float = _t(0.1, "orpo: weight λ of the odds-ratio term beside the chosen answer's NLL.")
    simpo_gamma: float = _t(0.5, "simpo: target margin γ between the chosen and rejected rewards.")
    reference: str = _t("auto", "dpo: the reference policy: copy, adapter, cached or auto. copy: a frozen copy of the "
                                "starting model (in --frozen_dtype); adapter (--lora_r): the model with its adapter "
                                "off, no copy; cached: a pre-pass stores every pair's reference log-probs in "
                                "OUTPUT_DIR/reference, and training holds no reference (least memory); auto: adapter "
                                "with --lora_r, else copy.",
                                resume="fixed", before="auto")
    model_preset: str = _f("tiny", "Model shape: tiny (3M parameters, CPU demos), small (T5-small shape: 52M), base "
                                   "(the reference's shape: 178M), t5-v1_1-base (T5 v1.1 base's: 12 + 12 layers, "
                                   "recipes/nanot5.yaml), with the tokenizer's vocabulary. Smaller saves memory.",
                                   resume="preset", section="model")
    feed_forward_proj: str = _f("gated-gelu", "Feed-forward of a --model_preset model: gated-gelu (T5 v1.1, flan-t5, "
                                              "mT5) or relu (the original T5); the same weights either way. "
                                              "gated-gelu's smooth gradients make runs reproducible to float error.",
                                              resume="preset", before="relu")
    tie_word_embeddings: bool = _f(False, "A preset's output layer: False, an lm_head of its own (T5 v1.1, flan-t5), "
                                          "which SFT trains; True, the shared embedding (original T5; saves memory).",
                                          resume="preset", before=True)
    dropout_rate: float = _t(0.1, "Dropout inside the T5 blocks.")
    batch_size: int | str = _f(2, "Training micro-batch per process, used as asked when the planner predicts it fits "
                                  "the memory budget (--max_rss_gb, else the available RAM or the GPU's memory), else "
                                  "lowered (more accumulation: the same batch per step). auto: the largest that fits. "
                                  "Larger is faster on short rows; lower saves activation memory.",
                                  section="batch and optimisation")
    eval_batch_size: int | str = _f(4, "Eval and generation batch, under the same budget (auto too). Larger is faster; "
                                       "lower saves memory.", planned_for=True)
    gradient_accumulation_steps: int = _t(16, "Micro-batches per optimizer step. Higher: same batch, less memory.")
    effective_batch_size: int = _t(0, "Examples per optimizer step on all processes (0: --batch_size x accumulation x "
                                      "processes); accumulation follows the micro-batch: the same maths.")
    max_tokens_per_batch: int = _f(0, "Micro-batches of up to this many padded tokens (source + target) instead of "
                                      "rows (0: off; a longer row alone), within each optimizer step's rows.")
    packing: bool = _f(False, "pairs, prefix_lm: pack each step's examples several to a row (segment masks, exact); "
                              "--batch_size and --max_tokens_per_batch then count packed rows. Less padding.")
    epochs: int = _t(1, "Passes over the training data.")
    max_steps: int = _t(-1, "Stop after this many optimizer steps (-1 = run all --epochs).")
    learn_rate: float = _t(3e-3, "Peak learning rate (Adafactor, applied as given).")
    lr_scheduler: str = _t("linear", "Decay after warmup: linear, cosine or constant.")
    warmup_steps: int = _t(30, "Optimizer steps of linear warmup.")
    weight_decay: float = _t(0.0, "Decoupled weight decay of the weight matrices (layer norms and biases exempt).")
    max_grad_norm: float = _t(1.0, "Clip the gradient norm to this (0 = no clipping).")
    max_nonfinite_steps: int = _t(5, "Optimizer steps with a non-finite loss or gradient are skipped and counted; "
                                     "abort after this many in a row.")
    max_rss_gb: float = _f(0.0, "Memory guard (0 = off): a process whose RSS reaches 90% of this many GiB (2^30 bytes, "
                                "like plan's --budget_gb) stops the run with exit code 3 instead of meeting the OOM "
                                "killer. The step in progress is dropped and the last step's checkpoint written; the "
                                "RSS is read before every optimizer step and after every micro-batch's backward (peaks "
                                "in between included).")
    mixed_precision: str = _f("no", "no, bf16 or fp16 (on a GPU bf16 keeps 0.67-0.79 of float32's activation memory; "
                                    "fp16, with a loss scaler, for GPUs without bf16: T4, V100).")
    loss_chunk_size: int | str = _f(AUTO, "Target tokens per chunk of the LM head + loss (auto: logits of at most 128 "
                                          "MiB per chunk; 0: all logits at once).")
    cpu: bool = _f(False, "Train on the CPU even when a GPU is present.")
    torch_compile: bool = _f(False, "Compile the encoder and decoder stacks for training (torch.compile; lengths "
                                    "padded to buckets 16, 32, 64, ...: one compile per bucket). See throughput.md.")
    torch_compile_backend: str = _f("inductor", "torch.compile's backend with --torch_compile=True (inductor; "
                                                "aot_eager: no code generation, for checking a setup quickly).")
    memory_profile: str | None = _f(None, "A named set of the flags below for a budget: "
                                          + ", ".join(MEMORY_PROFILES) + ". Explicit flags win over it.",
                                          section="memory modes")
    gradient_checkpointing: bool = _t(False, "Recompute each block's activations in backward. True saves most "
                                             "activation memory for more step time (each block's forward runs twice).")
    optimizer: str = _t("adafactor", "adafactor (factored second moments: the smallest state), adamw (2 x weights of "
                                     "state), adamw8bit (bitsandbytes, pip install .[gpu]: 1/4 of adamw) or "
                                     "adamw_scale (nanoT5's AdamW, steps scaled by each weight's RMS; adamw's state).",
                                     resume="shape")
    lora_r: int = _t(0, "LoRA rank (0 = off; peft, pip install .[gpu]). Only adapters get gradients and optimizer "
                        "state; best/ and final/ are merged plain models. Nonzero saves memory.", resume="shape")
    lora_alpha: float = _t(16.0, "LoRA scaling numerator (scale = alpha / r).", resume="shape")
    lora_dropout: float = _t(0.05, "Dropout on the LoRA input.")
    lora_target_modules: str = _t("q,v", "Comma list of T5 linear layers that get adapters: q, k, v, o (attention), "
                                         "wi, wo (feed-forward; on gated models wi means wi_0 and wi_1, each also "
                                         "nameable). Only the layers --freeze leaves trainable: with --freeze=encoder "
                                         "the decoder's.", resume="shape")
    encoder_cache: str = _t("off", "SFT only: compute the frozen encoder's outputs once per example and train the "
                                   "decoder from them. off, disk (OUTPUT_DIR/encoder_cache), memory (the same file "
                                   "read into RAM) or auto (memory when small). Saves the encoder's compute (the more, "
                                   "the longer the prompts), activations and, on a GPU, its weights.")
    encoder_cache_dtype: str = _t("float32", "Storage of the encoder cache: float32 (the compute dtype: training "
                                             "matches the uncached run), bfloat16 or float16 (half the disk and RAM).")
    frozen_dtype: str = _t("float32", "SFT: storage of the frozen weight matrices (shared embedding and encoder; with "
                                      "LoRA the base decoder too). bfloat16 (needs --mixed_precision=bf16) halves "
                                      "their memory; int8 or float8 (pip install '.[quant]') store the frozen linear "
                                      "layers in 8 bits, a quarter, the other frozen matrices (wo, embeddings) in "
                                      "bfloat16. Read into this form a block at a time; exports are float32.",
                                      resume="shape")
    quantize_wo: bool = _t(False, "With --frozen_dtype=int8|float8: quantize the feed-forward output layers (wo) too. "
                                  "Saves memory; T5's wo loses accuracy in 8 bits, so it stays as loaded by default.",
                                  resume="shape")
    merge_lora: bool = _f(False, "With --lora_r: export whole merged float32 models (11 GB at flan-t5-xl) instead of "
                                 "peft adapter folders (a few MB, loaded onto --init_from's model).")
    eval_steps: int = _t(100, "Evaluate at step 0, every N optimizer steps and at the end (0 = only at the end).",
                              section="evaluation, logging, checkpoints")
    max_eval_samples: int = _f(100, "Examples used per evaluation. Lower saves time.", planned_for=True, scores="eval")
    eval_metrics: str = _f(DEFAULT_METRICS, "Comma list of scores of generated answers (0-100, higher wins): bleu, "
                                            "chrf, rouge (logs rouge1, rouge2, rougeL, rougeLsum), exact_match.")
    metric_for_best: str = _t("eval_loss", "What picks best/: eval_loss (lower wins) or any value of --eval_metrics.",
                                           resume="fixed", planned_for=True)
    eval_generate: bool | str = _f(AUTO, "Generate answers at evaluations for --eval_metrics: True (every one, step 0 "
                                         "too), False (eval loss only, much faster) or auto (within --eval_budget_s).",
                                         planned_for=True)
    eval_generate_samples: int | str = _f(AUTO, "Eval rows generated for the scores (the first; the eval loss all). "
                                                "auto: all, or as many as fit --eval_budget_s. Lower saves time.",
                                                planned_for=True)
    eval_budget_s: float = _t(300.0, "Most seconds an evaluation should take (0: no bound), timed at start; over it "
                                     "the auto values run step 0's eval loss only and generate fewer rows (or none).",
                                     planned_for=True)
    num_beams: int = _f(1, "Beams for evaluation and generate. 1 (greedy) saves memory.", planned_for=True,
                           scores="answers")
    logging_steps: int = _t(10, "Log a line and a metrics.jsonl record every N optimizer steps.")
    save_steps: int = _t(100, "Write a resumable checkpoint every N optimizer steps (0 = only at the end).")
    save_total_limit: int = _t(2, "Checkpoints kept in output_dir/checkpoints (best/ and final/ are extra).")
    gc_every_steps: int = _t(100, "Run gc.collect() and malloc_trim (+ CUDA cache clearing) every N optimizer steps.")
    report_to: str = _t("none", "Also send the train/eval scalars of metrics.jsonl to trackers: none or a comma list "
                                "of tensorboard, wandb, mlflow, trackio. Each is pip install '.[NAME]'; their own "
                                "environment settings apply; a resume continues their runs; see docs/monitoring.md.")
    vocab_size: int = _f(8000, "Tokenizer vocabulary size before the 100 sentinels (train_tokenizer). A corpus with "
                               "fewer distinct pieces gets fewer, and the output says so.", reads=TOKENIZER_TOO,
                               section="tokenizer training")
    tokenizer_max_sentences: int = _f(200_000, "Cap on texts sampled for tokenizer training (from every file by its "
                                               "size; long texts in slices). Bounds its RAM.", reads=TOKENIZER_TOO)
    prompt: str | None = _f(None, "Text to answer (generate). Without it, generate answers a few eval prompts.",
                                  reads=("generate",), section="generate")
    max_new_tokens: int = _f(64, "Longest generated answer (evaluation's go to --max_target_len).", reads=("generate",))
    no_repeat_ngram_size: int = _f(0, "No n-gram of this size appears twice in an answer (0: off), against degenerate "
                                      "repetition; in generate and in the answers evaluation scores.", scores="answers",
                                      answers_only=True)
    repetition_penalty: float = _f(1.0, "Divide the score of tokens already in the answer by this (1.0: off; 1.2 is a "
                                        "common choice); in generate and in the answers evaluation scores.",
                                        scores="answers", answers_only=True)
    max_bad_rows_fraction: float = _f(0.01, "Abort when more than this fraction of the training rows are bad "
                                            "(malformed, missing or empty prompt/response); they are skipped and "
                                            "counted otherwise.", section="checks and debugging")
    dump_consumed: bool = _t(False, "Append every consumed training example (epoch, rank, file, row) to "
                                    "OUTPUT_DIR/consumed-rank{R}.tsv; kept exact across kills and resumes.")
    debug: bool = _f(False, "Show full tracebacks instead of one-line errors.", reads=COMMANDS, resume="run")

    # ---------------------------------------------------------------- resolution
    @property
    def kind(self) -> str:
        return "sft" if self.is_finetune else "pretrain"

    def resolve_defaults(self) -> None:
        """Fill the run-dependent defaults (folders and shipped data) in place."""
        train_default, eval_default = SHIPPED_CORPORA[self.kind]
        if self.output_dir is None:
            self.output_dir = str(Path("runs") / self.kind)
        if self.train_file is None:
            self.train_file = str(train_default)
            # The shipped eval split goes with the shipped training data only: with your own
            # --train_file and no --eval_file, eval_file stays None and the run holds out its last rows.
            if self.eval_file is None:
                self.eval_file = str(eval_default)
        if self.is_finetune and self.init_from is None:
            self.init_from = str(Path("runs") / "pretrain" / "best")
        if self.tokenizer_dir is None and self.init_from is None:
            # With --init_from it stays None: the model's own tokenizer (lowmem.model.source.tokenizer_folder).
            self.tokenizer_dir = str(SHIPPED_TOKENIZER_DIR)
        if self.freeze == "auto":
            self.freeze = "encoder" if self.is_finetune else "none"

    def problems(self) -> list[str]:
        """Every problem of the flags, one line each (the validation pass: ``lowmem.cli.flags.load_config`` adds
        the objective's own, ``data.objectives.base.objective_problems``, and raises one ``UserError``)."""
        problems = [f"--{f.name} must be a finite number (got {getattr(self, f.name)})"
                    for f in dataclasses.fields(self)
                    if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name))]
        for name in ("batch_size", "eval_batch_size", "eval_generate_samples"):
            value = getattr(self, name)
            if value != AUTO and (not isinstance(value, int) or value < 1):
                problems.append(f"--{name} must be at least 1 or auto (got {value!r})")
        positive = ["gradient_accumulation_steps", "max_source_len", "max_target_len", "epochs", "max_eval_samples",
                    "logging_steps", "save_total_limit", "gc_every_steps", "num_beams", "max_new_tokens", "vocab_size",
                    "tokenizer_max_sentences", "max_nonfinite_steps"]
        for name in positive:
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be at least 1 (got {getattr(self, name)})")
        for name in ["effective_batch_size", "max_tokens_per_batch", "shuffle_buffer_size", "shuffle_buffer_mb",
                     "eval_steps", "save_steps", "warmup_steps", "weight_decay", "max_grad_norm", "max_rss_gb",
                     "eval_budget_s", "peer_timeout_s", "no_repeat_ngram_size", "lora_r"]:
            if getattr(self, name) < 0:
                problems.append(f"--{name} must not be negative (got {getattr(self, name)})")
        if not 0 <= self.max_bad_rows_fraction <= 1:
            problems.append(f"--max_bad_rows_fraction must be in [0, 1] (got {self.max_bad_rows_fraction})")
        if self.learn_rate <= 0:
            problems.append(f"--learn_rate must be positive (got {self.learn_rate})")
        if self.repetition_penalty <= 0:
            problems.append(f"--repetition_penalty must be positive (got {self.repetition_penalty})")
        if not 0 <= self.dropout_rate < 1:
            problems.append(f"--dropout_rate must be in [0, 1) (got {self.dropout_rate})")
        if not 0 <= self.seed < 2**32:
            problems.append(f"--seed must be in [0, 2**32) (got {self.seed})")
        if self.max_steps == 0 or self.max_steps < -1:
            problems.append(f"--max_steps must be -1 (use --epochs) or at least 1 (got {self.max_steps})")
        if self.model_preset not in MODEL_PRESETS:
            problems.append(f"--model_preset must be one of {', '.join(MODEL_PRESETS)} (got {self.model_preset!r})")
        if self.feed_forward_proj not in FEED_FORWARD_WIDTHS:
            problems.append(f"--feed_forward_proj must be one of {', '.join(FEED_FORWARD_WIDTHS)} "
                            f"(got {self.feed_forward_proj!r})")
        if self.loss_chunk_size != AUTO and not (isinstance(self.loss_chunk_size, int) and self.loss_chunk_size >= 0):
            problems.append(f"--loss_chunk_size must be auto, 0 or a number of tokens (got {self.loss_chunk_size!r})")
        if self.mixed_precision not in PRECISION_DTYPES:
            problems.append(f"--mixed_precision must be {precision_choices()} (got {self.mixed_precision!r})")
        if self.lr_scheduler not in ("linear", "cosine", "constant"):
            problems.append(f"--lr_scheduler must be linear, cosine or constant (got {self.lr_scheduler!r})")
        problems += metric_problems(self.eval_metrics, self.metric_for_best, self.eval_generate)
        if self.num_workers != 0:
            problems.append("--num_workers must be 0: the data position (and shuffle buffer) is saved from the "
                            "trainer process for exact resume; tokenization is batched in that process")
        if self.dataset_config is not None and not self.dataset_config.strip():
            problems.append("--dataset_config is empty: name a configuration of the dataset, or leave it out")
        if self.prompt_column == self.response_column:
            problems.append("--prompt_column and --response_column must differ")
        if self.resume_from and not self.is_keep_training:
            problems.append("--resume_from needs --is_keep_training=True")
        names = [n.strip() for n in self.report_to.split(",")]  # (which trackers exist: lowmem.monitoring.trackers)
        if not all(names) or len(set(names)) < len(names) or "none" in names and len(names) > 1:
            problems.append(f"--report_to takes none or a comma list of trackers, each once (got {self.report_to!r})")
        return problems + memory_mode_problems(self)

    @property
    def gpu_profile(self) -> bool:
        """Whether --memory_profile names one of the GPU profiles (all but the CPU's, host16g)."""
        return bool(self.memory_profile) and not MEMORY_PROFILES[self.memory_profile].get("cpu")

    @property
    def frozen_encoder(self) -> bool:
        """Whether the encoder stays fixed (it then runs under no_grad in eval mode, and may be cached)."""
        return self.freeze == "encoder"

    def extras_used(self) -> list[tuple[str, str]]:
        """(module, the flag that needs it) for each package of '.[gpu]' this run imports (peft first: it is imported
        with bitsandbytes hidden, ``lowmem.utils.optional.import_extras``)."""
        return [(module, flag) for module, flag, used in (("peft", "--lora_r", self.lora_r > 0), (
            "bitsandbytes", "--optimizer=adamw8bit", self.optimizer == "adamw8bit")) if used]

    def optional_modules(self) -> list[tuple[str, str]]:
        """``extras_used``, and the frozen form's package (optimum.quanto for 8-bit frozen weights)."""
        frozen = FROZEN_FORMS[self.frozen_dtype].module
        return self.extras_used() + ([(frozen, "--frozen_dtype")] if frozen else [])

    @property
    def lora_targets(self) -> list[str]:
        return [t.strip() for t in str(self.lora_target_modules).split(",") if t.strip()]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def flags_with(role: str, *values) -> tuple[str, ...]:
    """The flags that have ``role`` (``lowmem.utils.flag_roles``), or whose ``role`` is one of ``values``."""
    return names_with(dataclasses.fields(TrainConfig), role, *values)
