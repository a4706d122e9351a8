"""Streaming data for t5-lowmem, from files to the micro-batches training reads (each subpackage's
``__init__`` is its map):

- ``data.sources``: corpus files and Hugging Face datasets as rows, read with bounded memory; the eval set.
- ``data.streams``: this process's rows in a seeded, resumable order (one stream protocol for files and
  datasets), and raw text packed into chunks.
- ``data.objectives``: what turns rows into ``(input_ids, labels)`` examples (pairs, span corruption, prefix LM).
- ``pipeline``: the one entry point from files to what training reads; ``collate``: tokenization and
  dynamic padding of micro-batches; ``packing``: several examples to a row (``--packing``); ``prepare``: a
  corpus tokenized once into parquet shards; ``preview``: the first examples as the model sees them;
  ``tokenization``: training a sentencepiece tokenizer.

Shipped corpora (``pinyin/``, ``chatterbot/``) and the default tokenizer (``tokenizer/``) live beside
these modules, built by ``build_shipped_data.py`` (see data/README.md); ``build_preference_pairs.py`` builds
``chatterbot/preference_{train,eval}.jsonl`` from the chat turns (for the preference objectives' demo and tests).
"""
