"""Processes running together: the accelerator and the engines that split the work.

- ``distributed``: the accelerator a run gets, and what its processes agree on (counts, indexes, stops).
- ``sharding``: FSDP2 (``fully_shard``) applied by the trainer, and the options a sharded launch refuses.
- ``deepspeed_engine``: DeepSpeed ZeRO 2 and 3, started by accelerate and driven by the trainer.
- ``adafactor_slices``: Adafactor's step on the flat partitions DeepSpeed hands the optimizer.
"""
