"""The frozen encoder's outputs, computed once per example and read back instead of running it.

In SFT the encoder (and the embedding it reads) is frozen and in eval mode, so its output for a
row depends only on the row's source tokens: ``--encoder_cache`` computes it once for every row of
this process's share of the training files, streamed in chunks (bounded RAM), and training feeds
it to the decoder as ``encoder_outputs``. Stored in the compute dtype (float32) the decoder sees
the same numbers as an uncached run.

Layout of ``OUTPUT_DIR/encoder_cache/<fingerprint>/`` (one set per process):

    rows-rank{R}.bin    int64 triples (offset in tokens, length, CRC-32 of the source text; -1, -1, 0
                        for a bad row), one per row of the share
    states-rank{R}.bin  hidden states, token after token, d_model values each in the storage dtype
    done-rank{R}.json   written last: the cache is complete

The fingerprint covers the encoder's weights, the tokenizer, --max_source_len, the storage dtype,
the files (path, size, modification time) and the process layout, so any change builds a new cache
(the old ones are removed: only folders holding nothing but cache files, see
``lowmem.utils.ownership``). A file rewritten under the same size and modification time (``cp -p``,
``rsync -t``, or two writes within the file system's clock tick) escapes the fingerprint; the
checksum of each row's source, compared as the row is read, catches it: the run stops with a clear
error and removes the stale cache, so the next one rebuilds it. ``disk`` reads rows with ``pread``
(no memory map: its pages would count in the RSS); ``memory`` reads the states file into RAM once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data.collate import CachedEncoderCollator
from data.sources.corpus import iter_rows, row_place
from data.sources.readers import file_kind
from data.streams.file_stream import batched
from lowmem.hardware.memory_use import free_memory
from lowmem.model.loss import batch_to_device, frozen_encoder_states
from lowmem.monitoring.telemetry import on_terminal
from lowmem.training.run_context import RunContext
from lowmem.utils.errors import UserError
from lowmem.utils.frozen_forms import FROZEN_FORMS
from lowmem.utils.ownership import MARKERS, claim_folder, open_own, remove_ours, saved_json, write_atomic

STORAGE = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.int16),
           "float16": (torch.float16, torch.float16)}  # name -> (torch dtype, numpy-compatible view)
BUILD_CHUNK = 256  # rows read and tokenized together while building (each is encoded alone)
AUTO_MEMORY_FRACTION = 0.1  # auto keeps the cache in RAM when it is at most this share of free RAM
ROW_FIELDS = 3  # offset, length, source checksum: int64 each in rows-rank{R}.bin
LAYOUT = "rows: offset, length, crc32 of the source"  # part of the fingerprint: a new layout rebuilds
CACHE_FILE = re.compile(r"(rows|states)-rank\d+\.bin|done-rank\d+\.json|" + re.escape(MARKERS["encoder_cache"]))
CACHE_LABEL = "the encoder cache folder"  # under --output_dir
CACHE_HINT = "move those files out of it, or choose another --output_dir"


@dataclass(frozen=True)
class CacheShare:
    """The rows one process caches: its share (rows ``[start, end)``) of each training file, the files' indexes
    (the rows training reads of each: held-out eval rows left out) and the columns read."""

    rank: int
    world: int
    files: list[Path]
    columns: tuple[str, str]  # a prepared corpus's token-id columns, or the text columns
    shares: list[tuple[int, int]]
    indexes: list = field(default_factory=list)  # ``data.sources`` FileIndex, one per file

    @classmethod
    def of(cls, data) -> CacheShare:
        """This process's share of a run's ``data.pipeline.TrainData``."""
        files = data.files.train
        return cls(data.rank, data.world, files, data.files.columns, [data.stream.share(i) for i in range(len(files))],
                   data.indexes)

    @property
    def rows(self) -> int:
        return sum(end - start for start, end in self.shares)


def fingerprint(encoder, share: CacheShare, tokenizer_hash: str, max_source_len: int, dtype: str,
                compute: str = "") -> str:
    """What the cached outputs depend on, hashed (the encoder's weights byte by byte; ``compute``
    names how the encoder runs: precision, device, padding; the files, their columns, the rows of each
    that training reads, and the processes, which fix every process's share)."""
    digest = hashlib.sha1()
    for name, tensor in sorted(encoder.state_dict().items()):
        digest.update(name.encode())
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy())  # the bytes, of any dtype (bf16, float8), without a copy
    stats = [(str(Path(f).resolve()), s.st_size, s.st_mtime_ns) for f, s in ((f, os.stat(f)) for f in share.files)]
    rows = [index.rows for index in share.indexes]
    digest.update(json.dumps([tokenizer_hash, max_source_len, dtype, stats, list(share.columns), share.world, compute,
                              LAYOUT, rows]).encode())
    return digest.hexdigest()[:16]


