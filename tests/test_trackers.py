"""--report_to's trackers on real tiny runs, offline: wandb (offline mode), mlflow (a sqlite store), trackio (a local
folder) and TensorBoard each get the same (step, value) series as metrics.jsonl; a run killed between two
checkpoints and continued with --is_keep_training=True goes on in the same tracker run, no step twice, none
backwards. Each tracker's test skips when its package is missing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import REPO, metrics, synthetic_rows, write_rows

from lowmem.monitoring.metrics_log import tracker_scalars

ARGS = ["--max_steps=40", "--save_steps=10", "--eval_steps=10", "--logging_steps=2", "--save_total_limit=4",
        "--gradient_accumulation_steps=4", "--warmup_steps=2", "--max_eval_samples=4", "--max_source_len=32",
        "--max_target_len=16", "--eval_generate=False"]
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio", "tensorboard": "tensorboard"}


@pytest.fixture(scope="module", autouse=True)
def mlflow_file_store_readable():
    """mlflow 3 reads a file store only when told (the runs here write one, as a user who chose it does)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        yield


def installed_trackers() -> list[str]:
    from lowmem.utils.optional import installed

    return [name for name, module in PACKAGES.items() if installed(module)]


def tracker_env(root: Path, **extra: str) -> dict:
    """This environment without the user's tracker settings, offline, with the stores under ``root``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_"))}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
            # offline, wandb writes its run file every 15 s: a run killed sooner after its checkpoint loses that
            "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL": "0.2", "TRACKIO_DIR": str(root / "trackio"), **extra}


def command(run: Path, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "train_low_mem.py"), "train", f"--output_dir={run}", *args]


def expected_series(run: Path) -> dict[str, list[tuple[int, float]]]:
    """What metrics.jsonl says each tracker gets: (step, value) per scalar name, in the log's order."""
    series = defaultdict(list)
    for record in metrics(run):
        fields = {k: v for k, v in record.items() if k not in ("event", "step", "time")}
        for key, value in tracker_scalars(record["event"], fields).items():
            series[key].append((record["step"], value))
    return dict(series)


def wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file (what ``wandb sync`` uploads): a 7-byte header (``:W&B``, magic,
    version), then LevelDB's log format: 32 KiB blocks of chunks (crc32c, length, type: 1 full, 2 first, 3 middle,
    4 last); a block's tail shorter than a chunk header is padding."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if length == 0 and kind == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_series(wandb_dir: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every history row the offline run ``run_id`` logged, its parts (one folder per process start) in order."""
    folders = sorted(wandb_dir.glob(f"offline-run-*-{run_id}"))
    assert folders, list(wandb_dir.iterdir())
    series = defaultdict(list)
    for folder in folders:
        for record in wandb_records(folder / f"run-{run_id}.wandb"):
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                for key, value in row.items():
                    if not key.startswith("_") and key != "step":  # (the optimizer step: the charts' x axis)
                        series[key].append((row["step"], value))
    return dict(series)


def mlflow_series(uri: str, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    history = {key: client.get_metric_history(run_id, key) for key in keys}
    return {key: [(m.step, m.value) for m in sorted(ms, key=lambda m: m.timestamp)] for key, ms in history.items()}


@pytest.fixture(scope="session")
def trackio_series(processes):
    def trackio_series(root: Path, run_name: str) -> dict[str, list[tuple[int, float]]]:
        code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
                f"print(json.dumps(SQLiteStorage.get_logs('t5-lowmem', {run_name!r})))")
        # (trackio reads TRACKIO_DIR at import)
        done = processes.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "TRACKIO_DIR": str(root / "trackio")}, check=True)
        series = defaultdict(list)
        for row in json.loads(done.stdout.strip().splitlines()[-1]):
            for key, value in row.items():
                if key not in ("step", "timestamp"):
                    series[key].append((row["step"], value))
        return dict(series)
    return trackio_series


