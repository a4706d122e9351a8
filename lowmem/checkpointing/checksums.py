"""Content checksums of a checkpoint's files, taken while the files are written.

A checkpoint's ``manifest.json`` lists each file's size and checksum (``record``); a resume reads every file once
to compare (``digest_file``). The files we write go through ``HashingFile`` as they are written, so a checksum
never costs a second read of a multi-GB file: ``save_torch`` (torch.save into the hashing file),
``save_safetensors`` (the safetensors format written tensor by tensor: safetensors has no streaming writer),
``save_json``.

The checksum is xxh3-64 (``xxhash``, which ``datasets`` requires too): it detects damage, it is no cryptographic
claim (a manifest can be rewritten along with the file). Measured on 1 GiB in memory on the 2-core machine this was
written on: xxh3-64 13.4 GB/s, zlib.crc32 2.2, sha1 1.5, sha256 1.3, blake2b 0.65 — at flan-t5-xl's 33 GB of
weights and AdamW state, xxh3 checks a checkpoint in seconds where sha256 would take half a minute
(``bench/checksum_cost.py`` sets it beside the load). Manifests written with another of ``ALGORITHMS`` verify too.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

from lowmem.utils.ownership import open_own

ALGORITHM = "xxh3_64"
READ_CHUNK = 16 * 2**20  # verification reads a file in pieces this size: memory stays flat


class _Crc32:
    """zlib.crc32 behind hashlib's ``update`` / ``hexdigest``."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hash(algorithm: str = ALGORITHM):
    """A fresh hash object of ``algorithm`` (one of ``ALGORITHMS``)."""
    if algorithm == "crc32":
        return _Crc32()
    import xxhash

    return xxhash.xxh3_64()


ALGORITHMS = ("xxh3_64", "crc32")


class HashingFile:
    """A file opened for writing that hashes every byte written through it (what torch.save and our writers
    are given instead of a path)."""

    def __init__(self, path: Path, sums: dict, name: str):
        self.file = open_own(Path(path), "wb")
        self.hash = new_hash()
        self.sums, self.name = sums, name

    def write(self, data) -> int:
        self.hash.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, kind, *_) -> None:
        self.file.close()
        if kind is None:  # a failed write records nothing: the staging folder is removed anyway
            self.sums[self.name] = self.hash.hexdigest()


def digest_file(path: Path, algorithm: str = ALGORITHM) -> str:
    """The checksum of the file at ``path``, read once in ``READ_CHUNK`` pieces."""
    hashed = new_hash(algorithm)
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while count := fh.readinto(buffer):
            hashed.update(view[:count])
    return hashed.hexdigest()


def save_torch(obj, folder: Path, name: str, sums: dict) -> None:
    """``torch.save(obj)`` into ``folder/name``, its checksum into ``sums[name]``. (Written to a file object torch
    streams its zip, data descriptors included: other bytes than a save to a path, read back the same.)"""
    import torch

    with HashingFile(folder / name, sums, name) as fh:
        torch.save(obj, fh)


def save_json(value, folder: Path, name: str, sums: dict) -> None:
    """``value`` as indented JSON into ``folder/name``, its checksum into ``sums[name]``."""
    with HashingFile(folder / name, sums, name) as fh:
        fh.write(json.dumps(value, indent=1).encode("utf-8"))


# safetensors' dtype names, in the order of its Rust ``Dtype`` enum: save_file lays tensors out by this rank,
# largest first (alignment), then by name
DTYPE_RANK = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16",
              "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")


def dtype_names() -> dict:
    """torch dtype -> safetensors' name for it (what safetensors' own loader maps back)."""
    from safetensors.torch import _TYPES  # (its table: the names load_file reads)

    return {dtype: name for name, dtype in _TYPES.items() if name in DTYPE_RANK}


def safetensors_header(tensors: dict, metadata: dict | None) -> tuple[bytes, list[str]]:
    """The bytes a safetensors file starts with for ``tensors`` (name -> tensor) and the names in the order their
    data follows: 8-byte little-endian length, the JSON header padded with spaces to a multiple of 8."""
    names = dtype_names()
    for name, tensor in tensors.items():
        if tensor.dtype not in names:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} has no safetensors name")
    order = sorted(tensors, key=lambda n: (-DTYPE_RANK.index(names[tensors[n].dtype]), n))
    header, offset = ({"__metadata__": metadata} if metadata is not None else {}), 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def save_safetensors(tensors: dict, folder: Path, name: str, sums: dict, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file(tensors, folder/name, metadata)`` written tensor by tensor through a hashing
    file, its checksum into ``sums[name]``: the same bytes (metadata of two keys or more excepted: the Rust writer
    orders those as its hash map iterates), read by ``safe_open`` and ``load_file``; a tensor on the GPU or not
    contiguous is copied to the host one at a time, never the whole model at once."""
    import torch

    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; this writer writes the host's bytes as they are")
    header, order = safetensors_header(tensors, metadata)
    with HashingFile(folder / name, sums, name) as fh:
        fh.write(header)
        for key in order:
            tensor = tensors[key].detach()
            if tensor.numel():
                host = tensor.to("cpu").contiguous()  # (no copy for a contiguous host tensor)
                fh.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
                del host  # one tensor's host copy at a time


def record(folder: Path, sums: dict) -> dict:
    """The manifest of ``folder``: every file's size and checksum (``sums`` holds those taken while writing;
    the files written by libraries we do not control, a sharded engine's own files, are read here once: written
    just now, they come from the page cache)."""
    files, checked = {}, {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            name = str(path.relative_to(folder))
            files[name] = path.stat().st_size
            checked[name] = sums[name] if name in sums else digest_file(path)
    return {"files": files, "checksum": ALGORITHM, "checksums": checked}
