"""Evaluation and generation with a model and a tokenizer: eval loss and the scores of --eval_metrics
(``lowmem.utils.eval_metrics``) over an eval set, answers to prompts, the best-model comparison, and loading a saved
model for the CLI's ``evaluate`` / ``generate`` (no trainer involved; training evaluates through the same
functions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from config import AUTO, SHIPPED_CORPORA, TrainConfig
from data.collate import by_source_length, length_groups, round_up
from data.objectives.base import objective_for
from data.sources.corpus import DataProblems, resolve_files
from data.sources.eval_set import eval_files_of, eval_split
from data.streams.file_stream import batched
from data.tokenization import has_tokenizer, load_tokenizer, load_trained_tokenizer
from lowmem.hardware.memory_use import free_memory
from lowmem.hardware.precision import precision_for
from lowmem.memory.batch_budget import saved_model_eval_size
from lowmem.memory.collector import imports_done
from lowmem.model.adapters import load_saved_model_weights
from lowmem.model.build import generation_cache, import_transformers_models
from lowmem.model.loss import batch_to_device, token_loss_sum
from lowmem.model.source import check_vocabulary, resolve_model_dir, tokenizer_folder
from lowmem.monitoring.telemetry import on_terminal
from lowmem.parallel.distributed import any_process, start_accelerator
from lowmem.parallel.engines import engine_for_launch, inner_model
from lowmem.parallel.sharding import is_sharded, padded_window, runs_deepspeed, whole_root
from lowmem.training.encoder_cache import encoder_on
from lowmem.training.run_context import RunContext
from lowmem.utils.errors import UserError
from lowmem.utils.eval_metrics import metric_named, metrics_of, score_answers, scores_in
from lowmem.utils.ownership import saved_json

CPU_LOSS_TOKENS = 2048  # padded tokens per eval forward on the CPU (the encoder's sources, the decoder's targets)


def is_better(result: dict, best: float | None, best_loss: float | None, metric: str) -> bool:
    """Whether an evaluation's ``result`` beats the best so far (``best`` by ``metric``, with its eval loss
    ``best_loss``): each metric's way (eval_loss lower, the scores of ``lowmem.utils.eval_metrics`` higher), and a
    tie of a score (every young model's BLEU is 0) broken by the lower eval loss."""
    value = result[metric]
    if value != value:  # NaN never wins
        return False
    if best is None:
        return True
    if not metric_named(metric).higher_is_better:
        return value < best
    return value > best or (value == best and best_loss is not None and result["eval_loss"] < best_loss)


def generation_options(cfg: TrainConfig, max_new_tokens: int) -> dict:
    """``generate``'s keyword arguments from the flags (a cache that grows per layer: transformers
    5.24 sizes its default by the encoder's depth, which breaks models with more decoder layers)."""
    options = {"max_new_tokens": max_new_tokens, "num_beams": cfg.num_beams, "cache": generation_cache()}
    if cfg.no_repeat_ngram_size:
        options["no_repeat_ngram_size"] = cfg.no_repeat_ngram_size
    if cfg.repetition_penalty != 1.0:
        options["repetition_penalty"] = cfg.repetition_penalty
    return options


def asked_generate_rows(cfg: TrainConfig, rows: int) -> int:
    """The eval rows whose answers are generated as the flags ask: none with --eval_generate=False, else the
    first --eval_generate_samples (auto: all ``rows``). Training may ask fewer (``lowmem.training.eval_cost``)."""
    if not cfg.eval_generate:
        return 0
    return rows if cfg.eval_generate_samples == AUTO else min(cfg.eval_generate_samples, rows)


def eval_batches(examples: list, collator, cfg: TrainConfig, accelerator, sharded: bool,
                 generate_rows: int) -> list[tuple[list, bool, bool]]:
    """This process's evaluation batches as (rows, generate, real): every world-th example, the first
    ``generate_rows`` of the eval set (whose answers are generated) batched apart from the others, each part in
    batches of similar source length: less padding, and generation (which runs until a batch's last row ends)
    spent on rows alike. Corpus scores and the token-mean loss do not depend on the order. Sharded, every forward
    is a collective: each part is padded (``real`` False) to as many batches on every process."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = examples[rank::world]
    first = len(range(rank, min(generate_rows, len(examples)), world))  # this process's among the first rows
    batches = []
    for part, generate in ((mine[:first], True), (mine[first:], False)):
        lengths = [len(ids) for ids in collator.token_ids([e.prompt for e in part], cfg.max_source_len)] if part else []
        chunks = [[part[i] for i in rows] for rows in by_source_length(lengths, cfg.eval_batch_size)]
        padded = padded_window(chunks, lambda: examples[:1], world) if sharded else chunks
        batches += [(chunk, generate, k < len(chunks)) for k, chunk in enumerate(padded)]
    return batches


@dataclass
class EvalModel:
    """A model with what evaluating and generating with it take: the run's context (options, accelerator,
    precision, padding multiple: ``lowmem.training.run_context``), the model as prepared (the loss runs through it)
    and the plain one inside (it generates), its tokenizer and collator. A training run holds one, and so does the
    CLI's evaluate / generate (``SavedModel``)."""

    ctx: RunContext
    model: object  # prepared by accelerate
    core: object  # unwrapped: generates
    tokenizer: object
    collator: object

    @property
    def cfg(self) -> TrainConfig:
        return self.ctx.cfg

    @property
    def sharded(self) -> bool:
        """Every forward is a collective (FSDP, DeepSpeed): the processes run as many, and stop at the same one."""
        return is_sharded(self.core) or runs_deepspeed(self.ctx.accelerator)


