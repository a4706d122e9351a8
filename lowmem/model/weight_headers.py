"""Each weight file of a model folder checked from its header alone: the tensors' names, shapes and dtypes.

Nothing here reads tensor data, so a check of a 45 GB folder costs a few reads per file:

- ``model*.safetensors``: an 8-byte little-endian header length, that many bytes of JSON (name -> dtype, shape,
  data_offsets), then the data. The length must fit the file, the JSON must parse, every dtype be known, and the
  offsets lie inside the data, tile it without gaps or overlaps, and match each tensor's size.
- ``pytorch_model*.bin``: only torch's zip format (``torch.save`` since torch 1.6, a ``data.pkl`` inside) is
  read, through the weights-only unpickler with the file mapped: shapes and dtypes come without reading the
  data. A pickle (the legacy torch format, or ``pickle.dump``) is refused with the command that converts it.
- an index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) names files of its own folder
  only: no absolute path, no ``..``, no symlink leading out (a hub cache snapshot's links into its blobs are in).
"""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from pathlib import Path
from typing import NamedTuple

from lowmem.utils.errors import UserError

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# safetensors dtypes -> bytes per element (the sub-byte float4/6 formats are not T5 weights)
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8,
                      "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}
FLOATING = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F16", "BF16", "F32", "F64"}
# The safetensors library refuses a longer header (100 MB); a header length past it is damage, not a model
MAX_HEADER_BYTES = 100_000_000
# torch's legacy (pre-zip) format starts with its magic number pickled with protocol 2
LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


class TensorHeader(NamedTuple):
    """One tensor as a weight file's header describes it."""

    shape: tuple[int, ...]
    dtype: str  # as the file names it (safetensors: "F32"; .bin: "torch.float32")
    floating: bool
    file: Path


def index_entries(folder: Path, index_name: str) -> dict[str, Path]:
    """{tensor name: file} as the index ``index_name`` in ``folder`` lists them, each file inside ``folder``.

    Raises:
        UserError: the index is not JSON with a weight_map of names, or names a file outside the folder (an
            absolute path, ``..``, or a symlink leading out: reading it would read whatever it points at).
    """
    index = folder / index_name
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise UserError(f"{index} cannot be read as a weights index (JSON with a weight_map of tensor names to "
                        "file names); pass a complete model folder") from None
    inside = allowed_roots(folder)
    for name in dict.fromkeys(weight_map.values()):
        path = Path(name)
        outside = path.is_absolute() or ".." in path.parts or not name.strip() or \
            not any((folder / path).resolve().is_relative_to(root) for root in inside)
        if outside:
            raise UserError(f"{index} names the weights file {name!r}, which is not inside {folder} (an absolute "
                            "path, '..' or a symlink leading out); it was not read: an index lists file names of "
                            "its own folder only, so restore the model folder's own index")
    return {key: folder / name for key, name in weight_map.items()}


def allowed_roots(folder: Path) -> list[Path]:
    """Where a model folder's weight files may lie: the folder, and for a Hugging Face cache snapshot
    (``models--X/snapshots/COMMIT``, whose files are symlinks into ``models--X/blobs``) its repository's blobs."""
    root = Path(folder).resolve()
    return [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]


def file_headers(path: Path) -> dict[str, TensorHeader]:
    """{tensor name: header} of one weight file (safetensors or torch zip), read without its tensor data.

    Raises:
        UserError: the file is empty, truncated, damaged, or not a format read here (one line naming it).
    """
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise empty_file(path)
    return safetensors_headers(path, size) if path.suffix == ".safetensors" else bin_headers(path)


def empty_file(path: Path) -> UserError:
    """The refusal of a weight file of 0 bytes (either format)."""
    return UserError(f"{path} is empty (0 bytes): an interrupted download or copy; download or copy the model folder "
                     "again")


