"""Several machines on one host: launchers sharing a rendezvous on 127.0.0.1, each with its own machine rank
(bench/machines.py), every process a CPU one over gloo with one compute thread.

A two-machine launch trains as one launcher with the same number of processes does, bit for bit under DDP; a hung
or killed machine stops the other within a minute with one line; an elastic restart continues the run by itself;
a run folder some machine cannot see, or a refusal on the main process, is one ``error:`` line on every machine.
"""

from __future__ import annotations

import functools
import json
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import metrics, shared_folder, synthetic_rows, write_rows

from bench.machines import Machines, launch_env, launcher_command

STEPS = 24  # 2 files of 50 and 33 rows, 8 examples a step: an epoch is 11 steps, so the run crosses two epoch ends
SAVE = 3


def corpus(folder: Path) -> list[str]:
    a = write_rows(folder / "a.jsonl", synthetic_rows(50, seed=21))
    b = write_rows(folder / "b.jsonl", synthetic_rows(33, seed=22))
    evals = write_rows(folder / "eval.jsonl", synthetic_rows(4, seed=23))
    return [f"--train_file={a},{b}", f"--eval_file={evals}", f"--max_steps={STEPS}", f"--save_steps={SAVE}",
            "--eval_steps=0", "--gradient_accumulation_steps=2", "--max_source_len=32", "--max_target_len=32",
            "--dump_consumed=True", "--logging_steps=1", "--shuffle_buffer_size=16"]


def start(processes, kind: str, machines: int, per_machine: int, port: int, args: list[str], logs: Path,
          launch_flags: tuple[str, ...] = (), cwds: list[Path] | None = None, env: dict | None = None,
          last_first_s: float = 0.0) -> Machines:
    logs.mkdir(parents=True, exist_ok=True)
    commands = [launcher_command(kind, rank, machines, per_machine, port, args, launch_flags)
                for rank in range(machines)]
    return Machines.start(commands, [logs / f"machine{rank}.log" for rank in range(machines)], cwds, env,
                          popen=processes.popen, last_first_s=last_first_s)


@pytest.fixture
def launch(processes):
    """``launch(kind, machines, per_machine, port, args, logs, ...)``: one launcher per machine (``start``)."""
    return functools.partial(start, processes)


def finished(machines: Machines, timeout: float = 600) -> None:
    codes = machines.wait(timeout)
    assert codes == [0] * len(codes), "\n".join(machines.output(m)[-3000:] for m in range(len(codes)))


@pytest.fixture(scope="module")
def straight(request, tmp_path_factory, processes) -> tuple[Path, list[str]]:
    """One launcher of 2 processes (DDP), uninterrupted: what every two-machine run here must equal. (The run folder
    and the flags the others use with their own --output_dir.)"""
    def build(folder: Path) -> None:
        args = corpus(folder / "data")
        finished(start(processes, "accelerate", 1, 2, 29811, args + [f"--output_dir={folder / 'run'}"],
                        folder / "logs"))
        (folder / "args.txt").write_text("\n".join(args))

    folder = shared_folder(request, tmp_path_factory, "multi-node-straight", build)
    return folder / "run", (folder / "args.txt").read_text().splitlines()


def weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "model.safetensors"))


def largest_difference(a: Path, b: Path) -> float:
    x, y = weights(a), weights(b)
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def each_row_once_per_epoch(run: Path, processes: int) -> None:
    lines = [ln.split("\t") for rank in range(processes)
             for ln in (run / f"consumed-rank{rank}.tsv").read_text().splitlines()]
    epochs = sorted({e for e, *_ in lines})
    for epoch in epochs[:-1]:  # the last is partly trained by then
        seen = Counter((Path(path).name, int(row)) for e, _, path, row in lines if e == epoch)
        assert sorted(seen) == sorted([("a.jsonl", r) for r in range(50)] + [("b.jsonl", r) for r in range(33)])
        assert max(seen.values()) == 1
    last = Counter((Path(path).name, int(row)) for e, _, path, row in lines if e == epochs[-1])
    assert max(last.values()) == 1


@pytest.mark.parametrize("kind,port", [("accelerate", 29820), ("torchrun", 29822)])
def test_two_machines_train_bit_for_bit_as_one_launcher_does(tmp_path, launch, straight, kind, port):
    run_dir, args = straight
    run = tmp_path / "run"
    finished(launch(kind, 2, 1, port, args + [f"--output_dir={run}"], tmp_path / "logs"))
    assert largest_difference(run, run_dir) == 0
    each_row_once_per_epoch(run, 2)
    steps = [r["step"] for r in metrics(run) if r["event"] == "train"]
    assert steps == list(range(1, STEPS + 1))  # one metrics.jsonl, each step once
    assert (run / "final" / "config.json").is_file() and (run / "checkpoints" / f"step_{STEPS:06d}").is_dir()
    assert len(json.loads((run / "launchers.json").read_text())["launchers"]) == 2  # one per machine


