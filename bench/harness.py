"""What every benchmark shares: run a child process and read its rusage, time a block, print a table.

    from bench.harness import Column, Table, Timer, child_env, run_child, trainer

- ``run_child`` runs one process to its end (or until a watcher stops it), its output in a log file, and
  returns a ``Run``: exit code, wall seconds, and the CPU seconds and peak RSS that the kernel's ``os.wait4``
  reports for that child. ``trainer`` and ``module`` build the command lines it is given: ``train_low_mem.py``
  and a bench module of its own (``python -m bench.x``, from the repository root: ``run_child``'s folder).
- ``child_env``: the environment a contender runs in. ``TreeMemory`` and ``cpu_seconds`` sample a running
  child from a watcher.
- ``Timer``: wall seconds of a block or between laps (``time.perf_counter``), after an optional sync.
- ``Table``: rows side by side, as text or markdown, at once or a row at a time, with ratio columns that
  divide a row's value by its baseline row's.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
POLL_S = 0.05  # a watcher's interval: fine enough to see a short peak, cheap beside a training step


# --------------------------------------------------------------------------- command lines and environment
def flags(*given: str, **named) -> list[str]:
    """``given`` as they are, then ``--key=value`` for each of ``named``."""
    return [*given, *(f"--{key}={value}" for key, value in named.items())]


def trainer(command: str, *given: str, **named) -> list[str]:
    """``python train_low_mem.py COMMAND`` with flags (see ``flags``), run as a user runs it."""
    return [sys.executable, str(REPO / "train_low_mem.py"), command, *flags(*given, **named)]


def module(name: str, *given: str, **named) -> list[str]:
    """``python -m NAME`` with flags: a bench module (``bench.x``) in a process of its own."""
    return [sys.executable, "-m", name, *flags(*given, **named)]


def child_env(threads: int = 0, **extra: str) -> dict:
    """This process's environment for a contender: the hub and datasets offline (every run reads local files),
    output unbuffered (its log is current when a watcher reads it), ``threads`` OMP/MKL threads when given (0:
    the library's default), and ``extra``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1", **extra)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


# --------------------------------------------------------------------------- running a child
@dataclass
class Run:
    """One child process, run to its end: what ``run_child`` returns."""

    rc: int  # exit code; negative: the signal that ended it (-9 when a watcher stopped it)
    start: float  # unix times, comparable with a run's own records
    end: float
    wall_s: float
    cpu_s: float  # user + system, every thread, the children it waited for included
    peak_rss_mib: float  # the kernel's high-water mark of its RSS (``ru_maxrss``), the whole run
    output: str  # stdout and stderr together
    log: Path | None  # where the output was written, when a log was asked for

    def tail(self, lines: int = 15) -> list[str]:
        """The output's last ``lines`` lines."""
        return self.output.splitlines()[-lines:]

    def last_json(self) -> dict:
        """The last line of the output that holds a JSON object: what a child reports (its warnings, on stderr,
        share the output)."""
        return json.loads(next(line for line in reversed(self.output.splitlines()) if line.startswith("{")))


def run_child(argv: list[str], log: Path | None = None, *, cwd: Path = REPO, env: dict | None = None,
              watch: Callable[[int], bool] | None = None, every: float = POLL_S) -> Run:
    """Run ``argv`` to its end, stdout and stderr into ``log`` (a temporary file when None), and read its rusage.

    Args:
        argv: the command line.
        log: where its output goes (kept); None: a temporary file, read and removed.
        cwd: its folder (the repository root: ``python -m bench.x`` finds the package there).
        env: its environment (default: this process's; see ``child_env``).
        watch: called with the child's pid every ``every`` seconds while it runs, to sample it; when it returns
            True the child is killed (what is measured is done) and its end awaited.
        every: the watcher's interval, in seconds.
    """
    path = Path(log) if log else Path(tempfile.mkstemp(prefix="bench_child_", suffix=".log")[1])
    with open(path, "wb") as sink:
        start, clock = time.time(), time.perf_counter()
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            while True:
                pid, status, usage = os.wait4(process.pid, os.WNOHANG if watch else 0)
                if pid:
                    break
                if watch(process.pid):
                    process.kill()
                    watch = None  # the next wait4 blocks until it has ended
                    continue
                time.sleep(every)
        except BaseException:
            process.kill()  # an interrupted benchmark leaves no contender running
            process.wait()
            raise
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    wall, end = time.perf_counter() - clock, time.time()
    output = path.read_text(errors="replace")
    if not log:
        path.unlink()
    return Run(rc=process.returncode, start=start, end=end, wall_s=wall, cpu_s=usage.ru_utime + usage.ru_stime,
               peak_rss_mib=usage.ru_maxrss / 1024, output=output, log=Path(log) if log else None)  # Linux: KiB


def peak_rss_mib() -> float:
    """This process's own peak RSS so far (``getrusage``), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process, all its threads (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


class TreeMemory:
    """A ``run_child`` watcher: each call samples (unix time, RSS summed over the process and all its children,
    the largest single RSS, anonymous RSS summed), in bytes, into ``samples``; it never stops the child."""

    def __init__(self):
        self.samples: list[tuple[float, int, int, int]] = []
        self.root = None

    def __call__(self, pid: int) -> bool:
        import psutil

        if self.root is None:
            self.root = psutil.Process(pid)
        total = largest = anon = 0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for proc in procs:
            try:
                mem = proc.memory_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):  # ended between the listing and the read
                continue
            total += mem.rss
            largest = max(largest, mem.rss)
            anon += mem.rss - getattr(mem, "shared", 0)  # shared = file-backed + shmem pages (Linux)
        self.samples.append((time.time(), total, largest, anon))
        return False


# --------------------------------------------------------------------------- timing
class Timer:
    """Wall seconds (``time.perf_counter``): of a block (``with Timer() as t: ...``, then ``t.seconds``) or
    between laps (``t = Timer()``, then ``t.lap()`` after each step: ``t.laps``). ``sync`` runs before each
    reading (``torch.cuda.synchronize``: a GPU's queued work counted where it was asked for)."""

    def __init__(self, sync: Callable[[], object] | None = None):
        self.sync = sync or (lambda: None)
        self.laps: list[float] = []
        self.sync()
        self.mark = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (or the start), kept in ``laps``."""
        self.sync()
        now = time.perf_counter()
        self.laps.append(now - self.mark)
        self.mark = now
        return self.laps[-1]

    @property
    def seconds(self) -> float:
        return sum(self.laps)

    def __enter__(self) -> Timer:
        self.laps = []
        self.sync()
        self.mark = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.lap()


def time_call(fn: Callable[[], object], sync: Callable[[], object] | None = None) -> float:
    """Wall seconds of one call of ``fn``."""
    with Timer(sync) as timer:
        fn()
    return timer.seconds


# --------------------------------------------------------------------------- tables
class Column(NamedTuple):
    """One column of a ``Table``: its header, the key of a row's value, how a number is shown (an empty spec:
    text, left-aligned), whether it shows the row's value / its baseline row's, and a least width (text)."""

    header: str
    key: str
    spec: str = ""
    ratio: bool = False
    width: int = 0


class Table:
    """Rows side by side, one line a row, as text (aligned) or markdown.

    ``add(name, values)`` adds a row (its ``name`` is the value of the key ``"name"``); with ``stream`` it is
    printed at once (the header before the first; widths from the headers and ``Column.width``), else ``show``
    prints every row, widths fitted to the cells. A ratio column divides the row's value by that of the row
    named ``against`` (default: the table's ``baseline``), "-" where either is missing. A row with an
    ``"error"`` shows its name and ``failed: ERROR``. A value None is shown as "-", a string as it is.
    """

    def __init__(self, columns: list[Column], baseline: str | None = None, markdown: bool = False,
                 stream: bool = False):
        self.columns, self.baseline, self.markdown, self.stream = columns, baseline, markdown, stream
        self.rows: dict[str, dict] = {}
        self.cells: list[list[str]] = []

    def add(self, name: str, values: dict, against: str | None = None) -> list[str]:
        """Add (and with ``stream`` print) one row; returns its cells."""
        row = self.rows[name] = {"name": name, **values}
        base = self.rows.get(against or self.baseline)
        if "error" in row:
            cells = [self.cell(row, self.columns[0], base), f"failed: {row['error']}"]
        else:
            cells = [self.cell(row, column, base) for column in self.columns]
        self.cells.append(cells)
        if self.stream:
            widths = [max(len(c.header), c.width) for c in self.columns]
            lines = self.render_lines([cells], widths, header=len(self.cells) == 1)
            print("\n".join(lines), flush=True)
        return cells

    @staticmethod
    def cell(row: dict, column: Column, base: dict | None) -> str:
        value = row.get(column.key)
        if column.ratio:
            below = base.get(column.key) if base else None
            numbers = isinstance(value, (int, float)) and isinstance(below, (int, float))
            value = value / below if numbers and below else None
        if value is None:
            return "-"
        return value if isinstance(value, str) else format(value, column.spec)

    def render(self, markdown: bool | None = None) -> list[str]:
        """Every row's line, the header first, as text or (``markdown``) markdown."""
        widths = [max([len(c.header)] + [len(cells[i]) for cells in self.cells if len(cells) == len(self.columns)])
                  for i, c in enumerate(self.columns)]
        return self.render_lines(self.cells, widths, True, self.markdown if markdown is None else markdown)

    def render_lines(self, rows: list[list[str]], widths: list[int], header: bool,
                     markdown: bool | None = None) -> list[str]:
        markdown = self.markdown if markdown is None else markdown
        text = [not c.spec and not c.ratio for c in self.columns]
        if markdown:
            lines = ["| " + " | ".join(c.header for c in self.columns) + " |",
                     "|" + "|".join("---" if t else "---:" for t in text) + "|"] if header else []
            return lines + ["| " + " | ".join(cells) + " |" for cells in rows]

        def line(cells: list[str]) -> str:
            if len(cells) < len(widths):  # a failed row: its name, then what went wrong
                return f"{cells[0].ljust(widths[0])}  {' '.join(cells[1:])}"
            return "  ".join(c.ljust(w) if t else c.rjust(w) for c, w, t in zip(cells, widths, text)).rstrip()

        lines = [line([c.header for c in self.columns]), line(["-" * w for w in widths])] if header else []
        return lines + [line(cells) for cells in rows]

    def show(self) -> list[str]:
        """Print the whole table (without ``stream``); returns its lines."""
        lines = self.render()
        print("\n".join(lines), flush=True)
        return lines