def loss_and_inputs(at: EvalModel, batch: dict, budget: int) -> tuple[float, dict]:
    """The summed token loss of ``batch`` and the inputs ``generate`` takes for it (its encoder output, unless
    sharded: there every forward is one collective, and generate runs the encoder again); ``budget``: padded tokens
    per loss forward (``loss_budget``)."""
    multiple, loss_chunk = at.ctx.multiple, at.cfg.loss_chunk_size
    if at.sharded:
        loss = token_loss_sum(at.model, at.core, batch, multiple=multiple, loss_chunk=loss_chunk)
        return float(loss), {"input_ids": batch["input_ids"]}
    return loss_and_encoded(at.model, at.core, batch, budget, multiple, loss_chunk)


def generate_for(at: EvalModel, inputs: dict, batch: dict, new_tokens: int, forced: bool = False):
    """Answers to ``batch`` (``inputs`` from ``loss_and_inputs``), up to ``new_tokens`` each (exactly that many
    when ``forced``: what a young model, which rarely stops early, runs to)."""
    from transformers.modeling_outputs import BaseModelOutput

    extra = {"min_new_tokens": new_tokens} if forced else {}
    if "encoder_outputs" in inputs:  # generate expands it for beams in place: a new one, so the inputs serve again
        inputs = {**inputs, "encoder_outputs": BaseModelOutput(last_hidden_state=inputs["encoder_outputs"][0])}
    return at.core.generate(**inputs, attention_mask=batch["attention_mask"], synced_gpus=at.sharded,
                            **generation_options(at.cfg, new_tokens), **extra)


def loss_budget(accelerator, sharded: bool) -> int:
    """Padded tokens per eval loss forward: on the CPU the loss's forward is bound by compute, so padding costs
    what it pads, and the encoder and the decoder each run over groups of similar length within
    CPU_LOSS_TOKENS (``loss_and_encoded``), while generation takes the whole batch (fewer decoding steps, each
    cheap). 0: the whole batch (a GPU; or sharded, where every forward is a collective: one per batch)."""
    return CPU_LOSS_TOKENS if accelerator.device.type == "cpu" and not sharded else 0


