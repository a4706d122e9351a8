"""A model folder's weight files read a few tensors at a time, and their fingerprint.

The layouts ``from_pretrained`` reads: ``model.safetensors``, sharded safetensors with
``model.safetensors.index.json``, ``pytorch_model.bin`` and its sharded form with an index. A
safetensors file is mapped only while its tensors are read: every page a read touches counts in the
process's resident memory for as long as the mapping is open, so a whole 10 GB hub shard held open
would be resident by the end. A ``.bin`` file is read through torch's weights-only unpickler (tensors
and plain values only: no code in it runs), mapped, and the wanted tensors copied out; only torch's zip format
is read (``lowmem.model.weight_headers``: a pickle is refused before anything unpickles it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from lowmem.model.weight_headers import BIN_INDEX, SAFETENSORS_INDEX, file_headers, index_entries, load_bin
from lowmem.utils.errors import UserError

# A fingerprint reads this many evenly spread samples of each weight file (and its size and header): enough to
# tell a retrained or replaced model apart, cheap at 45 GB (a full hash would read all of it at every resume)
FINGERPRINT_SAMPLES = 16
FINGERPRINT_SAMPLE_BYTES = 64 * 1024


def weight_files(folder: Path) -> dict[str, Path]:
    """{tensor name: file} of the weights in ``folder`` (safetensors preferred, as ``from_pretrained`` does).

    Raises:
        UserError: no weights file, or an index naming a file that is not there.
    """
    folder = Path(folder)
    for index_name, single in ((SAFETENSORS_INDEX, "model.safetensors"), (BIN_INDEX, "pytorch_model.bin")):
        index = folder / index_name
        if index.is_file():
            files = index_entries(folder, index_name)
            missing = sorted({p.name for p in files.values() if not p.is_file()})
            if missing:
                raise UserError(f"{folder} is missing {', '.join(missing)}, which {index_name} lists; "
                                "download or copy the model folder whole")
            return files
        if (folder / single).is_file():
            return dict.fromkeys(_keys_of(folder / single), folder / single)
    raise UserError(f"{folder} holds no weights (model.safetensors, pytorch_model.bin or their index); "
                    "pass a complete model folder")


def _keys_of(path: Path) -> list[str]:
    return list(file_headers(path))  # its header checked: a damaged file is one line, not a SafetensorError


def read_tensors(files: dict[str, Path], keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` (those ``files`` has), as the files store them. They may be views of a file's mapping,
    which lasts as long as they do: copy what is kept, and drop them."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in dict.fromkeys(files[key] for key in keys if key in files):
        wanted = [key for key in keys if files.get(key) == path]
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                for key in wanted:
                    found[key] = f.get_tensor(key)
        else:
            loaded = load_bin(path)  # a torch zip of tensors, mapped, or one line
            found.update((key, loaded[key]) for key in wanted)
            del loaded  # the wanted tensors keep the mapping alive until the caller drops them
    return found


def fingerprint(folder: Path) -> str:
    """A short hash of ``folder``'s weight files: their names, sizes and evenly spread samples of their bytes
    (the safetensors header, with every name, dtype and shape, is among them). A model whose weights changed
    (retrained, replaced, another download) has another."""
    digest = hashlib.sha256()
    for path in sorted(set(weight_files(folder).values())):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        step = max(1, (size - FINGERPRINT_SAMPLE_BYTES) // max(1, FINGERPRINT_SAMPLES - 1))
        with open(path, "rb") as f:
            for offset in sorted({min(i * step, max(0, size - FINGERPRINT_SAMPLE_BYTES))
                                  for i in range(FINGERPRINT_SAMPLES)}):
                f.seek(offset)
                digest.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()[:16]
