"""Where a run starts: the checks on OUTPUT_DIR that decide it, without importing torch.

The command line runs them before the trainer's imports (torch, transformers: several seconds), so a
folder that cannot take the run is refused in about half a second; the trainer runs them again once
its processes are up (the state may have changed meanwhile) and then holds the folder's lock. The
refusals leave the folder as they found it; a new run's folder, once accepted, is claimed here (made, with
its marker: ``lowmem.utils.ownership.claim_folder``).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from config import TrainConfig
from lowmem.checkpointing import checkpoint
from lowmem.model.source import resolve_model_dir
from lowmem.monitoring.metrics_log import read_metrics
from lowmem.monitoring.trackers import tracker_entries  # (importing it adds the trackers' entries to a run's own)
from lowmem.parallel.launch import Launch, launcher_id
from lowmem.runs.shared_folder import LAUNCHERS_FILE
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import (
    LEGACY_STARTED_MARKER,
    STARTED_MARKER,
    check_closed,
    check_folder,
    claim_folder,
    is_ours,
    is_run_folder,
    saved_json,
)

LOCK_FILE = ".lock"


def run_files(path: Path) -> list[Path]:
    """The files a run leaves in ``path`` (what starting over removes)."""
    files = [path / "checkpoints", path / "best", path / "final", path / "metrics.jsonl",
             *[path / name for name in tracker_entries()], path / "trackers.json", path / "plots",
             *path.glob("consumed-rank*.tsv"),
             path / ".old-best", path / ".old-final"]  # (an export's swap cut between its two renames)
    return [p for p in files if p.is_symlink() or p.exists() and not checkpoint.only_foreign(p)]


def check_owned(cfg: TrainConfig, path: Path) -> None:
    """Refuse an OUTPUT_DIR that is the model the run starts from, a saved model or inside one (a run's
    best/ and final/ are replaced whole, checkpoints/ rotated), or a folder of files not ours (for a
    resume: anything but a run's folder)."""
    if cfg.init_from and path.resolve() in [init := resolve_model_dir(cfg.init_from).resolve(), *init.parents]:
        raise UserError(f"--output_dir={cfg.output_dir} contains --init_from={cfg.init_from}: a run must not "
                        "write into the model it starts from; choose another --output_dir")
    for outer in path.resolve().parents:  # a run replaces its exports whole and removes old checkpoints
        run = outer.parent
        if outer.name in ("best", "final", "checkpoints") and is_ours(run, "run", is_run_folder):
            raise UserError(f"--output_dir={cfg.output_dir} is inside {outer}, which the run in {run} replaces or "
                            "removes as a whole, with what is inside; choose an --output_dir outside it")
    # A link among the run's own entries (final/ to a folder of the user's, checkpoints/ to another disk) would
    # have the run read, replace, move or remove what it leads to: refused before anything there is read
    check_closed(path)
    if (saved_json(path / "config.json") or {}).get("model_type"):  # a run's config.json has none
        raise UserError(f"--output_dir={cfg.output_dir} holds a saved model (config.json, weights), which a run "
                        "there would overwrite; choose another --output_dir")
    if cfg.is_keep_training:  # a run to continue, or nothing (said in starting_point): not a folder to start one in
        check_folder(path, "--output_dir", "run", is_run_folder, "pass the --output_dir of the run to continue")
    else:
        claim_folder(path, "--output_dir", "run", is_run_folder, "choose a new or empty --output_dir")


def lock_holder(path: Path) -> str | None:
    """The process id written in ``path``/.lock while another process holds that lock (``?`` if it wrote
    none yet), or None when nobody holds it. Only looks: the lock is left as it was."""
    import fcntl

    try:
        handle = open(path / LOCK_FILE)
    except OSError:  # no lock file (or none readable): no run has held this folder
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return handle.read().strip() or "?"
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def in_use_error(output_dir: str, owner: str) -> UserError:
    return UserError(f"--output_dir={output_dir} is in use by another run (process {owner}); wait for it to end or "
                     "choose another --output_dir")


def starting_point(cfg: TrainConfig, path: Path, say=print, states: bool = False) -> tuple[Path | None, list[Path]]:
    """The checkpoint a run in ``path`` resumes from (None: step 0), and the old run files to remove first.

    The checkpoint is verified (``checkpoint.validate``: sizes, checksums, state values; with ``states`` its
    torch state files' values too, which needs torch: the trainer's look): a damaged one is passed over with a
    warning for the one before. Each folder is read once per process, however often this runs.

    Raises:
        UserError: a run already there (without --is_keep_training or --overwrite_output_dir), a
            ``--resume_from`` that is not one of its usable checkpoints, nothing to resume.
    """
    used = run_files(path)
    checkpoints = path / "checkpoints"
    if not cfg.is_keep_training:
        if used and not cfg.overwrite_output_dir:
            if not stopped_before_training(path, used):
                raise UserError(f"--output_dir={cfg.output_dir} already holds a run; continue it with "
                                "--is_keep_training=True, start over with --overwrite_output_dir=True, "
                                "or choose another --output_dir")
            say(f"the last run in {cfg.output_dir} stopped before its first step: starting over")
        return None, used
    if cfg.resume_from:
        if Path(cfg.resume_from).resolve().parent != checkpoints.resolve():
            raise UserError(f"--resume_from={cfg.resume_from} is not one of this run's checkpoints: pass a "
                            f"step_NNNNNN folder of {checkpoints} (--output_dir names the run)")
        kept = ", ".join(f.name for f in checkpoint.step_folders(checkpoints)) or "none"
        if not Path(cfg.resume_from).is_dir():
            raise UserError(f"--resume_from={cfg.resume_from} does not exist (--save_total_limit prunes old "
                            f"checkpoints); this run's checkpoints: {kept}")
        if not checkpoint.is_step_name(Path(cfg.resume_from).name):
            raise UserError(f"--resume_from={cfg.resume_from} is not named step_NNNNNN: a copy of a checkpoint is "
                            f"never resumed from; pass one of this run's checkpoints: {kept}")
        problem = checkpoint.validate(Path(cfg.resume_from), states=states)
        if problem:
            raise UserError(f"--resume_from={cfg.resume_from} is not a usable checkpoint: {problem}")
        return _steps_left(cfg, Path(cfg.resume_from)), []
    found = checkpoint.find_latest_valid(checkpoints, warn=say, states=states)
    if found is not None:
        return _steps_left(cfg, found), []
    if not any((path / name).is_file() for name in ("config.json", STARTED_MARKER, LEGACY_STARTED_MARKER)):
        raise UserError(f"--is_keep_training: no run to continue in {cfg.output_dir} (no checkpoint); "
                        "run without --is_keep_training to start one")
    if has_trained_models(path):
        why = "damaged or removed" if checkpoint.step_folders(checkpoints) else "none was written"
        raise UserError(f"--is_keep_training: no checkpoint of the run in {cfg.output_dir} is usable ({why}), "
                        "and starting it again would replace the models it trained (best/, final/); "
                        "start over with --overwrite_output_dir=True, or train into another --output_dir")
    # Stopped before its first checkpoint, or every checkpoint damaged before any trained model was
    # exported: the same seed replays the run exactly, and nothing is lost.
    say(f"no usable checkpoint in {checkpoints}: starting the run again from step 0")
    return None, used


def _steps_left(cfg: TrainConfig, folder: Path) -> Path:
    """``folder``, the checkpoint a run continues from, unless --max_steps ends the run before its step: it
    would train nothing and export that checkpoint's weights again as the final model."""
    step = checkpoint.step_number(folder)
    if 0 < cfg.max_steps < step:
        raise UserError(f"--max_steps={cfg.max_steps} is below step {step}, where the run continues from ({folder}); "
                        f"pass a --max_steps above {step} to train on, or use a new --output_dir")
    return folder


def has_trained_models(path: Path) -> bool:
    """Whether the run exported a model trained past step 0 (final/, or a best/ from a later evaluation)."""
    # (.old-best, .old-final: an export's swap cut between its two renames holds the previous one there)
    best = saved_json(path / "best" / "training_info.json") or saved_json(path / ".old-best" / "training_info.json")
    exported = [path / "final", path / ".old-final"]
    return any(p.exists() and not checkpoint.only_foreign(p) for p in exported) or (best or {}).get("step", 0) > 0


def stopped_before_training(path: Path, used: list[Path]) -> bool:
    """True when the run in ``path`` stopped before its first optimizer step (bad data, a wrong flag,
    out of memory while building): it left a metrics.jsonl of step-0 records and at most the
    step-0 evaluation's ``best/`` (the model it started from), nothing that starting over would
    lose, so fixing the cause and running the same command again just works."""
    metrics = path / "metrics.jsonl"
    # What setup opens before the first step: the consumed-example logs and the trackers' files
    # (empty of steps then), and the step-0 evaluation's best/
    opened = {metrics, path / "best", *[path / name for name in tracker_entries()], path / "trackers.json",
              *path.glob("consumed-rank*.tsv")}
    if metrics not in used or not set(used) <= opened:
        return False
    try:
        records = read_metrics(metrics)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return all(r.get("step") == 0 and r.get("event") not in ("train", "checkpoint") for r in records)


def refuse_early(cfg: TrainConfig) -> None:
    """Every refusal of ``starting_point`` and ``check_owned``, and a lock another run holds, before the
    trainer's imports, on the first process of a launch (the only one that claims the folder)."""
    if int(os.environ.get("RANK", 0)) != 0:  # the main process decides for the launch; its refusal stops the others
        return  # (lowmem.parallel.peer_watch), and the trainer checks that every process sees the folder it made
    path = Path(cfg.output_dir)
    check_owned(cfg, path)
    if cfg.tokenizer_dir and is_ours(cfg.tokenizer_dir, "tokenizer"):  # one a run trained (or trains) there
        check_closed(cfg.tokenizer_dir, "--tokenizer_dir", "tokenizer")
    owner = lock_holder(path)
    if owner is not None:
        raise in_use_error(cfg.output_dir, owner)
    starting_point(cfg, path, say=lambda _line: None)  # what it would say, the trainer says


def watch_peers(flags: dict):
    """Under a launcher that hosts the launch's store, with several processes: the running
    ``lowmem.parallel.peer_watch.PeerWatch`` (else None; the trainer starts one once the process group is up),
    started before anything else with ``--peer_timeout_s`` as given on the command line (``settle_watch``
    applies a config file's): a mistake met by one process stops all of them from here on."""
    launch = Launch.from_env()
    if not (launch.several and launch.agent_store):
        return None
    from lowmem.parallel.peer_watch import PeerWatch

    given = flags.get("peer_timeout_s", TrainConfig.peer_timeout_s)
    return PeerWatch.start(given if isinstance(given, (int, float)) and not isinstance(given, bool) and given >= 0
                           else TrainConfig.peer_timeout_s)


def settle_watch(cfg: TrainConfig, watch) -> tuple[TrainConfig, list[str]]:
    """The run's config, with the watch's timeout settled; a process restarted by an elastic agent (torchrun or
    accelerate launch with --max_restarts) continues the run its launch claimed (``launchers.json`` names its
    launcher) from its latest valid checkpoint, as ``--is_keep_training=True`` would, with the same checks (a
    changed configuration or data is refused). Returns (config, notes)."""
    if watch is not None:
        watch.timeout_s = cfg.peer_timeout_s
        if not cfg.peer_timeout_s:
            watch.finish()
    me = launcher_id()
    recorded = saved_json(Path(cfg.output_dir) / LAUNCHERS_FILE) if me and Launch.from_env().max_restarts else None
    if me not in (recorded or {}).get("launchers", []):
        return cfg, []
    note = (f"restarted by the launcher (--max_restarts): continuing the run in {cfg.output_dir} from its latest "
            "valid checkpoint")
    return replace(cfg, is_keep_training=True, overwrite_output_dir=False, resume_from=None), [note]