@torch.no_grad()
def evaluate_model(at: EvalModel, examples: list, progress: bool = False, interrupted=None,
                   generate_rows: int | None = None) -> dict:
    """Eval loss (token-mean) over ``examples`` and the scores of --eval_metrics (``lowmem.utils.eval_metrics``) of
    greedy/beam generations for the first ``generate_rows`` of them (at most as many as the flags ask,
    ``asked_generate_rows``; no score keys when none).

    ``at.model`` is the prepared (wrapped) model the loss runs through, ``at.core`` the unwrapped one that
    generates. Each process takes every world-th example; no collective runs inside the loop (ranks
    may hold different numbers of batches), and predictions are gathered once as text at the end.
    ``interrupted()`` (a signal to stop) ends the loop before the next batch; the caller, which asks every
    process, discards the partial result.
    """
    from accelerate.utils import gather_object

    if at.ctx.criterion is not None:  # a preference objective's own (lowmem.training.criteria)
        own = at.ctx.criterion.evaluate(at, examples, progress=progress, interrupted=interrupted,
                                        generate_rows=generate_rows)
        if own is not None:
            return own
    start = time.time()
    cfg, accelerator, tokenizer = at.cfg, at.ctx.accelerator, at.tokenizer
    at.model.eval()
    asked = asked_generate_rows(cfg, len(examples))  # (a plan generates fewer, never more)
    generate_rows = asked if generate_rows is None else min(generate_rows, asked)
    loss_sum, tokens, pairs, examples_done = 0.0, 0, [], 0
    sharded = at.sharded
    batches = eval_batches(examples, at.collator, cfg, accelerator, sharded, generate_rows)
    budget = loss_budget(accelerator, sharded)
    for chunk, generate, real in tqdm(batches, desc="eval", leave=False, disable=not progress):
        # (sharded, every batch is a collective already: the processes stop at the same one)
        if interrupted is not None and (any_process(accelerator, interrupted()) if sharded else interrupted()):
            break  # a generation of 100 rows can outlast a job scheduler's grace period
        batch = batch_to_device(at.collator(chunk), accelerator.device, at.ctx.multiple)
        with at.ctx.precision.autocast(accelerator), whole_root(at.core):
            loss, inputs = loss_and_inputs(at, batch, budget)
            generated = generate_for(at, inputs, batch, cfg.max_target_len) if generate else None
        if not real:  # padding
            continue
        loss_sum += loss
        tokens += int(batch["labels"].ne(-100).sum())
        if generated is not None:
            predictions = tokenizer.batch_decode(generated, skip_special_tokens=True)
            pairs.extend(zip(predictions, [e.response if isinstance(e.response, str)  # else token ids (raw text)
                                           else tokenizer.decode(e.response, skip_special_tokens=True) for e in chunk]))
        examples_done += len(chunk)
        del batch, generated
    totals = torch.tensor([loss_sum, tokens, examples_done], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, "sum")
        pairs = gather_object(pairs)
    result = {"eval_loss": round(totals[0].item() / max(totals[1].item(), 1), 5)}
    if generate_rows:  # else no scores at all (not a 0 that reads as one)
        result.update(score_answers(metrics_of(cfg.eval_metrics), [p for p, _ in pairs], [r for _, r in pairs]))
        result["scored_rows"] = len(pairs)
    return {**result, "eval_examples": int(totals[2].item()), "eval_s": round(time.time() - start, 2)}


def eval_log_line(step: int, result: dict, improved: bool) -> str:
    """The log line of an evaluation: the eval loss, then each score of --eval_metrics (none where nothing was
    generated), and the rows they scored where fewer than the eval loss's."""
    scores = "".join(f" | {name} {value:.2f}" for name, value in scores_in(result).items())
    if scores and result["scored_rows"] < result["eval_examples"]:
        scores += f" ({result['scored_rows']} of {result['eval_examples']} rows)"
    pairs = (f" | reward_accuracy {result['eval_reward_accuracy']:.3f} | margin {result['eval_reward_margin']:.3f}"
             if "eval_reward_accuracy" in result else "")  # (a preference objective's)
    best = " | new best" if improved else ""
    return f"eval step {step} | eval_loss {result['eval_loss']:.4f}{pairs}{scores}{best}"


def loss_and_encoded(model, core, batch: dict, budget: int, multiple: int,
                     loss_chunk: int | str = AUTO) -> tuple[float, dict]:
    """The summed token loss of ``batch`` and its encoder output for ``generate`` (the encoder runs once
    for both). With a ``budget`` of padded tokens (0: the whole batch in one forward) the encoder runs over
    groups of similar source length and the decoder over groups of similar target length
    (``length_groups``), each cut to its own longest row: on the CPU a forward costs what it pads."""
    from transformers.modeling_outputs import BaseModelOutput

    mask, labels = batch["attention_mask"], batch["labels"]
    sources, targets = mask.sum(1).tolist(), labels.ne(-100).sum(1).tolist()

    def groups(lengths: list[int]) -> list[list[int]]:
        return length_groups(lengths, budget, multiple) if budget else [list(range(len(lengths)))]

    def cut(rows: list[int], lengths: list[int], tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        return torch.tensor(rows, device=tensor.device), min(round_up(max(lengths[i] for i in rows), multiple),
                                                              tensor.shape[1])

    hidden = None
    for rows in groups(sources):
        index, width = cut(rows, sources, mask)
        encoded = core.encoder(input_ids=batch["input_ids"][index, :width],
                               attention_mask=mask[index, :width]).last_hidden_state
        if hidden is None:
            hidden = encoded.new_zeros((*mask.shape, encoded.shape[-1]))
        hidden[index, :width] = encoded
    loss = 0.0
    for rows in groups(targets):
        (index, width), (_, length) = cut(rows, sources, mask), cut(rows, targets, labels)
        part = {"attention_mask": mask[index, :width], "labels": labels[index, :length],
                "encoder_hidden_states": hidden[index, :width]}
        loss += float(token_loss_sum(model, core, part, multiple=multiple, loss_chunk=loss_chunk))
    return loss, {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden)}


