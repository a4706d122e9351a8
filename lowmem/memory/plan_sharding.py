"""What one process of a sharded run holds, for the planner: FSDP's full shard and DeepSpeed ZeRO-3 (each
process keeps 1/N of the weights, gradients and optimizer state) and ZeRO-2 (the weights whole, the
rest split), against the whole-model terms a data-parallel process holds.

Beside its shards a process holds what it gathers for the step's computation: the weights of the block
it computes and of the next one (prefetched), and the shared embedding, which the encoder, the decoder
and a tied output layer all use (FSDP keeps it in the root group, gathered for the whole step). A
backward also makes each block's gradients whole before they are reduce-scattered. Exports gather the
whole model on the main process (counted by the planner as a save's copy).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem.memory.tensor_bytes import part_elements
from lowmem.parallel.layouts import LAYOUTS

SHARDINGS = tuple(LAYOUTS)  # as `plan --sharding` and the trainer name them ("fsdp", "zero2", "zero3")


@dataclass(frozen=True)
class HeldSizes:
    """Bytes a process holds of the model's terms at its step's peak: the whole model's in data parallelism, its
    shares and what it gathers in a sharded run (``sharded_sizes``; ``gathered`` is part of ``weights``)."""

    weights: float
    gathered: float
    gradients: float
    optimizer: float
    optimizer_temp: float
    gradient_copy: float = 0.0  # DDP's: between all-reduces autograd accumulates beside its buckets


def block_elements(dims: dict) -> int:
    """Elements of the largest T5 block: a decoder block's self- and cross-attention and feed-forward."""
    d, f, inner = dims["d_model"], dims["d_ff"], dims["num_heads"] * dims["d_kv"]
    attention = 4 * inner * d + d
    return 2 * attention + (3 if dims["gated"] else 2) * f * d + d


def sharded_sizes(sharding: str, world: int, dims: dict, shapes: dict, whole: HeldSizes) -> HeldSizes:
    """The sharded terms of one process of ``world``, from the ``whole`` model's (``sharding``: a name in
    ``lowmem.parallel.layouts.LAYOUTS``; no DDP buckets, so no gradient copy)."""
    weights, gradients, optimizer = whole.weights, whole.gradients, whole.optimizer
    layout = LAYOUTS[sharding]
    block = 4 * block_elements(dims)
    if layout.whole_weights:  # ZeRO-2: DeepSpeed steps a float32 copy of this process's partition
        return HeldSizes(weights + weights / world, 0.0, gradients / world + block, optimizer / world, 3 * block)
    embedding = 4 * part_elements(shapes, "shared")
    gathered = 2 * block + embedding * (1 - 1 / world)
    # FSDP steps each weight's shard (the largest one's temporaries); DeepSpeed one sub-group of a block's
    # size at a time (its flat copy of the sub-group's gradients, and the optimizer's temporaries)
    temp = whole.optimizer_temp / world if layout.steps_by_shard else 3 * block
    return HeldSizes(weights / world + gathered, gathered, gradients / world + block, optimizer / world, temp)
