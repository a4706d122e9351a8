"""Shared fixtures: small real corpora in several formats, the shipped tokenizer, a CLI runner."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the test helpers (t5_family)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One compute thread in each pytest worker and in every run it starts (children inherit the variable;
# accelerate and torchrun keep a value that is set). Two workers on two cores, each run asking torch
# for a thread per core, oversubscribe the cores: OpenMP's waiting threads then spin against each
# other and a tiny model's step took ~20x longer (9.0 s instead of 0.42 s, measured on the 2-core VM).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tests start ~300 CLI processes. Where PYTHONDONTWRITEBYTECODE is set (some container images set it), each
# compiled the project's own modules from source again: 0.4 s a process. The runs they start may keep that
# bytecode in the checkout's __pycache__ folders (git ignores them); the libraries' bytecode is pip's.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from config import SHIPPED_CORPORA, SHIPPED_TOKENIZER_DIR  # noqa: E402

WORDS = "the cat dog runs jumps over a lazy quick brown fox river stone light dark day night".split()


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    """Learnable prompt/response pairs: the response reverses the prompt's words."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 8))]
        rows.append({"prompt": " ".join(words), "response": " ".join(reversed(words))})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Write rows as jsonl / json / parquet / csv according to the file ending."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=64)
    elif path.suffix == ".csv":
        import csv

        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


@pytest.fixture(scope="session")
def tokenizer():
    from data.tokenization import load_tokenizer

    return load_tokenizer(SHIPPED_TOKENIZER_DIR)


@pytest.fixture(scope="session")
def shipped():
    return SHIPPED_CORPORA


def run_cli(*args: str, cwd: Path = REPO, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python train_low_mem.py ARGS`` as a user would; return the finished process."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, str(REPO / "train_low_mem.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=full_env)


def metrics(run_dir: Path) -> list[dict]:
    from lowmem.metrics import read_metrics

    return read_metrics(Path(run_dir) / "metrics.jsonl")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly on machines without CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """Model folders of every T5 family in the hub's layouts (tests/t5_family.py), built once per session."""
    from t5_family import FAMILIES, train_spiece, write_family_model

    root = tmp_path_factory.mktemp("families")
    texts = [r[c] for r in read_jsonl(SHIPPED_CORPORA["sft"][0]) for c in ("prompt", "response")]
    texts += [r[c] for r in synthetic_rows(500) for c in ("prompt", "response")]
    texts = list(dict.fromkeys(texts))  # each distinct text once: the shipped corpus repeats its Chinese pairs
    spiece = train_spiece(root / "spiece.model", texts)
    return {family: write_family_model(root / family, family, spiece) for family in FAMILIES}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