class EncoderCache:
    """This process's cached encoder outputs; ``hidden_states(examples)`` gives a padded batch."""

    def __init__(self, folder: Path, share: CacheShare, meta: dict, in_memory: bool):
        """``meta``: the cache's done record (``d_model``, the storage ``dtype``)."""
        rank, d_model, dtype = share.rank, meta["d_model"], meta["dtype"]
        self.folder, self.rank, self.d_model, self.dtype, self.files = folder, rank, d_model, dtype, share.files
        self.shares = share.shares
        self.bases = np.cumsum([0] + [end - start for start, end in share.shares]).tolist()
        self.torch_dtype, self.view_dtype = STORAGE[dtype]
        self.row_bytes = d_model * self.torch_dtype.itemsize
        self.rows_fd = os.open(folder / f"rows-rank{rank}.bin", os.O_RDONLY)
        self.states_fd = os.open(folder / f"states-rank{rank}.bin", os.O_RDONLY)
        self.states = None
        if in_memory:
            size = os.fstat(self.states_fd).st_size
            self.states = np.fromfile(folder / f"states-rank{rank}.bin", dtype=np.uint8, count=size)
        self.in_memory = in_memory

    def entry(self, file_index: int, row: int) -> tuple[int, int, int]:
        """(offset in tokens, length, source checksum) of a row; length -1 for a row that was bad."""
        start = self.shares[file_index][0]
        size = 8 * ROW_FIELDS
        raw = os.pread(self.rows_fd, size, (self.bases[file_index] + row - start) * size)
        offset, length, checksum = np.frombuffer(raw, dtype=np.int64)
        return int(offset), int(length), int(checksum)

    def row_states(self, example) -> torch.Tensor:
        offset, length, checksum = self.entry(example.file_index, example.row)
        if length < 0 or checksum != source_checksum(example.prompt):
            self.discard()
            path = Path(self.files[example.file_index])
            raise UserError(f"{row_place(file_kind(path), example.row)} of {path} changed since the encoder "
                            f"cache was built (the file kept its size and modification time); the stale cache is "
                            f"removed: run again to rebuild it (--is_keep_training=True continues)")
        begin, size = offset * self.row_bytes, length * self.row_bytes
        raw = self.states[begin:begin + size].tobytes() if self.states is not None \
            else os.pread(self.states_fd, size, begin)
        flat = torch.frombuffer(bytearray(raw), dtype=self.view_dtype).view(self.torch_dtype)
        return flat.view(length, self.d_model)

    def hidden_states(self, examples, multiple: int = 1,
                      compute_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states [B, S, d_model], attention mask [B, S]) padded to the batch's longest source
        (rounded up to a multiple of ``multiple``, as the collator pads token ids).

        Padding positions hold zeros: the decoder's cross-attention masks them, as it masks the
        encoder's outputs at pad tokens in an uncached run.
        """
        from data.collate import round_up

        rows = [self.row_states(e) for e in examples]
        longest = round_up(max(r.shape[0] for r in rows), multiple)
        hidden = torch.zeros(len(rows), longest, self.d_model, dtype=compute_dtype)
        mask = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, r in enumerate(rows):
            hidden[i, :r.shape[0]] = r.to(compute_dtype)
            mask[i, :r.shape[0]] = 1
        return hidden, mask

    def discard(self) -> None:
        """Mark the cache incomplete for every process, so the next run builds it again."""
        for done in self.folder.glob("done-rank*.json"):
            done.unlink(missing_ok=True)

    def close(self) -> None:
        for fd in (self.rows_fd, self.states_fd):
            os.close(fd)
        self.states = None


def source_checksum(prompt: str | list[int]) -> int:
    """CRC-32 of a row's source: its text, or its token ids (a prepared corpus's rows)."""
    raw = prompt.encode("utf-8") if isinstance(prompt, str) else np.asarray(prompt, dtype=np.int64).tobytes()
    return zlib.crc32(raw)


def build(folder: Path, share: CacheShare, encode, d_model: int, dtype: str, progress=None) -> None:
    """Encode every usable row of this process's ``share`` and write the cache files of its rank.

    ``encode(prompts)`` returns (hidden states [B, S, d], attention mask [B, S]) for a list of texts.
    Rows are streamed in chunks of BUILD_CHUNK, so RAM holds one chunk whatever the corpus size.
    """
    torch_dtype, view_dtype = STORAGE[dtype]
    rank, columns = share.rank, share.columns
    claim_folder(folder, CACHE_LABEL, "encoder_cache", is_cache_folder, CACHE_HINT)
    offset = 0
    with open_own(folder / f"rows-rank{rank}.bin", "wb") as rows_out, \
            open_own(folder / f"states-rank{rank}.bin", "wb") as states_out:
        for file_index, (path, index, (start, end)) in enumerate(zip(share.files, share.indexes, share.shares)):
            items = iter_rows(path, file_index, columns, (start, end), index)
            for chunk in batched(items, BUILD_CHUNK):
                good = [e for e in chunk if e is not None]
                spans = {}  # row -> (offset, length, checksum); bad rows (None) get none
                if good:
                    hidden, mask = encode([e.prompt for e in good])
                    for i, (example, length) in enumerate(zip(good, mask.sum(dim=1).tolist())):
                        states = hidden[i, :length].to("cpu", torch_dtype).contiguous()
                        states_out.write(states.view(view_dtype).numpy().tobytes())
                        spans[example.row] = (offset, length, source_checksum(example.prompt))
                        offset += length
                    del hidden, mask
                entries = [spans[e.row] if e is not None else (-1, -1, 0) for e in chunk]
                rows_out.write(np.asarray(entries, dtype=np.int64).tobytes())
                if progress is not None:
                    progress.update(len(chunk))
        for out in (rows_out, states_out):
            out.flush()
            os.fsync(out.fileno())
    meta = {"d_model": d_model, "dtype": dtype, "tokens": offset,
            "bytes": offset * d_model * torch_dtype.itemsize}
    write_atomic(folder / f"done-rank{rank}.json", json.dumps(meta))  # whole or absent, after the data


def open_cache(root: Path, key: str, share: CacheShare, mode: str, build_fn, say=print) -> EncoderCache:
    """Reuse the complete cache for ``key`` or build it with ``build_fn(folder)`` (removing caches of
    other keys), then open this process's ``share`` of it in RAM (``memory``, or ``auto`` when small) or on disk."""
    claim_folder(root, CACHE_LABEL, "encoder_cache", _unmarked_root, CACHE_HINT)
    folder, rank = root / key, share.rank
    done = folder / f"done-rank{rank}.json"
    meta = saved_json(done)  # None: not built, or a record torn by a crash before it was written atomically
    if meta is not None:
        say(f"encoder cache: reusing {folder}")
    else:
        for old in root.iterdir():
            if old.name != key:
                remove_ours(old, "encoder_cache", is_cache_folder)  # data, tokenizer or encoder changed
        try:
            build_fn(folder)
        except BaseException:
            for part in ("rows", "states", "done"):  # never leave a half-written cache behind
                for f in folder.glob(f"{part}-rank{rank}.*"):
                    f.unlink()
            raise
        meta = json.loads(done.read_text())
    available = _available_ram()
    in_memory = mode == "memory" or (mode == "auto" and meta["bytes"] <= AUTO_MEMORY_FRACTION * available)
    if mode == "memory" and meta["bytes"] > 0.5 * available:
        raise UserError(f"--encoder_cache=memory: the cache is {meta['bytes'] / 2**20:.0f} MiB, more than half "
                        f"of the free RAM; use --encoder_cache=disk (or auto)")
    cache = EncoderCache(folder, share, meta, in_memory)
    say(f"encoder cache: {meta['tokens']:,} tokens, {meta['bytes'] / 2**20:.1f} MiB "
        f"({meta['dtype']}), {'in RAM' if in_memory else 'read from disk'}")
    return cache


