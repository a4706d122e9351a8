"""Shared fixtures: small real corpora in several formats, the shipped tokenizer, the CLI run in-process and in a
process of its own.

Every process a test starts (a CLI run, an ``accelerate launch``, ``torch.multiprocessing``) goes through the
``processes`` fixture, or a fixture built on it (``run_cli``, ``accelerate_launch``); a test that uses one is marked
``e2e`` here, so ``pytest -m "not e2e"`` is the fast subset. A test that starts a Python process any other way fails.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the test helpers (t5_family)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One compute thread in each pytest worker and in every run it starts (children inherit the variable;
# accelerate and torchrun keep a value that is set). Two workers on two cores, each run asking torch
# for a thread per core, oversubscribe the cores: OpenMP's waiting threads then spin against each
# other and a tiny model's step took ~20x longer (9.0 s instead of 0.42 s, measured on the 2-core VM).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tests start ~300 CLI processes. Where PYTHONDONTWRITEBYTECODE is set (some container images set it), each
# compiled the project's own modules from source again: 0.4 s a process. The runs they start may keep that
# bytecode in the checkout's __pycache__ folders (git ignores them); the libraries' bytecode is pip's.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from forking import ForkServers  # noqa: E402

from config import SHIPPED_CORPORA, SHIPPED_TOKENIZER_DIR  # noqa: E402

WORDS = "the cat dog runs jumps over a lazy quick brown fox river stone light dark day night".split()


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    """Learnable prompt/response pairs: the response reverses the prompt's words."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 8))]
        rows.append({"prompt": " ".join(words), "response": " ".join(reversed(words))})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Write rows as jsonl / json / parquet / csv according to the file ending."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=64)
    elif path.suffix == ".csv":
        import csv

        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


@pytest.fixture(scope="session")
def tokenizer():
    from data.tokenization import load_tokenizer

    return load_tokenizer(SHIPPED_TOKENIZER_DIR)


@pytest.fixture(scope="session")
def shipped():
    return SHIPPED_CORPORA


class Processes:
    """The one way tests start processes (see the module docstring): thin wrappers of ``subprocess`` and
    ``torch.multiprocessing``. The training CLI's runs, and each rank of the ``accelerate launch``es ``run`` starts, are
    forked from a process that imported torch and transformers already (tests/forking.py)."""

    def __init__(self):
        self.forks = ForkServers()
        self.environments: set[frozenset] = set()  # those of the CLI runs so far
        usual = self.cli_env(None)
        self.forks.server(usual)  # importing while the first test sets up
        self.environments.add(ForkServers.key(usual))

    def run(self, command: list[str], env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
        command, env = self.forks.launch(command, dict(os.environ if env is None else env))
        return subprocess.run(command, env=env, **kwargs)

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        # Not forked: the runs a test kills (the launcher's process group) die as a user's would, the launched ranks
        # with their launcher (lowmem.cli.runner.die_with_launcher)
        return subprocess.Popen(*args, **kwargs)

    def spawn(self, fn, args: tuple, nprocs: int) -> None:
        import torch.multiprocessing as mp

        mp.spawn(fn, args=args, nprocs=nprocs)

    @staticmethod
    def cli_env(env: dict | None) -> dict:
        return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}

    def cli(self, *args: str, cwd: Path = REPO, timeout: int = 600, env: dict | None = None, fresh: bool = False,
            **kwargs) -> subprocess.CompletedProcess:
        """Run ``python train_low_mem.py ARGS`` as a user would; return the finished process. A child of a fork
        server that imported its libraries in the run's environment; the first run in another environment than the
        usual (a test's own ``HF_HOME``, or a ``PYTHONPATH`` with a ``sitecustomize``) starts from scratch, the
        second starts a server for it. ``fresh``: from scratch anyway, for a run whose RSS is held against a budget
        (a forked child has not yet touched, and so does not count, the library code its parent loaded: ~30 MiB)."""
        full_env = self.cli_env(env)
        argv = [str(REPO / "train_low_mem.py"), *args]
        key = ForkServers.key(full_env)
        if not kwargs and not fresh and key in self.environments:
            return self.forks.server(full_env).run(argv, cwd, full_env, timeout)
        self.environments.add(key)
        return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env=full_env, **kwargs)

    def close(self) -> None:
        self.forks.close()

    def launch_command(self, *args: str, processes: int = 2, port: int = 29517) -> list[str]:
        # `accelerate launch --cpu --num_processes 2` starts one process; this form starts two gloo ranks.
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                str(port), str(REPO / "train_low_mem.py"), "train", "--cpu=True", *args]

    def accelerate_launch(self, *args: str, processes: int = 2, port: int = 29517) -> subprocess.CompletedProcess:
        """``accelerate launch`` of the training CLI on ``processes`` CPU processes (2 or more)."""
        return self.run(self.launch_command(*args, processes=processes, port=port), cwd=REPO, capture_output=True,
                        text=True, timeout=600, env=LAUNCH_ENV)


