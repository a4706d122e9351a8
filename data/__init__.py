"""Streaming data for t5-lowmem: sources (files -> rows), the resumable shuffled stream,
tokenization + dynamic padding, and tokenizer training. Shipped corpora and the default tokenizer
live beside this package (see data/README.md)."""
