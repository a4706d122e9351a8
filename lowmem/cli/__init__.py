"""The command line (the commands themselves are ``train_low_mem.py``'s).

- ``runner``: one command run through fire, a user's mistake shown as one ``error:`` line (exit 2).
- ``flags``: command-line and YAML values into a ``TrainConfig``, with suggestions; notes for options a command
  does not read.
- ``help_pages``: ``--help`` (every command and option) and ``COMMAND --help`` (one command's options, examples).
- ``options_page``: docs/options.md, generated from the fields (``python -m lowmem.cli.options_page``).
- ``plan_command``: the ``plan`` command: predicted peak memory and the memory modes that fit a budget.
- ``export_command``: the ``export`` command: an adapter merged into its base, a checkpoint or a model, written as
  one plain transformers model folder in a chosen dtype, a shard at a time.
"""
