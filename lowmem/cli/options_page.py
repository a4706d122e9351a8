"""docs/options.md, generated from the fields of ``TrainConfig``: a table per section (each option's default, the
commands that read it and the first sentences of its help), with the notes that explain more below each table.

    python -m lowmem.cli.options_page > docs/options.md    # after changing a field (a test fails while it is stale)
"""

from __future__ import annotations

import re
import textwrap

from config import flags_with
from data.objectives.base import registry
from lowmem.cli.help_pages import readers, sections
from lowmem.utils.flag_roles import RUN_COMMANDS

REGENERATE = "python -m lowmem.cli.options_page > docs/options.md"
CELL = 200  # a cell holds the help's first sentences up to about this many characters (the first one whole)

HEADER = f"""# Options

Every option is a flag (`--name=value`), converted to its declared type, and can also come from a
YAML file: `--config=run.yaml` (CLI flags win). An unknown flag, a wrong type or an invalid
combination prints one line naming what to change and exits with code 2 (`--debug` shows the
traceback). An option on the line of a command that does not read it (the column "read by") gets a
`note:` line and changes nothing; options from a `--config` file are not noted (one file serves every
command). "read by" says `all` for every command and `run` for the commands that build a run:
{", ".join(f"`{c}`" for c in RUN_COMMANDS)} (`plan` predicts a training run and
`preview` shows its stream, so both read what `train` reads).

`python train_low_mem.py COMMAND --help` lists the options one command reads, with their full help,
and its examples; `python train_low_mem.py --help` lists every option. The [README](../README.md) has
the main ones in short. This page is generated from the fields of `config.py`
(`{REGENERATE}`); the notes under each table say more."""

