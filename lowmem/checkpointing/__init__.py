"""Checkpoint files: crash-safe folders, checksums taken as they are written, and the checks that decide
whether one can be resumed from (the engines read their own shards through it; ``lowmem.runs`` writes them).

- ``checkpoint``: crash-safe folders: written beside, synced, renamed into place, the oldest pruned.
- ``checksums``: each checkpoint file's checksum, taken as it is written (safetensors written tensor by tensor).
- ``verify``: whether a checkpoint can be resumed from: sizes, checksums, state values; read once per process.
- ``state_values``: the types and ranges a checkpoint's state files must hold.
"""
