"""``--reference=cached``: the reference policy's log-probabilities of every training pair, computed once by a
streamed pre-pass with the starting model and read back with each batch, so that DPO trains holding no reference.

Layout of ``OUTPUT_DIR/reference/<fingerprint>/`` (one set per process):

    logprobs-rank{R}.bin   float32 (chosen, rejected) summed log-probabilities, one pair per row of the process's
                           share of the training files, in file order (NaN for a bad row)
    progress-rank{R}.json  the rows written so far (after an fsync): a killed pre-pass continues from there
    eval-rank{R}.json      the eval pairs' log-probabilities, by (file, row)
    done-rank{R}.json      written last: the cache is complete

The pre-pass reads the rows in chunks of CHUNK (bounded RAM whatever the corpus), runs the model in eval mode
without a graph, ``--batch_size`` pairs at a time, and appends each chunk's results. Killed, it resumes at its last
chunk boundary with the same batches, so a resumed pre-pass writes the same bytes as an uninterrupted one. The
fingerprint covers the starting model (its files, or a new one's configuration and seed), the tokenizer, the
lengths, the files (path, size, modification time, rows), the columns, the processes and how the model computes;
a change builds a new cache (old ones are removed).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data.sources.corpus import iter_rows
from data.streams.file_stream import batched
from lowmem.model.answer_logprobs import answer_logprobs
from lowmem.model.loss import batch_to_device
from lowmem.monitoring.telemetry import on_terminal
from lowmem.parallel.distributed import smallest
from lowmem.training.encoder_cache import CacheShare
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import claim_folder, open_own, remove_ours, saved_json, write_atomic

CHUNK = 256  # rows read together; the progress record moves a chunk at a time
LABEL = "the reference cache folder"
HINT = "move those files out of it, or choose another --output_dir"


def fingerprint(ctx, core, share: CacheShare, tokenizer_hash: str) -> str:
    """What the cached log-probabilities depend on, hashed (see the module's docstring). The starting weights are
    named by --init_from's files (their fingerprint), or for a new model by its configuration and --seed: not hashed
    from the model, which a sharded engine holds in pieces (every process must name the same folder)."""
    from lowmem.model.streamed_load import base_model_identity

    cfg, digest = ctx.cfg, hashlib.sha1()
    start = base_model_identity(cfg) or {"config": core.config.to_dict(), "seed": cfg.seed}
    digest.update(json.dumps([start, cfg.frozen_dtype, cfg.quantize_wo], sort_keys=True, default=str).encode())
    stats = [(str(Path(f).resolve()), s.st_size, s.st_mtime_ns) for f, s in ((f, os.stat(f)) for f in share.files)]
    digest.update(json.dumps([tokenizer_hash, cfg.max_source_len, cfg.max_target_len, stats, list(share.columns),
                              share.world, [i.rows for i in share.indexes], cfg.mixed_precision, ctx.device.type,
                              ctx.multiple, cfg.batch_size]).encode())
    return digest.hexdigest()[:16]


class ReferenceCache:
    """This process's cached reference log-probabilities: ``pair_logprobs(examples)`` for a training batch,
    ``eval_logprobs(examples)`` for eval pairs."""

    def __init__(self, folder: Path, share: CacheShare):
        self.rank, self.shares = share.rank, share.shares
        self.bases = np.cumsum([0] + [end - start for start, end in share.shares]).tolist()
        self.fd = os.open(folder / f"logprobs-rank{share.rank}.bin", os.O_RDONLY)
        saved = saved_json(folder / f"eval-rank{share.rank}.json") or {}
        self.eval = {tuple(json.loads(k)): v for k, v in saved.items()}

    def pair_logprobs(self, examples: list) -> torch.Tensor:
        """[len(examples), 2] float32: each training pair's (chosen, rejected) reference log-probabilities."""
        out = torch.empty(len(examples), 2)
        for i, e in enumerate(examples):
            at = self.bases[e.file_index] + e.row - self.shares[e.file_index][0]
            out[i] = torch.from_numpy(np.frombuffer(os.pread(self.fd, 8, at * 8), dtype=np.float32).copy())
        return out

    def eval_logprobs(self, examples: list) -> torch.Tensor:
        return torch.tensor([self.eval[(e.file_index, e.row)] for e in examples], dtype=torch.float32)

    def close(self) -> None:
        os.close(self.fd)


class PrePass:
    """The pre-pass of one process: the starting model's log-probabilities of its share's pairs (and of the eval
    pairs), appended chunk by chunk to ``folder`` (see the module's docstring)."""

    def __init__(self, ctx, model, core, data, folder: Path):
        self.ctx, self.model, self.core, self.data, self.folder = ctx, model, core, data, folder
        self.share = CacheShare.of(data)
        self.calls = math.ceil(CHUNK / ctx.cfg.batch_size) if ctx.engine.shards else 0  # per chunk, on every process

    @torch.no_grad()
    def logprobs(self, examples: list) -> list[list[float]]:
        """(chosen, rejected) of ``examples``, ``--batch_size`` pairs a forward (under a sharded engine, as many
        forwards on every process: empty ones after this process's own)."""
        ctx, out = self.ctx, []
        batches = [self.data.collator(list(part)) for part in batched(examples, ctx.cfg.batch_size)]
        batches += [self.data.collator.empty() for _ in range(self.calls - len(batches))]
        for k, host in enumerate(batches):
            batch = batch_to_device(host, ctx.device, ctx.multiple)
            with ctx.precision.autocast(ctx.accelerator):
                sums, _ = answer_logprobs(self.model, self.core, batch, ctx.cfg.frozen_encoder, ctx.multiple,
                                          ctx.cfg.loss_chunk_size)
            if k * ctx.cfg.batch_size < len(examples):
                half = len(sums) // 2
                out += torch.stack([sums[:half], sums[half:]], dim=1).cpu().tolist()
        return out

    def chunks(self):
        """This process's rows in chunks of CHUNK, file by file (None for a bad row)."""
        share = self.share
        for file_index, (path, index, (start, end)) in enumerate(zip(share.files, share.indexes, share.shares)):
            yield from batched(iter_rows(path, file_index, share.columns, (start, end), index), CHUNK)

    def run(self, progress) -> None:
        rank, folder = self.share.rank, self.folder
        data_file, progress_file = folder / f"logprobs-rank{rank}.bin", folder / f"progress-rank{rank}.json"
        done = (saved_json(progress_file) or {}).get("rows", 0)
        if done:
            os.truncate(data_file, done * 8)  # (a chunk written after the last progress record is written again)
            progress.update(done)
        total_chunks = [len(range(0, end - start, CHUNK)) for start, end in self.share.shares]
        most = -smallest(self.ctx.accelerator, [-sum(total_chunks)])[0] if self.calls else 0
        chunks = 0
        with open_own(data_file, "ab") as out:
            for chunk in self.chunks():
                chunks += 1
                if (chunks - 1) * CHUNK < done:
                    continue  # written before the kill
                good = [e for e in chunk if e is not None]
                values = iter(self.logprobs(good))
                rows = [next(values) if e is not None else [math.nan, math.nan] for e in chunk]
                out.write(np.asarray(rows, dtype=np.float32).tobytes())
                out.flush()
                os.fsync(out.fileno())
                done += len(chunk)
                write_atomic(progress_file, json.dumps({"rows": done}))
                progress.update(len(chunk))
            for _ in range(chunks, most):  # a sharded engine's collectives: as many chunks on every process
                self.logprobs([])
        evals = self.data.eval_examples
        pairs = self.logprobs(evals) if evals else []
        write_atomic(folder / f"eval-rank{rank}.json",
                     json.dumps({json.dumps([e.file_index, e.row]): p for e, p in zip(evals, pairs)}))
        write_atomic(folder / f"done-rank{rank}.json", json.dumps({"rows": done}))


def open_reference_cache(ctx, model, core, data, tokenizer_hash: str, say=print) -> ReferenceCache:
    """Reuse this run's complete reference cache, or run (or continue) its pre-pass with the starting model."""
    share = CacheShare.of(data)
    if data.files.dataset is not None:
        raise UserError("--reference=cached reads the training rows by position: it takes files, not a Hugging Face "
                        "dataset (use --reference=copy, or save the dataset as jsonl/parquet files)")
    root = Path(ctx.cfg.output_dir) / "reference"
    claim_folder(root, LABEL, "reference", None, HINT)
    key = fingerprint(ctx, core, share, tokenizer_hash)
    folder = root / key
    if saved_json(folder / f"done-rank{share.rank}.json") is None:
        for old in root.iterdir():
            if old.name != key and old.is_dir():
                remove_ours(old, "reference")  # the data, tokenizer or model changed
        claim_folder(folder, LABEL, "reference", None, HINT)
        rows = share.rows
        say(f"reference: computing the starting model's log-probabilities of {rows:,} pairs into {folder}")
        bar = tqdm(total=rows, desc="reference", unit="pair", disable=not (ctx.is_main and on_terminal()))
        was_training = model.training
        model.eval()
        PrePass(ctx, model, core, data, folder).run(bar)
        model.train(was_training)
        bar.close()
    else:
        say(f"reference: reusing {folder}")
    return ReferenceCache(folder, share)