def is_cache_folder(folder: Path) -> bool:
    """A cache folder of ours, marked or not (written before cache folders were): only cache files."""
    files = list(folder.iterdir())
    return bool(files) and all(f.is_file() and CACHE_FILE.fullmatch(f.name) for f in files)


def _unmarked_root(root: Path) -> bool:
    """OUTPUT_DIR/encoder_cache written before it was marked: cache folders alone."""
    return all(p.is_dir() and is_cache_folder(p) for p in root.iterdir())


def _available_ram() -> int:
    import psutil

    return psutil.virtual_memory().available


def park_encoder(core, device) -> None:
    """Off the GPU while training reads the cache instead of running the encoder (evaluation brings its
    blocks back: ``encoder_on``); nothing moves on the CPU."""
    if torch.device(device).type == "cuda":
        move_encoder(core, "cpu")
        free_memory()


def move_encoder(core, device) -> None:
    """The encoder's blocks to ``device`` (the shared embedding stays: the decoder reads it)."""
    for module in (core.encoder.block, core.encoder.final_layer_norm):
        module.to(device)


@contextlib.contextmanager
def encoder_on(core, device):
    """The encoder on ``device`` for what runs inside (evaluation: the eval set is not in the cache),
    back where it was after (off the GPU when the cache took it off)."""
    home = core.encoder.final_layer_norm.weight.device
    # compared by type: an accelerator on CPU processes says cpu:0 where the weights say cpu, and a
    # move of weights FSDP has sharded would put new parameters in place of the ones the optimizer steps
    if home.type != torch.device(device).type:
        move_encoder(core, device)
    try:
        yield
    finally:
        if home.type != torch.device(device).type:
            move_encoder(core, home)


