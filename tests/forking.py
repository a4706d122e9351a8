"""The tests' side of tests/fork_server.py: runs of ``train_low_mem.py`` forked from a process that imported torch,
transformers and accelerate already (~5 s of every run's start, ~8 s of CPU with DeepSpeed).

``ForkServers.cli`` runs ``python train_low_mem.py ARGS`` as a forked child; ``ForkServers.launch`` rewrites an
``accelerate launch ... train_low_mem.py ARGS`` command so that each rank the launcher starts is one
(``--no_python`` with ``forked_worker.py``): the launcher, its rendezvous, its environment and its signals are
accelerate's and torch's own; only the interpreter's start is skipped.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SERVER_VARIABLE = "T5LOWMEM_TEST_FORK_SERVER"  # (tests/forked_worker.py reads it)
LAUNCHER = [sys.executable, "-m", "accelerate.commands.launch"]


class ForkServer:
    """One tests/fork_server.py process, its libraries imported in ``env``, listening at ``address``."""

    def __init__(self, env: dict, address: str, preload: tuple[str, ...]):
        self.address = address
        self.server = subprocess.Popen([sys.executable, str(TESTS / "fork_server.py"), address, ",".join(preload)],
                                       cwd=TESTS.parent, env=env, stdin=subprocess.PIPE)

    def connect(self) -> socket.socket:
        """A connection (the server listens first thing, its address appearing then; it answers once its imports are
        done)."""
        started = time.monotonic()
        while not os.path.exists(self.address):
            assert self.server.poll() is None, f"the fork server ended (exit code {self.server.returncode})"
            assert time.monotonic() < started + 120, "the fork server did not start in 120 s"
            time.sleep(0.01)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.connect(self.address)
        return connection

    def run(self, argv: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        """``python ARGV`` in ``cwd`` with ``env``, its output captured as ``subprocess.run`` would."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as null:
            connection = self.connect()
            with connection:
                request = {"argv": argv, "cwd": str(cwd), "env": env}
                socket.send_fds(connection, [json.dumps(request).encode()], [null.fileno(), out.fileno(), err.fileno()])
                pid = json.loads(connection.recv(4096))["pid"]
                connection.settimeout(timeout)
                try:
                    returncode, timed_out = json.loads(connection.recv(4096))["returncode"], False
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)
                    connection.settimeout(None)
                    returncode, timed_out = json.loads(connection.recv(4096))["returncode"], True
            stdout, stderr = (self.read(f) for f in (out, err))
        command = [sys.executable, *argv]
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)

    @staticmethod
    def read(file) -> str:
        file.seek(0)
        return file.read().decode("utf-8", errors="replace")

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


class ForkServers:
    """The fork servers of one pytest process, one for each environment its runs have (libraries read some variables
    when imported: a test's own ``HF_HOME``, a ``PYTHONPATH`` with a ``sitecustomize``), the latest ``KEPT`` kept."""

    KEPT = 3
    # Set in the pytest process as tests run, and read by no library when imported: pytest's name of the running
    # test, and the inductor cache folder torch sets (its default) the first time something compiles in-process
    READ_WHEN_USED = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="t5lm-fork-"))  # short: a socket's path has at most 107 bytes
        self.servers: dict[frozenset, ForkServer] = {}  # by environment and preloaded modules, oldest first
        self.worker = self.folder / "worker"  # what a launch runs for each rank (an executable: --no_python)
        self.worker.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
                               f"{shlex.quote(str(TESTS / 'forked_worker.py'))} \"$@\"\n")
        self.worker.chmod(0o755)

    @classmethod
    def key(cls, env: dict) -> frozenset:
        """What of ``env`` a server's runs must share with it (all but ``READ_WHEN_USED``)."""
        return frozenset((k, v) for k, v in env.items() if k not in cls.READ_WHEN_USED)

    def server(self, env: dict, preload: tuple[str, ...] = ()) -> ForkServer:
        """The server for runs in ``env`` (started now if there is none)."""
        key = self.key(env) | {("", preload)}
        if key in self.servers:
            self.servers[key] = self.servers.pop(key)  # the latest used last
        else:
            if len(self.servers) == self.KEPT:
                self.servers.pop(next(iter(self.servers))).close()
            address = str(self.folder / f"server-{time.monotonic_ns()}")
            self.servers[key] = ForkServer(env, address, preload)
        return self.servers[key]

    def launch(self, command: list[str], env: dict) -> tuple[list[str], dict]:
        """``command`` (``accelerate launch [OPTIONS] SCRIPT ARGS``) with each rank forked, and its environment;
        other commands as they are."""
        if command[:len(LAUNCHER)] != LAUNCHER:
            return command, env
        script = next(i for i, arg in enumerate(command) if arg.endswith(".py"))
        options = command[len(LAUNCHER):script]
        deepspeed = any(arg.endswith(".yaml") and "DEEPSPEED" in Path(arg).read_text() for arg in options)
        server = self.server(env, ("deepspeed",) if deepspeed or "--use_deepspeed" in options else ())
        return ([*command[:script], "--no_python", str(self.worker), *command[script:]],
                {**env, SERVER_VARIABLE: server.address})

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        for path in self.folder.iterdir():
            path.unlink()
        self.folder.rmdir()
