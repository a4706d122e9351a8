"""Where ``--report_to`` sends a run's numbers: one ``Tracker`` subclass per library, registered by its name.

A tracker is started (a new run, or the one it continues), gets the scalars of metrics.jsonl's records as
``log(step, values, when)`` and is finished; ``lowmem.monitoring.tracker_feed`` decides which records it gets and when.
Each library's own settings (its environment variables) win: a tracker only fills in what the user left
unset. Add a tracker: one subclass here, with its ``name``, ``extra`` and the three methods.

    python train_low_mem.py train --report_to=tensorboard,wandb,mlflow,trackio
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import ClassVar

from config import UserError
from lowmem.extras import installed, optional_package_missing

PROJECT = "t5-lowmem"  # the project / experiment a run goes into when the user names none
TRACKERS: dict[str, type[Tracker]] = {}  # --report_to name -> class, filled as the classes are defined


class Tracker:
    """One library a run's scalars go to (main process only)."""

    name: ClassVar[str]  # the --report_to value
    extra: ClassVar[str]  # pip install '.[extra]'
    live: ClassVar[bool] = False  # gets each record as it is written (it can hide, on resume, what came later)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        TRACKERS[cls.name] = cls

    def __init__(self, out: Path, config: dict):
        self.out = Path(out).resolve()  # the run folder
        self.config = config  # the run's options (config.json), stored with a new tracker run

    @classmethod
    def modules(cls) -> tuple[str, ...]:
        """What it imports (checked before training starts)."""
        return (cls.name,)

    def start(self, run_id: str | None, resume_step: int | None) -> str | None:
        """Start a new tracker run (``run_id`` None) or continue ``run_id``; ``resume_step``: the checkpoint's step
        when the training run resumed. Returns the id that continues this tracker run (None: nothing to keep)."""
        raise NotImplementedError

    def log(self, step: int, values: dict[str, float], when: float) -> None:
        """The scalars of one record, at its optimizer step; ``when``: the record's time (seconds since the epoch)."""
        raise NotImplementedError

    def finish(self, complete: bool) -> None:
        """Flush and close; ``complete``: the training run ended (False: it stopped, to be resumed)."""


def requested(report_to: str) -> list[str]:
    """The tracker names of a ``--report_to`` value (``none``: no tracker)."""
    return [n.strip() for n in report_to.split(",") if n.strip() and n.strip() != "none"]


def check_report_to(report_to: str) -> None:
    """Refuse, in one line, an unknown tracker or one whose package is missing.

    Raises:
        UserError: what to change or to pip install.
    """
    for name in requested(report_to):
        if name not in TRACKERS:
            raise UserError(f"--report_to: unknown tracker {name!r}; a comma list of {', '.join(TRACKERS)} "
                            "(or none)")
        missing = [m for m in TRACKERS[name].modules() if not installed(m)]
        if missing:
            raise UserError(optional_package_missing(f"--report_to={name}", missing[0], extra=TRACKERS[name].extra))


