"""Training a T5-layout sentencepiece tokenizer from a bounded sample of a streamed corpus.

Layout: pad 0, eos 1, unk 2, no bos, byte fallback (no unknown characters), then 100 sentinels
``<extra_id_N>`` at the end (``<extra_id_0>`` last), as in T5. Normalisation is ``identity`` so
Chinese punctuation (，。？！) survives encode -> decode (sentencepiece's default NFKC would turn
``，`` into ``,``). The result is saved as ``tokenizer.json`` that ``AutoTokenizer`` loads offline,
without protobuf and without the original ``spiece.model``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from data.objectives.base import objective_class
from data.sources.corpus import iter_rows
from data.streams.packed_text import text_slices
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import (
    MARKERS,
    check_closed,
    check_folder,
    claim_folder,
    is_ours,
    is_run_folder,
    move_in,
    remove_ours,
    saved_json,
)

EXTRA_IDS = 100
MIN_PIECES = 3 + 256  # pad, eos, unk and the byte-fallback pieces: any vocabulary needs these
STAGING = ".saving"  # inside --tokenizer_dir: the files are written here, then moved into place


# sentencepiece skips every sentence over its max_sentence_length (4,192 bytes), without a word: most
# documents of a raw-text corpus. Texts are cut at whitespace into slices of at most this many characters
# (at most 4,000 bytes of UTF-8).
SAMPLE_SLICE_CHARS = 1_000


def sample_sentences(files: list, columns: tuple[str, str], limit: int, progress: bool = False):
    """Yield up to ``limit`` texts (prompts and responses) streamed from ``files``, long ones cut into slices.

    Each file gives a share of ``limit`` in proportion to its size (equal shares where a source has no
    size, such as a dataset streamed from the hub), taken from its first rows; what a file leaves unused
    passes to the files after it. So a corpus of several files, languages or domains is sampled from all of
    them, not only from its first files.
    """
    sizes = [Path(f).stat().st_size if isinstance(f, (str, Path)) else None for f in files]
    weights = sizes if None not in sizes and sum(sizes) else [1] * len(files)
    bar = tqdm(total=limit, desc="tokenizer sample", unit="text", disable=not progress)
    taken, weight_left = 0, sum(weights)
    for index, path in enumerate(files):
        share = (limit - taken) * weights[index] // max(weight_left, 1) if index < len(files) - 1 else limit - taken
        weight_left -= weights[index]
        texts = _texts(path, index, columns)
        for text in islice(texts, share):
            yield text
            taken += 1
            bar.update()
        texts.close()  # the file, left part-read
    bar.close()


def _texts(path, index: int, columns: tuple[str, str]):
    """The texts of one file's usable rows (prompt and response; raw text: one column), in slices."""
    for item in iter_rows(path, index, columns):
        if item is not None:
            for text in (item.prompt, item.response)[:len(columns)]:
                yield from text_slices(text, SAMPLE_SLICE_CHARS)


