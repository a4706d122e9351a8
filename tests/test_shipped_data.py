"""The shipped corpora and tokenizer are what data/build_shipped_data.py writes from the installed packages,
and the SFT corpus keeps the shape the default job's demo needs (both languages; Chinese training pairs written
CHINESE_REPEAT times)."""

from __future__ import annotations

import collections
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest
from conftest import REPO, read_jsonl

DATA = REPO / "data"
# The versions data/README.md names: another version may hold other rows, and then the files differ.
BUILT_FROM = {"pypinyin": "0.55.0", "chatterbot-corpus": "1.3.3"}


def build_module():
    spec = importlib.util.spec_from_file_location("build_shipped_data", DATA / "build_shipped_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def needs_source_packages():
    for name, wanted in BUILT_FROM.items():
        try:
            found = version(name)
        except PackageNotFoundError:
            pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
        if found != wanted:
            pytest.skip(f"the shipped data was built from {name} {wanted}, this is {found}")


@pytest.fixture(scope="session")
def build(processes):
    def build(out, *flags: str) -> None:
        proc = processes.run([sys.executable, str(DATA / "build_shipped_data.py"), f"--out_dir={out}", *flags],
                             capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return build


def test_shipped_corpora_are_what_the_build_script_writes(tmp_path, build):
    needs_source_packages()
    build(tmp_path, "--no_tokenizer")
    for name in ("pinyin/train.jsonl", "pinyin/eval.jsonl", "chatterbot/train.jsonl", "chatterbot/eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    assert not (tmp_path / "tokenizer").exists()


def test_shipped_tokenizer_is_what_the_build_script_trains(tmp_path, build):
    # The Chinese rows written several times into chatterbot/train.jsonl count once for the vocabulary.
    needs_source_packages()
    build(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "tokenizer" / name).read_bytes() == (DATA / "tokenizer" / name).read_bytes(), name


def test_sft_corpus_writes_chinese_training_pairs_chinese_repeat_times():
    build_shipped = build_module()
    times = build_shipped.CHINESE_REPEAT
    train = read_jsonl(DATA / "chatterbot" / "train.jsonl")
    held = read_jsonl(DATA / "chatterbot" / "eval.jsonl")
    counts = collections.Counter(zip((r["prompt"] for r in train), (r["response"] for r in train)))
    chinese = {pair: n for pair, n in counts.items() if build_shipped.HAN.search("".join(pair))}
    assert times >= 1 and chinese and all(n % times == 0 for n in chinese.values())
    # Eval rows are drawn before the repetition: no Chinese eval row comes in copies.
    held_chinese = collections.Counter((r["prompt"], r["response"]) for r in held if build_shipped.is_chinese(r))
    assert held_chinese and max(held_chinese.values()) == 1
    # generate answers the first eval prompts: the demo shows both languages.
    first = [build_shipped.is_chinese(r) for r in held[:5]]
    assert any(first) and not all(first)
