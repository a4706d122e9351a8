"""Where ``--report_to`` sends a run's numbers: one ``Tracker`` subclass per library, registered by its name.

A tracker is started (a new run, or the one it continues), gets the scalars of metrics.jsonl's records as
``log(step, values, when)`` and is finished; ``lowmem.monitoring.tracker_feed`` decides which records it gets and when.
Each library's own settings (its environment variables) win: a tracker only fills in what the user left
unset, and bounds the waits the library would otherwise spend on a server that does not answer. A tracker with a
server is reached before the run starts (``reach``): one that does not answer is refused in one line. Add a tracker:
one subclass here, with its ``name`` (it registers by it: ``lowmem.utils.registry``), ``extra``, the three methods,
what it writes in OUTPUT_DIR (``folders``, ``files``: the run folder owns them, ``lowmem.utils.ownership``) and, when it
sends to a server, ``reach``.

    python train_low_mem.py train --report_to=tensorboard,wandb,mlflow,trackio
"""

from __future__ import annotations

import http.client
import importlib
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlsplit

from lowmem.utils.errors import UserError
from lowmem.utils.optional import installed, optional_package_missing
from lowmem.utils.ownership import own_run_entries
from lowmem.utils.registry import Registered

PROJECT = "t5-lowmem"  # the project / experiment a run goes into when the user names none


class Tracker(Registered, family=True):
    """One library a run's scalars go to (main process only)."""

    name: ClassVar[str]  # the --report_to value
    extra: ClassVar[str]  # pip install '.[extra]'
    live: ClassVar[bool] = False  # gets each record as it is written (it can hide, on resume, what came later)
    reach_timeout_s: ClassVar[float] = 10.0  # how long the start waits for a tracker's server before refusing
    folders: ClassVar[tuple[str, ...]] = ()  # what it writes in OUTPUT_DIR by default: folders,
    files: ClassVar[tuple[str, ...]] = ()  # and files (the run folder's own entries: starting over removes them)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own_run_entries(cls.__dict__.get("files", ()), cls.__dict__.get("folders", ()))

    def __init__(self, out: Path, config: dict):
        self.out = Path(out).resolve()  # the run folder
        self.config = config  # the run's options (config.json), stored with a new tracker run

    @classmethod
    def modules(cls) -> tuple[str, ...]:
        """What it imports (checked before training starts)."""
        return (cls.name,)

    @classmethod
    def reach(cls, timeout: float) -> None:
        """Refuse, in one line, a server this tracker sends to that gives no answer within ``timeout`` seconds.
        Trackers that write local files have nothing to reach (this default).

        Raises:
            UserError: which tracker, which address, what to change.
        """

    def start(self, run_id: str | None, resume_step: int | None) -> str | None:
        """Start a new tracker run (``run_id`` None) or continue ``run_id``; ``resume_step``: the checkpoint's step
        when the training run resumed. Returns the id that continues this tracker run (None: nothing to keep)."""
        raise NotImplementedError

    def log(self, step: int, values: dict[str, float], when: float) -> None:
        """The scalars of one record, at its optimizer step; ``when``: the record's time (seconds since the epoch)."""
        raise NotImplementedError

    def finish(self, complete: bool) -> None:
        """Flush and close; ``complete``: the training run ended (False: it stopped, to be resumed)."""


TRACKERS: dict[str, type[Tracker]] = Tracker.kinds  # --report_to name -> class, filled as the classes are defined


def tracker_entries() -> list[str]:
    """The names of what every tracker writes in OUTPUT_DIR (files and folders)."""
    return [name for kind in TRACKERS.values() for name in (*kind.folders, *kind.files)]


def requested(report_to: str) -> list[str]:
    """The tracker names of a ``--report_to`` value (``none``: no tracker)."""
    return [n.strip() for n in report_to.split(",") if n.strip() and n.strip() != "none"]