@torch.no_grad()
def generate_answers(at: EvalModel, prompts: list[str]) -> list[str]:
    """Answers to ``prompts``, in batches of ``--eval_batch_size``, as ``answer_text`` writes them."""
    cfg, ctx = at.cfg, at.ctx
    at.core.eval()
    answers = []
    for chunk in batched(prompts, cfg.eval_batch_size):
        batch = batch_to_device(at.collator.encode(chunk, cfg.max_source_len), ctx.device, ctx.multiple)
        with ctx.precision.autocast(ctx.accelerator):
            out = at.core.generate(**batch, **generation_options(cfg, cfg.max_new_tokens))
        answers.extend(answer_text(at.tokenizer, ids) for ids in out.tolist())
    return answers


def answer_text(tokenizer, ids: list[int]) -> str:
    """The text of generated ``ids``. Sentinels (``<extra_id_0>``, ...) stay in it: a model pretrained by
    span corruption answers a prompt with sentinels by the fill-ins that follow each one (decoding with
    ``skip_special_tokens`` would drop them); padding, EOS, BOS and UNK are left out."""
    dropped = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.unk_token_id}
    return tokenizer.decode([t for t in ids if t not in dropped]).strip()


@dataclass
class SavedModel(EvalModel):
    """A saved model loaded for ``evaluate`` / ``generate``, with its tokenizer and eval set."""

    eval_examples: list = field(default_factory=list)

    @property
    def main(self) -> bool:
        return self.ctx.is_main

    def evaluate(self) -> dict:
        return evaluate_model(self, self.eval_examples, progress=self.main and on_terminal())

    def generate(self, prompts: list[str]) -> list[str]:
        return generate_answers(self, prompts)


def held_out_rows(cfg: TrainConfig, eval_files: list, train_files: list, held: int | None, say=print) -> list:
    """The eval rows of a saved model: ``--eval_file``'s, or those its training held out of --train_file
    (``held``: how many, from its training_info.json; None from a model trained before it was recorded).

    The rows held out are the last ``min(--max_eval_samples, 10 %)`` of the training files: counted with
    another --max_eval_samples they would take in rows the model was trained on (or leave some out).
    """
    problems = DataProblems(report=say)  # each of the first few said, then the count
    if eval_files or held is None or held == cfg.max_eval_samples:
        rows = eval_split(cfg, eval_files, train_files, problems=problems)[0]
        held = cfg.max_eval_samples
    else:
        rows = eval_split(replace(cfg, max_eval_samples=held), eval_files, train_files, problems=problems)[0]
    if problems.total:
        reasons = ", ".join(f"{reason}: {n}" for reason, n in problems.by_reason.items())
        say(f"{problems.total} bad eval row(s) skipped ({reasons}); the eval set is the "
            f"{min(len(rows), cfg.max_eval_samples)} usable ones")
    if cfg.max_eval_samples > held:
        say(f"note: evaluating the {held} rows training held out of --train_file (its last rows); "
            f"--max_eval_samples={cfg.max_eval_samples} asks for more, and the rows before them were trained on")
    elif cfg.max_eval_samples < held:
        say(f"note: evaluating the first {cfg.max_eval_samples} of the {held} rows training held out of --train_file "
            f"(--max_eval_samples={cfg.max_eval_samples}): the run's own evaluations took all {held}")
    return rows[:cfg.max_eval_samples]


