"""Bring your own T5: SFT, continued pretraining and full fine-tuning of every T5 family, by folder and by
hub id (served from a local Hugging Face cache), through the real CLI.

Each run checks what a user relies on: the loss falls, exactly the frozen tensors stay bit-identical
and the rest move, the export loads with the Auto classes as the same family with the source's
tokenizer files and ids, and ``evaluate`` on the export gives the run's last eval loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import metrics, synthetic_rows, write_rows
from t5_family import hub_cache

from data.tokenization import load_tokenizer

TEXTS = ["the quick brown fox jumps over a lazy dog", "What is AI?", "night river stone, day light"]
FAST = ["--max_steps=6", "--eval_steps=6", "--batch_size=2", "--gradient_accumulation_steps=2",
        "--max_eval_samples=8", "--max_source_len=24", "--max_target_len=24", "--warmup_steps=0",
        "--learn_rate=1e-2", "--logging_steps=3", "--dropout_rate=0.0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_corpus")
    return write_rows(root / "train.jsonl", synthetic_rows(96, seed=1)), write_rows(root / "eval.jsonl",
                                                                                    synthetic_rows(8, seed=2))


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """A model folder's tensors by name, loaded the way transformers loads them (the embedding as shared.weight)."""
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(str(folder))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="session")
def train(run_cli):
    def train(corpus, out: Path, init_from: str, *flags: str, env: dict | None = None):
        train_file, eval_file = corpus
        proc = run_cli("train", f"--init_from={init_from}", f"--train_file={train_file}", f"--eval_file={eval_file}",
                       f"--output_dir={out}", *FAST, *flags, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        evals = [r["eval_loss"] for r in metrics(out) if r["event"] == "eval"]
        assert len(evals) == 2 and evals[-1] < evals[0], evals  # step 0, then step 6: the loss fell
        return proc, evals[-1]
    return train


def check_frozen(source: dict, trained: dict, frozen) -> None:
    """Tensors ``frozen(name)`` names are bit-identical to the source; every other tensor moved."""
    assert source.keys() == trained.keys()
    kept = [n for n in source if frozen(n)]
    moved = [n for n in source if not frozen(n)]
    assert all(torch.equal(source[n], trained[n]) for n in kept), [n for n in kept
                                                                   if not torch.equal(source[n], trained[n])]
    assert all(not torch.equal(source[n], trained[n]) for n in moved), [n for n in moved
                                                                        if torch.equal(source[n], trained[n])]


@pytest.fixture(scope="session")
def check_export(run_cli):
    def check_export(source_dir: Path, export: Path, last_eval_loss: float | None = None,
                     eval_file: Path | None = None):
        """The export is the source's family with its tokenizer, and (given the run's last eval loss) evaluates
        to it."""
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        src_cfg = json.loads((source_dir / "config.json").read_text())
        out_cfg = json.loads((export / "config.json").read_text())
        for key in ("model_type", "architectures", "feed_forward_proj", "tie_word_embeddings", "vocab_size"):
            assert out_cfg.get(key) == src_cfg.get(key), key
        for name in ("spiece.model", "tokenizer.json"):
            if (source_dir / name).is_file():
                assert (export / name).read_bytes() == (source_dir / name).read_bytes()
        model = AutoModelForSeq2SeqLM.from_pretrained(str(export))
        source_model = AutoModelForSeq2SeqLM.from_pretrained(str(source_dir))
        assert type(model) is type(source_model)
        assert (model.lm_head.weight is model.shared.weight) == src_cfg["tie_word_embeddings"]
        # The source through the trainer's loader (transformers' AutoTokenizer cannot read umT5's spiece.model alone)
        source_tok, export_tok = load_tokenizer(source_dir), AutoTokenizer.from_pretrained(str(export))
        assert [source_tok(t).input_ids for t in TEXTS] == [export_tok(t).input_ids for t in TEXTS]
        if last_eval_loss is None:
            return
        proc = run_cli("evaluate", f"--init_from={export}", f"--eval_file={eval_file}", "--max_eval_samples=8",
                       "--max_source_len=24", "--max_target_len=24")
        assert proc.returncode == 0, proc.stderr[-3000:]
        evaluated = float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("eval_loss:")))
        assert evaluated == pytest.approx(last_eval_loss, rel=1e-4, abs=1e-4)
    return check_export


def is_embedding(name: str) -> bool:
    return name == "shared.weight"


def is_encoder_or_embedding(name: str) -> bool:
    return name.startswith("encoder.") or is_embedding(name)


