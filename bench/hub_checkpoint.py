"""Hub-shaped T5 checkpoints with random weights, written one tensor at a time so memory stays flat.

    python -m bench.hub_checkpoint /tmp/hubxl --shape=xl --dtype=bfloat16 --max_shard_gb=9.5
    python -m bench.hub_checkpoint /tmp/hublarge --shape=large                  # float32, one 3.1 GB file
    python -m bench.hub_checkpoint /tmp/hubtiny --shape=tiny --max_shard_gb=0.0003 --fmt=bin

The folder looks like a flan-t5 / t5-v1_1 hub folder: ``config.json`` (``tie_word_embeddings: false``),
``generation_config.json``, the tokenizer files, and the weights as safetensors shards
(``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``, or one ``model.safetensors``) or as
``pytorch_model*.bin``. The tensors are those the hub's safetensors hold and transformers' ``save_pretrained``
writes for an untied head: ``shared.weight``, every block, both final layer norms and ``lm_head.weight``; the
``encoder.`` / ``decoder.embed_tokens.weight`` aliases of ``shared.weight`` are left out (loading ties them).
Values are seeded normals at T5's initialisation scale, drawn in chunks of ``CHUNK_ELEMENTS`` straight into
the file in the target dtype: a builder holds one chunk, never a whole tensor (the .bin format excepted).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path

import torch
from transformers import GenerationConfig, T5Config, T5ForConditionalGeneration

from bench.harness import REPO, peak_rss_mib

DEFAULT_TOKENIZER_DIR = REPO / "data" / "tokenizer"
CHUNK_ELEMENTS = 16 * 2**20  # 64 MiB of float32 draws at a time, whatever the tensor's size
# What every flan-t5 / t5-v1_1 shape shares; a shape dict overrides any of it.
FLAN_BASE = dict(vocab_size=32128, d_kv=64, num_layers=24, num_decoder_layers=24, feed_forward_proj="gated-gelu",
                 tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
SHAPES = {
    # tiny's vocabulary holds the shipped tokenizer's 8,100 ids (rounded up to a multiple of 128, as 32,128 is)
    "tiny": dict(vocab_size=8192, d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2),
    "large": dict(d_model=1024, d_ff=2816, num_heads=16),
    "xl": dict(d_model=2048, d_ff=5120, num_heads=32),
    "xxl": dict(d_model=4096, d_ff=10240, num_heads=64),
}
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def t5_config(shape: str | dict, dtype: str) -> T5Config:
    """The ``T5Config`` of a named shape (``SHAPES``) or of a dict of ``T5Config`` arguments over ``FLAN_BASE``."""
    kwargs = SHAPES[shape] if isinstance(shape, str) else shape
    return T5Config(**{**FLAN_BASE, **kwargs}, architectures=["T5ForConditionalGeneration"], dtype=dtype)


def checkpoint_tensors(config: T5Config) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the tensors a hub checkpoint holds, in state-dict order, from a model on ``meta``."""
    with torch.device("meta"):  # names and shapes only: no memory for the weights
        model = T5ForConditionalGeneration(config)
    # transformers 5.24's T5Config forces tie_word_embeddings=True, so the model is built with lm_head tied to
    # shared; a flan-t5 checkpoint holds its own head, so give it its own parameter before listing unique ones.
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))
    # named_parameters drops aliases: the embed_tokens of encoder and decoder are shared.weight itself
    return [(name, tuple(param.shape)) for name, param in model.named_parameters()]


