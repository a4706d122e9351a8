"""Adafactor on flat partitions of slices of many weights (DeepSpeed ZeRO's layout), on two gloo
processes: each applies its slices of the update Adafactor gives the whole weights."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lowmem.parallel.adafactor_slices import Layout, Slice
from lowmem.training.optim import Adafactor

WORLD = 2
# matrices wider and taller than a partition, a stack of matrices, vectors, and weights smaller than
# the number of processes (a partition of padding only)
SHAPES = [(7, 5), (3, 11), (13,), (2, 3, 4), (1,), (6, 1), (1, 6), (4, 4)]
OPTIONS = [dict(), dict(beta1=0.9, weight_decay=0.01), dict(clip_threshold=1e9)]


def whole_weights(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def gradients(step: int) -> list[torch.Tensor]:
    # spread over orders of magnitude, so the factored statistics matter
    return [g * 10 ** (i % 3 - 1) for i, g in enumerate(whole_weights(100 + step))]


def zero3_partition(weights: list[torch.Tensor], rank: int) -> tuple[torch.Tensor, Layout, list]:
    """Each weight split on its own into WORLD equal parts, the last padded (ZeRO-3)."""
    slices, pieces, offset = [], [], 0
    for w in weights:
        size = math.ceil(w.numel() / WORLD)
        start = rank * size
        count = max(0, min(size, w.numel() - start))
        slices.append(Slice(tuple(w.shape), start, count, offset))
        pieces.append(torch.zeros(size))
        pieces[-1][:count] = w.reshape(-1)[start:start + count]
        offset += size
    return torch.cat(pieces), Layout(tuple(slices)), slices


def zero2_partition(weights: list[torch.Tensor], rank: int) -> tuple[torch.Tensor, Layout, list]:
    """All weights concatenated, padded to WORLD equal parts, then split (ZeRO-1 and 2)."""
    flat = torch.cat([w.reshape(-1) for w in weights])
    size = math.ceil(flat.numel() / WORLD)
    flat = torch.cat([flat, torch.zeros(size * WORLD - flat.numel())])
    begin, end = rank * size, (rank + 1) * size
    slices, at = [], 0
    for w in weights:
        low, high = max(at, begin), min(at + w.numel(), end)
        count = max(0, high - low)
        slices.append(Slice(tuple(w.shape), low - at if count else 0, count, low - begin if count else 0))
        at += w.numel()
    return flat[begin:end].clone(), Layout(tuple(slices)), slices


def gathered(flat: torch.Tensor, slices: list[Slice]) -> list[torch.Tensor]:
    """The whole weights back from every process's partition."""
    parts = [torch.zeros_like(flat) for _ in range(WORLD)]
    dist.all_gather(parts, flat)
    layouts = [torch.tensor([[s.start, s.count, s.offset] for s in slices]) for _ in range(WORLD)]
    dist.all_gather(layouts, layouts[dist.get_rank()].clone())
    whole = []
    for i, piece in enumerate(slices):
        values = torch.zeros(piece.numel)
        for part, layout in zip(parts, layouts):
            start, count, offset = (int(x) for x in layout[i])
            values[start:start + count] = part[offset:offset + count]
        whole.append(values.view(piece.shape))
    return whole


def run(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    worst = 0.0
    for options in OPTIONS:
        for partition in (zero3_partition, zero2_partition):
            reference = [w.clone() for w in whole_weights(0)]
            whole_optimizer = Adafactor(reference, lr=0.01, **options)
            flat, layout, slices = partition(whole_weights(0), rank)
            flat_optimizer = Adafactor([flat], lr=0.01, **options)
            flat_optimizer.describe(flat, layout)
            for step in range(3):
                for w, g in zip(reference, gradients(step)):
                    w.grad = g
                whole_optimizer.step()
                flat.grad = partition(gradients(step), rank)[0]
                flat_optimizer.step()
            for a, b in zip(reference, gathered(flat, slices)):
                worst = max(worst, float((a - b).abs().max()))
            moved = max(float((a - b).abs().max()) for a, b in zip(reference, whole_weights(0)))
            assert moved > 1e-3  # the steps changed the weights
    results[rank] = worst
    dist.destroy_process_group()


def test_adafactor_on_zero_partitions_steps_each_slice_as_the_whole_weight(tmp_path, processes):
    results = mp.Manager().dict()
    processes.spawn(run, (str(tmp_path / "init"), results), nprocs=WORLD)
    # 3 steps: float summation order only (a slice treated as a vector of its own is off by ~1e-2)
    assert max(results.values()) <= 1e-6
