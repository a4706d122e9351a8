"""How a multi-machine launch meets a lost machine, and what a healthy one at xl scale never trips.

    python -m bench.lost_machine                  # all three parts (about 6 minutes on 2 cores)
    python -m bench.lost_machine --only=stop      # survivors' time to stop: a hung (SIGSTOP) or killed machine
    python -m bench.lost_machine --only=restart   # an elastic restart: from the kill to the first step trained again
    python -m bench.lost_machine --only=xl        # the waits of a healthy run at flan-t5-xl's shape, watch running

Two launchers on this host are two machines (bench/machines.py), one CPU process each over gloo, training the tiny
preset on the shipped chat pairs; the trainer's default ``--peer_timeout_s`` (30 s). ``stop``: machine 1 (or machine 0,
whose launcher holds the launch's store) is stopped or killed after the step-6 checkpoint; each surviving process's
seconds until it ended. ``restart``: ``--max_restarts=1``, a worker of machine 1 killed after the step-6
checkpoint; seconds from the kill to the first step of the restarted run (its ``train`` record). ``xl``: two
processes under torchrun with the peer watch running; the longest gap between a thread's ticks (as the watch's
beat would see them) while they all-reduce an xl model's float32 gradient in DDP's 25 MB buckets, and while
process 0 builds an xl model (bfloat16, random weights) and generates while process 1 waits in a barrier.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.harness import REPO, Column, Table
from bench.machines import Machines, launch_env, launcher_command

ARGS = ["--max_steps=200", "--epochs=20", "--save_steps=3", "--eval_steps=0", "--gradient_accumulation_steps=2",
        "--max_source_len=32", "--max_target_len=32", "--logging_steps=1"]
STOPS = [("accelerate", 1, "SIGSTOP"), ("accelerate", 1, "SIGKILL"), ("accelerate", 0, "SIGSTOP"),
         ("torchrun", 1, "SIGSTOP"), ("torchrun", 1, "SIGKILL"), ("torchrun", 0, "SIGSTOP")]


def corpus() -> list[str]:
    """The shipped chat pairs (any rows would do: what is timed is the stop, not the training)."""
    from config import SHIPPED_CORPORA

    train, evals = SHIPPED_CORPORA["sft"]
    return [f"--train_file={train}", f"--eval_file={evals}", *ARGS]


def stop_times(root: Path, args: list[str], port: int) -> Table:
    table = Table([Column("launcher", "launcher"), Column("machine stopped", "victim"), Column("signal", "signal"),
                   Column("workers gone (s)", "workers"), Column("launcher gone (s)", "launcher_s"),
                   Column("line", "line")])
    for i, (kind, victim, sig) in enumerate(STOPS):
        run = root / f"stop{i}"
        machines = Machines.start([launcher_command(kind, r, 2, 1, port + i, args + [f"--output_dir={run}"])
                                   for r in (0, 1)], [root / f"stop{i}-{r}.log" for r in (0, 1)])
        machines.wait_for_checkpoint(run, 6, 600)
        survivor = 1 - victim
        processes, workers = machines.processes(survivor), {p.pid for p in machines.workers(survivor)}
        machines.signal(victim, getattr(signal, sig))
        gone = machines.wait_gone(processes, 180)
        machines.kill_all()
        machines.wait(30)
        line = next((ln for ln in machines.output(survivor).splitlines() if ln.startswith("error:")), "")
        table.add(f"{kind} {sig} {victim}", {
            "launcher": kind, "victim": victim, "signal": sig,
            "workers": ", ".join(f"{gone[p.pid]:.1f}" if p.pid in gone else "> 180" for p in processes
                                 if p.pid in workers),
            "launcher_s": f"{gone[processes[0].pid]:.1f}" if processes[0].pid in gone else "> 180",
            "line": line[7:80]})
    return table


def restart_times(root: Path, args: list[str], port: int) -> Table:
    table = Table([Column("launcher", "launcher"), Column("kill to first step again (s)", "seconds", ".1f"),
                   Column("resumed at step", "step")])
    for i, (kind, flag) in enumerate([("torchrun", "--max-restarts"), ("accelerate", "--max_restarts")]):
        run = root / f"restart{i}"
        machines = Machines.start([launcher_command(kind, r, 2, 1, port + i, args + [f"--output_dir={run}",
                                                                                      "--max_steps=30"], (flag, "1"))
                                   for r in (0, 1)], [root / f"restart{i}-{r}.log" for r in (0, 1)])
        machines.wait_for_checkpoint(run, 6, 600)
        machines.workers(1)[0].kill()
        killed = time.monotonic()
        resumed, step = None, None
        while step is None and time.monotonic() - killed < 300:
            records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
            marks = [i for i, r in enumerate(records) if r.get("event") == "resume"]
            if marks:
                resumed = records[marks[-1]]
                step = next((r["step"] for r in records[marks[-1]:] if r.get("event") == "train"), None)
            time.sleep(0.05)
        seconds = time.monotonic() - killed
        codes = machines.wait(300)
        table.add(kind, {"launcher": kind, "seconds": seconds if step and not any(codes) else None,
                         "step": Path(resumed["path"]).name if resumed else "-"})
    return table


def xl_worker() -> None:
    """One of two processes under torchrun: the waits of a healthy xl-shaped run, the peer watch running."""
    import os

    import torch
    import torch.distributed as dist

    from bench.hub_checkpoint import checkpoint_tensors, t5_config
    from lowmem.parallel.peer_watch import PeerWatch

    watch = PeerWatch.start(30.0)
    dist.init_process_group("gloo")
    rank, gaps, phase = dist.get_rank(), {}, ["start"]

    def tick() -> None:
        last = time.monotonic()
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            gaps[phase[0]] = max(gaps.get(phase[0], 0.0), now - last)
            last = now

    threading.Thread(target=tick, daemon=True).start()
    config = t5_config("xl", "bfloat16")
    elements = sum(math.prod(shape) for _, shape in checkpoint_tensors(config))  # xl: 2.85e9, untied head
    bucket = torch.zeros(25 * 2**20 // 4)
    phase[0] = "all-reduce"
    started = time.monotonic()
    for _ in range(elements // bucket.numel()):
        dist.all_reduce(bucket)
    seconds = {"all-reduce": time.monotonic() - started}
    dist.barrier()
    phase[0] = "generation on process 0"
    started = time.monotonic()
    if rank == 0:
        from transformers import T5ForConditionalGeneration

        torch.manual_seed(0)
        with torch.device("meta"):
            model = T5ForConditionalGeneration(config)
        model = model.to_empty(device="cpu").to(torch.bfloat16).eval()
        for p in model.parameters():
            p.data.normal_(0, 0.02)
        with torch.no_grad():
            model.generate(torch.randint(0, config.vocab_size, (4, 64)), max_new_tokens=32, min_new_tokens=32)
    dist.barrier()  # process 1 waits here the whole time
    seconds["generation on process 0"] = time.monotonic() - started
    watch.finish()
    print(json.dumps({"rank": rank, "seconds": seconds, "gaps": gaps, "pid": os.getpid()}), flush=True)


def xl_waits(root: Path, port: int) -> Table:
    import subprocess

    log = root / "xl.log"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend",
                               "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "bench.lost_machine",
                               "--worker"], cwd=REPO, env=launch_env(), stdout=out, stderr=subprocess.STDOUT)
    reports = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith('{"rank"')]
    table = Table([Column("phase", "phase"), Column("process", "rank"), Column("wall (s)", "seconds", ".1f"),
                   Column("longest tick gap (s)", "gap", ".2f")])
    if done.returncode or len(reports) != 2:
        table.add("xl", {"error": f"exit {done.returncode}: {log.read_text()[-300:]}"})
    for report in sorted(reports, key=lambda r: r["rank"]):
        for phase, seconds in report["seconds"].items():
            table.add(f"{phase} {report['rank']}", {"phase": phase, "rank": report["rank"], "seconds": seconds,
                                                    "gap": report["gaps"].get(phase)})
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="stop,restart,xl")
    parser.add_argument("--port", type=int, default=29900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        return xl_worker()
    root = Path(tempfile.mkdtemp(prefix="lost-machine-"))
    try:
        args = corpus()
        parts = options.only.split(",")
        if "stop" in parts:
            print("A machine stopped or killed after the step-6 checkpoint: when the other's processes ended")
            stop_times(root, args, options.port).show()
        if "restart" in parts:
            print("\nAn elastic restart (--max_restarts=1), a worker of machine 1 killed after the step-6 checkpoint")
            restart_times(root, args, options.port + 20).show()
        if "xl" in parts:
            print("\nA healthy run's waits at flan-t5-xl's shape (2 processes, torchrun, the peer watch running)")
            xl_waits(root, options.port + 40).show()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
