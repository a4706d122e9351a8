"""The README's default job as a new user runs it, and what it teaches.

    python -m bench.default_job                  # the job in a temporary folder; prints the figures below
    OMP_NUM_THREADS=1 python -m bench.default_job --keep=/tmp/default_job   # on shared cores; keep the runs
    python -m bench.default_job --job="python train_low_mem.py train ... && python train_low_mem.py ..."

The commands are read from the README ("Two commands on a fresh machine", the install left out), so what
is measured is what the README says; ``--job`` measures another chain of commands instead. Each command runs
in its own process from a fresh temporary folder (``runs/`` is written there; the shipped data and
tokenizer are read from the repository). Printed:

    eval loss      the SFT run's first evaluation (step 0), its best and its last, and best / first
                   (the README's promise: at most 0.6)
    language       over the first ``--prompts`` eval prompts (data/chatterbot/eval.jsonl), answered by
                   runs/sft/best with the README's generate flags: the share of answers holding Chinese
                   characters exactly when their prompt does, and the share of answers that differ
    time           wall and CPU seconds (user + system, from each child's ``wait4``) per command and in all.
                   With OMP_NUM_THREADS=1 the CPU seconds bound the wall time on an idle core; on shared cores
                   the wall time measures the neighbours too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

from bench.harness import REPO, run_child, trainer

CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


def readme_job() -> str:
    """The default job's command line in the README, the install left out."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Two commands on a fresh machine", 1)[1]
    line = next(line.strip() for line in section.splitlines() if "train_low_mem.py train" in line)
    return " && ".join(part for part in line.split(" && ") if not part.startswith("pip "))


def run(command: str, cwd: Path) -> dict:
    """Run one ``python train_low_mem.py ...`` command in ``cwd``; its output tail, wall and CPU seconds."""
    argv = shlex.split(command)
    if argv[:2] != ["python", "train_low_mem.py"]:
        sys.exit(f"not a train_low_mem.py command: {command}")
    done = run_child(trainer(*argv[2:]), cwd=cwd)
    if done.rc:
        sys.exit(f"{command}\nfailed:\n{done.output[-3000:]}")
    return {"command": command, "output": done.output, "wall_s": done.wall_s, "cpu_s": done.cpu_s}


def eval_losses(run_dir: Path) -> list[float]:
    """The eval losses of a run's metrics.jsonl, in order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["eval_loss"] for r in records if r.get("event") == "eval" and "eval_loss" in r]


def answers(cwd: Path, generate_command: str, count: int) -> list[tuple[str, str]]:
    """(prompt, answer) for the first ``count`` SFT eval prompts, decoded as ``generate_command`` decodes, in a
    process of its own in ``cwd`` (the generate command's paths are relative to it; the project is imported from
    the repository, on its PYTHONPATH)."""
    flags = dict(arg[2:].split("=", 1) for arg in shlex.split(generate_command)[3:] if arg.startswith("--"))
    code = (
        "import json\n"
        "from lowmem.cli.flags import load_saved_model_config\n"
        "from lowmem.training.evaluation import load_saved_model\n"
        f"cfg, _ = load_saved_model_config({flags!r})\n"
        "saved = load_saved_model(cfg, say=lambda line: None)\n"
        f"prompts = [e.prompt for e in saved.eval_examples[:{count}]]\n"
        "print('answers: ' + json.dumps(list(zip(prompts, saved.generate(prompts)))))\n")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    done = run_child([sys.executable, "-c", code], cwd=cwd, env=dict(os.environ, PYTHONPATH=path))
    if done.rc:
        sys.exit(f"the answers of {generate_command} failed:\n{done.output[-3000:]}")
    line = next(line for line in reversed(done.output.splitlines()) if line.startswith("answers: "))
    return [tuple(pair) for pair in json.loads(line.removeprefix("answers: "))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", default=None, help="commands joined by ' && ' (default: the README's)")
    parser.add_argument("--prompts", type=int, default=20, help="eval prompts checked for their language")
    parser.add_argument("--keep", default=None, help="run in this (new or empty) folder and keep it")
    parser.add_argument("--show", type=int, default=8, help="answers printed")
    args = parser.parse_args()

    job = args.job or readme_job()
    commands = [c.strip() for c in job.split(" && ")]
    generate = next((c for c in commands if " generate" in c), None)
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="default_job_") as tmp:
        cwd = Path(args.keep or tmp)
        print(f"job: {job}\nin {cwd} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
              f"load average at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
        timings = []
        for command in commands:
            result = run(command, cwd)
            timings.append(result)
            print(f"  {result['wall_s']:7.1f} s wall {result['cpu_s']:7.1f} s CPU  {command[:90]}")
            if " generate" in command:
                print("    " + "\n    ".join(result["output"].strip().splitlines()[-5:]))
        wall, cpu = sum(t["wall_s"] for t in timings), sum(t["cpu_s"] for t in timings)
        print(f"time: {wall:.1f} s wall, {cpu:.1f} s CPU in all (load average now {os.getloadavg()[0]:.2f})")

        losses = eval_losses(cwd / "runs" / "sft")
        first, best, last = losses[0], min(losses), losses[-1]
        print(f"SFT eval loss: first {first:.3f}, best {best:.3f}, last {last:.3f}; best/first {best / first:.2f}, "
              f"last/first {last / first:.2f} ({len(losses)} evaluations)")
        if generate:
            pairs = answers(cwd, generate, args.prompts)
            match = sum(bool(CJK.search(p)) == bool(CJK.search(a)) for p, a in pairs)
            chinese = [a for p, a in pairs if CJK.search(p)]
            english = [a for p, a in pairs if not CJK.search(p)]
            print(f"language: {match}/{len(pairs)} answers in their prompt's script ({match / len(pairs):.0%}); "
                  f"distinct answers {len(set(a for _, a in pairs))}/{len(pairs)} "
                  f"(Chinese prompts {len(chinese)}, English {len(english)})")
            for prompt, answer in pairs[:args.show]:
                print(f"    {prompt}  ->  {answer}")


if __name__ == "__main__":
    main()
