"""Stopping a run cleanly on SIGTERM / SIGINT: the current optimizer step finishes, a checkpoint is
written, and the command exits; a second signal stops at once. (The memory guard, which stops the
same way when RSS nears ``--max_rss_gb``, is in ``lowmem.run_memory``.)"""

from __future__ import annotations

import signal

from lowmem.distributed import any_process


class StoppedBySignal(Exception):
    """Raised after the checkpoint written on SIGTERM / SIGINT; the CLI exits cleanly."""


class SignalWatch:
    """Notes SIGTERM / SIGINT once installed; ``requested`` asks every process."""

    def __init__(self, say=print):
        self.say = say
        self.received: str | None = None  # the signal's name

    def install(self) -> None:
        self.received = None

        def request_stop(signum, _frame):
            if self.received is not None:  # a second signal: stop now
                raise KeyboardInterrupt
            self.received = signal.Signals(signum).name
            self.say(f"{self.received} received: finishing this optimizer step, then saving a checkpoint")

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request_stop)

    def requested(self, accelerator) -> bool:
        """Whether any process got a signal (the same answer on all: one small all-reduce)."""
        return any_process(accelerator, self.received is not None)