def import_module(name: str, extra: str):
    """Import a tracker's library; one installed but broken is refused in one line."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise UserError(f"--report_to={extra} needs {name}, which fails to import ({err}): pip install "
                        f"'.[{extra}]'") from None


def import_trackers(report_to: str) -> None:
    """Import the libraries of the requested trackers, where installed (the memory plan counts them)."""
    for name in requested(report_to):
        for module in TRACKERS[name].modules() if name in TRACKERS else ():
            if installed(module):
                import_module(module, TRACKERS[name].extra)


def unset(*names: str) -> bool:
    """Whether none of the environment variables is set (the library's own setting wins over our default)."""
    return not any(os.environ.get(n) for n in names)


class TensorBoardTracker(Tracker):
    """Event files in OUTPUT_DIR/tensorboard. Live: on resume SummaryWriter's ``purge_step`` hides what the stopped
    run logged after its checkpoint."""

    name, extra, live = "tensorboard", "tensorboard", True

    def start(self, run_id, resume_step):
        writer = import_module("torch.utils.tensorboard", self.extra).SummaryWriter
        purge = {} if resume_step is None else {"purge_step": resume_step + 1}
        self.writer = writer(str(self.out / "tensorboard"), **purge)
        return None

    def log(self, step, values, when):
        for key, value in values.items():
            self.writer.add_scalar(key, value, step, walltime=when)
        self.writer.flush()  # (seen while training, not every two minutes)

    def finish(self, complete):
        self.writer.close()


class WandbTracker(Tracker):
    """Weights & Biases. WANDB_MODE, WANDB_DIR, WANDB_PROJECT, WANDB_ENTITY, WANDB_NAME, ... are wandb's own; unset,
    the run's files go to OUTPUT_DIR/wandb, the project is ``t5-lowmem`` and the run is named after OUTPUT_DIR.

    The optimizer step is the charts' x axis (``step``), not wandb's own row counter: wandb keeps a row open until a
    later one comes and drops a row for a step it has passed, and a record may come at a step already logged (the
    final ``memory_peak``, after the last evaluation). Each record is one row, written at once."""

    name, extra = "wandb", "wandb"

    def start(self, run_id, resume_step):
        wandb = import_module("wandb", self.extra)
        kwargs = {"dir": str(self.out)} if unset("WANDB_DIR") else {}
        kwargs |= {"project": PROJECT} if unset("WANDB_PROJECT") else {}
        kwargs |= {"name": self.out.name} if unset("WANDB_NAME") else {}
        if run_id is None:  # a new run (WANDB_RUN_ID and WANDB_RESUME, when set, are wandb's to apply)
            self.run = wandb.init(config=self.config, **kwargs)
        else:
            self.run = wandb.init(id=run_id, resume="allow", **kwargs)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        return self.run.id

    def log(self, step, values, when):
        self.run.log({**values, "step": step})

    def finish(self, complete):
        self.run.finish(exit_code=0 if complete else 1)


class MlflowTracker(Tracker):
    """MLflow. MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME / MLFLOW_EXPERIMENT_ID and MLFLOW_RUN_ID are mlflow's own;
    unset, the store is OUTPUT_DIR/mlflow.db (sqlite: mlflow's file store is refused by mlflow 3 unless
    MLFLOW_ALLOW_FILE_STORE is set) and the experiment ``t5-lowmem``."""

    name, extra = "mlflow", "mlflow"

    @classmethod
    def modules(cls):
        return ("mlflow",) + (("sqlalchemy", "alembic") if unset("MLFLOW_TRACKING_URI") else ())

    def start(self, run_id, resume_step):
        import_module("mlflow", self.extra)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = f"sqlite:///{self.out / 'mlflow.db'}" if unset("MLFLOW_TRACKING_URI") else None
        self.client = MlflowClient(tracking_uri=uri)
        run_id = run_id or os.environ.get("MLFLOW_RUN_ID")
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
        else:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_ID")
            if experiment is None:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
                found = self.client.get_experiment_by_name(name)
                experiment = found.experiment_id if found else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment, run_name=self.out.name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in self.config.items() if v is not None]  # (mlflow's limit)
            for i in range(0, len(params), 100):  # (at most 100 params a batch)
                self.client.log_batch(run_id, params=params[i:i + 100])
        self.run_id = run_id
        return run_id

    def log(self, step, values, when):
        from mlflow.entities import Metric

        ms = int(when * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ms, step) for k, v in values.items()])

    def finish(self, complete):
        self.client.set_terminated(self.run_id, status="FINISHED" if complete else "KILLED")


class TrackioTracker(Tracker):
    """Trackio (local: TRACKIO_DIR, else HF_HOME/trackio; TRACKIO_SPACE_ID syncs to a Space: trackio reads them).
    Project ``t5-lowmem``; the run is named after OUTPUT_DIR and the time it started, and resumed by that name."""

    name, extra = "trackio", "trackio"

    def start(self, run_id, resume_step):
        trackio = import_module("trackio", self.extra)
        name = run_id or f"{self.out.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if run_id is None:
            self.run = trackio.init(project=PROJECT, name=name, config=self.config, resume="never")
        else:
            self.run = trackio.init(project=PROJECT, name=name, resume="allow")
        return name

    def log(self, step, values, when):
        self.run.log(values, step=step)

    def finish(self, complete):
        self.run.finish()
