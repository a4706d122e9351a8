"""One run folder for the whole launch: the main process decides how the run starts there, and every process
checks that it sees the folder the main process made, before anything is written in it.

On several machines ``--output_dir`` must be on storage they all reach at the same path (``lowmem.parallel.launch``:
the run folder's work is once per job). A node-local path would give each machine a folder of its own: the main
process's checkpoints on one disk, the other machines' data positions and shards on theirs, a resume that
finds different runs on different machines. Such a launch stops at start with one line naming the machines
that cannot see it.

The folder also records the launchers of the launch that claimed it (``launchers.json``): a process an elastic
agent restarts (``--max_restarts``) has the same launcher, and so continues the run (``run_start.settle_watch``).
"""

from __future__ import annotations

import json
import secrets
import socket
from pathlib import Path

from lowmem.parallel.launch import Launch, launcher_id, runs_here
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import open_own, write_atomic

PROBE_PREFIX = ".write-test-"  # a run's own entry (lowmem.utils.ownership.RUN_ENTRIES)
LAUNCHERS_FILE = "launchers.json"  # the launchers of the launch that claimed the folder last (a run's own entry)


def record_launchers(accelerator, path: Path) -> None:
    """Write the launchers of every process into the run folder (the main process, once the run is claimed)."""
    ids = [launcher_id()]
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        ids = gather_object(ids)
    if runs_here("run folder") and any(ids):
        write_atomic(path / LAUNCHERS_FILE, json.dumps({"launchers": sorted({i for i in ids if i})}, indent=1) + "\n")


def made_here(path: Path, flag: str) -> str:
    """Make the folder (the main process), and leave a probe in it for the others to find: its name."""
    probe = path / f"{PROBE_PREFIX}{secrets.token_hex(8)}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open_own(probe, "w") as fh:
            fh.write("ok")
    except OSError as err:
        raise UserError(f"{flag}={path} is not writable ({err.strerror})") from None
    return probe.name


def seen_by_every_process(accelerator, path: Path, probe: str, flag: str) -> None:
    """Every process finds the main process's ``probe`` in ``path`` and can write beside it; else one ``UserError``
    on every process naming the machines that cannot. The probe is removed."""
    launch = Launch.from_env()
    problem = None
    if not runs_here("run folder"):
        mine = path / f"{PROBE_PREFIX}{launch.rank}"
        if not (path / probe).is_file():
            problem = "cannot see it"
        else:
            try:
                with open_own(mine, "w") as fh:
                    fh.write("ok")
                mine.unlink()
            except OSError as err:
                problem = f"cannot write there ({err.strerror})"
    reports = [(launch.rank, launch.machine, socket.gethostname(), problem, str(Path(path).resolve()))]
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        reports = gather_object(reports)
    if runs_here("run folder"):
        (path / probe).unlink(missing_ok=True)
    failed = [r for r in reports if r[3] is not None]
    if not failed:
        return
    machines = sorted({(machine, host, problem) for _, machine, host, problem, _ in failed})
    who = "; ".join(f"machine {machine} ({host}) {problem}" for machine, host, problem in machines)
    raise UserError(f"{flag}={path}: {who}. Every process of a launch uses the one run folder the main process "
                    f"made ({reports[0][4]}, on machine 0): put {flag} on storage every machine reaches at "
                    "that path (NFS, Lustre, a shared volume), not on a disk of each machine's own")
