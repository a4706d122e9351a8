"""``prepare``: tokenize a corpus once into parquet shards that training streams directly.

    python train_low_mem.py prepare --train_file=corpus.jsonl --prepared_dir=corpus.prepared
    python train_low_mem.py train --train_file=corpus.prepared

Each shard holds the columns ``input_ids`` and ``labels`` (token ids, already truncated) in row
groups of ``GROUP_ROWS`` rows; ``prepared.manifest`` (JSON) records the tokenizer's fingerprint, the length
limits, the source files and the bad rows that were skipped. Training from the shards skips
tokenization in every epoch, and refuses a different tokenizer or longer limits than the shards
were cut to. Memory stays bounded: rows are read one at a time and written ``GROUP_ROWS`` at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from data.sources.corpus import DataProblems, iter_rows, spec_parts, too_many_bad_rows
from data.sources.readers import MANIFEST, TOKEN_COLUMNS, manifest_of
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import MARKERS, check_closed, check_folder, claim_folder, move_in, remove_ours

GROUP_ROWS = 4096  # rows tokenized and written at once (one parquet row group)
SHARD_ROWS = 25 * GROUP_ROWS  # 102,400 rows per shard (whole row groups): several shards let each epoch visit
# them in a new order
STAGING = ".partial"  # inside --prepared_dir: shards are written here, then moved into place


def prepare_command(cfg, out_dir: Path, tokenizer_dir: Path) -> dict:
    """The ``prepare`` command: resolve and check the corpus, load the tokenizer, write the shards."""
    from data.collate import Seq2SeqCollator
    from data.objectives.base import objective_class
    from data.sources.corpus import check_columns, resolve_files
    from data.tokenization import load_trained_tokenizer

    if not objective_class(cfg.objective).prepared_data:
        raise UserError(f"prepare tokenizes prompt/response pairs; --objective={cfg.objective} reads raw text, "
                        "which train tokenizes as it packs: train from the text corpus directly")
    check_prepared_dir(out_dir)  # before any work
    for part in (Path(p).expanduser() for p in spec_parts(cfg.train_file)):
        if part.is_dir() and part.resolve() in [out_dir.resolve(), *out_dir.resolve().parents]:
            raise UserError(f"--prepared_dir={out_dir} is inside --train_file={part}: its shards would be read as "
                            "training data; choose a --prepared_dir outside it")
    files = resolve_files(cfg.train_file, "--train_file", dataset_config=cfg.dataset_config)
    if manifest_of(files):
        raise UserError(f"--train_file={cfg.train_file} is prepared already; train from it directly")
    columns = (cfg.prompt_column, cfg.response_column)
    check_columns(files, columns, "--train_file")
    tokenizer = load_trained_tokenizer(tokenizer_dir)
    collator = Seq2SeqCollator(tokenizer, cfg.max_source_len, cfg.max_target_len)
    manifest = prepare(cfg, files, collator, out_dir, tokenizer_dir)
    return {"prepared_dir": str(out_dir), "rows": manifest["rows"], "tokens": manifest["tokens"],
            "shards": len(manifest["shards"]), "bad_rows": manifest["bad_rows"]}


def check_manifest(manifest: dict, tokenizer: dict, max_source_len: int, max_target_len: int) -> None:
    """Refuse shards made with another tokenizer (``tokenizer``: its ``tokenizer_fingerprint``, compared on
    what the manifest records), or cut shorter than this run's limits."""
    if any(manifest[key] != value for key, value in tokenizer.items() if key in manifest):
        raise UserError(f"--train_file was prepared with another tokenizer ({manifest['tokenizer_dir']}); pass "
                        "that --tokenizer_dir, or prepare the corpus again with this one")
    for flag, limit in (("max_source_len", max_source_len), ("max_target_len", max_target_len)):
        if limit > manifest[flag]:
            raise UserError(f"--train_file was prepared with --{flag}={manifest[flag]}: train with --{flag} at "
                            f"most {manifest[flag]}, or prepare again with --{flag}={limit}")


def check_prepared_dir(out_dir: Path) -> None:
    """Refuse a ``--prepared_dir`` holding a prepared corpus (a run may train from it) or files not ours."""
    if (out_dir / MANIFEST).is_file():
        raise UserError(f"--prepared_dir={out_dir} exists and holds a prepared corpus ({MANIFEST}); choose a new "
                        "or empty folder, or remove that one first")
    check_folder(out_dir, "--prepared_dir", "prepared")
    check_closed(out_dir, "--prepared_dir", "prepared")  # its staging folder filled, its shards replaced: no link


