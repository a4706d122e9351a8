"""``UserError``: a mistake the user can fix, raised anywhere and printed by the CLI as one ``error:`` line
(exit code 2), and ``print_error``, which prints that line once per machine. It sits on the ground floor so that every
package raises the same class (and a process that stops for a lost peer prints its line the same way)."""

import os
import sys
from pathlib import Path


class UserError(Exception):
    """A mistake the user can fix; the CLI prints it as one line and exits with code 2."""


def print_error(message: str, same_as: str | None = None) -> None:
    """Print ``error: message`` on stderr, once per machine under ``accelerate launch`` (``same_as``: a message that
    counts as this one, printed already or later: the same mistake another process met, and said so).

    A wrong flag or bad data is met by every process alike, and N identical lines (interleaved, as
    processes write at once) bury it. The launcher's per-launch folder (the parent of each worker's
    ``TORCHELASTIC_ERROR_FILE``) holds the lines already printed; a process prints only a line no
    other process on this machine has, so a mistake met by one process alone is still shown.
    """
    line = f"error: {message}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        import fcntl

        key = f"error: {same_as or message}".replace("\n", "\\n")
        try:
            with open(Path(error_file).parent.parent / "t5_lowmem_errors.txt", "a+") as seen:
                fcntl.flock(seen, fcntl.LOCK_EX)  # released when the file closes
                seen.seek(0)
                if key in seen.read().splitlines():
                    return
                seen.write(key + "\n")
        except OSError:
            pass  # cannot share the folder: print the line anyway
    print(line, file=sys.stderr, flush=True)
