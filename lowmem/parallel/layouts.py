"""The sharded layouts the memory planner knows, as ``plan --sharding`` and a run's recorded ``sharding`` name them.

What each keeps on one process is data here, read by ``lowmem.memory.plan_sharding`` (which asks a layout, never
compares its name); an engine (``lowmem.parallel.engines``) names the layout it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

UNSHARDED_TITLE = "neither FSDP nor DeepSpeed"  # a run of one process or plain data parallelism, in messages


@dataclass(frozen=True)
class ShardingLayout:
    """One process's share under a sharded engine, as the planner reckons it."""

    name: str  # as `plan --sharding` and run_config.json name it
    title: str  # in messages
    whole_weights: bool  # every process keeps the whole weights (ZeRO-1/2); else 1/N, gathered a block at a time
    steps_by_shard: bool  # the optimizer steps each weight's shard (FSDP); else a block-sized sub-group at a time


LAYOUTS = {layout.name: layout for layout in (
    ShardingLayout("fsdp", "FSDP", whole_weights=False, steps_by_shard=True),
    ShardingLayout("zero2", "DeepSpeed ZeRO-1/2", whole_weights=True, steps_by_shard=False),
    ShardingLayout("zero3", "DeepSpeed ZeRO-3", whole_weights=False, steps_by_shard=False),
)}


def layout_title(name: str | None) -> str:
    """The layout ``name`` (None: no sharding) as messages name it."""
    return UNSHARDED_TITLE if name is None else LAYOUTS[name].title
