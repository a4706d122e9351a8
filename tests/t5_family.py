"""Model folders laid out as the hub's T5-family releases, built offline from configs (never downloaded).

    original T5     model_type t5, ReLU feed-forward, head tied to the embedding, tokenizer.json + spiece.model
    flan-t5         gated-gelu, untied lm_head, embedding padded past the tokenizer, spiece.model +
                    tokenizer.json, model.safetensors, generation_config.json
    t5-v1_1         gated-gelu, untied, spiece.model alone (no tokenizer.json), pytorch_model.bin
    mT5             model_type mt5, gated, untied, padded, spiece.model alone, pytorch_model.bin
    umT5            model_type umt5 (a relative position table in every layer), gated, untied, spiece.model alone
    ByT5            model_type t5, gated, untied, 384 rows: the byte tokenizer, no vocabulary file

Shapes are tiny (d_model 64, 2 encoder and 3 decoder layers) so the tests run on a CPU in seconds.
``hub_cache`` serves a folder under a hub id from a local Hugging Face cache (HF_HOME), as a download
would have left it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FAMILIES = ("t5", "flan", "v1_1", "mt5", "umt5", "byt5")
TINY = dict(d_model=64, d_ff=128, num_heads=2, d_kv=32, num_layers=2, num_decoder_layers=3)
SPM_PIECES = 400
EXTRA_IDS = 100


def train_spiece(path: Path, texts: list[str]) -> Path:
    """A T5-layout sentencepiece model (pad 0, eos 1, unk 2, no bos), as Google's spiece.model."""
    import sentencepiece as spm

    prefix = path.with_suffix("")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=SPM_PIECES,
                                   pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=0.98,
                                   hard_vocab_limit=False, minloglevel=2, num_threads=1)
    Path(str(prefix) + ".vocab").unlink()
    return Path(str(prefix) + ".model")


def _tokenizer_files(folder: Path, family: str, spiece: Path | None) -> int:
    """Write the family's tokenizer files; returns the tokenizer's size."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    if family == "byt5":
        tokenizer = ByT5Tokenizer()
        tokenizer.save_pretrained(folder)
        return len(tokenizer)
    shutil.copyfile(spiece, folder / "spiece.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "T5Tokenizer", "extra_ids": EXTRA_IDS, "model_max_length": 512, "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>"}), encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "additional_special_tokens": [f"<extra_id_{i}>" for i in range(EXTRA_IDS)]}), encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if family in ("t5", "flan"):  # these releases carry both files
        tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))
    return len(tokenizer)


def write_family_model(folder: Path, family: str, spiece: Path | None, seed: int = 0) -> Path:
    """A model folder of ``family`` (see the module docstring) with random weights; returns ``folder``."""
    from safetensors.torch import save_file
    from transformers import (
        MT5Config,
        MT5ForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
        UMT5Config,
        UMT5ForConditionalGeneration,
    )

    folder.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer_files(folder, family, spiece)
    tied = family == "t5"
    rows = vocab if family in ("t5", "byt5") else -(-vocab // 128) * 128 + 128  # Google pads past the tokenizer
    classes = {"mt5": (MT5Config, MT5ForConditionalGeneration), "umt5": (UMT5Config, UMT5ForConditionalGeneration)}
    config_class, model_class = classes.get(family, (T5Config, T5ForConditionalGeneration))
    config = config_class(vocab_size=rows, feed_forward_proj="relu" if tied else "gated-gelu",
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **TINY)
    torch.manual_seed(seed)
    model = model_class(config)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
               if k not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")}
    if tied:
        weights.pop("lm_head.weight", None)
    else:  # a head of its own, as v1.1 and later train it
        weights["lm_head.weight"] = torch.randn(rows, TINY["d_model"]) * TINY["d_model"] ** -0.5
    if family in ("v1_1", "mt5"):  # these releases ship the older pickle-free-loaded .bin only
        torch.save(weights, folder / "pytorch_model.bin")
    else:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict()
    saved.pop("scale_decoder_outputs", None)
    saved.update(tie_word_embeddings=tied, architectures=[model_class.__name__])
    (folder / "config.json").write_text(json.dumps(saved, indent=2), encoding="utf-8")
    if family == "flan":
        (folder / "generation_config.json").write_text(json.dumps(
            {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}), encoding="utf-8")
    return folder


def hub_cache(root: Path, repo_id: str, source: Path, commit: str = "a" * 40) -> dict:
    """Serve ``source`` as ``repo_id`` from a Hugging Face cache under ``root``; returns the environment
    (HF_HOME, HF_HUB_OFFLINE=1) a process needs to resolve the id there without any network."""
    repo = Path(root) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return {"HF_HOME": str(root), "HF_HUB_OFFLINE": "1"}