def prepare(cfg, files: list[Path], collator, out_dir: Path, tokenizer_dir: str, report=print) -> dict:
    """Tokenize ``files`` (their columns --prompt_column and --response_column) with ``collator`` (its tokenizer,
    loaded from ``tokenizer_dir``, and lengths) into parquet shards in ``out_dir`` (new, empty or ours; written in
    a staging folder inside it, the shards moved into place at the end and the manifest last).

    More bad rows than --max_bad_rows_fraction of the rows read stop it, as they stop ``train``; a stopped
    prepare leaves nothing behind (nor the folder, when it made it).

    Returns:
        The manifest (also written as ``out_dir/prepared.manifest``).
    """
    from data.tokenization import tokenizer_fingerprint

    columns, max_bad_fraction = (cfg.prompt_column, cfg.response_column), cfg.max_bad_rows_fraction
    tokenizer = tokenizer_fingerprint(collator.tokenizer)
    check_prepared_dir(out_dir)
    created = not out_dir.exists()
    claim_folder(out_dir, "--prepared_dir", "prepared")
    staging = out_dir / STAGING
    remove_ours(staging, "prepared")  # left by a prepare that was stopped
    claim_folder(staging, "--prepared_dir", "prepared")
    try:
        manifest = _write_shards(files, columns, collator, staging, report, max_bad_fraction)
        manifest.update(tokenizer, tokenizer_dir=str(tokenizer_dir))  # its tokenizer_fingerprint
    except BaseException:
        shutil.rmtree(staging)
        if created:  # made by this call a moment ago: nothing but its marker
            (out_dir / MARKERS["prepared"]).unlink()
            out_dir.rmdir()
        raise
    for stale in out_dir.glob("shard-*.parquet"):  # of a prepare stopped while moving its shards in
        stale.unlink()
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
    move_in(staging, [*manifest["shards"], MANIFEST], out_dir)  # the manifest last: with it, the corpus is complete
    shutil.rmtree(staging)
    return manifest


def _write_shards(files: list[Path], columns: tuple[str, str], collator, folder: Path, report,
                  max_bad_fraction: float) -> dict:
    """Write the shards of ``files`` into ``folder``; returns the manifest but for the tokenizer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    problems = DataProblems(report=report)
    schema = pa.schema([(c, pa.list_(pa.int32())) for c in TOKEN_COLUMNS])
    shards, writer, in_shard, rows, tokens = [], None, 0, 0, 0

    def flush(group: list) -> None:
        nonlocal writer, in_shard, rows, tokens
        if writer is None or in_shard >= SHARD_ROWS:
            if writer is not None:
                writer.close()
            shards.append(f"shard-{len(shards):05d}.parquet")
            writer, in_shard = pq.ParquetWriter(folder / shards[-1], schema), 0
        sources = collator.token_ids([e.prompt for e in group], collator.max_source_len)
        targets = collator.targets(group)
        writer.write_table(pa.table([sources, targets], schema=schema), row_group_size=GROUP_ROWS)
        in_shard, rows = in_shard + len(group), rows + len(group)
        tokens += sum(map(len, sources)) + sum(map(len, targets))

    group = []
    for index, path in enumerate(files):
        for item in iter_rows(path, index, columns, problems=problems):
            if item is not None:
                group.append(item)
            if len(group) == GROUP_ROWS:
                flush(group)
                group = []
    if group:
        flush(group)
    if writer is not None:
        writer.close()
    if not rows:
        raise UserError(f"--train_file holds no usable rows ({problems.total} bad); nothing to prepare")
    if problems.counted > max_bad_fraction * (rows + problems.counted):
        raise too_many_bad_rows(problems.counted, rows + problems.counted, max_bad_fraction, problems.by_reason,
                                "rows")
    return {"rows": rows, "tokens": tokens, "shards": shards, "max_source_len": collator.max_source_len,
            "max_target_len": collator.max_target_len, "columns": list(columns),
            "sources": [{"path": str(f), "bytes": f.stat().st_size if isinstance(f, Path) else None} for f in files],
            "bad_rows": problems.total, "bad_rows_by_reason": dict(problems.by_reason)}
