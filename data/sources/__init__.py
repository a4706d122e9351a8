"""Where rows come from: corpus files and Hugging Face datasets, read with bounded memory.

- ``corpus``: finding corpus files, their formats, and streaming their rows (``Example``, ``DataProblems``).
- ``readers``: any row range of a file read one row at a time, every bad row named; file indexes.
- ``json_array``: a ``.json`` file holding one JSON array, its elements found one at a time.
- ``text_files``: plain-text corpora (``.txt``), one document per row.
- ``hf_datasets``: ``datasets`` folders and hub ids as a source of rows.
- ``eval_set``: the eval rows: an --eval_file's first rows, or the train file's held-out last rows.
"""
