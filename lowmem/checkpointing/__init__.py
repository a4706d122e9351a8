"""The run folder on disk: what may be written where, and crash-safe checkpoints that resume exactly.

- ``checkpointer``: ``Checkpointer``, the one object the trainer saves, resumes and exports through.
- ``run_folder``: the files of a run folder: checkpoint contents, model exports, what a resume reads back.
- ``run_start``: the checks on OUTPUT_DIR that decide whether a run starts, resumes or is refused.
- ``checkpoint``: crash-safe folders: written beside, synced, renamed into place, the oldest pruned.
- ``checksums``: each checkpoint file's checksum, taken as it is written (safetensors written tensor by tensor).
- ``verify``: whether a checkpoint can be resumed from: sizes, checksums, state values; read once per process.
- ``state_values``: the types and ranges a checkpoint's state files must hold.
- ``ownership``: which folders the commands may write into (new, empty or ours), and that none of their own
  entries is a symbolic link (the closed room); a leaf module that ``data.prepare`` uses too.
"""