def train_tokenizer(files: list[Path], out_dir: str | Path, columns: tuple[str, str], vocab_size: int,
                    max_sentences: int, progress: bool = False):
    """Train sentencepiece on a capped sample of ``files`` and save a transformers tokenizer.

    Memory is bounded by ``max_sentences``: sentencepiece holds only the sampled texts.

    Returns:
        The loaded tokenizer.
    """
    import sentencepiece as spm
    from tokenizers import decoders
    from tokenizers.models import Unigram
    from transformers import T5Tokenizer

    if vocab_size < MIN_PIECES:  # below this sentencepiece fails with an internal assertion
        raise UserError(f"--vocab_size={vocab_size} is below the {MIN_PIECES} pieces any tokenizer needs "
                        "(3 special pieces + 256 bytes) before this corpus's characters; raise it")
    out_dir = check_folder(out_dir, "--tokenizer_dir", "tokenizer")  # before training: a refusal costs nothing
    check_closed(out_dir, "--tokenizer_dir", "tokenizer")  # its files replaced, its staging folder filled: no link
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "spiece")
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sample_sentences(files, columns, max_sentences, progress),
                model_prefix=prefix, vocab_size=vocab_size, model_type="unigram",
                pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=True,
                normalization_rule_name="identity", character_coverage=0.9995,
                hard_vocab_limit=False,  # a small corpus gets a smaller vocabulary, no error
                minloglevel=2, num_threads=max(1, os.cpu_count() or 1))
        except RuntimeError as err:
            raise UserError(f"tokenizer training failed: {_spm_reason(err)}") from None
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
        vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in reversed(range(EXTRA_IDS))]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=EXTRA_IDS)
    # T5Tokenizer builds its Unigram without byte fallback; put it back so unseen characters
    # become bytes instead of <unk>, and decode bytes back into characters.
    tokenizer._tokenizer.model = Unigram(vocab, unk_id=2, byte_fallback=True)
    tokenizer._tokenizer.decoder = decoders.Sequence([
        decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        decoders.ByteFallback(), decoders.Fuse()])
    _save_into(out_dir, tokenizer)
    return load_tokenizer(out_dir)


def _save_into(out_dir: Path, tokenizer) -> None:
    """Save ``tokenizer`` into ``out_dir`` (claimed: new, empty or ours), staged in a folder of ours
    inside it; then its files replace those of the same names. Nothing else in the folder is touched.

    ``tokenizer.json`` moves last: a folder caught between two moves fails to load, rather than
    loading the vocabulary with another tokenizer's settings.
    """
    check_closed(out_dir, "--tokenizer_dir", "tokenizer")
    claim_folder(out_dir, "--tokenizer_dir", "tokenizer")
    staging = out_dir / STAGING
    remove_ours(staging, "tokenizer")  # left by a save that was stopped
    claim_folder(staging, "--tokenizer_dir", "tokenizer")
    tokenizer.save_pretrained(staging)
    # Load tokenizer.json as saved: T5Tokenizer's constructor would rebuild the model without
    # byte fallback on reload.
    config_path = staging / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "TokenizersBackend"
    config_path.write_text(json.dumps(tok_config, ensure_ascii=False, indent=2), encoding="utf-8")
    saved = sorted((p for p in staging.iterdir() if p.name != MARKERS["tokenizer"]),
                   key=lambda p: p.name == "tokenizer.json")
    move_in(staging, [path.name for path in saved], out_dir)
    shutil.rmtree(staging)


def vocab_shortfall(tokenizer, vocab_size: int) -> str | None:
    """A line saying so when the corpus gave fewer pieces than ``--vocab_size`` asked for
    (``hard_vocab_limit=False`` shrinks the vocabulary of a small corpus instead of failing)."""
    pieces = len(tokenizer) - EXTRA_IDS
    if pieces >= vocab_size:
        return None
    return (f"the corpus gave {pieces:,} tokenizer pieces, fewer than --vocab_size={vocab_size:,}: sentencepiece "
            f"found no more distinct pieces; the vocabulary is {len(tokenizer):,} with the {EXTRA_IDS} sentinels")


def _spm_reason(err: RuntimeError) -> str:
    text = str(err)
    if "Vocabulary size is smaller than required_chars" in text:
        needed = text.split("vs")[-1].split(".")[0].strip()
        return f"--vocab_size is below the {needed} pieces this corpus needs (characters + bytes); raise it"
    return text.splitlines()[0]