def test_four_processes_on_two_machines_under_torchrun_equal_one_launcher_of_four(tmp_path, launch, straight):
    _, args = straight
    one, two = tmp_path / "one", tmp_path / "two"
    finished(launch("accelerate", 1, 4, 29830, args + [f"--output_dir={one}"], tmp_path / "logs1"))
    finished(launch("torchrun", 2, 2, 29832, args + [f"--output_dir={two}"], tmp_path / "logs2"))
    assert largest_difference(one, two) == 0
    each_row_once_per_epoch(two, 4)


@pytest.mark.parametrize("config,port", [("fsdp_cpu.yaml", 29840), ("deepspeed_zero3_cpu.yaml", 29844)])
def test_sharded_engines_on_two_machines_stay_within_float_error_of_one_launcher(tmp_path, launch, straight, config,
                                                                                 port):
    """FSDP2 and ZeRO-3 across two machines end within the engine's float error of DDP under one launcher
    (docs/distributed.md: each sums DDP's gradient in its own order; measured here 7.6e-7 and 1.6e-6, and bit for bit
    equal to the same engine under one launcher). DeepSpeed's multi-machine launch runs its processes through torch's
    launcher (``--deepspeed_multinode_launcher standard``)."""
    run_dir, args = straight
    env = launch_env()
    flags: tuple[str, ...] = ("--config_file", str(Path(__file__).parents[1] / "accelerate_configs" / config))
    if "deepspeed" in config:
        pytest.importorskip("deepspeed")
        env.pop("ACCELERATE_USE_CPU")  # (accelerate's CPU flag would mean plain data parallelism)
        flags += ("--deepspeed_multinode_launcher", "standard")
    run = tmp_path / "run"
    finished(launch("accelerate", 2, 1, port, args + [f"--output_dir={run}"], tmp_path / "logs", flags, env=env))
    assert largest_difference(run, run_dir) <= 1e-5
    each_row_once_per_epoch(run, 2)


def stop_machine_and_time_the_other(launch, tmp_path, straight, kind: str, port: int, sig: int,
                                    last_first_s: float = 0.0, flags: tuple[str, ...] = ()):
    """Train on 2 x 1 machines, send ``sig`` to machine 1 once the step-6 checkpoint is there; returns (run, the
    machines, seconds each of machine 0's processes took to end)."""
    _, args = straight
    run = tmp_path / "run"
    machines = launch(kind, 2, 1, port, args + [f"--output_dir={run}", *flags], tmp_path / "logs",
                      last_first_s=last_first_s)
    machines.wait_for_checkpoint(run, 6)
    survivors = machines.processes(0)
    machines.signal(1, sig)
    gone = machines.wait_gone(survivors, 120)
    machines.kill_all()
    machines.wait(30)
    return run, machines, [gone.get(p.pid) for p in survivors]


