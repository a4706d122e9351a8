"""A run's folder: whether a run starts, resumes or is refused there, its checkpoints and its exports.

- ``checkpointer``: ``Checkpointer``, the one object the trainer saves, resumes and exports through.
- ``run_folder``: the files of a run folder: checkpoint contents, model exports, what a resume reads back.
- ``run_start``: the checks on OUTPUT_DIR that decide whether a run starts, resumes or is refused (an elastic
  restart continues its run).
- ``shared_folder``: one run folder for every machine of a launch: the main process decides, every process checks
  it sees the folder, and the folder records the launch's launchers.
"""