def train_from_cache(ctx: RunContext, core, data, tokenizer_hash: str, steps_left: int, telemetry) -> tuple:
    """Train from the frozen encoder's outputs, computed once per row: (the cache, built or reused by
    ``open_for_training``, and the collator that reads it); the encoder leaves the GPU, which training no longer
    runs it on. ``steps_left``: the optimizer steps the run still takes; ``telemetry``: the run's
    (``lowmem.monitoring.telemetry.Telemetry``)."""
    cfg = ctx.cfg
    reads = steps_left * cfg.batch_size * cfg.gradient_accumulation_steps
    cache = open_for_training(ctx, core, data, tokenizer_hash, reads, telemetry.say)
    collator = CachedEncoderCollator(data.train_collator or data.collator, cache)  # (with a cached reference)
    telemetry.log_memory("encoder_cache")
    park_encoder(core, ctx.device)  # training no longer runs it
    return cache, collator


def open_for_training(ctx: RunContext, core, data, tokenizer_hash: str, reads: int, say=print) -> EncoderCache:
    """Build (or reuse) the frozen encoder's outputs for this process's training rows, in OUTPUT_DIR/encoder_cache.

    ``data``: the run's ``data.pipeline.TrainData``; ``reads``: the rows the run will still read (a
    run reading none twice gains no time from the cache, which the log says).
    """
    cfg, device, multiple = ctx.cfg, ctx.device, ctx.multiple
    share = CacheShare.of(data)
    # How the encoder runs counts too: bf16 autocast (and its padding) or not, on which device.
    # 8-bit frozen weights (--frozen_dtype=int8|float8): the cache holds the quantized encoder's outputs
    # (its state dict, hashed below, holds the 8-bit bytes and scales; the dtype is named as well).
    compute = f"{cfg.mixed_precision}/{device.type}/{multiple}" + (
        f"/{cfg.frozen_dtype}" if FROZEN_FORMS[cfg.frozen_dtype].quantized else "")
    key = fingerprint(core.encoder, share, tokenizer_hash, cfg.max_source_len, cfg.encoder_cache_dtype, compute)
    rows = share.rows

    @torch.no_grad()
    def encode(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen encoder's outputs for ``prompts``, exactly as the uncached training step computes them."""
        core.encoder.eval()
        batch = batch_to_device(data.collator.encode(prompts, cfg.max_source_len), device, multiple, ctx.pin)
        with ctx.precision.autocast(ctx.accelerator):
            hidden = frozen_encoder_states(core.encoder, batch["input_ids"], batch["attention_mask"], multiple)
        return hidden, batch["attention_mask"]

    def build_into(folder: Path) -> None:
        quantized = FROZEN_FORMS[cfg.frozen_dtype].quantized
        say(f"encoder cache: encoding {rows:,} rows into {folder}"
            + (f" with the {cfg.frozen_dtype} encoder (--frozen_dtype)" if quantized else ""))
        if reads <= rows:
            say(f"encoder cache: this run reads {reads:,} of those rows, none twice; encoding costs what "
                "the encoder would take in its steps, so the cache saves time only in runs that read rows "
                "again (more --epochs or --max_steps); it still frees the encoder's GPU memory")
        bar = tqdm(total=rows, desc="encoder cache", unit="row", disable=not (ctx.is_main and on_terminal()))
        build(folder, share, encode, core.config.d_model, cfg.encoder_cache_dtype, bar)
        bar.close()

    return open_cache(Path(cfg.output_dir) / "encoder_cache", key, share, cfg.encoder_cache, build_into, say)
