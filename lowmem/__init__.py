"""Support code for the trainer: memory probes, atomic checkpoint folders, the metrics log."""
