"""Memory: predicted before a run, sized to a budget, and guarded while it runs.

- ``tensor_bytes``: bytes of a T5's tensors from its shapes (weights, gradients, optimizer state, activations).
- ``planner``: a run's peak memory by component on the host and the GPU, from the bytes ``plan_sizes`` counts.
- ``plan_sizes``: the bytes a run holds (weights, gradients, optimizer state, the peak's activations, caches, saves).
- ``plan_batches``: which micro-batches a run will train on (token lengths sampled from its stream), the costliest.
- ``plan_sharding``: what one process of an FSDP or ZeRO run holds, for the planner.
- ``profiles``: a --memory_profile's flags put on a configuration, and host16g's low-memory caps.
- ``batch_budget``: micro-batch sizes from the memory budget (the other profiles, and auto).
- ``run_memory``: a run's plan beside its measured peak, and the guard's message.
- ``guard``: the ``--max_rss_gb`` guard (``MemoryGuard``), read from ``lowmem.hardware.memory_use``.
- ``collector``: Python's cyclic garbage collector over a process's life.
"""