def load_saved_model(cfg: TrainConfig, say=print, eval_set: bool = True) -> SavedModel:
    """--init_from (default OUTPUT_DIR/best) with its own tokenizer (unless --tokenizer_dir names
    one), and the eval set (none without ``eval_set``: generate given --prompt): --eval_file, or the rows
    training on --train_file held out."""
    model_dir = Path(cfg.init_from) if cfg.init_from else Path(cfg.output_dir) / "best"
    objective = objective_for(cfg)
    info = saved_json(model_dir / "training_info.json") or {}
    shipped_eval = cfg.eval_file == str(SHIPPED_CORPORA[cfg.kind][1]) and not cfg.prompt
    own_data = info.get("train_file") not in (None, *(str(t) for t, _ in SHIPPED_CORPORA.values()))
    try:  # Without --eval_file: the rows that training on --train_file held out
        train_files = [] if cfg.eval_file is not None or not eval_set else resolve_files(
            cfg.train_file, "--train_file", formats=objective.formats, dataset_config=cfg.dataset_config)
        eval_files = eval_files_of(cfg, train_files) if eval_set else []
    except UserError as err:
        if not (shipped_eval and own_data):
            raise
        why = str(err).split("; ")[0]  # (not its advice: the columns are the model's own, the rows are what to change)
        raise UserError(f"{model_dir} was trained on --train_file={info['train_file']}, and the shipped {cfg.kind} "
                        f"eval rows it would be scored on do not fit it ({why}): pass that --train_file (the rows its "
                        "training held out) or an --eval_file of its own") from None
    import_transformers_models()
    imports_done()  # before the weights (lowmem.memory.collector)
    model = load_saved_model_weights(model_dir)  # an adapter folder's base and adapters, or a whole model
    model_dir = resolve_model_dir(str(model_dir))
    engine_for_launch().for_inference()  # whole weights on every process (DeepSpeed's engine is left out)
    accelerator, _ = start_accelerator(cfg)  # evaluate / generate keep whole weights on every process
    # The model's own tokenizer unless --tokenizer_dir names one (without --init_from it holds the
    # shipped default, which OUTPUT_DIR/best's own wins over).
    own = has_tokenizer(model_dir) and not (cfg.init_from and cfg.tokenizer_dir)
    tokenizer = load_tokenizer(model_dir) if own else load_trained_tokenizer(tokenizer_folder(cfg))
    check_vocabulary(cfg, model.get_input_embeddings().num_embeddings, tokenizer, model_dir)
    precision = precision_for(cfg.mixed_precision, accelerator.device.type)
    precision.prepare(model)
    model = accelerator.prepare(model)
    multiple = precision.shape_multiple(accelerator.device.type == "cpu")
    collator = objective.collator(tokenizer, multiple)
    info = saved_json(model_dir / "training_info.json") or {}  # (model_dir resolved: a hub id's cached copy)
    main_says = say if accelerator.is_main_process else (lambda _line: None)  # every process reads the rows
    eval_rows = held_out_rows(cfg, eval_files, train_files, info.get("held_out_rows"), main_says) if eval_set else []
    eval_examples = objective.eval_examples(eval_rows, tokenizer, cfg.max_eval_samples) if eval_set else []
    if cfg.eval_batch_size == AUTO and eval_examples:
        cfg = replace(cfg, eval_batch_size=saved_model_eval_size(
            cfg, model_dir, collator, eval_examples[accelerator.process_index::accelerator.num_processes],
            "gpu" if accelerator.device.type == "cuda" else "cpu"))
    trained = info.get("kind")
    if trained in SHIPPED_CORPORA and trained != cfg.kind and shipped_eval and accelerator.is_main_process:
        say(f"note: {model_dir} was trained by {trained}, and these are the shipped {cfg.kind} eval rows "
            f"({cfg.eval_file}); pass --is_finetune={trained == 'sft'} for the {trained} ones")
    elif own_data and shipped_eval and accelerator.is_main_process:  # trained on the user's own data
        say(f"note: {model_dir} was trained on --train_file={info['train_file']}, and these are the shipped "
            f"{cfg.kind} eval rows ({cfg.eval_file}); pass that --train_file (the rows its training held out) or "
            "an --eval_file of its own")
    ctx = RunContext.plain(cfg, accelerator, multiple)
    return SavedModel(ctx, model, inner_model(accelerator, model), tokenizer, collator, eval_examples)


def evaluate_in_run(at: EvalModel, examples: list, generate_rows: int, interrupted, log_memory) -> dict:
    """One evaluation of a training run (``examples``: its eval set): ``evaluate_model`` with memory given back
    to the OS before and after, the encoder brought back when the encoder cache took it off the GPU (the eval
    set is not in the cache), and the seconds it took as ``eval_s``."""
    start = time.time()
    free_memory()  # before evaluation
    log_memory("eval_start")
    with encoder_on(at.core, at.ctx.device):
        result = evaluate_model(at, examples, at.ctx.is_main and on_terminal(), interrupted=interrupted,
                                generate_rows=generate_rows)
    free_memory()  # after evaluation: the heap generation's growing cache left goes back to the OS
    result["eval_s"] = round(time.time() - start, 2)
    log_memory("eval_end")
    return result