@pytest.mark.parametrize("family", ["flan", "v1_1", "mt5", "byt5", "t5", "umt5"])
def test_sft_continued_pretraining_and_full_finetune(family, family_models, corpus, tmp_path, check_export, train):
    """Each family by folder: SFT freezes the encoder and embedding (an untied lm_head trains), continued
    pretraining (three families) and --freeze=none move every tensor; each export is the same family and
    evaluates alike."""
    source = family_models[family]
    before = weights(source)
    tied = json.loads((source / "config.json").read_text())["tie_word_embeddings"]

    proc, last = train(corpus, tmp_path / "sft", str(source), "--is_finetune=True")
    assert ("untied lm_head trains" in proc.stdout) != tied
    check_frozen(before, weights(tmp_path / "sft" / "final"), is_encoder_or_embedding)
    check_export(source, tmp_path / "sft" / "final", last, corpus[1])

    if family in ("t5", "flan", "mt5"):  # continued pretraining (tied, untied and gated, a large vocabulary)
        train(corpus, tmp_path / "pretrain", str(source))  # every weight trains
        check_frozen(before, weights(tmp_path / "pretrain" / "final"), lambda _name: False)
        check_export(source, tmp_path / "pretrain" / "final")

    if family == "flan":  # the two other --freeze choices, on an untied and gated model
        train(corpus, tmp_path / "full", str(source), "--is_finetune=True", "--freeze=none")
        check_frozen(before, weights(tmp_path / "full" / "final"), lambda _name: False)
        train(corpus, tmp_path / "emb", str(source), "--is_finetune=True", "--freeze=embeddings")
        check_frozen(before, weights(tmp_path / "emb" / "final"), is_embedding)


def test_sft_by_hub_id_from_the_local_cache(family_models, corpus, tmp_path, check_export, run_cli, train):
    """A hub id resolves through the Hugging Face cache (offline here, as HF_HUB_OFFLINE=1 asks), and
    plan, train and the export work as with the folder."""
    env = hub_cache(tmp_path / "hf", "acme/flan-t5-tiny", family_models["flan"])
    plan = run_cli("plan", "--json", "--is_finetune=True", "--init_from=acme/flan-t5-tiny",
                   f"--train_file={corpus[0]}", f"--eval_file={corpus[1]}", env=env)
    assert plan.returncode == 0, plan.stderr[-2000:]
    _, last = train(corpus, tmp_path / "sft", "acme/flan-t5-tiny", "--is_finetune=True", env=env)
    check_export(family_models["flan"], tmp_path / "sft" / "final", last, corpus[1])
    missing = run_cli("train", "--is_finetune=True", "--init_from=acme/not-cached", f"--output_dir={tmp_path / 'x'}",
                      env=env)
    assert missing.returncode == 2 and "not in the Hugging Face cache" in missing.stderr
    assert not (tmp_path / "x").exists()


def test_lora_reaches_the_gated_feed_forward(family_models, corpus, tmp_path, run_cli, train):
    """--lora_target_modules=wi adapts wi_0 and wi_1 of a gated decoder: they (merged) move, nothing else does;
    a name the model lacks is one error line naming the layers it has."""
    source = family_models["flan"]
    before = weights(source)
    train(corpus, tmp_path / "lora", str(source), "--is_finetune=True", "--lora_r=4", "--lora_target_modules=wi",
          "--lora_dropout=0.0", "--merge_lora=True")  # a whole merged export (the default is the adapter folder)
    check_frozen(before, weights(tmp_path / "lora" / "final"),
                 lambda name: not (name.startswith("decoder.") and (".wi_0." in name or ".wi_1." in name)))
    proc = run_cli("train", "--is_finetune=True", f"--init_from={family_models['t5']}", "--lora_r=4",
                   "--lora_target_modules=wi_0", f"--train_file={corpus[0]}", f"--eval_file={corpus[1]}",
                   f"--output_dir={tmp_path / 'bad'}", *FAST)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "names wi_0, which this model does not have" in proc.stderr and "q, k, v, o, wi, wo" in proc.stderr
    assert not (tmp_path / "bad").exists()  # refused before the run folder is made


def test_tokenizer_larger_than_the_embedding_is_one_line(family_models, corpus, tmp_path, cli_in_process):
    """A padded embedding (640 rows for 500 tokens) trains; a tokenizer past the embedding does not."""
    proc = cli_in_process("train", "--is_finetune=True", f"--init_from={family_models['byt5']}",
                          f"--tokenizer_dir={family_models['flan']}", f"--train_file={corpus[0]}",
                          f"--eval_file={corpus[1]}", f"--output_dir={tmp_path / 'run'}", *FAST)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "the tokenizer has 500 tokens but the model's embedding only 384 rows" in proc.stderr


def test_a_column_of_numbers_or_booleans_is_named(tmp_path, cli_in_process):
    numbers = write_rows(tmp_path / "numbers.jsonl", [{"prompt": f"what is {i}", "response": i} for i in range(40)])
    flags = write_rows(tmp_path / "flags.parquet", [{"prompt": f"is {i} even", "answer": i % 2 == 0}
                                                    for i in range(40)])
    proc = cli_in_process("train", f"--train_file={numbers}", f"--output_dir={tmp_path / 'a'}")
    assert proc.returncode == 2 and "column 'response'" in proc.stderr
    assert "holds numbers (int), not text" in proc.stderr
    proc = cli_in_process("train", f"--train_file={flags}", "--response_column=answer",
                          f"--output_dir={tmp_path / 'b'}")
    assert proc.returncode == 2 and "column 'answer'" in proc.stderr and "holds booleans, not text" in proc.stderr