def init_std(name: str, config: T5Config) -> float | None:
    """The normal's std for a tensor, as T5's ``_init_weights`` draws it but for the head (None: all ones)."""
    if "layer_norm" in name:
        return None
    if name == "lm_head.weight":
        # v1.1 does not scale the decoder output by d_model**-0.5 (scale_decoder_outputs=False): the head
        # carries that factor, so logits start near unit scale instead of ~sqrt(d_model)
        return config.d_model**-0.5
    d_model, d_kv = config.d_model, config.d_kv
    # T5's attention does not divide by sqrt(d_kv): q's init carries it; the other projections are fan-in**-0.5
    stds = {"shared.weight": 1.0, ".q.weight": (d_model * d_kv) ** -0.5, ".k.weight": d_model**-0.5,
            ".v.weight": d_model**-0.5, ".o.weight": (config.num_heads * d_kv) ** -0.5, ".wo.weight": config.d_ff**-0.5,
            "relative_attention_bias.weight": d_model**-0.5, ".wi.weight": d_model**-0.5,
            ".wi_0.weight": d_model**-0.5, ".wi_1.weight": d_model**-0.5}
    for suffix, std in stds.items():
        if name.endswith(suffix):
            return std
    raise ValueError(f"no initialisation scale known for {name}")


def tensor_chunks(name: str, shape: tuple[int, ...], config: T5Config, dtype: torch.dtype, seed: int):
    """Yield a tensor's values as flat chunks of whole rows, in row-major order, in ``dtype``.

    The generator is seeded from ``seed`` and the tensor's name, so a tensor's values do not depend on its
    place, the shard size or the format.
    """
    std = init_std(name, config)
    # one 32-bit seed from both: torch's CPU generator keeps only the low 32 bits of what it is given
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    row = math.prod(shape[1:])
    rows_per_chunk = max(1, CHUNK_ELEMENTS // row)
    for start in range(0, shape[0], rows_per_chunk):
        count = min(rows_per_chunk, shape[0] - start) * row
        if std is None:
            yield torch.ones(count, dtype=dtype)
            continue
        values = torch.randn(count, generator=generator).mul_(std)  # drawn in float32, then rounded once
        yield values.to(dtype)
        del values  # free the float32 draws before the next chunk


def plan_shards(tensors: list, itemsize: int, max_shard_bytes: int) -> list[list]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    shards, size = [[]], 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_safetensors(path: Path, tensors: list, config: T5Config, dtype: str, seed: int) -> None:
    """Write one safetensors file by hand: header length, JSON header, then each tensor's bytes in order."""
    torch_dtype, itemsize = getattr(torch, dtype), getattr(torch, dtype).itemsize
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data then starts 8-byte aligned, as the safetensors library writes it
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in tensors:
            for chunk in tensor_chunks(name, shape, config, torch_dtype, seed):
                file.write(chunk.view(torch.uint8).numpy())  # raw little-endian bytes, no copy
        if file.tell() != 8 + len(encoded) + offset:
            raise RuntimeError(f"{path}: wrote {file.tell()} bytes, the header promises {8 + len(encoded) + offset}")


def write_bin(path: Path, tensors: list, config: T5Config, dtype: str, seed: int) -> None:
    """Write one ``torch.save`` shard: a plain dict of the shard's tensors, all held at once (small folders only)."""
    torch_dtype = getattr(torch, dtype)
    state = {}
    for name, shape in tensors:
        state[name] = torch.cat(list(tensor_chunks(name, shape, config, torch_dtype, seed))).view(shape)
    torch.save(state, path)


def write_weights(folder: Path, tensors: list, config: T5Config, dtype: str, max_shard_bytes: int, fmt: str, seed: int):
    """Write the weight files and, past one shard, their index; returns the names of the files written."""
    prefix, suffix, writer = {"safetensors": ("model", "safetensors", write_safetensors),
                              "bin": ("pytorch_model", "bin", write_bin)}[fmt]
    shards = plan_shards(tensors, getattr(torch, dtype).itemsize, max_shard_bytes)
    if len(shards) == 1:
        names = [f"{prefix}.{suffix}"]
    else:
        names = [f"{prefix}-{k:05d}-of-{len(shards):05d}.{suffix}" for k in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        writer(folder / name, shard, config, dtype, seed)
    if len(shards) > 1:
        total = sum(math.prod(shape) for _, shape in tensors) * getattr(torch, dtype).itemsize
        index = {"metadata": {"total_size": total},
                 "weight_map": {tensor: name for name, shard in zip(names, shards) for tensor, _ in shard}}
        (folder / f"{prefix}.{suffix}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_configs(folder: Path, config: T5Config, tokenizer_dir: Path) -> None:
    """config.json as ``save_pretrained`` writes it (but with the hub's ``tie_word_embeddings: false``),
    generation_config.json as flan-t5's, and the tokenizer's files."""
    saved = json.loads(config.to_json_string(use_diff=True))
    # to_dict says true (T5Config always ties, in 5.24); flan-t5's config.json says false, and a reload reads
    # it as scale_decoder_outputs=False, the v1.1 behaviour
    saved["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    GenerationConfig(decoder_start_token_id=0, eos_token_id=1, pad_token_id=0).save_pretrained(folder)
    for path in sorted(Path(tokenizer_dir).iterdir()):
        # hidden files are left: the shipped tokenizer's ownership marker would tell the trainer the folder is its own
        if path.is_file() and not path.name.startswith("."):
            shutil.copy2(path, folder / path.name)


def build_checkpoint(folder, shape: str | dict = "xl", dtype: str = "float32", max_shard_bytes: int = 10**10,
                     fmt: str = "safetensors", seed: int = 0, tokenizer_dir=None) -> dict:
    """Write a hub-shaped T5 checkpoint with random weights into an empty (or new) folder.

    Args:
        folder: where the checkpoint goes; refused when it holds anything.
        shape: a name in ``SHAPES`` (tiny, large, xl, xxl) or a dict of ``T5Config`` arguments over ``FLAN_BASE``.
        dtype: float32, bfloat16 or float16: the stored dtype and config.json's ``dtype``.
        max_shard_bytes: tensors fill a shard in state-dict order until the next would pass this.
        fmt: "safetensors" (one chunk in memory at a time) or "bin" (``torch.save`` holds a whole shard:
            for small test folders only).
        seed: the values' seed; each tensor's values depend only on it and the tensor's name.
        tokenizer_dir: whose files are copied (default: the repo's ``data/tokenizer``).

    Returns:
        A summary: folder, params, bytes (the weight files), files, seconds, peak_rss_mib (this process's peak).
    """
    if dtype not in SAFETENSORS_DTYPES or fmt not in ("safetensors", "bin"):
        raise ValueError(f"dtype must be one of {list(SAFETENSORS_DTYPES)} and fmt safetensors or bin")
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty: choose a new folder (stale shards would be read with new ones)")
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian values; this writer copies memory as it is")
    started = time.time()
    folder.mkdir(parents=True, exist_ok=True)
    config = t5_config(shape, dtype)
    tensors = checkpoint_tensors(config)
    files = write_weights(folder, tensors, config, dtype, max_shard_bytes, fmt, seed)
    write_configs(folder, config, Path(tokenizer_dir or DEFAULT_TOKENIZER_DIR))
    return {"folder": str(folder), "params": sum(math.prod(s) for _, s in tensors),
            "bytes": sum((folder / f).stat().st_size for f in files), "files": files,
            "seconds": round(time.time() - started, 1),
            "peak_rss_mib": round(peak_rss_mib())}


def main(argv: list[str] | None = None) -> dict:
    """The CLI: parse flags, build, print one summary line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="new or empty folder to write")
    parser.add_argument("--shape", default="xl", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=sorted(SAFETENSORS_DTYPES))
    parser.add_argument("--max_shard_gb", type=float, default=10.0, help="shard size limit, GB (10**9 bytes)")
    parser.add_argument("--fmt", default="safetensors", choices=["safetensors", "bin"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer_dir", default=None, help="tokenizer files to copy (default: data/tokenizer)")
    options = parser.parse_args(argv)
    summary = build_checkpoint(options.folder, options.shape, options.dtype, int(options.max_shard_gb * 10**9),
                               options.fmt, options.seed, options.tokenizer_dir)
    print(f"{summary['folder']} | {summary['params']:,} params | {summary['bytes']:,} bytes in "
          f"{len(summary['files'])} files | {summary['seconds']} s | peak RSS {summary['peak_rss_mib']:,} MiB",
          flush=True)
    return summary


if __name__ == "__main__":
    main()
