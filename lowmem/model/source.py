"""Where a run's starting model comes from: ``--init_from`` as a local folder or a hub id, its
family (T5, T5 v1.1 / flan-t5, mT5, umT5, ByT5), its own tokenizer, and the tokenizer files an
export carries.

A hub id resolves as ``from_pretrained`` resolves one: the Hugging Face cache first, the hub when
online, and ``HF_HUB_OFFLINE`` / ``HF_HOME`` as the user set them (this project never sets them).
It resolves once per process to the cached snapshot folder, so everything after reads a plain
local folder.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

from data.tokenization import has_tokenizer, load_tokenizer, tokenizer_sha1
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import saved_json

# model_type values of the T5 family; each loads with AutoModelForSeq2SeqLM (T5-, MT5-, UMT5ForConditionalGeneration).
T5_FAMILY = ("t5", "mt5", "umt5")
# What a model folder's tokenizer may be saved as: a tokenizers JSON, a sentencepiece model (t5-v1_1 and mT5
# ship only this), or ByT5's byte tokenizer, which has no vocabulary file at all (its tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json")
# Hub files worth fetching: config, weights (safetensors; the older .bin only where a repository has no
# safetensors) and tokenizer. Not the TensorFlow, Flax, Rust or ONNX copies most T5 repositories also hold.
HUB_FILES = ["*.json", "*.safetensors", "*.model"]
HUB_FALLBACK_WEIGHTS = ["pytorch_model*.bin"]
# A LoRA run's export (lowmem.model.adapters): peft's adapter folder
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@functools.cache
def resolve_model_dir(init_from: str) -> Path:
    """The local folder ``--init_from`` names: the folder itself, or a hub id's snapshot in the cache.

    Raises:
        UserError: neither a folder nor a resolvable hub id (one line: what was tried, what to change).
    """
    path = Path(init_from).expanduser()
    if path.exists() or not _looks_like_repo_id(init_from):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = Path(snapshot_download(init_from, allow_patterns=HUB_FILES))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(init_from, allow_patterns=HUB_FALLBACK_WEIGHTS))
    except GatedRepoError:
        raise UserError(f"--init_from={init_from} is a gated hub model: accept its terms on the hub and log in "
                        "(hf auth login), then run again") from None
    except RepositoryNotFoundError:
        raise UserError(f"--init_from={init_from} is neither a local folder nor a model on the hub (or it is "
                        "private: log in with hf auth login); check the path or the id") from None
    except LocalEntryNotFoundError:
        raise UserError(f"--init_from={init_from} is not a local folder and not in the Hugging Face cache, and the "
                        "hub cannot be reached (offline, or HF_HUB_OFFLINE=1); download it once online, or pass "
                        "the model's folder") from None
    except (HfHubHTTPError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"--init_from={init_from}: the hub download failed ({reason}); run again, or pass the "
                        "model's folder") from None
    return folder


def _looks_like_repo_id(text: str) -> bool:
    """Whether ``text`` could be a hub model id (``name`` or ``owner/name``), not a filesystem path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def model_folder_config(init_from: str | Path) -> dict:
    """The saved config of the T5-family model ``--init_from`` names (a folder, a run's best/ or final/,
    or a hub id).

    A training run's own folder also holds a config.json (the run's flags), so the file alone
    does not make a model folder: its ``model_type`` must be one of the T5 family.
    """
    folder = resolve_model_dir(str(init_from))
    base = adapter_base(folder)
    if base is not None:  # a LoRA run's export: the model is its base's
        return model_folder_config(base)
    inside = [folder / name for name in ("best", "final") if (folder / name / "config.json").is_file()]
    fix = (f"it is a training run's folder: pass --init_from={inside[0]}" if inside
           else "point it at a model folder (a run's best/ or final/, a downloaded T5) or a hub id such as "
                "google/flan-t5-small (pretrain first: python train_low_mem.py train)")
    if not (folder / "config.json").is_file():
        raise UserError(f"--init_from={init_from} is not a model folder (no config.json); {fix}")
    saved = saved_json(folder / "config.json")
    if saved is None:
        raise UserError(f"--init_from={init_from}: its config.json cannot be read as JSON; {fix}")
    if saved.get("model_type") not in T5_FAMILY:
        kind = saved.get("model_type")
        what = f"a {kind} model's config" if kind else "no model's config"
        raise UserError(f"--init_from={init_from} is not a T5-family model folder (its config.json is {what}; "
                        f"model_type must be one of {', '.join(T5_FAMILY)}); {fix}")
    return saved


