"""Tokenizer training: T5 id layout, offline reload without protobuf, Chinese punctuation."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO, write_rows

from data.tokenization import train_tokenizer, vocab_shortfall
from lowmem.utils.errors import UserError

CHINESE = "你好，世界。今天天气怎么样？很好！我们去公园吧。"


def test_trained_tokenizer_layout_and_round_trip(tmp_path):
    rows = [{"prompt": f"{CHINESE} 第{i}句话", "response": f"hello world number {i}, fine."} for i in range(400)]
    corpus = write_rows(tmp_path / "c.jsonl", rows)
    with pytest.raises(UserError, match="--vocab_size is below"):
        train_tokenizer([corpus], tmp_path / "bad", ("prompt", "response"), vocab_size=300, max_sentences=500)
    with pytest.raises(UserError, match="--vocab_size=1 is below the 259 pieces any tokenizer needs"):
        train_tokenizer([corpus], tmp_path / "bad", ("prompt", "response"), vocab_size=1, max_sentences=500)
    tok = train_tokenizer([corpus], tmp_path / "tok", ("prompt", "response"), vocab_size=600, max_sentences=500)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.bos_token_id is None
    # This corpus has fewer distinct pieces than asked for: a smaller vocabulary, said aloud.
    assert len(tok) < 700 and vocab_shortfall(tok, len(tok) - 100) is None
    assert f"gave {len(tok) - 100:,} tokenizer pieces, fewer than --vocab_size=600" in vocab_shortfall(tok, 600)
    assert tok.convert_tokens_to_ids("<extra_id_0>") == len(tok) - 1
    assert tok.convert_tokens_to_ids("<extra_id_99>") == len(tok) - 100
    for text in (CHINESE, "Unseen: 🙂 ünï ｑ", "pinyin nǐ hǎo"):
        ids = tok(text).input_ids
        assert ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids  # byte fallback: no <unk>
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_loads_offline_without_protobuf(tmp_path, processes):
    code = ("import sys; from transformers import AutoTokenizer; "
            f"t = AutoTokenizer.from_pretrained({str(REPO / 'data' / 'tokenizer')!r}); "
            f"assert t.decode(t({CHINESE!r}).input_ids, skip_special_tokens=True) == {CHINESE!r}; "
            "assert 'google.protobuf' not in sys.modules; print(len(t))")
    proc = processes.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) == 8100


def test_sampling_is_capped(tmp_path):
    from data.tokenization import sample_sentences

    corpus = write_rows(tmp_path / "c.jsonl", [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(1000)])
    assert sum(1 for _ in sample_sentences([corpus], ("prompt", "response"), limit=123)) == 123


def made_up_words(seed: int, count: int) -> list[str]:
    import random

    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ra", "tu", "ne", "zo", "pi", "qua", "sh", "ve", "do"]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))) for _ in range(count)]


def tokens_per_word(tok, text: str) -> float:
    return len(tok(text, add_special_tokens=False).input_ids) / len(text.split())


def test_long_documents_shape_the_vocabulary(tmp_path):
    """sentencepiece skips, without a word, every sentence over 4,192 bytes: documents are sampled in slices."""
    import random

    rng, words = random.Random(0), made_up_words(1, 150)
    documents = [{"text": " ".join(rng.choice(words) for _ in range(1500))} for _ in range(30)]  # ~10 KB each
    assert min(len(d["text"].encode()) for d in documents) > 4192
    corpus = write_rows(tmp_path / "long.jsonl", documents)
    tok = train_tokenizer([corpus], tmp_path / "tok", ("text",), vocab_size=600, max_sentences=10_000)
    assert tokens_per_word(tok, documents[0]["text"]) < 1.5  # 6.9 (bytes and letters) when they were skipped


def test_the_sample_comes_from_every_file(tmp_path):
    """A cap smaller than the first file still samples the files after it (in proportion to their sizes)."""
    import random

    rng = random.Random(0)
    first, second = made_up_words(2, 100), made_up_words(3, 100)
    files = [write_rows(tmp_path / name, [{"text": " ".join(rng.choice(words) for _ in range(12))}
                                          for _ in range(3000)])
             for name, words in (("a.jsonl", first), ("b.jsonl", second))]
    tok = train_tokenizer(files, tmp_path / "tok", ("text",), vocab_size=600, max_sentences=3000)
    for words in (first, second):
        assert tokens_per_word(tok, " ".join(words)) < 1.5  # the second file's: 6.9 when only the first was sampled


def test_a_tokenizer_without_pad_or_eos_is_refused_in_one_line(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from data.tokenization import load_tokenizer

    words = Tokenizer(WordLevel({"stone": 0, "river": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "words")
    with pytest.raises(UserError, match="has no pad and no eos token, which a T5 needs"):
        load_tokenizer(tmp_path / "words")


def test_a_tokenizer_is_identified_by_how_it_splits_text_not_by_its_vocabulary_alone(tmp_path):
    """A normalizer changed under the same vocabulary gives other ids for one text: the encoder cache and a
    resume must see another tokenizer (the cache was reused, and its losses were not the uncached run's)."""
    import json
    import shutil

    from config import SHIPPED_TOKENIZER_DIR
    from data.tokenization import load_tokenizer, tokenizer_json_sha1, tokenizer_sha1

    shutil.copytree(SHIPPED_TOKENIZER_DIR, tmp_path / "changed")
    state = json.loads((tmp_path / "changed" / "tokenizer.json").read_text(encoding="utf-8"))
    state["normalizer"] = {"type": "Replace", "pattern": {"String": "a"}, "content": "o"}
    (tmp_path / "changed" / "tokenizer.json").write_text(json.dumps(state), encoding="utf-8")
    shipped, changed = load_tokenizer(SHIPPED_TOKENIZER_DIR), load_tokenizer(tmp_path / "changed")
    assert shipped("the cat").input_ids != changed("the cat").input_ids
    assert tokenizer_sha1(shipped) == tokenizer_sha1(changed)  # the vocabulary alone cannot tell them apart
    assert tokenizer_json_sha1(shipped) != tokenizer_json_sha1(changed)
    before = tokenizer_json_sha1(shipped)
    shipped(["the cat runs"], truncation=True, max_length=2, padding="max_length")  # leaves state in the backend
    assert tokenizer_json_sha1(shipped) == before


def test_a_run_folder_as_tokenizer_dir_names_its_export(tmp_path, cli_in_process):
    """A run folder passed as --tokenizer_dir used to start training a tokenizer into it, then be refused as a
    folder of files 't5-lowmem did not write' (its own marker among them): now one line names the export."""
    import shutil

    from config import SHIPPED_TOKENIZER_DIR
    from data.tokenization import load_trained_tokenizer
    from lowmem.utils.ownership import STARTED_MARKER

    run = tmp_path / "run"
    run.mkdir()
    (run / STARTED_MARKER).write_text("")
    with pytest.raises(UserError, match="is a training run's folder; it exported no tokenizer yet"):
        load_trained_tokenizer(run)
    shutil.copytree(SHIPPED_TOKENIZER_DIR, run / "final")
    before = sorted(p.name for p in run.iterdir())
    proc = cli_in_process("train", f"--tokenizer_dir={run}", f"--output_dir={tmp_path / 'out'}", "--max_steps=1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    expected = (f"error: --tokenizer_dir={run} is a training run's folder; its tokenizer is in its exports: pass "
                f"--tokenizer_dir={run / 'final'}")
    assert proc.stderr.strip().splitlines()[-1] == expected
    assert sorted(p.name for p in run.iterdir()) == before
