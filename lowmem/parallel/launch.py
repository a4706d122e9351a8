"""The launch as its launcher describes it (``accelerate launch``, ``torchrun``, or one process), and which work
runs once per job and which once per machine: decided here, and nowhere else.

A job of N processes on M machines shares one run folder (``--output_dir`` on storage every machine sees, the
default and the only layout the trainer runs in: a machine that cannot see it gets one ``error:`` line at start,
``lowmem.runs.run_folder.RunFolder.check``). Reading the environment only: no torch here, so the command line
can ask before its heavy imports.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

JOB, MACHINE = "once per job", "once per machine"

# What each kind of work writes, and so where it runs. Once per job: on the main process (global rank 0), into the
# shared run folder; every other process waits for it and then reads what it wrote. Once per machine: on each
# machine's first process (local rank 0), for what lives on that machine only.
SCOPES = {
    "run folder": JOB,  # its claim, lock, metrics.jsonl, checkpoints' shared files (each process adds its shard)
    "tokenizer": JOB,  # trained by the main process when --tokenizer_dir has none; read by all
    "prepared shards": JOB,  # `prepare` runs as one process; a run reads the shards
    "exports": JOB,  # best/, final/, adapters
    "error line": MACHINE,  # a mistake every process meets is printed once per machine (lowmem.utils.errors)
}


def runs_here(work: str, launch: Launch | None = None) -> bool:
    """Whether this process does ``work`` (a key of ``SCOPES``)."""
    launch = launch or Launch.from_env()
    return launch.rank == 0 if SCOPES[work] == JOB else launch.local_rank == 0


@dataclass(frozen=True)
class Launch:
    """This process's place in the launch (one process: rank 0 of 1, on machine 0 of 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    machine: int = 0  # the launcher's node rank (accelerate's --machine_rank, torchrun's group rank)
    machines: int = 1
    max_restarts: int = 0  # torch elastic's --max_restarts (accelerate launch passes its own on)
    store_address: tuple[str, int] | None = None  # the launch's c10d store (MASTER_ADDR, MASTER_PORT)
    agent_store: bool = False  # the launcher hosts that store (before the process group exists, for every attempt)

    @classmethod
    def from_env(cls) -> Launch:
        env = os.environ
        if "LOCAL_RANK" not in env:
            return cls()
        world, local_world = int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_WORLD_SIZE", 1))
        rank = int(env.get("RANK", 0))
        address = (env["MASTER_ADDR"], int(env["MASTER_PORT"])) if env.get("MASTER_ADDR") and env.get(
            "MASTER_PORT") else None
        return cls(rank=rank, world=world, local_rank=int(env["LOCAL_RANK"]), local_world=local_world,
                   machine=int(env.get("GROUP_RANK", rank // max(local_world, 1))),
                   machines=int(env.get("GROUP_WORLD_SIZE", max(world // max(local_world, 1), 1))),
                   max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)), store_address=address,
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")

    @property
    def several(self) -> bool:
        """Several processes started by a launcher."""
        return self.world > 1


def launcher_id() -> str | None:
    """This process's launcher (its parent, an elastic agent: ``lowmem.cli.runner.die_with_launcher`` keeps it so) as
    "host pid start-time", which no other process on any machine shares; None outside a launcher."""
    if "LOCAL_RANK" not in os.environ:
        return None
    parent = os.getppid()
    started = start_time(parent)
    return f"{socket.gethostname()} {parent} {started}" if started else None


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat's field 22): with the pid, it names
    one process, which a later one reusing the number does not share; None where there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