def safetensors_headers(path: Path, size: int) -> dict[str, TensorHeader]:
    """The header of a safetensors file, checked against its size (see the module docstring)."""
    def damaged(what: str) -> UserError:
        return UserError(f"{path} is not a readable safetensors file: {what}; download or copy the model folder "
                         "again (or export it again)")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise damaged(f"{size} bytes, shorter than the 8-byte header length (truncated)")
        length = struct.unpack("<Q", head)[0]
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise damaged(f"its header length says {length:,} bytes but the file holds {size - 8:,} after it "
                          "(truncated, or not a safetensors file)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError
    except (UnicodeDecodeError, ValueError):
        raise damaged("its header is not JSON (damaged, or not a safetensors file)") from None
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    spans, found = [], {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if not all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise damaged(f"the header's entry for {name} is not a dtype, shape and data_offsets") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise damaged(f"{name} has the dtype {dtype!r}, which is not one of {', '.join(SAFETENSORS_DTYPES)}")
        numel = 1
        for n in shape:
            numel *= n
        if end - begin != numel * SAFETENSORS_DTYPES[dtype]:
            raise damaged(f"{name} spans {end - begin:,} bytes but a {dtype} tensor of shape {list(shape)} takes "
                          f"{numel * SAFETENSORS_DTYPES[dtype]:,}")
        if end > data_size:
            raise damaged(f"{name} ends at byte {end:,} of the data, past its end at {data_size:,} (truncated)")
        spans.append((begin, end, name))
        found[name] = TensorHeader(shape, dtype, dtype in FLOATING, path)
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise damaged(f"{name} starts at byte {begin:,} of the data where the previous tensor ends at "
                          f"{covered:,} (tensors overlap or leave a gap)")
        covered = end
    if covered != data_size:
        raise damaged(f"its tensors cover {covered:,} bytes of data but the file holds {data_size:,}")
    return found


def bin_headers(path: Path) -> dict[str, TensorHeader]:
    """The tensors of a torch zip file, mapped: their shapes and dtypes, no data read."""
    loaded = load_bin(path)
    found = {name: TensorHeader(tuple(t.shape), str(t.dtype), t.is_floating_point(), path)
             for name, t in loaded.items()}
    del loaded  # the mapping closes with the tensors
    return found


def load_bin(path: Path) -> dict:
    """A ``.bin`` file's tensors, mapped (not read), through the weights-only unpickler.

    Raises:
        UserError: anything but a torch zip of tensors (``refuse_bin``), or one that fails to load.
    """
    import torch

    refuse_bin(path)  # a pickle, a legacy file, another zip, a truncated one: refused before unpickling
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:  # the weights-only unpickler met a global it does not allow: an object
        raise UserError(f"{path} holds objects other than tensors and was not loaded: building them could run "
                        "code; pass the model's weights as safetensors (or a torch.save of its state dict)") from None
    except Exception as err:  # RuntimeError, EOFError, ...: whatever a damaged file makes torch raise
        detail = str(err).splitlines()[0][:200] if str(err) else "no detail"
        raise UserError(f"{path} cannot be loaded as torch weights ({type(err).__name__}: {detail}); it is "
                        "damaged: download or copy the model folder again") from None
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in loaded.items()):
        raise UserError(f"{path} is not a state dict (a dict of tensor names to tensors); pass the model's own "
                        "weights file")
    return loaded


def refuse_bin(path: Path) -> None:
    """Refuse a ``.bin`` file that is not a torch zip before anything unpickles it, saying what it is.

    Raises:
        UserError: a pickle (legacy torch or ``pickle.dump``), a truncated or foreign zip, or something else.
    """
    with open(path, "rb") as f:
        start = f.read(len(LEGACY_TORCH_MAGIC))
    if not start:
        raise empty_file(path)
    if start.startswith(b"PK"):
        if not zipfile.is_zipfile(path):
            raise UserError(f"{path} is a damaged zip (truncated, or its directory is missing): download or copy "
                            "the model folder again")
        with zipfile.ZipFile(path) as archive:
            if not any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist()):
                raise UserError(f"{path} is a zip archive but not one torch.save wrote (it has no data.pkl); pass "
                                "the model's own weights file")
        return
    if start.startswith(b"\x80"):
        raise UserError(f"{path} is a pickle ({'torch' if start == LEGACY_TORCH_MAGIC else 'not torch'}'s legacy "
                        "format) and was not read: unpickling can run code; convert it once with code you trust, "
                        f"then pass the folder again: {convert_command(path, start == LEGACY_TORCH_MAGIC)}")
    raise UserError(f"{path} is neither a torch zip nor a safetensors file; pass the model's own weights file")


def convert_command(path: Path, legacy_torch: bool) -> str:
    """A one-line command writing ``path``'s tensors to a safetensors file beside it (``model.safetensors`` for
    ``pytorch_model.bin``), which the folder then loads first. A legacy torch file converts through torch's
    weights-only unpickler (no code runs); a plain pickle only through pickle, which runs what the file holds."""
    if path.name != "pytorch_model.bin":  # a shard: the whole folder, through transformers (torch's format only)
        return (f"python -c \"from transformers import AutoModelForSeq2SeqLM as M; M.from_pretrained("
                f"{str(path.parent)!r}).save_pretrained({str(path.parent) + '-safetensors'!r})\" (then copy the "
                "tokenizer files beside it)")
    target = path.parent / "model.safetensors"
    read = (f"torch.load({str(path)!r}, weights_only=True)" if legacy_torch
            else f"pickle.load(open({str(path)!r}, 'rb'))")
    note = "" if legacy_torch else " (only if you trust where the file came from)"
    return (f"python -c \"import pickle, torch, safetensors.torch as st; st.save_file({{k: v.clone().contiguous() "
            f"for k, v in {read}.items()}}, {str(target)!r}, metadata={{'format': 'pt'}})\"{note}")