def tensorboard_series(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="session")
def kill_between_checkpoints(processes):
    def kill_between_checkpoints(run: Path, args: list[str], env: dict, log: Path) -> int:
        """Start a run, SIGKILL it once it has logged train steps past a checkpoint, a second or more after it (trackio
        stores what it was sent every 0.5 s); return that checkpoint's step."""
        with open(log, "w") as fh:
            child = processes.popen(command(run, *args), cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env)
        started, saved = time.time(), None
        while True:
            assert child.poll() is None and time.time() < started + 600, log.read_text()[-3000:]
            lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
            records = [json.loads(line) for line in lines if line.endswith("}")]
            saved = max(((r["step"], r["time"]) for r in records if r["event"] == "checkpoint"), default=None)
            if saved and time.time() > saved[1] + 1 and any(r["event"] == "train" and r["step"] > saved[0]
                                                            for r in records):
                break
            time.sleep(0.02)
        child.kill()
        child.wait()
        return saved[0]
    return kill_between_checkpoints


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, kill_between_checkpoints, processes):
    """A 40-step run with every installed tracker, killed after one of its checkpoints (every 10 steps) once it
    logged steps after it, then continued with --is_keep_training=True; mlflow into the file store the environment
    names."""
    trackers = installed_trackers()
    if not set(trackers) - {"tensorboard"}:
        pytest.skip("needs wandb, mlflow or trackio (pip install '.[wandb]' '.[mlflow]' '.[trackio]')")
    root = tmp_path_factory.mktemp("trackers")
    train = write_rows(root / "train.jsonl", synthetic_rows(200, seed=11))
    evals = write_rows(root / "eval.jsonl", synthetic_rows(4, seed=12))
    run = root / "run"
    env = tracker_env(root, MLFLOW_TRACKING_URI=f"file:{root / 'mlruns'}", MLFLOW_ALLOW_FILE_STORE="true")
    args = [f"--train_file={train}", f"--eval_file={evals}", *ARGS, f"--report_to={','.join(trackers)}"]
    killed_at = kill_between_checkpoints(run, args, env, root / "killed.log")
    before = json.loads((run / "trackers.json").read_text())
    after_kill = expected_series(run)  # the killed run's log, steps past its checkpoint included
    done = processes.run(command(run, *args, "--is_keep_training=True"), cwd=REPO, capture_output=True, text=True,
                         env=env, timeout=1200)
    assert done.returncode == 0 and f"resumed from {run / 'checkpoints' / f'step_{killed_at:06d}'}" in done.stdout, \
        done.stdout[-2000:] + done.stderr[-3000:]
    return {"root": root, "run": run, "env": env, "args": args, "killed_at": killed_at, "before": before,
            "after_kill": after_kill, "stdout": done.stdout}


def check_series(got: dict, run: Path, killed_at: int, after_kill: dict, approx: bool = False) -> None:
    """``got`` is metrics.jsonl's series exactly (every key, every step once, in order), and the killed run had
    logged steps past its checkpoint that the resumed one trained again."""
    want = expected_series(run)
    assert set(got) == set(want)
    for key, series in want.items():
        steps = [s for s, _ in got[key]]
        assert steps == sorted(set(steps)), (key, steps)  # no step twice, none backwards
        assert got[key] == ([(s, pytest.approx(v, rel=1e-6)) for s, v in series] if approx else series), key
    assert max(s for s, _ in after_kill["train/loss"]) > killed_at  # the case that matters was met


def test_wandb_offline_resumes_its_run_with_the_series_of_metrics_jsonl(resumed_run):
    pytest.importorskip("wandb", reason="pip install '.[wandb]'")
    run, state = resumed_run["run"], json.loads((resumed_run["run"] / "trackers.json").read_text())
    run_id = state["wandb"]["run_id"]
    assert run_id == resumed_run["before"]["wandb"]["run_id"]  # continued, not a second run
    assert {p.name.rsplit("-", 1)[-1] for p in (run / "wandb").glob("offline-run-*")} == {run_id}
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2  # one part per process start
    assert resumed_run["before"]["wandb"]["last_step"] <= resumed_run["killed_at"]  # nothing past the checkpoint
    check_series(wandb_series(run / "wandb", run_id), run, resumed_run["killed_at"], resumed_run["after_kill"])


def test_mlflow_resumes_its_run_in_the_store_the_environment_names(resumed_run):
    pytest.importorskip("mlflow", reason="pip install '.[mlflow]'")
    from mlflow.tracking import MlflowClient

    run, uri = resumed_run["run"], resumed_run["env"]["MLFLOW_TRACKING_URI"]
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]["run_id"]
    assert run_id == resumed_run["before"]["mlflow"]["run_id"]
    assert not (run / "mlflow.db").exists()  # MLFLOW_TRACKING_URI is the user's: no store of ours
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("t5-lowmem")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).data.params["max_steps"] == "40"
    got = mlflow_series(uri, run_id, expected_series(run))
    check_series(got, run, resumed_run["killed_at"], resumed_run["after_kill"])


def test_trackio_resumes_its_run_with_the_series_of_metrics_jsonl(resumed_run, trackio_series):
    pytest.importorskip("trackio", reason="pip install '.[trackio]'")
    run = resumed_run["run"]
    name = json.loads((run / "trackers.json").read_text())["trackio"]["run_id"]
    assert name == resumed_run["before"]["trackio"]["run_id"]
    got = trackio_series(resumed_run["root"], name)
    check_series(got, run, resumed_run["killed_at"], resumed_run["after_kill"])


def test_tensorboard_beside_them_hides_the_steps_trained_again(resumed_run):
    pytest.importorskip("tensorboard", reason="pip install '.[tensorboard]'")
    got = tensorboard_series(resumed_run["run"])
    check_series(got, resumed_run["run"], resumed_run["killed_at"], resumed_run["after_kill"], approx=True)


