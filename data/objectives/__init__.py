"""Training objectives: what turns the rows a stream reads into ``(input_ids, labels)`` examples.

- ``base``: the objectives (pairs, span corruption, prefix LM) and ``objective_for``.
- ``span_noise``: T5's span-corruption maths on one chunk of token ids (noise masks, sentinels).
"""
