"""Every process of a launch watches another one, so that a lost machine stops the rest within a minute.

A process waiting in a collective for a peer that hung (a frozen host, a stalled disk, a network partition)
waits until the process group's timeout: 30 minutes for gloo, 10 for NCCL. Shortening that timeout would
also stop a healthy run whose main process evaluates, generates or writes a large checkpoint while the others
wait. So the processes beat instead, through the launch's own c10d store (the TCPStore the launcher hosts,
at MASTER_ADDR:MASTER_PORT): a thread in each process adds 1 to its counter every second, and watches the
counter of the next rank (a ring: whatever set of processes is lost, some survivor watches one of them). A
counter that has not moved for ``--peer_timeout_s`` marks its process lost in the store, and every process,
reading that mark at its next beat, prints one line naming it and exits with ``EXIT_PEER_LOST``, whatever its
main thread is blocked in. The thread needs the interpreter for microseconds a second: the library calls a
run makes (torch's kernels and collectives, safetensors, sentencepiece) let it run (measured: gaps of 0.05 s
while a 1.6 GB checkpoint was written).

The same store carries the mistakes of the user's: a process that stops with an ``error:`` line posts it, and the
others stop with that line instead of waiting for a peer that will never come (before the process group exists
too, where the launcher hosts the store). Keys are per attempt: an elastic agent (``--max_restarts``) starts the
processes again with the same store.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from pathlib import Path

from lowmem.parallel.launch import Launch, start_time
from lowmem.utils.errors import print_error

EXIT_PEER_LOST = 4  # distinct from a mistake (2), the memory guard (3) and a signal's stop (128 + N)
BEAT_S = 1.0

_ACTIVE: PeerWatch | None = None


def active() -> PeerWatch | None:
    """The watch of this process, when it runs one."""
    return _ACTIVE


class PeerWatch:
    """The beat, the ring watch and the posted failures of one process (``start`` returns it running)."""

    def __init__(self, launch: Launch, timeout_s: float):
        self.launch, self.timeout_s = launch, timeout_s
        self.store = None
        self.prefix = ""  # this attempt's keys (an elastic restart is a new attempt)
        self.lock = threading.RLock()  # the store client is one connection: one caller at a time
        self.done = threading.Event()
        self.reported = threading.Lock()  # the first report exits the process; a second waits for that
        self.peer_failure: tuple[str, int, str] | None = None  # (line, exit code, its own line) another one posted
        self.answered = time.monotonic()  # when the store last answered a round of the beat

    @classmethod
    def start(cls, timeout_s: float) -> PeerWatch | None:
        """Start watching (a launched process of several, with the launch's store address); else None."""
        global _ACTIVE
        launch = Launch.from_env()
        if not launch.several or launch.store_address is None or timeout_s <= 0:
            return None
        watch = cls(launch, timeout_s)
        try:
            watch.connect()
        except Exception:  # no store at that address (a launcher that hosts none): the run goes on unwatched
            return None
        watch.answered = time.monotonic()
        threading.Thread(target=watch.run, name="peer-watch", daemon=True).start()
        threading.Thread(target=watch.supervise, name="peer-watch-supervisor", daemon=True).start()
        _ACTIVE = watch
        return watch

    def connect(self) -> None:
        from torch.distributed import TCPStore

        host, port = self.launch.store_address
        self.store = TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=BEAT_S * 5))  # longer: its host is lost
        # This attempt's number: every process of an attempt arrives once, and an elastic agent starts the next
        # attempt only after every process of this one has ended (so a failure posted by a process of an earlier
        # attempt is never read as this one's).
        arrived = int(self.store.add("t5lowmem/arrivals", 1))
        self.prefix = f"t5lowmem/{(arrived - 1) // self.launch.world}/"
        self.store.set(f"{self.prefix}where/{self.launch.rank}", f"{self.launch.machine} {socket.gethostname()}")
        self.store.add(f"{self.prefix}beat/{self.launch.rank}", 1)

    # ------------------------------------------------------------------ the thread
    def run(self) -> None:
        watched = (self.launch.rank + 1) % self.launch.world
        seen, moved = None, time.monotonic()
        while not self.done.wait(BEAT_S):
            try:
                with self.lock:
                    self.store.add(f"{self.prefix}beat/{self.launch.rank}", 1)
                    posted = self._posted()
                    beat = self._beat(watched)
                    stopped = self._flag(f"done/{watched}")
                self.answered = time.monotonic()
            except Exception:  # the store refused or timed out: its host is lost (supervise() decides when)
                continue
            if posted is not None:
                self.report(*posted)
            if beat != seen or stopped:
                seen, moved = beat, time.monotonic()
            elif beat is not None and time.monotonic() - moved > self.timeout_s:
                self._mark_lost(watched)

    def supervise(self) -> None:
        """Watch the watch: a store whose host hung (SIGSTOP, a frozen machine) never answers, and torch's store
        client waits for an answer to ``add`` with no timeout of its own (measured, torch 2.13), so the beat
        above blocks; the store's host is then lost."""
        while not self.done.wait(BEAT_S):
            if time.monotonic() - self.answered > self.timeout_s:
                self.report(self.lost_line(self._store_host(), self.timeout_s), EXIT_PEER_LOST)

    def _posted(self) -> tuple | None:
        """(line, exit code[, the poster's own line]) of a failure or a lost process marked in the store, or None."""
        if self.store.check([f"{self.prefix}failed"]):
            rank, code, line = self.store.get(f"{self.prefix}failed").decode().split("\t", 2)
            if int(rank) != self.launch.rank:
                if self.peer_failure is None:
                    self.store.add(f"{self.prefix}failed_seen", 1)  # (the poster waits for the others to read it)
                    self.peer_failure = (f"{self._where(int(rank))}: {line}", int(code), line)
                return self.peer_failure
        if self.store.check([f"{self.prefix}lost"]):
            rank, silent_s = self.store.get(f"{self.prefix}lost").decode().split()
            return self.lost_line(self._names([int(rank)]), float(silent_s)), EXIT_PEER_LOST
        return None

    def _beat(self, rank: int) -> int | None:
        key = f"{self.prefix}beat/{rank}"
        return int(self.store.add(key, 0)) if self.store.check([key]) else None  # None: not started yet

    def _flag(self, name: str) -> bool:
        return self.store.check([f"{self.prefix}{name}"])

    def _mark_lost(self, rank: int) -> None:
        with self.lock:
            self.store.compare_set(f"{self.prefix}lost", "", f"{rank} {self.timeout_s:.0f}")
            posted = self._posted()
        if posted is not None:
            self.report(*posted)

    # ------------------------------------------------------------------ what the main thread asks
    def lost_line(self, who: str, silent_s: float | None = None) -> str:
        """The one line a survivor prints: who was lost (``_names``), how (``silent_s``: hung that long; None:
        gone), and how to continue."""
        how = f"has not answered for {silent_s:.0f} s (hung, or cut off)" if silent_s else \
            "stopped (killed, or out of memory)"
        return (f"{who} {how}; this process stops too. Checkpoints are written whole, so the last one is intact: "
                "continue with the same command plus --is_keep_training=True (under an elastic launcher with "
                "--max_restarts, its restart continues the run by itself)")

    def _names(self, ranks: list[int]) -> str:
        return ", ".join(self._where(rank) for rank in ranks) or "another process of this launch"

    def _store_host(self) -> str:
        host, port = self.launch.store_address
        return f"machine 0 (it holds the launch's rendezvous store, {host}:{port})"

    def _where(self, rank: int) -> str:
        try:
            with self.lock:
                machine, host = self.store.get(f"{self.prefix}where/{rank}").decode().split(" ", 1)
        except Exception:
            return f"process {rank}"
        return f"process {rank} (machine {machine}, {host})" if self.launch.machines > 1 else f"process {rank}"

    def explain_loss(self) -> tuple[str, int]:
        """(line, exit code) for a collective that failed because a peer went away: a peer's own posted error,
        else the processes whose beat stopped (read twice, a few beats apart)."""
        world = range(self.launch.world)
        try:
            with self.lock:
                first = [self._beat(r) for r in world]
            time.sleep(BEAT_S * 3)
            with self.lock:
                posted = self._posted()
                second = [self._beat(r) for r in world]
                ended = [self._flag(f"done/{r}") for r in world]
        except Exception:  # the store went with the lost machine (its launcher stopped after a mistake of its own?)
            return self.peer_failure[:2] if self.peer_failure else (self.lost_line(self._store_host()), EXIT_PEER_LOST)
        if posted is not None:
            return posted[:2]
        lost = [r for r in world if first[r] == second[r] and not ended[r] and r != self.launch.rank]
        return self.lost_line(self._names(lost)), EXIT_PEER_LOST

    def post_failure(self, line: str, code: int) -> None:
        """Tell the others this process stops with ``line`` (its ``error:`` message) and exit code ``code``."""
        mine = f"{self.launch.rank}\t{code}\t{line}"
        try:
            with self.lock:
                posted = self.store.compare_set(f"{self.prefix}failed", "", mine).decode()
                if posted != mine:  # another process posted first: this one has read it
                    self.store.add(f"{self.prefix}failed_seen", 1)
                    return
            # Wait (a few beats at most) until the others have read it: this process's exit ends its launcher, and
            # on machine 0 the store with it, which a process still waiting to read it would meet as a lost machine
            deadline = time.monotonic() + BEAT_S * 3
            while time.monotonic() < deadline:
                with self.lock:
                    if int(self.store.add(f"{self.prefix}failed_seen", 0)) >= self.launch.world - 1:
                        return
                time.sleep(BEAT_S / 10)
        except Exception:
            pass  # the store is gone too: the others find this process silent instead

    def init_process_group(self) -> None:
        """Start torch's default process group through this attempt's keys of the launch's store.

        An elastic agent (torchrun's c10d rendezvous, which shares its TCPStore with the workers, and accelerate
        launch's static one) keeps one store for every attempt, and torch's process group keys carry no attempt:
        a restarted process read the address a process of the attempt before had published and was refused
        (gloo's ``connectFullMesh``; NCCL's unique id, pytorch/pytorch#135712). Called before accelerate starts,
        which then uses this group."""
        import torch
        import torch.distributed as dist

        host, port = self.launch.store_address
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False)
        dist.init_process_group(None if torch.cuda.is_available() else "gloo",
                                store=dist.PrefixStore(f"{self.prefix}process_group/", store),
                                rank=self.launch.rank, world_size=self.launch.world)

    def finish(self) -> None:
        """This process ends on its own terms (done, a signal's checkpoint, the memory guard): not lost."""
        global _ACTIVE
        self.done.set()
        try:
            with self.lock:
                self.store.set(f"{self.prefix}done/{self.launch.rank}", "1")
        except Exception:
            pass
        _ACTIVE = None

    def report(self, line: str, code: int, same_as: str | None = None) -> None:
        """Print ``line`` once per machine and end this process at once: its main thread may be blocked in a
        collective that never returns. ``same_as``: the line as its process printed it (lowmem.utils.errors)."""
        with self.reported:
            print_error(line, same_as)
            if code == EXIT_PEER_LOST:
                self.end_launcher_if_stuck()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def end_launcher_if_stuck(self) -> None:
        """End this process's launcher ``LAUNCHER_GRACE_S`` after this process, if it is still there then.

        A torchrun agent whose workers have all stopped closes its c10d rendezvous before it exits, and when the
        lost machine hosts that rendezvous store, torch's store client waits for its answer with no timeout: the
        agent would wait forever (measured: over 180 s, where accelerate's launchers exit within 1 s of their
        workers). Not under --max_restarts, where the launcher's own restart logic decides. A detached process
        sleeps, then SIGKILLs the launcher only if that process (pid and start time) is still alive."""
        parent = os.getppid()
        started = start_time(parent)
        if self.launch.max_restarts or started is None or "TORCHELASTIC_RUN_ID" not in os.environ:
            return
        import subprocess

        repo = str(Path(__file__).resolve().parents[2])  # (its working folder may be any: it imports start_time)
        subprocess.Popen([sys.executable, "-c", END_IF_STILL_THERE, repo, str(parent), started, str(LAUNCHER_GRACE_S)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)


LAUNCHER_GRACE_S = 15  # a launcher that still runs this long after its worker stopped for a lost machine is stuck
END_IF_STILL_THERE = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from lowmem.parallel.launch import start_time
pid, started, grace = int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
time.sleep(grace)
if start_time(pid) == started:
    os.kill(pid, 9)
"""