LAUNCH_ENV = {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="session")
def processes():
    """Start processes (marks the test ``e2e``)."""
    starter = Processes()
    yield starter
    starter.close()


@pytest.fixture(scope="session")
def run_cli(processes):
    """``run_cli(*args, cwd=, timeout=, env=)``: ``python train_low_mem.py ARGS`` in a process of its own."""
    return processes.cli


@pytest.fixture(scope="session")
def accelerate_launch(processes):
    """``accelerate_launch(*args, processes=2, port=)``: the training CLI on several CPU processes."""
    return processes.accelerate_launch


@pytest.fixture(scope="session")
def kill_at_first_checkpoint_and_resume(processes, run_cli):
    """``kill_at_first_checkpoint_and_resume(run, args, log, wait_s)``: train into ``run`` (its output in ``log``),
    SIGKILL the process once its first checkpoint is written, then continue it with --is_keep_training=True
    (which must resume from that checkpoint)."""
    import time

    def kill_and_resume(run: Path, args: list[str], log: Path, wait_s: float) -> None:
        with open(log, "w") as fh:  # (a pipe nobody reads could block it)
            child = processes.popen([sys.executable, str(REPO / "train_low_mem.py"), "train", f"--output_dir={run}",
                                     *args], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, text=True)
        started = time.time()
        while not (run / "checkpoints" / "latest").is_file():
            assert child.poll() is None and time.time() < started + wait_s, log.read_text()[-2000:]
            time.sleep(0.05)
        child.kill()
        child.wait()
        done = run_cli("train", f"--output_dir={run}", *args, "--is_keep_training=True", timeout=1200)
        assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr[-3000:]

    return kill_and_resume


@pytest.fixture
def cli_in_process(monkeypatch):
    """``cli_in_process(*args, cwd=, env=)``: ``train_low_mem.main(ARGS)`` in this process, through the same
    ``lowmem.cli.runner.run_cli`` as a user's command (a ``UserError`` is one ``error:`` line and exit code 2). Returns
    a ``CompletedProcess`` as ``run_cli`` does. For refusals that come before anything heavy is built: a run
    that trains belongs in its own process (``run_cli``), where its signal handlers and threads are its own."""
    import contextlib
    import gc
    import io

    import train_low_mem

    def run(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        out, err, code = io.StringIO(), io.StringIO(), 0
        thresholds = gc.get_threshold()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                train_low_mem.main(list(args))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        finally:  # the command's collector settings are a process's; this one goes on running tests
            gc.unfreeze()
            gc.set_threshold(*thresholds)
        return subprocess.CompletedProcess(["train_low_mem.py", *args], code, out.getvalue(), err.getvalue())

    return run


STARTS_A_RUN = ("python", "accelerate", "torchrun", "deepspeed")


@pytest.fixture(autouse=True)
def _processes_only_through_the_fixture(request, monkeypatch):
    """A test that starts a Python process (or a launcher, or a ``multiprocessing`` child) without the
    ``processes`` fixture fails: it would escape the ``e2e`` marker and slow the fast subset down."""
    if "processes" in request.fixturenames:
        return
    import multiprocessing.process

    def refuse(what: str):
        pytest.fail(f"this test starts {what} without the `processes` fixture (tests/conftest.py): take "
                    "`run_cli`, `accelerate_launch` or `processes`, which mark it e2e", pytrace=False)

    execute_child = subprocess.Popen._execute_child

    def guarded(self, args, *rest, **kwargs):
        program = os.fsdecode(args if isinstance(args, (str, bytes, os.PathLike)) else args[0])
        if program == sys.executable or Path(program).name.startswith(STARTS_A_RUN):
            refuse(f"a process ({Path(program).name})")
        return execute_child(self, args, *rest, **kwargs)

    def start(self):
        refuse("a multiprocessing child")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)


