"""Training objectives: what turns the rows a stream reads into ``(input_ids, labels)`` examples, one
module each. Add one: a file here holding a subclass of ``base.Objective`` with a ``name``; it registers
itself and ``--objective=NAME`` finds it (no list to edit).

- ``base``: the ``Objective`` interface, the registry (``registry``, ``objective_class``) and ``objective_for``.
- ``pairs``: each row a prompt -> response example (``--objective=pairs``, the default).
- ``packed_text``: the shared base of the raw-text objectives: documents packed into chunks of tokens.
- ``span_corruption``: T5's pretraining objective on those chunks; ``span_noise``: its maths on one chunk.
- ``prefix_lm``: each chunk split at a random point, prefix -> rest.
- ``preference``: the shared base of the preference objectives (prompt, chosen, rejected rows; their collator);
  ``dpo``, ``orpo``, ``simpo``: one each, the loss of a pair from its answers' log-probabilities.
"""
