"""Stopping a run cleanly on SIGTERM / SIGINT: the current optimizer step finishes, a checkpoint is
written, and the command exits; a second signal stops at once. Also the count of skipped non-finite
steps, which stops a run after too many in a row. (The memory guard, which checkpoints and stops when RSS
nears ``--max_rss_gb``, within a step too, is ``lowmem.memory.guard.MemoryGuard``, driven by
``lowmem.memory.run_memory.MemoryStop``.)"""

from __future__ import annotations

import math
import signal
import sys
import threading

import torch

from lowmem.parallel.distributed import any_process
from lowmem.utils.errors import UserError


class StoppedBySignal(Exception):
    """Raised after the checkpoint written on SIGTERM / SIGINT. The CLI exits with ``exit_code``, the
    shell's 128 + signal number (130 for Ctrl-C, 143 for SIGTERM): the run did not finish, so
    ``train && train --is_finetune=True`` stops there and a job scheduler sees an interrupted job."""

    def __init__(self, step: int, exit_code: int):
        super().__init__(step)
        self.step, self.exit_code = step, exit_code


class StoppedAtOnce(KeyboardInterrupt):
    """Raised by a second SIGTERM / SIGINT, wherever the run is: no checkpoint (the last one stays). Not an
    ``Exception``, so that nothing on the way catches it; the CLI exits with ``exit_code``."""

    def __init__(self, exit_code: int):
        super().__init__(exit_code)
        self.exit_code = exit_code


class SignalWatch:
    """Notes SIGTERM / SIGINT once installed; ``requested`` asks every process."""

    def __init__(self, say=print):
        self.say = say
        self.received: str | None = None  # the signal's name

        def interrupt(signum, _frame):  # until install(): Ctrl-C interrupts setup at once, as by default, and
            self.received = signal.Signals(signum).name  # is remembered, for Python discards the exception
            raise KeyboardInterrupt  # when it lands in a finalizer (setup's gc.collect runs regex's)

        if threading.current_thread() is threading.main_thread():  # (signals reach the main thread only)
            signal.signal(signal.SIGINT, interrupt)
            shown = sys.unraisablehook

            def quiet(unraisable):  # that lost KeyboardInterrupt is remembered: no "Exception ignored" traceback
                if not isinstance(unraisable.exc_value, KeyboardInterrupt):
                    shown(unraisable)

            sys.unraisablehook = quiet

    def install(self) -> None:
        if self.received is not None:  # a Ctrl-C during setup whose KeyboardInterrupt was lost
            raise KeyboardInterrupt

        def request_stop(signum, _frame):
            if self.received is not None:  # a second signal: stop now
                self.say(f"{signal.Signals(signum).name} received again: stopping now, without a checkpoint (the "
                         "last one written is kept; continue from it with --is_keep_training=True)")
                raise StoppedAtOnce(128 + signum)
            self.received = signal.Signals(signum).name
            self.say(f"{self.received} received: finishing this optimizer step, then saving a checkpoint")

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request_stop)

    def pending(self) -> bool:
        """Whether this process got a signal (work that can be cut short stops at its next batch)."""
        return self.received is not None

    def exit_code(self) -> int:
        """128 + the signal's number (another process's signal, not this one's, counts as SIGTERM)."""
        return 128 + signal.Signals[self.received or "SIGTERM"].value

    def requested(self, accelerator) -> bool:
        """Whether any process got a signal (the same answer on all: one small all-reduce)."""
        return any_process(accelerator, self.received is not None)


class WindowRandomness:
    """The random generators as a window began (its dropout masks' source: the CPU's, and the GPU's on CUDA)."""

    def __init__(self, device):
        self.device = device
        self.cpu = torch.random.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class NonfiniteSteps:
    """The non-finite guard: optimizer steps skipped for a non-finite loss or gradient, counted in ``state`` (the
    trainer's counters, kept in every checkpoint), and ``UserError`` after ``max_in_a_row`` (--max_nonfinite_steps)
    in a row; ``record``: writes a metrics.jsonl record (none: not recorded)."""

    def __init__(self, state, max_in_a_row: int, say=print, record=None):
        self.state, self.max_in_a_row, self.say, self.record = state, max_in_a_row, say, record

    def again(self, precision, loss_finite, drawn: WindowRandomness | None = None) -> bool:
        """A window's gradient norm was not finite: whether to run the same window again. fp16's overflow of the
        loss scale (with a finite loss on every process: ``loss_finite()``) is the scaler's to count, and it lowers
        the scale: the window runs again, so no example is dropped for it, and with the random generators as
        ``drawn`` kept them, so it draws the dropout masks of its first attempt (the same computation at a lower
        scale). Anything else is counted (``count``) and the window is dropped. Every process calls it alike (the
        norm is the same)."""
        if precision.overflowed(loss_finite):
            if self.record is not None:
                self.record("scaler_skip", **precision.log_fields())  # (at step: the steps done before it)
            if drawn is not None:
                drawn.restore()
            return True
        self.count()
        return False

    def count(self) -> None:
        """Count an optimizer step skipped; raise ``UserError`` at ``max_in_a_row`` in a row."""
        state, max_in_a_row = self.state, self.max_in_a_row
        state.nonfinite_steps += 1
        state.nonfinite_in_a_row += 1
        self.say(f"step {state.step + 1}: non-finite loss or gradient, optimizer step skipped "
                 f"({state.nonfinite_in_a_row} in a row, {state.nonfinite_steps} in total)")
        if self.record is not None:
            self.record("nonfinite_step", skipped_total=state.nonfinite_steps, in_a_row=state.nonfinite_in_a_row)
        if state.nonfinite_in_a_row >= max_in_a_row:
            raise UserError(f"{state.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or "
                            f"gradient (--max_nonfinite_steps={max_in_a_row}); lower --learn_rate, keep "
                            "--max_grad_norm on, or use --mixed_precision=no (best/ never holds non-finite weights)")


def all_finite(accelerator, value) -> bool:
    """Whether ``value`` (a number, or a tensor: each of its elements, a preference objective's sums) is finite on
    every process (a collective)."""
    finite = bool(torch.isfinite(value).all()) if torch.is_tensor(value) else math.isfinite(float(value))
    return not any_process(accelerator, not finite)
