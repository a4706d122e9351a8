"""Processes running together: the accelerator and the engines that split the work.

- ``launch``: the launch as its launcher describes it (ranks, machines, elastic restarts), and which work runs once
  per job and which once per machine (``SCOPES``).
- ``peer_watch``: the beat each launched process keeps through the launch's store, so that a lost or hung machine
  stops the others within ``--peer_timeout_s``, a mistake met by one process stops all, and an elastic restart
  continues its run.
- ``distributed``: the accelerator a run gets, and what its processes agree on (counts, indexes, stops).
- ``engines``: the engine a launch runs (plain, FSDP, DeepSpeed), one object the trainer, the accumulation
  window and the checkpointer ask; ``engine_for_launch`` reads the launch config.
- ``layouts``: the sharded layouts the memory planner knows (``plan --sharding``: fsdp, zero2, zero3).
- ``sharding``: FSDP2 (``fully_shard``) applied by the trainer, its shards' state, equal forward counts.
- ``deepspeed_engine``: DeepSpeed ZeRO 2 and 3, started by accelerate and driven by the trainer.
- ``adafactor_slices``: Adafactor's step on the flat partitions DeepSpeed hands the optimizer.
"""