def test_a_resume_from_an_older_checkpoint_gets_a_new_tracker_run(resumed_run, tmp_path, processes):
    """The finished run's tracker runs hold steps past step 10: the continuation from there goes into a new run
    that holds the records up to step 10 and then its own, and the old runs stay as they were."""
    pytest.importorskip("mlflow", reason="pip install '.[mlflow]'")
    copy = tmp_path / "run"
    shutil.copytree(resumed_run["run"], copy)
    (copy / "wandb").exists() and shutil.rmtree(copy / "wandb")  # (wandb's files name the original folder)
    env = tracker_env(tmp_path, MLFLOW_TRACKING_URI=f"file:{tmp_path / 'mlruns'}", MLFLOW_ALLOW_FILE_STORE="true")
    shutil.copytree(resumed_run["root"] / "mlruns", tmp_path / "mlruns")
    args = [a for a in resumed_run["args"] if not a.startswith("--report_to")] + ["--report_to=mlflow"]
    old = json.loads((copy / "trackers.json").read_text())["mlflow"]
    done = processes.run(command(copy, *args, "--is_keep_training=True",
                                  f"--resume_from={copy / 'checkpoints' / 'step_000010'}"),
                         cwd=REPO, capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "holds steps past step 10" in done.stdout
    new = json.loads((copy / "trackers.json").read_text())["mlflow"]
    assert new["run_id"] != old["run_id"]
    uri = env["MLFLOW_TRACKING_URI"]
    got = mlflow_series(uri, new["run_id"], expected_series(copy))
    assert got == expected_series(copy)
    old_loss = mlflow_series(uri, old["run_id"], ["train/loss"])["train/loss"]
    assert [s for s, _ in old_loss] == list(range(2, 41, 2))


@pytest.mark.parametrize("name", ["wandb", "mlflow", "trackio"])
def test_a_missing_tracker_package_is_one_line(tmp_path, name, processes):
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.modules[{PACKAGES[name]!r}] = None\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    done = processes.run(command(tmp_path / "run", f"--report_to=tensorboard,{name}"), cwd=REPO, capture_output=True,
                         text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and f"pip install '.[{name}]'" in done.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("value, message", [
    ("comet", "--report_to: unknown tracker 'comet'; a comma list of tensorboard, wandb, mlflow, trackio (or none)"),
    ("none,wandb", "--report_to takes none or a comma list of trackers, each once (got 'none,wandb')"),
    ("wandb,wandb", "--report_to takes none or a comma list of trackers, each once (got 'wandb,wandb')")])
def test_report_to_names_are_checked(tmp_path, value, message, processes):
    done = processes.run(command(tmp_path / "run", f"--report_to={value}"), cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_two_processes_log_once_from_the_main_process(tmp_path, processes):
    """Under ``accelerate launch`` (two CPU processes over gloo) one mlflow run gets metrics.jsonl's series once."""
    pytest.importorskip("mlflow", reason="pip install '.[mlflow]'")
    from mlflow.tracking import MlflowClient

    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(200, seed=11))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(4, seed=12))
    run = tmp_path / "run"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
              "29531", str(REPO / "train_low_mem.py"), "train", "--cpu=True"]
    args = [f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={run}", "--max_steps=8", "--save_steps=4",
            "--eval_steps=4", "--logging_steps=2", "--max_eval_samples=4", "--max_source_len=32",
            "--max_target_len=16", "--eval_generate=False", "--gradient_accumulation_steps=2", "--report_to=mlflow"]
    done = processes.run(launch + args, cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**tracker_env(tmp_path), "ACCELERATE_USE_CPU": "true"})
    assert done.returncode == 0, done.stderr[-3000:]
    uri = f"sqlite:///{run / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("t5-lowmem").experiment_id])
    assert [r.info.run_id for r in runs] == [json.loads((run / "trackers.json").read_text())["mlflow"]["run_id"]]
    assert mlflow_series(uri, runs[0].info.run_id, expected_series(run)) == expected_series(run)


def closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("name, env, setting", [
    ("mlflow", {"MLFLOW_TRACKING_URI": "http://127.0.0.1:{port}"}, "MLFLOW_TRACKING_URI"),
    ("wandb", {"WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:{port}"}, "WANDB_BASE_URL")])
