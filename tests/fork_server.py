"""A process that imports what every CLI run imports (torch, transformers, accelerate, ...) once, then forks a child
per ``run_cli`` of the tests: the child sets the run's argv, working folder, environment and output files and runs
``train_low_mem.py`` as ``python train_low_mem.py ARGS`` would (``__main__``, the interpreter's own exit: atexit
handlers, thread joins, the exit code of ``SystemExit`` or 1 and a traceback for an uncaught exception).

Why: a test's CLI run of two steps is ~6 s, of which ~5 s is importing torch and transformers; the suite starts ~300.
Started by ``tests/conftest.py``, one per environment its runs have (a test's own ``HF_HOME``, a ``PYTHONPATH`` with a
``sitecustomize``): the hub libraries read such variables when imported, which here happened before the fork.

Nothing here computes before a fork: with ``OMP_NUM_THREADS=1`` (conftest sets it) the process has one thread when it
forks, and no OpenMP pool or CUDA context for a child to inherit.

Protocol: one JSON request per line on standard input (``args``, ``cwd``, ``env``, ``stdout``, ``stderr``: file paths,
``timeout``), one JSON reply per line on standard output (``returncode``, as ``subprocess`` gives it, ``timed_out``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "train_low_mem.py"


def preload() -> None:
    # train_low_mem.py sets this before the hub libraries are imported when its standard error is not a terminal,
    # as a child's (a file) never is
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import accelerate  # noqa: F401
    import safetensors.torch  # noqa: F401
    import sentencepiece  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoTokenizer, T5ForConditionalGeneration  # noqa: F401


def serve(requests, replies) -> dict | None:
    """Answer requests until standard input closes (returns None); in a forked child, return its request."""
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            return request
        replies.write(json.dumps(wait(pid, request["timeout"])) + "\n")
        replies.flush()
    return None


def wait(pid: int, timeout: float) -> dict:
    with os.fdopen(os.pidfd_open(pid), "rb") as exited:
        timed_out = not select.select([exited], [], [], timeout)[0]
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    return {"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out}


def become_the_run(request: dict) -> None:
    """In the child: what ``python train_low_mem.py ARGS`` with ``cwd``, ``env`` and redirected output would be."""
    import runpy

    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                           (2, request["stderr"], os.O_WRONLY)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [str(SCRIPT), *request["args"]]
    sys.path[0] = str(SCRIPT.parent)
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    sys.path[0] = str(REPO)
    # the protocol moves off standard input and output, which a child points at its run's files
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    preload()
    child_request = serve(requests, replies)
    if child_request is not None:
        become_the_run(child_request)