NOTES = {
    "run mode and paths": """\
- `--output_dir`: SFT's default, `runs/sft`, never writes into the pretraining run.
- `--init_from`: a folder or a hub id of the T5 family — a run's `best/`, original T5, t5-v1_1, flan-t5, mT5, umT5,
  ByT5 — trained as saved (gated feed-forward, untied `lm_head`, padded embedding, asymmetric layer counts), with its
  own tokenizer (`tokenizer.json`, `spiece.model` alone, or ByT5's bytes) unless `--tokenizer_dir` names the same
  one. See [bring_your_own_t5.md](bring_your_own_t5.md).
- `--freeze`: `encoder` with `--is_finetune`, else `none`. A tied output layer is the embedding and freezes with it;
  an untied `lm_head` (the presets' default, v1.1, flan-t5, mT5, ByT5) always trains. Freezing the encoder keeps
  what pretraining taught it; when the SFT data is in a language pretraining never read, the frozen encoder cannot
  learn to read it: the README's default job pretrains on Chinese phrases and fine-tunes with `--freeze=none` for
  its English turns.
- `--is_keep_training`, `--resume_from`: [resume_and_faults.md](resume_and_faults.md).""",
    "data": """\
- `--train_file`, `--eval_file`: a file, glob, folder or comma list of `.jsonl .json .parquet .csv` (and `.txt` raw
  text with `--objective=span_corruption` or `prefix_lm`); or a Hugging Face dataset: a `save_to_disk` folder, a hub
  id (streamed) or a local copy of a hub dataset repository, for every objective: see
  [datasets_sources.md](datasets_sources.md).
- `--eval_file` with your own `--train_file`: given only `--train_file`, the run holds out that data's last
  `--max_eval_samples` rows (10 % of them at most, counting back from the last file in sorted order) as the eval
  set and never trains on them; the start-up log and the `setup` record say how many. The shipped eval split goes
  with the shipped training data only. `evaluate` / `generate` given the same `--train_file` and no `--eval_file`
  use the same rows (the model's `training_info.json` says how many; a larger `--max_eval_samples` takes no more, a
  smaller one the first of them, with a note); a resume that would hold out other rows is refused. Pass
  `--eval_file` for a proper split of your own (required with `prepare`d shards).
- `evaluate` and `generate` take {trained_with} from the model's `training_info.json` unless given (those its
  objective reads; a note says which), so they reproduce the run's own eval numbers.
- `--shuffle_buffer_mb`: past it, rows are handed out at random until the buffer fits, so long rows shuffle among
  fewer; it bounds the buffer's host RAM and the data position a checkpoint saves. A row counts as the larger of its
  size in Python (1, 2 or 4 bytes a character: one emoji makes a row 4) and in UTF-8 (a raw-text document once);
  token ids 36 bytes each. Where it never binds (rows under 64 KiB on average) the order is the one
  `--shuffle_buffer_size` alone gives. A run begun before the flag existed resumes with `--shuffle_buffer_mb=0`.
- The objectives (`--objective`):
{objectives}""",
    "model": """\
- `--model_preset`, parameters with the shipped 8.1k vocabulary: `tiny` 3.0M (CPU demos), `small` (T5-small shape)
  52M, 76M with a 32k vocabulary; `base` (the reference project's d_model 768 / 12 heads / 10+10 layers) 178M, 210M
  with a 29k vocabulary, the reference's own count (its output layer was untied too); `t5-v1_1-base`
  (google/t5-v1_1-base's shape, 12+12 layers, which nanoT5 pretrains: [nanot5.md](nanot5.md)) 211M, 248M with T5's
  32,100-piece tokenizer. With `--tie_word_embeddings=True`: 1.9M, 48M (60M), 171M (188M), 204M (223M).
- `--tie_word_embeddings`: False gives an `lm_head` of its own, as T5 v1.1, flan-t5 and mT5 have, drawn with std
  d_model^-0.5 (first logits of unit variance) and with no d_model^-0.5 scaling of the decoder's output; SFT's
  `--freeze=encoder` and `embeddings` leave it trainable. True is the original T5's layout: the output layer is the
  shared embedding (one vocabulary × d_model matrix fewer: 1.0M of tiny's 3.0M) and freezes with it. Why False is
  the default: the shipped pretraining (Chinese phrases → pinyin) writes no English, so with a tied head the default
  job's SFT, whose frozen embedding was the output layer, could not learn to write English: it answered `can a robot
  get drunk?` with `这是。` ([benchmarks.md](benchmarks.md), `bench/default_job.py`). Runs begun before 2026-11-29
  were tied and resume only with `--tie_word_embeddings=True`; ignored with `--init_from` (the model's own layout is
  kept).
- `--feed_forward_proj`: `gated-gelu` (T5 v1.1, flan-t5, mT5: `wi_0`, `wi_1`, `wo`; d_ff 320 / 1344 / 2048 for
  tiny / small / base) or `relu` (the original T5 and the reference: `wi`, `wo`; d_ff 512 / 2048 / 3072). The gated
  one is 2/3 as wide, so both hold the same weights within 1 %. A ReLU unit whose input is near zero is on in one run
  and off in another that differs only in float rounding, and the normalising optimizers turn that into steps of the
  learning rate's size; gelu has no such edge, so runs that add up the same maths in another order (another
  micro-batch split, FSDP or ZeRO against DDP) stay within float error:
  [throughput.md, "The noise floor"](throughput.md#micro-batch-size-and-the-memory-budget). Its activation runs as
  torch's fused tanh-GELU (the same function as transformers' `gelu_new` to 4.8e-7; exports still say gated-gelu,
  and so do flan-t5's and mT5's, fused too), so its feed-forward keeps 1.06x what ReLU's keeps for backward with
  dropout, 2.6x without (the planner counts it). Runs begun before 2026-11-28 used relu and resume only with
  `--feed_forward_proj=relu`; ignored with `--init_from`.""",
    "batch and optimisation": """\
- `--batch_size`, `--eval_batch_size`: used as given when the planner predicts the run fits its memory budget
  (`--max_rss_gb`'s guard, else 80 % of the RAM available at start, or the GPU's memory), else lowered with one log
  line (a training batch keeps its rows per optimizer step: `--batch_size=16` that does not fit becomes e.g. 4 × 4
  times the accumulation). `auto`: the largest that fits with a 15 % margin (a power of two or a multiple of 8, at
  most 256). `--memory_profile=host16g` keeps the reference's caps of 2 and 4. See [throughput.md](throughput.md).
- `--effective_batch_size`: `--batch_size=auto --effective_batch_size=32` does the same maths whatever micro-batch
  the budget allows. Without it, `auto` keeps `--gradient_accumulation_steps` and the effective batch grows with the
  micro-batch.
- `--max_tokens_per_batch` counts padded tokens as rows × (longest source + longest target): short rows many
  together, a long row alone.
- `--packing`: the examples of each optimizer step packed into rows of at most `--max_source_len` +
  `--max_target_len` tokens (an example never split) with block-diagonal attention masks: each example's loss and
  gradient are those it has alone. Refused with `span_corruption` (its rows are whole chunks) and
  `--encoder_cache`. [throughput.md](throughput.md) "Packing".
- `--max_steps` > 0 overrides `--epochs`.
- `--mixed_precision=fp16`: docs/memory.md "fp16"; `--loss_chunk_size`: docs/memory.md "Chunked loss".
- `--torch_compile`: compiles T5's encoder and decoder stacks for training (regional); training lengths are padded
  to buckets (16, 32, 64, ... and each side's longest) and each stack compiles once per bucket it meets, the number
  of rows left dynamic: every compile says one `torch.compile: compiling ...` line, and the train records carry
  `compiled_buckets` and `compiled_graphs` (equal: nothing recompiled). The LM head, evaluation, generation and a
  frozen encoder stay eager; dropout draws eager's masks. Not with FSDP or DeepSpeed. Off by default: on the CPU it
  measured slower ([throughput.md](throughput.md) "Compiled steps").""",
    "memory modes": """\
- What each mode saves and costs, measured, is in [memory.md](memory.md); `python train_low_mem.py plan` predicts it
  for your run.""",
    "evaluation, logging, checkpoints": """\
- `--eval_metrics`: `bleu` (sacrebleu's corpus BLEU-4, tokenised `zh` when a reference holds Chinese), `chrf`
  (sacrebleu's corpus chrF), `rouge` (rouge_score's ROUGE, logged as `rouge1`, `rouge2`, `rougeL`, `rougeLsum`: the
  mean F-measure; Chinese, Japanese, Thai and other scripts written without spaces count by character, other text by
  lowercased words; `rougeLsum` splits sentences at newlines), `exact_match` (the share of answers equal to their
  reference, surrounding whitespace aside). Computed at evaluations that generate (`--eval_generate`), by `train`
  and `evaluate`.
- `--max_eval_samples`: the eval loss takes every row. `--metric_for_best`: `eval_loss` (lower wins) or any value
  of `--eval_metrics` (`bleu`, `chrf`, `rouge1`, `rouge2`, `rougeL`, `rougeLsum`, `exact_match`: higher wins, a tie
  broken by the lower eval loss). A score not in `--eval_metrics`, or one with `--eval_generate=False`, is one
  `error:` line.
- `--eval_generate`, `--eval_generate_samples`, `--eval_budget_s`: before training the run times one eval batch of
  its own model (a loss forward and a few forced decoding steps) and predicts an evaluation as a young model runs
  it, every answer to `--max_target_len` tokens; the start-up line `eval: ...` says the cost (seconds, rows,
  tokens), what was chosen and why. Past `--eval_budget_s`, what is left at `auto` gets cheaper:
  `--eval_generate=auto` runs the step-0 evaluation (the baseline, before any training) as eval loss only, and
  `--eval_generate_samples=auto` generates for as many of the eval set's first rows as fit (whole batches on every
  process), none when not one batch fits. A value given is obeyed: `--eval_generate=True` generates at every
  evaluation, the baseline too (at least one batch of rows); `False` never (the eval loss only, much faster);
  `--eval_generate_samples=N` the first N rows; `--eval_budget_s=0` lifts the bound. A `--metric_for_best` scoring
  answers (`bleu`, `rougeL`, ...) keeps generation at every evaluation on the same rows. A resumed run keeps its
  plan (in the checkpoint's trainer state) unless one of {planned_for} changed. `evaluate` reads `--eval_generate`
  and `--eval_generate_samples` (auto: every row). Measured costs:
  [throughput.md](throughput.md#what-an-evaluation-costs).
- `--report_to`: every number of the `train` and `eval` records and the memory peak also go to each tracker, at the
  same steps as in `metrics.jsonl`; each is an extra (`pip install '.[wandb]'`, `'.[mlflow]'`, `'.[trackio]'`,
  `'.[tensorboard]'`), and `--is_keep_training` continues its run (see
  [monitoring.md](monitoring.md#trackers---report_to)).""",
    "generate": """\
- `--num_beams`, `--no_repeat_ngram_size` and `--repetition_penalty` decode `generate`'s answers and those
  `--eval_metrics` scores (which go up to `--max_target_len`, not `--max_new_tokens`); the last two (off by default)
  stop degenerate repetition (`,,,,` or a word looped), e.g. `--no_repeat_ngram_size=3 --repetition_penalty=1.2`.""",
    "checks and debugging": """\
- `--dump_consumed`: [resume_and_faults.md](resume_and_faults.md).""",
}