def test_an_unreachable_tracker_server_is_one_line_before_the_run_folder(tmp_path, run_cli, name, env, setting):
    pytest.importorskip(PACKAGES[name], reason=f"pip install '.[{name}]'")
    port = closed_port()
    env = {k: v.format(port=port) for k, v in env.items()}
    started = time.time()
    done = run_cli("train", f"--output_dir={tmp_path / 'run'}", "--model_preset=tiny", "--max_steps=4",
                   f"--report_to={name}", env={**tracker_env(tmp_path), **env}, timeout=120)
    assert time.time() - started < 30
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"error: --report_to={name}: http://127.0.0.1:{port} ({setting}) did not answer "
                                  "(") and f"or drop {name} from --report_to" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_a_server_that_never_answers_is_refused_after_the_bounded_wait(monkeypatch):
    pytest.importorskip("mlflow", reason="pip install '.[mlflow]'")
    from lowmem.monitoring.trackers import TRACKERS
    from lowmem.utils.errors import UserError

    with socket.socket() as silent:  # connections queue in its backlog and never get an answer
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        started = time.time()
        with pytest.raises(UserError, match=f"--report_to=mlflow: {uri} \\(MLFLOW_TRACKING_URI\\) did not answer"):
            TRACKERS["mlflow"].reach(1.0)
        assert 0.9 < time.time() - started < 5
    assert TRACKERS["mlflow"].reach_timeout_s <= 10


def free_port_outside_the_ephemeral_range() -> int:
    """A port free now below Linux's ephemeral range (where the kernel picks the local end of connections), so
    that no connection on the machine takes it while the server is down."""
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for port in range(max(1024, low - 8000 + os.getpid() % 4000), low):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    return 0


class MlflowServer:
    """mlflow's own tracking server (its Flask app on a sqlite store) on 127.0.0.1, in a thread of the test: ``up()``
    and ``down()`` start and stop it on the same port, as a user's server would go down and come back."""

    def __init__(self, root: Path, monkeypatch):
        monkeypatch.setenv("_MLFLOW_SERVER_FILE_STORE", f"sqlite:///{root / 'server.db'}")  # (mlflow server's own)
        monkeypatch.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", str(root / "artifacts"))
        self.port, self.server = free_port_outside_the_ephemeral_range(), None  # every up() comes back on it

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        from mlflow.server import app
        from werkzeug.serving import make_server

        # Back on its port: a stopped server's port may take a moment to be free again. (A port from the
        # ephemeral range was taken meanwhile, as some connection's own end, twice in CI: it is picked outside it.)
        for attempt in range(50):
            try:  # one request per connection (HTTP/1.0): a kept-alive connection would outlive down()
                self.server = make_server("127.0.0.1", self.port, app, threaded=False)
                break
            except (OSError, SystemExit):  # (werkzeug prints the OSError and exits)
                if attempt == 49:
                    raise
                time.sleep(0.2)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_tracker_server_down_mid_run_never_stops_training(tmp_path, monkeypatch, processes):
    """A real mlflow server stops after the first checkpoint's feed and comes back after the second checkpoint's
    feed failed: the run goes on with one warning, and the server ends up with metrics.jsonl's series, every step
    once."""
    pytest.importorskip("mlflow.server", reason="mlflow's server needs flask: pip install mlflow")
    from mlflow.tracking import MlflowClient

    server = MlflowServer(tmp_path, monkeypatch)
    server.up()
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(200, seed=11))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(4, seed=12))
    run, log = tmp_path / "run", tmp_path / "run.log"
    args = [f"--train_file={train}", f"--eval_file={evals}", *ARGS, "--max_steps=30", "--report_to=mlflow"]
    with open(log, "w") as fh:
        child = processes.popen(command(run, *args), cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                env=tracker_env(tmp_path, MLFLOW_TRACKING_URI=server.uri))

    def paused_at(reached) -> None:  # stop the run where ``reached()`` says, switch the server, go on
        started = time.time()
        while not reached():
            assert child.poll() is None and time.time() < started + 600, log.read_text()[-3000:]
            time.sleep(0.02)
        child.send_signal(signal.SIGSTOP)

    fed = run / "trackers.json"
    paused_at(lambda: fed.is_file() and json.loads(fed.read_text())["mlflow"]["last_step"] >= 10)
    server.down()
    child.send_signal(signal.SIGCONT)
    paused_at(lambda: "warning: --report_to=mlflow" in log.read_text())
    server.up()
    child.send_signal(signal.SIGCONT)
    assert child.wait(timeout=600) == 0, log.read_text()[-3000:]
    server.down()
    text = log.read_text()
    assert text.count("warning: ") == 1 and "Traceback" not in text, text[-3000:]
    assert "--report_to=mlflow: answering again" in text
    state = json.loads(fed.read_text())["mlflow"]
    assert state["last_step"] == 30 and state["fed"] == (run / "metrics.jsonl").stat().st_size
    server.up()
    client = MlflowClient(tracking_uri=server.uri)
    assert client.get_run(state["run_id"]).info.status == "FINISHED"
    assert mlflow_series(server.uri, state["run_id"], expected_series(run)) == expected_series(run)
    server.down()
