"""What verifying a checkpoint's checksums costs beside loading it (lowmem/checkpointing/checksums.py).

    python -m bench.checksum_cost                         # flan-t5-large float32: one 3.1 GB model.safetensors
    python -m bench.checksum_cost --shape=xl              # flan-t5-xl float32: 11.4 GB (needs ~24 GB of RAM free)
    python -m bench.checksum_cost --torch_gb=2 --write_gb=1

Side by side, on files just written (in the page cache, as a resume after a run finds them; from a cold disk both
the load and the checksum wait on the same read, which only lowers the ratio):

1. a hub-shaped ``model.safetensors`` (bench/hub_checkpoint.py): ``checksums.digest_file`` (xxh3-64, the manifest's,
   and zlib.crc32 for comparison) against ``safetensors.torch.load_file`` with every tensor copied out (load_file
   maps the file: its bytes are read when a model's parameters take them);
2. a ``torch.save`` file of ``--torch_gb`` of tensors (an optimizer state's shape): the checksum against ``torch.load``;
3. writing ``--write_gb`` of tensors: ``checksums.save_safetensors`` (hashed as written) against ``save_file``.

Prints each time and the ratios; the files are removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from bench.harness import Column, Table, time_call
from bench.hub_checkpoint import build_checkpoint
from lowmem.checkpointing import checksums


def tensors_of(gigabytes: float) -> dict:
    """Float32 tensors of 64 MiB each, ``gigabytes`` in all."""
    count = max(1, round(gigabytes * 1e9 / 2**26))
    return {f"t{i}": torch.randn(2**24) for i in range(count)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="large", help="hub shape of model.safetensors (bench/hub_checkpoint.py)")
    parser.add_argument("--torch_gb", type=float, default=2.0, help="size of the torch.save file")
    parser.add_argument("--write_gb", type=float, default=1.0, help="size written with and without the checksum")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="checksum-cost-", dir=args.dir))
    rows = []
    try:
        model = root / "hub" / "model.safetensors"
        build_checkpoint(root / "hub", shape=args.shape, dtype="float32", max_shard_bytes=10**12)
        size = model.stat().st_size / 1e9
        # Each timed twice, alternating, and the second kept: the first read of a file just written may wait on
        # the disk (its dirty pages still being written back), which would charge whichever ran first
        checksum, crc, load = (lambda: checksums.digest_file(model)), (
            lambda: checksums.digest_file(model, "crc32")), (lambda: _load_file(model))
        times = [time_call(fn) for fn in (checksum, crc, load, load, crc, checksum)]
        rows.append((f"{args.shape} model.safetensors ({size:.1f} GB): xxh3-64", times[5]))
        rows.append(("  zlib.crc32", times[4]))
        rows.append(("  safetensors load_file", times[3]))
        model.unlink()
        state = tensors_of(args.torch_gb)
        torch.save(state, root / "optimizer.pt")
        del state
        checksum, load = (lambda: checksums.digest_file(root / "optimizer.pt")), (
            lambda: torch.load(root / "optimizer.pt", weights_only=True))
        times = [time_call(fn) for fn in (checksum, load, load, checksum)]
        rows.append((f"torch file ({args.torch_gb:.1f} GB): xxh3-64", times[3]))
        rows.append(("  torch.load", times[2]))
        (root / "optimizer.pt").unlink()
        weights = tensors_of(args.write_gb)
        from safetensors.torch import save_file

        plain, hashed = (lambda: save_file(weights, str(root / "a"))), (
            lambda: checksums.save_safetensors(weights, root, "b", {}))
        times = [time_call(fn) for fn in (plain, hashed, hashed, plain)]
        rows.append((f"write {args.write_gb:.1f} GB: save_file", times[3]))
        rows.append(("  save_safetensors, hashed as written", times[2]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = Table([Column("what", "name"), Column("seconds", "seconds", ".2f")])
    for label, seconds in rows:
        table.add(label, {"seconds": seconds})
    table.show()
    print(f"model: checksum / load = {rows[0][1] / rows[2][1]:.2f}; torch file: checksum / load = "
          f"{rows[3][1] / rows[4][1]:.2f}; write: hashed / save_file = {rows[6][1] / rows[5][1]:.2f}")


def _load_file(path: Path) -> None:
    from safetensors.torch import load_file

    loaded = load_file(str(path))  # mapped: the bytes are read as the tensors are copied into a model
    for tensor in loaded.values():
        torch.empty_like(tensor).copy_(tensor)  # what load_model does into the model's parameters


if __name__ == "__main__":
    main()