def tokenizer_sha1(tokenizer) -> str:
    """What identifies a tokenizer: its vocabulary (not the backend's JSON, which also holds the
    truncation / padding state left by the last call)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode("utf-8")
    return hashlib.sha1(vocab).hexdigest()


def tokenizer_json_sha1(tokenizer) -> str:
    """What identifies how a tokenizer splits text: its backend's whole JSON (normalizer, pre-tokenizer,
    model with its scores or merges, added tokens), less the truncation / padding state the last call left.
    Two tokenizers with one vocabulary can split one text into other ids. A tokenizer without a
    ``tokenizers`` backend (ByT5's bytes) is identified by its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer_sha1(tokenizer)
    state = json.loads(backend.to_str())
    state.update(truncation=None, padding=None)
    return hashlib.sha1(json.dumps(state, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer) -> dict:
    """The tokenizer's part of a run's settings, compared on resume (``tokenizer_json_sha1`` only where the
    checkpoint has it: runs of earlier versions recorded the vocabulary alone)."""
    return {"tokenizer_size": len(tokenizer), "tokenizer_sha1": tokenizer_sha1(tokenizer),
            "tokenizer_json_sha1": tokenizer_json_sha1(tokenizer)}


def has_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` holds a tokenizer ``AutoTokenizer`` loads: a tokenizers JSON, a sentencepiece
    model alone (t5-v1_1 and mT5 ship only ``spiece.model``), or a config naming its class (ByT5's
    byte tokenizer has no vocabulary file at all)."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file() or (folder / "spiece.model").is_file():
        return True
    # Classes that read tokenizer.json need it: a folder of ours caught between a save's moves (the config
    # moved, tokenizer.json not yet) is no tokenizer, and a run trains one there again.
    return (saved_json(folder / "tokenizer_config.json") or {}).get("tokenizer_class") not in (
        None, "", "TokenizersBackend", "PreTrainedTokenizerFast")


def not_a_run_folder(folder: str | Path) -> None:
    """Refuse a run folder given as ``--tokenizer_dir``: its tokenizer is in its exports, and a run would
    otherwise train a new one there (refused as a folder of other files, ours among them).

    Raises:
        UserError: one line naming the export to pass instead.
    """
    folder = Path(folder)
    if (folder / MARKERS["run"]).is_file() or is_run_folder(folder):
        exports = [folder / name for name in ("final", "best") if has_tokenizer(folder / name)]
        where = f"its tokenizer is in its exports: pass --tokenizer_dir={exports[0]}" if exports else \
            "it exported no tokenizer yet: pass a tokenizer folder, or a new one to train one in"
        raise UserError(f"--tokenizer_dir={folder} is a training run's folder; {where}")


def load_trained_tokenizer(folder: str | Path):
    """The tokenizer in ``--tokenizer_dir``, for commands that need one and do not train it."""
    not_a_run_folder(folder)
    if not has_tokenizer(folder):
        raise UserError(f"no tokenizer in --tokenizer_dir={folder}; train one first (python train_low_mem.py "
                        "train_tokenizer, same flags) or pass the folder that has it")
    return load_tokenizer(folder)


def load_tokenizer(path: str | Path):
    """Load a tokenizer folder offline."""
    from transformers import AutoTokenizer

    if not (Path(path) / "tokenizer.json").is_file():
        _check_sentencepiece_model(Path(path))

    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except ValueError:
            # transformers 5.24 maps model_type umt5 to a tokenizer class that cannot read a sentencepiece
            # model: a umT5 folder with spiece.model alone fails there, and T5's own class reads it.
            if not (Path(path) / "spiece.model").is_file() or (Path(path) / "tokenizer.json").is_file():
                raise
            from transformers import T5Tokenizer

            tokenizer = T5Tokenizer.from_pretrained(str(path))
    except Exception as err:  # a damaged or partly copied folder: JSON, sentencepiece or tokenizers errors
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UserError(f"the tokenizer in {path} cannot be loaded ({reason}); pass a complete tokenizer folder, "
                        "or a new folder to train one in") from err  # (--debug shows the cause)
    missing = [name for name in ("pad", "eos") if getattr(tokenizer, f"{name}_token_id") is None]
    if missing:  # T5 pads with one (its decoder starts from it) and ends every sequence with the other
        raise UserError(f"the tokenizer in {path} has no {' and no '.join(missing)} token, which a T5 needs: use "
                        "a tokenizer trained by 'train_low_mem.py train_tokenizer', or the model's own T5 tokenizer")
    return tokenizer


def tokenizer_for_run(cfg, folder: Path, files, is_main: bool = True, wait=lambda: None, say=print):
    """The tokenizer a training run uses: the one in ``folder`` (``--tokenizer_dir``, or the
    ``--init_from`` model's own), else one trained there on the training files by the main process
    (``wait``: every process waits for it). ``files``: the run's ``data.pipeline.DataFiles``.

    Raises:
        UserError: a fine-tuned model or a prepared corpus needs the tokenizer it was made with.
    """
    if is_ours(folder, "tokenizer"):  # one a run trained: its files are read, or trained again, never through a link
        check_closed(folder, "--tokenizer_dir", "tokenizer")
    if has_tokenizer(folder):
        return load_tokenizer(folder)
    not_a_run_folder(folder)
    if cfg.init_from:
        raise UserError(f"no tokenizer in --tokenizer_dir={folder}; pass the folder of the tokenizer the "
                        f"--init_from model was trained with (or leave --tokenizer_dir out to use its own)")
    if files.prepared:
        raise UserError(f"no tokenizer in --tokenizer_dir={folder}; pass the one the corpus was prepared with "
                        f"({files.prepared['tokenizer_dir']})")
    say(f"no tokenizer in {folder}: training one on {cfg.train_file}")
    if is_main:
        train_tokenizer(files.train, folder, objective_class(cfg.objective).text_columns(cfg), cfg.vocab_size,
                        cfg.tokenizer_max_sentences, progress=sys.stderr.isatty())
    wait()
    if not has_tokenizer(folder):  # trained by the main process on a disk this machine does not share
        raise UserError(f"--tokenizer_dir={folder}: the main process trained the run's tokenizer there, and this "
                        "machine cannot see it; put --tokenizer_dir on storage every machine shares")
    tokenizer = load_tokenizer(folder)
    shortfall = vocab_shortfall(tokenizer, cfg.vocab_size)
    if shortfall:
        say(shortfall)
    return tokenizer


def _check_protobuf(path) -> None:
    """transformers reads a sentencepiece model alone (t5-v1_1, mT5) through protobuf: without it one
    line, not the traceback of a conversion (an install with --no-deps, or a trimmed environment)."""
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        raise UserError(f"{path} has a sentencepiece model (spiece.model) and no tokenizer.json: reading it "
                        "needs protobuf; pip install protobuf") from None


# Tokenizer classes that read their vocabulary from spiece.model when a folder has no tokenizer.json. Without a
# readable one transformers 5 still builds them, from their special tokens alone (103 of them: every word unk).
SENTENCEPIECE_CLASSES = ("T5Tokenizer", "T5TokenizerFast", "MT5Tokenizer", "MT5TokenizerFast")


def _check_sentencepiece_model(folder: Path) -> None:
    """A folder without tokenizer.json reads its vocabulary from spiece.model: one there must be a sentencepiece
    model (an empty, cut or overwritten one, or a folder in its place, would leave a tokenizer of special tokens
    alone, which trains and scores every word as unk without a word), and a T5 class named without it is refused."""
    model = folder / "spiece.model"
    if not (model.exists() or model.is_symlink()):
        named = (saved_json(folder / "tokenizer_config.json") or {}).get("tokenizer_class")
        if named in SENTENCEPIECE_CLASSES:
            raise UserError(f"the tokenizer in {folder} is a {named}, which reads its vocabulary from spiece.model or "
                            "tokenizer.json, and the folder has neither; copy the tokenizer folder whole")
        return
    _check_protobuf(folder)
    problem = "it is not a file" if not model.is_file() else None
    if problem is None:
        import sentencepiece

        try:
            sentencepiece.SentencePieceProcessor(model_file=str(model))
        except (OSError, RuntimeError) as err:
            problem = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    if problem:
        raise UserError(f"{model} cannot be read as a sentencepiece model ({problem}), and it is the tokenizer's "
                        "vocabulary (the folder has no tokenizer.json); pass a complete tokenizer folder")
