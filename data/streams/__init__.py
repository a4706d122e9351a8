"""The training streams: rows of a run's share in a seeded, resumable order.

Every stream offers the same small protocol, so the objectives, the trainer and the planner take any of
them (``data.streams.file_stream.ExampleStream`` documents it): ``iter_epoch()`` yields ``Example``s of
this process's share for the current ``epoch``; ``rank``; ``state_dict()`` / ``load_state_dict()`` restore
the position exactly on resume.

- ``file_stream``: files in a seeded order each epoch, rows through a bounded shuffle buffer.
- ``dataset_stream``: the same for a Hugging Face dataset.
- ``packed_text``: documents of either stream tokenized, concatenated and cut into fixed-length chunks.
"""