def cell(help_text: str) -> str:
    """The help's first sentence, and the next ones while the cell stays within ``CELL`` characters."""
    sentences = re.split(r"(?<=\.)\s+(?=\S)", " ".join(help_text.split()))
    text = sentences[0]
    for sentence in sentences[1:]:
        if len(text) + 1 + len(sentence) > CELL:
            break
        text += " " + sentence
    return text.replace("|", "\\|")


def _default(value) -> str:
    return "none" if value is None else f"`{value}`"


def _notes(title: str) -> str:
    """The notes under a section's table, their lists of flags from the roles, each item wrapped."""
    flags = ", ".join(f"`--{name}`" for name in flags_with("trained_with"))
    planned = ", ".join(f"`--{name}`" for name in flags_with("planned_for"))
    objectives = "\n".join(f"  - `{name}`: {found.summary}" for name, found in registry().items())
    text = NOTES.get(title, "").format(trained_with=flags, planned_for=planned, objectives=objectives)
    return "\n".join(_wrapped(item) for item in re.split(r"\n(?=\s*- )", text)) if text else ""


def _wrapped(item: str) -> str:
    bullet = item[:item.index("- ") + 2]  # "- ", or "  - " for an item of a list in an item
    return textwrap.fill(" ".join(item[len(bullet):].split()), 116, initial_indent=bullet,
                         subsequent_indent=" " * len(bullet), break_on_hyphens=False, break_long_words=False)


def options_markdown() -> str:
    """The whole of docs/options.md."""
    parts = [HEADER]
    for title, fields in sections():
        rows = ["| option | default | read by | what it does |", "|---|---|---|---|"]
        rows += [f"| `--{f.name}` | {_default(f.default)} | {readers(f)} | {cell(f.metadata['help'])} |"
                 for f in fields]
        parts += [f"## {title[0].upper()}{title[1:]}", "\n".join(rows)]
        if _notes(title):
            parts.append(_notes(title))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")