def shared_folder(request, tmp_path_factory, name: str, build) -> Path:
    """A folder (a finished tiny run, say) built once per test session for every test that only reads it, pytest-xdist
    workers included: the first to ask calls ``build(folder)`` under a file lock, the others wait and read what it
    made. A test that would write into it copies it first (``shutil.copytree``); one that wrote anyway fails at the
    session's end, when the folder's files are compared with what ``build`` left."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has a basetemp of its own under the run's
        root = root.parent
    folder = root / f"shared-{name}"
    with FileLock(f"{folder}.lock"):
        if not (folder.parent / f"{folder.name}.built").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed in another worker: again, here
            folder.mkdir()
            build(folder)
            (folder.parent / f"{folder.name}.built").write_text("")
    built = folder_state(folder)

    def unchanged():
        changed = sorted(set(built) ^ set(folder_state(folder)))
        assert not changed, f"a test wrote into the shared folder {folder} (copy it first): {changed[:10]}"

    request.addfinalizer(unchanged)
    return folder


def folder_state(folder: Path) -> set[tuple[str, int, int]]:
    return {(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}


def metrics(run_dir: Path) -> list[dict]:
    from lowmem.monitoring.metrics_log import read_metrics

    return read_metrics(Path(run_dir) / "metrics.jsonl")


def pytest_collection_modifyitems(config, items):
    """Tests that start processes (the ``processes`` fixture, directly or through another fixture) are marked
    ``e2e``; tests marked ``gpu`` skip cleanly on machines without CUDA.

    The longest tests run first: multi-process launches (``accelerate_launch`` or a module's own ``launch``, at
    any depth of a test's fixtures), then the other e2e tests, then the rest. pytest-xdist hands each worker a slice of
    this order and an idle worker takes tests from the end of another's, so the run ends on short tests, not on a launch
    started last (file order put the sharded launches near the end: minutes of one busy core)."""
    import torch

    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "processes" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)

    def weight(item) -> int:
        fixtures = getattr(item, "fixturenames", ())
        return 0 if {"accelerate_launch", "launch"} & set(fixtures) else 1 if "processes" in fixtures else 2

    items.sort(key=weight)  # stable: file order within each weight


@pytest.fixture(scope="session")
def family_models(request, tmp_path_factory):
    """Model folders of every T5 family in the hub's layouts (tests/t5_family.py), built once per session (read
    only: shared_folder)."""
    from t5_family import FAMILIES, train_spiece, write_family_model

    def build(root):
        texts = [r[c] for r in read_jsonl(SHIPPED_CORPORA["sft"][0]) for c in ("prompt", "response")]
        texts += [r[c] for r in synthetic_rows(500) for c in ("prompt", "response")]
        texts = list(dict.fromkeys(texts))  # each distinct text once: the shipped corpus repeats its Chinese pairs
        spiece = train_spiece(root / "spiece.model", texts)
        for family in FAMILIES:
            write_family_model(root / family, family, spiece)

    root = shared_folder(request, tmp_path_factory, "families", build)
    return {family: root / family for family in FAMILIES}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