def adapter_base(folder: Path) -> str | None:
    """The base model an adapter folder adapts (its ``base_model_name_or_path``); None for any other folder."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or (folder / "config.json").is_file():
        return None
    try:
        return json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (ValueError, KeyError, TypeError):
        return None


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_weights(init_from: str | Path, headers: bool = True) -> None:
    """Refuse a model folder (an adapter folder's base, a hub id's cached copy) whose weights ``from_pretrained``
    cannot read as its config's model, from the files' headers only (``lowmem.model.weight_check``): no weights
    file (a hub id's cache holds none when only its tokenizer or config was fetched), a damaged or pickled one, an
    index naming files outside the folder, or a config.json that disagrees with the weights.

    ``headers``: False checks only that weight files are there (no torch import: the command line's first checks).
    """
    folder = resolve_model_dir(str(init_from))
    base = adapter_base(folder)
    if base is not None:
        if not (folder / ADAPTER_WEIGHTS).is_file():
            raise UserError(f"--init_from={init_from} is an adapter folder without {ADAPTER_WEIGHTS}; pass a "
                            "complete export")
        if headers:
            from lowmem.model.weight_check import check_adapter_folder

            check_adapter_folder(folder, f"--init_from={init_from}", ADAPTER_WEIGHTS)
        return check_weights(base, headers)
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        hub = "" if Path(str(init_from)).expanduser().exists() else \
            " (its cached copy has no weights: only its tokenizer or config was fetched; download it online once)"
        raise UserError(f"--init_from={init_from} holds no weights: {folder} has none of {', '.join(WEIGHT_FILES)}"
                        f"{hub}; pass a complete model folder")
    if headers:
        from lowmem.model.weight_check import check_model_folder

        check_model_folder(folder, f"--init_from={init_from}")


def refuse_untrained(cfg) -> None:
    """Refuse SFT from a model its run exported before any optimizer step: a run stopped (or refused) early
    leaves its step-0 evaluation's best/, the random initial weights, which SFT would start from (and freeze)."""
    info = saved_json(resolve_model_dir(str(cfg.init_from)) / "training_info.json") or {}
    if cfg.is_finetune and info.get("step") == 0:
        raise UserError(f"--init_from={cfg.init_from} is the untrained model its run exported at step 0, before "
                        f"its first optimizer step: SFT would start from random weights"
                        f"{' and keep them frozen' if cfg.freeze != 'none' else ''}; finish that run (the same "
                        "command plus --is_keep_training=True), or pass another --init_from")


def tokenizer_folder(cfg) -> Path:
    """The tokenizer a run uses: ``--tokenizer_dir``, else the ``--init_from`` model's own.

    Raises:
        UserError: the model folder has no tokenizer and none was given.
    """
    if cfg.tokenizer_dir is not None:
        return Path(cfg.tokenizer_dir)
    model_folder_config(cfg.init_from)  # first whether it is a model at all (a run's folder names its best/)
    folder = resolve_model_dir(cfg.init_from)
    if not has_tokenizer(folder):
        raise UserError(f"--init_from={cfg.init_from} has no tokenizer (no tokenizer.json, spiece.model or "
                        "tokenizer_config.json); pass --tokenizer_dir=FOLDER with the tokenizer the model was "
                        "trained with")
    return folder


def tokenizer_for_model(cfg, files, tokenizer=None, folder: Path | None = None) -> tuple[Path | None, object]:
    """(folder, tokenizer) of a run from ``--init_from``: ``--tokenizer_dir``, else the model's own, or
    ``tokenizer`` (one handed in, from ``folder``), checked against the model before the run writes anything.
    ``files``: the run's ``data.pipeline.DataFiles``.

    Raises:
        UserError: no tokenizer there, or not one that fits the model (``check_vocabulary``).
    """
    from data.tokenization import tokenizer_for_run

    if tokenizer is None:
        folder = tokenizer_folder(cfg)
        tokenizer = tokenizer_for_run(cfg, folder, files)
    check_vocabulary(cfg, model_folder_config(cfg.init_from)["vocab_size"], tokenizer)
    return folder, tokenizer


def copy_tokenizer_files(source: Path, target: Path) -> None:
    """Make an export's tokenizer files the source tokenizer's own, beside what ``save_pretrained`` wrote.

    transformers 5 saves a sentencepiece tokenizer as tokenizer.json only, so ``spiece.model`` (which
    slow tokenizers, older transformers and other tools read) is copied; the source's tokenizer.json
    replaces the saved one, which carries the truncation the collator set at its last call (a reader
    using the tokenizers library directly would cut every text at --max_source_len). A tokenizer.json
    the source lacks (``spiece.model`` alone) is written without that state.
    """
    saved = target / "tokenizer.json"
    if saved.is_file():
        state = json.loads(saved.read_text(encoding="utf-8"))
        if state.get("truncation") or state.get("padding"):
            state.update(truncation=None, padding=None)
            saved.write_text(json.dumps(state, ensure_ascii=False, indent=2), encoding="utf-8")
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and (name in ("tokenizer.json", "spiece.model") or not (target / name).exists()):
            shutil.copyfile(source / name, target / name)


def check_vocabulary(cfg, rows: int, tokenizer, model_dir: Path | None = None) -> None:
    """The tokenizer must fit the model: no id past its embedding (Google's checkpoints pad the
    embedding past the tokenizer, 32,128 rows for 32,100 pieces: rows never produced, which is
    fine), and it must be the one saved with the model if the model has one (a tokenizer with
    other words would feed the model wrong ids silently).

    ``rows``: the model's embedding rows (``vocab_size``).

    Raises:
        UserError: either is not so.
    """
    if len(tokenizer) > rows:
        raise UserError(f"the tokenizer has {len(tokenizer):,} tokens but the model's embedding only "
                        f"{rows:,} rows: ids past {rows - 1:,} have no embedding; pass the --tokenizer_dir the "
                        "model was trained with (or leave it out to use the model's own)")
    saved = model_dir or (resolve_model_dir(cfg.init_from) if cfg.init_from else None)
    if saved and cfg.tokenizer_dir is not None and has_tokenizer(saved) \
            and saved.resolve() != Path(cfg.tokenizer_dir).resolve():
        if tokenizer_sha1(load_tokenizer(saved)) != tokenizer_sha1(tokenizer):
            raise UserError(f"--tokenizer_dir={cfg.tokenizer_dir} is not the tokenizer saved with the model "
                            f"{saved} (other words); leave --tokenizer_dir out to use that one")
