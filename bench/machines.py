"""Several "machines" on one host: one launcher each (``accelerate launch`` with a static rendezvous, or ``torchrun``
with c10d), sharing a rendezvous on 127.0.0.1, each with its own machine rank. To torch and accelerate they are
machines; a test or a bench stops one by signalling every process of it (its launcher and the workers the launcher
started, each in a Unix session of its own, so a process-group signal would reach the launcher only).

    from bench.machines import Machines, launcher_command
    machines = Machines.start([launcher_command("accelerate", rank, 2, 1, port, train_args) for rank in (0, 1)], logs)
    machines.signal(1, signal.SIGSTOP); machines.wait_gone(0)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
KINDS = ("accelerate", "torchrun")


def launcher_command(kind: str, rank: int, machines: int, per_machine: int, port: int, args: list[str],
                     launch_flags: tuple[str, ...] = ()) -> list[str]:
    """The command line of machine ``rank``'s launcher of ``train_low_mem.py train ARGS`` (``machines`` x
    ``per_machine`` CPU processes over gloo); ``launch_flags``: the launcher's own (``--max_restarts``,
    ``--config_file``)."""
    script = [str(REPO / "train_low_mem.py"), "train", *args]
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(machines), "--nproc-per-node",
                str(per_machine), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                f"lowmem{port}", *launch_flags, *script]
    # (`--cpu` would start one process; the trainer makes launched processes CPU ones where no GPU is)
    config = [] if "--config_file" in launch_flags else ["--multi_gpu", "--mixed_precision", "no"]
    return [sys.executable, "-m", "accelerate.commands.launch", *config, "--num_processes",
            str(machines * per_machine), "--num_machines", str(machines), "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--dynamo_backend", "no",
            *launch_flags, *script]


def launch_env(threads: int = 1) -> dict:
    """The launchers' environment: CPU processes with ``threads`` compute threads each (the same in every run
    compared: another thread count sums in another order)."""
    return {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}


@dataclass
class Machines:
    """The launchers of one launch, started together."""

    launchers: list[subprocess.Popen]
    logs: list[Path]
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, commands: list[list[str]], logs: list[Path], cwds: list[Path] | None = None,
              env: dict | None = None, popen=subprocess.Popen, last_first_s: float = 0.0) -> Machines:
        """Start the launchers, in order; ``last_first_s``: the last one first, the others that many seconds later
        (under torchrun's c10d the first launcher hosts the rendezvous store)."""
        launchers: list = [None] * len(commands)
        order = list(range(len(commands)))
        if last_first_s:
            order = order[-1:] + order[:-1]
        for i in order:
            with open(logs[i], "w") as out:  # (a file, not a pipe nobody reads)
                launchers[i] = popen(commands[i], cwd=(cwds or [REPO] * len(commands))[i], env=env or launch_env(),
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            if last_first_s and i == order[0]:
                time.sleep(last_first_s)
        return cls(launchers, logs)

    def processes(self, machine: int) -> list[psutil.Process]:
        """Machine ``machine``'s launcher and every process under it."""
        try:
            root = psutil.Process(self.launchers[machine].pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def workers(self, machine: int) -> list[psutil.Process]:
        """The training processes of machine ``machine`` (its launcher's children running train_low_mem.py)."""
        found = []
        for p in self.processes(machine)[1:]:
            try:
                if "train_low_mem.py" in " ".join(p.cmdline()):
                    found.append(p)
            except psutil.NoSuchProcess:
                pass
        return found

    def signal(self, machine: int, sig: int) -> list[psutil.Process]:
        """Send ``sig`` to every process of machine ``machine`` (a hung host: SIGSTOP; a lost one: SIGKILL)."""
        stopped = self.processes(machine)
        for p in stopped:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        return stopped

    def wait_gone(self, processes: list[psutil.Process], limit_s: float) -> dict[int, float]:
        """Seconds from now until each of ``processes`` ended (reaped or a zombie), up to ``limit_s``."""
        start, gone = time.monotonic(), {}
        while len(gone) < len(processes) and time.monotonic() - start < limit_s:
            for p in processes:
                if p.pid in gone:
                    continue
                try:
                    ended = p.status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    ended = True
                if ended:
                    gone[p.pid] = time.monotonic() - start
            for launcher in self.launchers:
                launcher.poll()  # reap
            time.sleep(0.05)
        return gone

    def wait(self, timeout: float = 900) -> list[int]:
        """Every launcher's exit code (each killed first if it outlives ``timeout``)."""
        codes = []
        for launcher in self.launchers:
            try:
                codes.append(launcher.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started))))
            except subprocess.TimeoutExpired:
                self.kill_all()
                codes.append(launcher.wait())
        return codes

    def kill_all(self) -> None:
        for machine in range(len(self.launchers)):
            self.signal(machine, signal.SIGCONT)
            self.signal(machine, signal.SIGKILL)

    def wait_for_checkpoint(self, run: Path, step: int, limit_s: float = 300) -> None:
        """Wait until ``run``'s latest checkpoint is at ``step`` or later; AssertionError (machine 0's log) when a
        launcher ends first or ``limit_s`` passes."""
        deadline = time.monotonic() + limit_s
        while not checkpoint_reached(run, step):
            assert time.monotonic() < deadline and all(p.poll() is None for p in self.launchers), \
                self.output(0)[-2000:]
            time.sleep(0.05)

    def output(self, machine: int) -> str:
        return self.logs[machine].read_text(errors="replace")


def checkpoint_reached(run: Path, step: int) -> bool:
    """Whether ``run``'s latest checkpoint is at ``step`` or later."""
    latest = run / "checkpoints" / "latest"
    try:
        return latest.read_text().strip() >= f"step_{step:06d}"
    except OSError:
        return False