def check_report_to(report_to: str) -> None:
    """Refuse, in one line, an unknown tracker, one whose package is missing, or one whose server does not answer
    within its ``reach_timeout_s``.

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
    for name in requested(report_to):  # (after every name is known: a typo is not a wait)
        TRACKERS[name].reach(TRACKERS[name].reach_timeout_s)


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


def no_answer(url: str, timeout: float) -> str | None:
    """Why ``url`` gave no HTTP answer within ``timeout`` seconds; None when it answered (any status: a 401 or a 404
    comes from a server that is there). Proxies of the environment apply, as they do to the libraries."""
    outcome: list[str | None] = []

    def ask() -> None:
        try:
            urllib.request.urlopen(url, timeout=timeout).close()
            outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)
        except urllib.error.URLError as err:  # (a TLS refusal comes from a server that is there: its trust settings,
            # MLFLOW_TRACKING_INSECURE_TLS or a CA bundle, are the library's)
            outcome.append(None if isinstance(err.reason, ssl.SSLError) else str(err.reason))
        except (OSError, ValueError, http.client.HTTPException) as err:  # reset, not HTTP, a malformed address
            outcome.append(f"{type(err).__name__}: {err}")

    asking = threading.Thread(target=ask, daemon=True)  # (a name lookup has no timeout of its own: the thread's join
    asking.start()  # bounds the whole wait)
    asking.join(timeout)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


def refuse_unanswered(tracker: str, url: str, setting: str, timeout: float, change: str) -> None:
    """One ``error:`` line when ``url`` (the tracker's server, from ``setting``) gives no answer within ``timeout``."""
    why = no_answer(url, timeout)
    if why is not None:
        raise UserError(f"--report_to={tracker}: {url} ({setting}) did not answer ({why}): {change}, or drop "
                        f"{tracker} from --report_to")


class TensorBoardTracker(Tracker):
    """Event files in OUTPUT_DIR/tensorboard. Live: on resume SummaryWriter's ``purge_step`` hides what the stopped
    run logged after its checkpoint."""

    name, extra, live = "tensorboard", "tensorboard", True
    folders = ("tensorboard",)

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
    folders = ("wandb",)  # (WANDB_DIR unset)
    init_timeout_s = 30  # wandb.init's wait for its server (wandb's default: 90 s), unless WANDB_INIT_TIMEOUT is set

    @classmethod
    def reach(cls, timeout):
        """Online (wandb's mode, read by wandb from WANDB_MODE and its settings file): its server must answer."""
        import_module("wandb", cls.extra)
        from wandb.sdk import wandb_setup

        settings = wandb_setup.singleton().settings  # (read, not started: no service process yet)
        if not (settings._noop or settings._offline):
            refuse_unanswered(cls.name, settings.base_url, "WANDB_BASE_URL", timeout,
                              "check the network or WANDB_BASE_URL, run with WANDB_MODE=offline (then wandb sync)")

    def start(self, run_id, resume_step):
        wandb = import_module("wandb", self.extra)
        kwargs = {"dir": str(self.out)} if unset("WANDB_DIR") else {}
        if unset("WANDB_INIT_TIMEOUT"):  # (a retry at a checkpoint, with its server down, waits this long)
            kwargs["settings"] = wandb.Settings(init_timeout=self.init_timeout_s)
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
    files = ("mlflow.db", "mlflow.db-journal")  # (MLFLOW_TRACKING_URI unset)

    # mlflow's own waits for a server (7 retries with backoff factor 2, 120 s a request) hold a checkpoint's feed about
    # 4 minutes per call when the server is down; these (unless set) bound a failed call to a few seconds
    BOUNDED_WAITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                     "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}

    @classmethod
    def modules(cls):
        return ("mlflow",) + (("sqlalchemy", "alembic") if unset("MLFLOW_TRACKING_URI") else ())

    @classmethod
    def reach(cls, timeout):
        """A tracking server (an http(s) MLFLOW_TRACKING_URI, or Databricks at DATABRICKS_HOST) must answer; a
        database or a folder is local. (Databricks from a ~/.databrickscfg profile is not checked here.)"""
        uri = os.environ.get("MLFLOW_TRACKING_URI") or ""
        if urlsplit(uri).scheme in ("http", "https"):
            address, setting = uri, "MLFLOW_TRACKING_URI"
        elif uri.split(":")[0] == "databricks" and not unset("DATABRICKS_HOST"):
            host = os.environ["DATABRICKS_HOST"]
            address, setting = host if "://" in host else f"https://{host}", "DATABRICKS_HOST"
        else:
            return
        refuse_unanswered(cls.name, address, setting, timeout, f"start the tracking server or fix {setting}")

    def start(self, run_id, resume_step):
        import_module("mlflow", self.extra)
        for name, value in self.BOUNDED_WAITS.items():  # (mlflow reads them at each request)
            if unset(name):
                os.environ[name] = value
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