def test_a_hung_machine_stops_the_other_within_a_minute_and_both_resume_bit_for_bit(tmp_path, launch, straight):
    run_dir, args = straight
    run, machines, seconds = stop_machine_and_time_the_other(launch, tmp_path, straight, "accelerate", 29850,
                                                             signal.SIGSTOP)
    assert None not in seconds and max(seconds) < 60, seconds  # (--peer_timeout_s: 30 by default)
    errors = [line for line in machines.output(0).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "process 1 (machine 1" in errors[0] and "has not answered for 30 s" in errors[0]
    assert "--is_keep_training=True" in errors[0] and "exitcode: 4" in machines.output(0)
    from lowmem.checkpointing import checkpoint

    latest = checkpoint.find_latest_valid(run / "checkpoints")
    assert latest is not None and checkpoint.validate(latest) is None
    # Both machines again, with the flag: the run ends as the uninterrupted one did
    finished(launch("accelerate", 2, 1, 29852, args + [f"--output_dir={run}", "--is_keep_training=True"],
                    tmp_path / "again"))
    assert "resumed from" in (tmp_path / "again" / "machine0.log").read_text()
    assert largest_difference(run, run_dir) == 0


def test_under_torchrun_a_hung_machine_holding_the_rendezvous_stops_the_other_within_a_minute(tmp_path, launch,
                                                                                              straight):
    """Machine 1's launcher starts first and so hosts torchrun's c10d store: the survivor's agent, closing its
    rendezvous, would wait on that store for good; it is ended 15 s after its worker (peer_watch). (A shorter
    --peer_timeout_s than the default the test above holds to its minute.)"""
    _, machines, seconds = stop_machine_and_time_the_other(launch, tmp_path, straight, "torchrun", 29857,
                                                           signal.SIGSTOP, 4.0, ("--peer_timeout_s=10",))
    assert None not in seconds and max(seconds) < 40, seconds
    errors = [line for line in machines.output(0).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "has not answered for 10 s" in errors[0], errors


def test_a_killed_machine_stops_the_other_within_seconds_naming_it(tmp_path, launch, straight):
    _, machines, seconds = stop_machine_and_time_the_other(launch, tmp_path, straight, "torchrun", 29855,
                                                           signal.SIGKILL)
    assert None not in seconds and max(seconds) < 20, seconds
    errors = [line for line in machines.output(0).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "process 1 (machine 1" in errors[0] and "stopped (killed" in errors[0], errors


def test_elastic_restarts_continue_the_run_by_themselves(tmp_path, launch, straight):
    """torchrun --max_restarts=2: a worker of machine 1 killed twice; each time the agents start every process
    again, and they continue from the latest checkpoint without --is_keep_training, ending bit for bit where the
    uninterrupted run did."""
    run_dir, args = straight
    run = tmp_path / "run"
    machines = launch("torchrun", 2, 1, 29860, args + [f"--output_dir={run}"], tmp_path / "logs",
                      ("--max-restarts", "2"))
    for step in (3, 9):
        machines.wait_for_checkpoint(run, step)
        machines.workers(1)[0].kill()
        time.sleep(1.0)
    finished(machines)
    log = machines.output(0)
    assert log.count("restarted by the launcher (--max_restarts)") == 2, log[-3000:]
    assert log.count("resumed from") == 2
    assert largest_difference(run, run_dir) == 0
    steps = [r["step"] for r in metrics(run) if r["event"] == "train"]
    assert steps == list(range(1, STEPS + 1))  # the steps after each checkpoint were cut back, then trained again


def test_a_run_folder_one_machine_cannot_see_is_one_line_on_each_machine(tmp_path, launch, straight):
    """A relative --output_dir launched from another folder on each machine: a disk of each machine's own."""
    _, args = straight
    cwds = [tmp_path / "machine0", tmp_path / "machine1"]
    for cwd in cwds:
        cwd.mkdir()
    machines = launch("accelerate", 2, 1, 29865, args + ["--output_dir=run"], tmp_path / "logs", cwds=cwds)
    assert machines.wait(300) == [1, 1]  # (the launcher's code for a worker's 2)
    for machine in (0, 1):
        errors = [line for line in machines.output(machine).splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "machine 1 (" in errors[0] and "cannot see it" in errors[0], errors
        assert str(cwds[0] / "run") in errors[0]
    assert not any(cwds[1].iterdir())  # no second run folder


def test_a_refusal_on_the_main_process_stops_every_machine_with_its_line(tmp_path, launch, straight):
    run_dir, args = straight
    run = tmp_path / "run"
    run.mkdir()
    for name in (".t5-lowmem-run", "metrics.jsonl"):  # a run already there
        (run / name).write_bytes((run_dir / name).read_bytes())
    started = time.monotonic()
    machines = launch("accelerate", 2, 1, 29868, args + [f"--output_dir={run}"], tmp_path / "logs")
    assert machines.wait(120) == [1, 1] and time.monotonic() - started < 60
    for machine in (0, 1):
        errors = [line for line in machines.output(machine).splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "already holds a run" in errors[0], machines.output(machine)[-2000:]
    assert machines.output(1).count("error: process 0 (machine 0, ") == 1  # whose line it is


def test_work_runs_once_per_job_or_once_per_machine_as_declared(monkeypatch):
    from lowmem.parallel.launch import JOB, MACHINE, SCOPES, Launch, runs_here

    env = {"LOCAL_RANK": "0", "RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_MAX_RESTARTS": "3",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launch = Launch.from_env()
    assert (launch.rank, launch.machine, launch.machines, launch.max_restarts) == (2, 1, 2, 3)
    assert launch.store_address == ("10.0.0.1", 29500) and launch.agent_store and launch.several
    assert {runs_here(work, launch) for work, scope in SCOPES.items() if scope == JOB} == {False}
    assert {runs_here(work, launch) for work, scope in SCOPES.items() if scope == MACHINE} == {True}


def test_only_a_restart_under_the_same_launchers_continues_a_run_without_the_flag(tmp_path, monkeypatch):
    """A process an elastic agent restarts finds its own launcher in launchers.json and continues; a new launch (other
    launchers) on the same folder, or one without --max_restarts, is refused as any second run is."""
    from config import TrainConfig
    from lowmem.parallel.launch import launcher_id
    from lowmem.runs.run_start import settle_watch

    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "2"}.items():
        monkeypatch.setenv(name, value)
    cfg = TrainConfig(output_dir=str(tmp_path), overwrite_output_dir=True)
    (tmp_path / "launchers.json").write_text(json.dumps({"launchers": ["elsewhere 12 345"]}))
    assert settle_watch(cfg, None) == (cfg, [])  # another launch's folder
    (tmp_path / "launchers.json").write_text(json.dumps({"launchers": ["elsewhere 12 345", launcher_id()]}))
    restarted, notes = settle_watch(cfg, None)
    assert restarted.is_keep_training and not restarted.overwrite_output_dir and "restarted by the launcher" in notes[0]
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert settle_watch(cfg, None) == (cfg, [])  # no restarts asked for: never one
