"""t5-lowmem command line (python-fire). Every option is a flag; ``--help`` lists them all, ``COMMAND --help`` the
options of one command with its examples (the lines below that run it).

    python train_low_mem.py train                                   # pretrain on the shipped data
    python train_low_mem.py train --is_finetune=True                # SFT from runs/pretrain/best
    python train_low_mem.py train --is_keep_training=True           # resume the latest checkpoint
    accelerate launch --multi_gpu train_low_mem.py train --is_finetune=True
    python train_low_mem.py plan --budget_gb=12 --device=gpu       # predicted peak memory, modes that fit
    python train_low_mem.py evaluate --init_from=runs/sft/best --is_finetune=True
    python train_low_mem.py generate --init_from=runs/sft/best --prompt="What is AI?"
    python train_low_mem.py plot --output_dir=runs/pretrain         # PNG charts in runs/pretrain/plots
    python train_low_mem.py train_tokenizer --train_file=corpus.jsonl --tokenizer_dir=my_tokenizer
    python train_low_mem.py prepare --train_file=corpus.jsonl --prepared_dir=corpus.prepared  # tokenize once
    python train_low_mem.py preview --num_examples=3 --decode=True  # the first training examples as the model sees them
    python train_low_mem.py export --init_from=runs/sft/final --export_dir=merged --dtype=bfloat16  # one model folder
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def _interrupted_while_starting(_signum, _frame) -> None:
    """Ctrl-C before a command begins (lowmem.cli.runner.run_cli hands SIGINT back to Python there): nothing is written
    yet, so leave at once with one line. Raised as KeyboardInterrupt inside an import, it could leave a module half
    made, whose use at exit printed a traceback of its own."""
    os.write(2, b"error: interrupted (Ctrl-C)\n")
    os._exit(130)


# Run as a script only (an importer's Ctrl-C stays theirs), and where Ctrl-C is Python's (a background job's
# ignored SIGINT stays ignored)
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)

# The Hugging Face environment (HF_HUB_OFFLINE, HF_HOME, HF_TOKEN) is the user's: a hub id given to
# --init_from resolves through the cache, then the hub when online, exactly as from_pretrained does.
if not sys.stderr.isatty():  # progress bars (weights written, files fetched) only where someone watches
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from config import SHIPPED_CORPORA, SHIPPED_TOKENIZER_DIR  # noqa: E402
from lowmem.cli.flags import (  # noqa: E402
    load_config,
    load_saved_model_config,
    to_bool,
    unread_flag_notes,
    unused_answer_notes,
)
from lowmem.cli.runner import die_with_launcher, print_error, run_cli  # noqa: E402
from lowmem.memory.collector import imports_done  # noqa: E402
from lowmem.model.source import (  # noqa: E402
    check_weights,
    model_folder_config,
    refuse_untrained,
    tokenizer_for_model,
)
from lowmem.utils.errors import UserError  # noqa: E402


def train(config: str | None = None, **flags) -> dict:
    """Pretrain (default) or fine-tune (--is_finetune=True); resume with --is_keep_training=True."""
    from lowmem.runs.run_start import settle_watch, watch_peers

    die_with_launcher()
    watch = watch_peers(flags)  # several launched processes: a lost one, or one's mistake, stops them all
    cfg, notes = load_config(flags, config)
    cfg, restarted = settle_watch(cfg, watch)  # an elastic restart continues its run
    notes += restarted + unread_flag_notes("train", flags) + unused_answer_notes(cfg, flags)
    files, tokenizer_dir, tokenizer = claim_output_dir(cfg)  # before the heavy imports below: refusals come at
    # once, and a run killed this early can still be continued
    from lowmem.memory.guard import StoppedForMemory
    from lowmem.training.stopping import StoppedAtOnce
    from trainer_low_mem import LowMemTrainer, StoppedBySignal

    trainer = LowMemTrainer(cfg, tokenizer=tokenizer, files=files, tokenizer_dir=tokenizer_dir)
    for note in notes:
        trainer.say(note)
    try:
        result = trainer.setup().train()
        return result if trainer.main else None  # one summary, not one per process
    except (StoppedBySignal, StoppedAtOnce) as stop:  # (a checkpoint written and the resume command printed)
        sys.exit(stop.exit_code)
    except StoppedForMemory as stop:
        print_error(str(stop))
        sys.exit(EXIT_MEMORY_GUARD)
    finally:
        trainer.close()
        if "LOCAL_RANK" in os.environ:  # a launched worker: its trainer is never destroyed (lowmem.cli.runner ends
            LAUNCHED_TRAINERS.append(trainer)  # the process with os._exit). Destroying DDP's reducer holds the
            # GIL while it joins gloo's threads, and one that is still freeing a finished collective waits for the
            # GIL: a deadlock (seen at the end of a 2-process CPU run, torch 2.13)


LAUNCHED_TRAINERS: list = []
EXIT_MEMORY_GUARD = 3  # distinct from user errors (2): a checkpoint was written, resume with more memory


def claim_output_dir(cfg):
    """Refuse an OUTPUT_DIR the run cannot start in, and mark it as a run's (OUTPUT_DIR/.t5-lowmem-run, which tells
    ``--is_keep_training`` that a run began there), before the trainer's imports: a refusal takes half a
    second, not the several seconds of importing torch. The data flags (files, formats, columns) and SFT's
    model folder and tokenizer are checked first: a mistake in them should not leave a run folder behind.
    The trainer checks the folder again once its processes are up.

    Returns:
        For the trainer: the checked data files (``data.pipeline.DataFiles``), and from --init_from the
        tokenizer's folder and the tokenizer, checked against the model (else None, None).
    """
    from data.objectives.base import objective_for
    from data.pipeline import check_data  # light: pyarrow is imported only to read a parquet file's columns
    from lowmem.monitoring.trackers import check_report_to
    from lowmem.runs.run_start import refuse_early

    files, tokenizer_dir, tokenizer = check_data(cfg, objective_for(cfg)), None, None
    check_report_to(cfg.report_to)  # an unknown tracker, or its package missing: one line
    if cfg.init_from:
        model_folder_config(cfg.init_from)  # a hub id is resolved (downloaded if need be) here, once
        if not cfg.is_keep_training:
            refuse_untrained(cfg)
        check_weights(cfg.init_from, headers=False)  # weight files there: refused before torch is imported
    extras = cfg.init_from or cfg.optimizer == "adamw8bit"
    if extras and not cfg.is_keep_training:
        from lowmem.model.build import import_transformers_models
        from lowmem.monitoring.trackers import import_trackers
        from lowmem.utils.optional import import_extras

        import_transformers_models()  # first, as the trainer does: without scipy and boto3 (peft imports both)
        import_trackers(cfg.report_to)
        import_extras(cfg)  # peft, bitsandbytes, optimum-quanto: one installed but broken is refused
    if cfg.init_from:  # a resume reads it again (a checkpoint holds only what trains): checked then too
        from lowmem.model.build import import_transformers_models

        import_transformers_models()  # (again a no-op, or a resume's first: before any model class)
        check_weights(cfg.init_from)  # every weight file's header, and config.json against them
    if cfg.init_from and not cfg.is_keep_training:  # before the folder is made
        from lowmem.model.build import check_init_from

        check_init_from(cfg)  # LoRA's targets are layers of that model
        tokenizer_dir, tokenizer = tokenizer_for_model(cfg, files)
    refuse_early(cfg)
    return files, tokenizer_dir, tokenizer


def plan(config: str | None = None, **flags) -> None:
    """Predicted peak memory by component (--json: one JSON object); --budget_gb=X --device=cpu|gpu
    recommends the fastest modes that fit (exit code 1 when nothing does); --num_processes=N
    [--num_machines=M] plans N processes, --sharding=fsdp|zero2|zero3 one process of a sharded run."""
    from lowmem.cli.plan_command import PlanFlags, plan_command
    from lowmem.parallel.engines import engine_for_launch

    as_json = to_bool("json", flags.pop("json", False))
    budget_gb, device = flags.pop("budget_gb", None), flags.pop("device", None)
    # Under `accelerate launch` the launcher's process counts are the defaults, and one process prints.
    world = int(os.environ.get("WORLD_SIZE", 1))
    num_processes = flags.pop("num_processes", world)
    num_machines = flags.pop("num_machines", world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    sharding = flags.pop("sharding", engine_for_launch().sharding)
    cfg, notes = load_config(flags, config)
    if int(os.environ.get("RANK", 0)) != 0:
        return
    say_notes(notes + unread_flag_notes("plan", flags), sys.stderr)
    result = plan_command(cfg, PlanFlags(as_json, budget_gb, device, num_processes, num_machines, sharding))
    if budget_gb is not None and result["recommendation"] is None:
        sys.exit(1)  # scripts can test it: `plan --budget_gb=X ... && train ...`


def say_notes(notes: list[str], stream=None) -> None:
    """The notes of the flags (the main process's: evaluate and generate may run under a launcher), on standard
    output or ``stream`` (standard error where standard output carries the command's result)."""
    if int(os.environ.get("RANK", 0)) == 0:
        for note in notes:
            print(note, file=stream or sys.stdout, flush=True)


def evaluate(config: str | None = None, **flags) -> dict:
    """Eval loss and --eval_metrics of --init_from (default: OUTPUT_DIR/best) on --eval_file (preference pairs: the
    rewards and reward accuracy of orpo / simpo)."""
    from dataclasses import replace

    from lowmem.training.criteria import saved_model_criterion
    from lowmem.training.evaluation import load_saved_model

    cfg, notes = load_saved_model_config(flags, config)
    say_notes(notes + unread_flag_notes("evaluate", flags) + unused_answer_notes(cfg, flags))
    criterion = saved_model_criterion(cfg)  # (dpo's refusal before the model is read)
    saved = load_saved_model(cfg)
    saved.ctx = replace(saved.ctx, criterion=criterion)
    result = saved.evaluate()
    where = cfg.eval_file or f"the rows held out of --train_file={cfg.train_file}"
    return {**result, "eval_file": where} if saved.main else None


def generate(config: str | None = None, **flags) -> None:
    """Answer --prompt (or the first eval prompts) with --init_from (default: OUTPUT_DIR/best)."""
    from lowmem.training.evaluation import answer_text, load_saved_model

    cfg, notes = load_saved_model_config(flags, config)
    say_notes(notes + unread_flag_notes("generate", flags))
    if cfg.prompt is not None and not cfg.prompt.strip():
        raise UserError("--prompt is empty: give the text to answer, or leave --prompt out to answer eval prompts")
    saved = load_saved_model(cfg, eval_set=not cfg.prompt)
    prompts = [cfg.prompt] if cfg.prompt else [e.prompt for e in saved.eval_examples[:5]]
    for prompt, answer in zip(prompts, saved.generate(prompts)):
        if saved.main:  # every process generates (a sharded model needs them all); one prints
            shown = prompt if isinstance(prompt, str) else answer_text(saved.tokenizer, prompt)  # packed: token ids
            print(f"{shown}  ->  {answer}")


def train_tokenizer(config: str | None = None, **flags) -> dict:
    """Train the sentencepiece tokenizer on a capped, streamed sample of --train_file
    (default: both shipped corpora) into --tokenizer_dir (default: data/tokenizer)."""
    from data.objectives.base import objective_class
    from data.sources.corpus import check_columns, resolve_files
    from data.tokenization import train_tokenizer as train_spm
    from data.tokenization import vocab_shortfall

    cfg, notes = load_config(flags, config)
    say_notes(notes + unread_flag_notes("train_tokenizer", flags), sys.stderr)
    # (with --init_from, or --is_finetune's default one, the config leaves it to the model's own tokenizer)
    tokenizer_dir = cfg.tokenizer_dir or str(SHIPPED_TOKENIZER_DIR)
    if (Path(tokenizer_dir) / "tokenizer.json").is_file():  # models trained with it need it as it is
        raise UserError(f"--tokenizer_dir={tokenizer_dir} holds a tokenizer already; pass a new folder, or "
                        "remove that one first")
    spec = cfg.train_file if "train_file" in flags else ",".join(str(t) for t, _ in SHIPPED_CORPORA.values())
    objective = objective_class(cfg.objective)
    files = resolve_files(spec, "--train_file", formats=objective.formats, dataset_config=cfg.dataset_config)
    columns = objective.text_columns(cfg)
    check_columns(files, columns, "--train_file")  # (sentencepiece's own words for no text: "INTERNAL")
    tokenizer = train_spm(files, tokenizer_dir, columns, cfg.vocab_size,
                          cfg.tokenizer_max_sentences, progress=sys.stderr.isatty())
    summary = {"tokenizer_dir": tokenizer_dir, "vocab_size": len(tokenizer), "files": len(files)}
    shortfall = vocab_shortfall(tokenizer, cfg.vocab_size)
    return {**summary, "note": shortfall} if shortfall else summary


def prepare(config: str | None = None, **flags) -> dict:
    """Tokenize --train_file once into parquet shards in --prepared_dir (default: runs/prepared);
    then train with --train_file=PREPARED_DIR (no tokenization in any epoch)."""
    from data.prepare import prepare_command
    from lowmem.model.source import tokenizer_folder

    out_dir = flags.pop("prepared_dir", "runs/prepared")
    cfg, notes = load_config(flags, config)
    say_notes(notes + unread_flag_notes("prepare", flags), sys.stderr)
    imports_done()  # a corpus of any size streams from here: the usual collections keep its garbage bounded
    return prepare_command(cfg, Path(out_dir), tokenizer_folder(cfg))


def preview(config: str | None = None, **flags) -> None:
    """Print the first --num_examples (default 5) training examples as the model sees them, one JSON object per
    line (input_ids, labels; rejected_labels of a preference pair; original_ids for span corruption; packed rows'
    segments with --packing=True; --decode=True adds the texts); logs on stderr."""
    import json

    from data.preview import preview_examples
    from data.tokenization import load_trained_tokenizer
    from lowmem.model.source import tokenizer_folder

    count = flags.pop("num_examples", 5)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UserError(f"--num_examples expects a positive whole number (got {count!r})")
    decode = to_bool("decode", flags.pop("decode", False))
    cfg, notes = load_config(flags, config)
    say_notes(notes + unread_flag_notes("preview", flags), sys.stderr)
    tokenizer = load_trained_tokenizer(tokenizer_folder(cfg))
    for record in preview_examples(cfg, tokenizer, count, decode, report=lambda line: print(line, file=sys.stderr)):
        print(json.dumps(record, ensure_ascii=False))


def plot(config: str | None = None, **flags) -> dict:
    """PNG charts of OUTPUT_DIR/metrics.jsonl (loss, scores, learning rate, tokens/s, RSS) into --plot_dir
    (default: OUTPUT_DIR/plots)."""
    from lowmem.monitoring.plots import plot_run

    plot_dir = flags.pop("plot_dir", None)
    cfg, notes = load_config(flags, config)
    say_notes(notes + unread_flag_notes("plot", flags), sys.stderr)
    return plot_run(cfg.output_dir, plot_dir)


def export(config: str | None = None, **flags) -> dict:
    """--init_from (a LoRA adapter folder, merged into its base; a run's checkpoint; a model) as a plain transformers
    folder in --export_dir (new or empty), a shard at a time: --dtype=float32|bfloat16|float16, --base=MODEL where
    the adapter's or checkpoint's base model is elsewhere."""
    from lowmem.cli.export_command import export_command

    export_dir, dtype, base = flags.pop("export_dir", None), flags.pop("dtype", "float32"), flags.pop("base", None)
    cfg, notes = load_config(flags, config)
    say_notes(notes + unread_flag_notes("export", flags), sys.stderr)
    # (with --init_from, --tokenizer_dir is None unless given: the source's own tokenizer is taken)
    return export_command(cfg.init_from, export_dir, dtype, base, cfg.tokenizer_dir,
                          say=lambda line: print(line, file=sys.stderr))


COMMANDS = {"train": train, "plan": plan, "evaluate": evaluate, "generate": generate,
            "train_tokenizer": train_tokenizer, "prepare": prepare, "preview": preview, "plot": plot, "export": export}


def main(argv: list[str] | None = None) -> None:
    run_cli(COMMANDS, sys.argv[1:] if argv is None else list(argv), _interrupted_while_starting)


if __name__ == "__main__":
    main()
