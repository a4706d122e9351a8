"""A process that imports what every run imports (torch, transformers, accelerate, ...) once, then forks a child per
run the tests start: the child takes the run's argv, working folder, environment and standard streams and runs the
script (``train_low_mem.py``) as ``python SCRIPT ARGS`` would (``__main__``, the interpreter's own exit: atexit
handlers, thread joins, the exit code of ``SystemExit`` or 1 and a traceback for an uncaught exception).

Why: a test's CLI run of two steps is ~6 s, of which ~5 s is importing torch and transformers (~8 s of CPU with
DeepSpeed); the suite starts ~300 runs and ~40 ``accelerate launch``es of two processes each.

Clients (``tests/conftest.py``): ``Processes.cli`` for a ``python train_low_mem.py`` run, and ``forked_worker.py``,
the command an ``accelerate launch`` starts for each rank (``--no_python``). One server per environment its runs
have (a test's own ``HF_HOME``, a ``PYTHONPATH`` with a ``sitecustomize``, a launch's variables): libraries read such
variables when imported, which here happened before the fork. The variables a launcher adds for each rank (``RANK``,
``MASTER_PORT``, ``ACCELERATE_*``) are read when the run sets up, in the child.

Nothing here computes before a fork: with ``OMP_NUM_THREADS=1`` (conftest sets it) the process has one thread when it
forks, and no OpenMP pool or CUDA context for a child to inherit.

Protocol (a ``SOCK_SEQPACKET`` Unix socket, one message each): the client sends ``{"argv", "cwd", "env"}`` with its
standard input, output and error as file descriptors; the server answers ``{"pid"}`` once the child runs, then
``{"returncode"}`` (as ``subprocess`` gives it) when it ends. A client that goes away (killed) takes its run with it:
the server kills the child. The server ends when its standard input closes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MESSAGE_BYTES = 1 << 20


def preload(modules: list[str]) -> None:
    # train_low_mem.py sets this before the hub libraries are imported when its standard error is not a terminal,
    # as a child's (a file or pipe here) never is
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import accelerate  # noqa: F401
    import safetensors.torch  # noqa: F401
    import sentencepiece  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoTokenizer, T5ForConditionalGeneration  # noqa: F401

    for name in modules:  # what some runs import too (deepspeed, for its launches)
        __import__(name)


def serve(listener: socket.socket, lifeline) -> tuple[dict, list[int]] | None:
    """Answer clients until ``lifeline`` closes (returns None); in a forked child, return its request and streams."""
    runs: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, its client's connection)
    clients: dict[int, int] = {}  # a running child's client connection (fd) -> its pid
    while True:
        ready = select.select([listener, lifeline, *runs, *clients], [], [])[0]
        if lifeline in ready and not os.read(lifeline.fileno(), 1024):
            for pid, _ in runs.values():
                os.kill(pid, signal.SIGKILL)
            return None
        for fd in ready:
            if fd in runs:
                pid, connection = runs.pop(fd)
                clients.pop(connection.fileno(), None)
                os.close(fd)
                status = os.waitpid(pid, 0)[1]
                reply(connection, {"returncode": os.waitstatus_to_exitcode(status)})
                connection.close()
            elif fd in clients:  # the client ended before its run (killed): the run goes with it
                os.kill(clients.pop(fd), signal.SIGKILL)
        if listener in ready:
            connection = listener.accept()[0]
            message, fds, _, _ = socket.recv_fds(connection, MESSAGE_BYTES, 3)
            pid = os.fork()
            if pid == 0:
                for pidfd in runs:
                    os.close(pidfd)
                for _, other in runs.values():
                    other.close()
                listener.close()
                lifeline.close()
                connection.close()
                return json.loads(message), fds
            for fd in fds:
                os.close(fd)
            runs[os.pidfd_open(pid)] = (pid, connection)
            clients[connection.fileno()] = pid
            reply(connection, {"pid": pid})


def reply(connection: socket.socket, message: dict) -> None:
    try:
        connection.send(json.dumps(message).encode())
    except OSError:  # the client is gone
        pass


def become_the_run(request: dict, streams: list[int]) -> None:
    """In the child: what ``python SCRIPT ARGS`` with ``cwd``, ``env`` and these standard streams would be."""
    import runpy

    for fd, stream in enumerate(streams):
        os.dup2(stream, fd)
        os.close(stream)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    sys.path[0] = str(REPO)
    address, preloaded = sys.argv[1], [m for m in sys.argv[2].split(",") if m]
    server_socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Bound beside, then renamed into place once listening: the client waits for the address to exist, and a socket
    # bound but not yet listening refuses a connection (17 tests of one session errored so in CI)
    server_socket.bind(address + ".binding")
    server_socket.listen(16)
    os.rename(address + ".binding", address)
    lifeline_stream = os.fdopen(os.dup(0), "rb", buffering=0)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    preload(preloaded)
    child = serve(server_socket, lifeline_stream)
    if child is not None:
        become_the_run(*child)
