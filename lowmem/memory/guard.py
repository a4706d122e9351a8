"""The ``--max_rss_gb`` guard (``MemoryGuard``: light to import, for the trainer's loop and for long loops
elsewhere, loading and exporting models), read from ``lowmem.hardware.memory_use``'s probes."""

from __future__ import annotations

import time

from lowmem.hardware.memory_use import rss_and_peak_bytes

MEMORY_GUARD_AT = 0.9  # --max_rss_gb's guard stops once RSS reaches this fraction of it: what comes next may need more


class StoppedForMemory(Exception):
    """The memory guard (--max_rss_gb) tripped. The CLI prints the message as one line and exits with
    code 3; in training, after the checkpoint of the last step (when one was completed)."""


class MemoryGuard:
    """``--max_rss_gb``'s guard: whether this process's resident memory has reached ``MEMORY_GUARD_AT`` of it.

    Each reading takes the RSS and the kernel's high-water mark of it: when the mark rose since the
    reading before, RSS went that high in between, so a peak already freed (a micro-batch's activations,
    gone by the end of its backward) trips the guard as memory still held does. Once tripped it stays
    so, with where it tripped; a guard of ``max_rss_gb=0`` is off and never trips.

        guard = MemoryGuard(cfg.max_rss_gb)
        for name, tensor in tensors:                  # a long loop of one process (loading, exporting):
            guard.check(f"loading {name} from {file}")  # raises StoppedForMemory once over
        if guard.over("micro-batch 3 of 8"):          # where the processes must stop together: note it,
            ...                                       # agree at the next collective, then stop (the trainer)
    """

    CHECK_EVERY_S = 0.005  # check() reads at most this often (the high-water mark keeps a peak in between)

    def __init__(self, max_rss_gb: float):
        self.max_rss_gb = max_rss_gb
        self.limit = int(MEMORY_GUARD_AT * max_rss_gb * 2**30)  # bytes; 0: off
        self.tripped: str | None = None  # where the first reading at or over the limit was taken
        self.tripped_bytes = 0  # what that reading saw: the RSS, or the peak reached since the reading before
        self.peak = rss_and_peak_bytes()[1] if self.limit else 0  # the high-water mark at the last reading
        self.read_at = 0.0  # time.monotonic() of the last reading

    @property
    def active(self) -> bool:
        return self.limit > 0

    def over(self, where: str) -> bool:
        """Read RSS now (unless tripped already); True once it has reached the limit, here or at an earlier
        reading (``tripped`` keeps that one's ``where``)."""
        if not self.limit or self.tripped is not None:
            return self.tripped is not None
        rss, peak = rss_and_peak_bytes()
        self.read_at = time.monotonic()
        seen = max(rss, peak if peak > self.peak else 0)
        self.peak = max(self.peak, peak)
        if seen >= self.limit:
            self.tripped, self.tripped_bytes = where, seen
        return self.tripped is not None

    def check(self, where: str, change: str = "") -> None:
        """Raise ``StoppedForMemory`` once RSS has reached the limit. For long loops of one process where
        stopping at once loses nothing (loading a model, exporting one): it reads at most every
        ``CHECK_EVERY_S``, so calling it once per tensor costs next to nothing. Under ``accelerate launch``
        the process that raises exits with code 3 and the launcher stops the others.

        Args:
            where: what is being done, for the message ("loading decoder.block.5.layer.1.DenseReluDense.wo.weight
                from model-00002-of-00002.safetensors").
            change: what to change so that it fits (default: ``plan`` and a larger --max_rss_gb).
        """
        if self.limit and self.tripped is None and time.monotonic() - self.read_at < self.CHECK_EVERY_S:
            return
        if self.over(where):
            change = change or ("`python train_low_mem.py plan --budget_gb=...` lists memory modes that fit, or "
                                "raise --max_rss_gb")
            raise StoppedForMemory(f"memory guard: RSS {self.tripped_bytes / 2**30:.2f} GiB reached "
                                   f"{MEMORY_GUARD_AT:.0%} of --max_rss_gb={self.max_rss_gb:g} while {self.tripped}; "
                                   f"nothing was saved. {change}")
