"""What the command line needs besides its commands: running one through fire with a user's mistake
shown as one ``error:`` line, passing text flags to fire verbatim, and, under ``accelerate launch``,
printing an error once per machine and dying with the launcher."""

from __future__ import annotations

import os
import signal
import sys

from lowmem.cli.flags import text_flags
from lowmem.cli.help_pages import command_help, help_text
from lowmem.memory import collector
from lowmem.parallel import peer_watch
from lowmem.utils.errors import UserError, print_error


def verbatim_text(argv: list[str]) -> list[str]:
    """Text flags' values as Python string literals, which fire hands over unchanged."""
    text = text_flags() | {"config", "prepared_dir", "plot_dir", "export_dir", "dtype", "base"}
    out = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.removeprefix("--").partition("=")
        if arg.startswith("--") and eq and name in text:
            arg = f"--{name}={value!r}"
        elif i and argv[i - 1].startswith("--") and "=" not in argv[i - 1] and argv[i - 1][2:] in text:
            arg = repr(arg)  # --prompt "hello, world"
        out.append(arg)
    return out


def die_with_launcher() -> None:
    """Under ``accelerate launch`` / torchrun, die when the launcher dies.

    torch's elastic agent starts each worker in a session of its own, so a SIGKILL of the launcher
    (or of its process group) would leave the workers training and writing checkpoints into the run
    folder, racing the run that resumes it. Linux only (prctl); elsewhere nothing changes.
    """
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the request took effect
        os._exit(1)


def run_cli(commands: dict, argv: list[str], startup_handler=None) -> None:
    """Run ``argv``'s command through fire. A user's mistake (``UserError``, a full disk) prints one
    ``error:`` line and exits with code 2; ``--debug`` shows the traceback instead. ``startup_handler``: the
    SIGINT handler of the imports before, replaced by Python's own as the command begins."""
    import fire

    if not argv or "--help" in argv or "-h" in argv:  # (fire's own help would list the function's signature)
        print(command_help(argv[0], commands) if argv and argv[0] in commands else help_text(commands))
        return
    if argv[0] not in commands:
        print_error(f"unknown command {argv[0]!r}; use one of {', '.join(commands)} (see --help)")
        sys.exit(2)
    for before, arg in zip(argv, argv[1:]):  # a word that is no option's value: fire would take it for --config
        if not arg.startswith("-") and not (before.startswith("--") and "=" not in before):
            print_error(f"unexpected argument {arg!r}: options are --name=value (a YAML file of them: --config=FILE)")
            sys.exit(2)
    debug = any(a in ("--debug", "--debug=True", "--debug=true") for a in argv)
    collector.during_imports()
    try:
        if startup_handler is not None and signal.getsignal(signal.SIGINT) is startup_handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt, handled below
        fire.Fire(commands, command=verbatim_text(argv), name="train_low_mem.py")
        finish_watch()
        if "LOCAL_RANK" in os.environ:  # a launched worker whose work is done and flushed
            # Skip interpreter teardown: C++ threads of the gloo process group left to static
            # destructors can abort a finished worker ("terminate called without an active exception").
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except UserError as err:
        if debug:
            raise
        stop_with(str(err), 2)
    except RuntimeError as err:  # under a launcher: another process died in the middle of a collective
        if debug or "LOCAL_RANK" not in os.environ or not any(sign in str(err) for sign in PEER_LOST):
            raise
        watch = peer_watch.active()
        line, code = watch.explain_loss() if watch else (
            "another process of this launch stopped (killed, or out of memory) inside a collective this one was "
            "waiting in; checkpoints are written whole, so the last one is intact: continue with "
            "--is_keep_training=True", peer_watch.EXIT_PEER_LOST)
        print_error(line)
        sys.exit(code)
    except Exception as err:  # a write the user can make possible (an OSError, or a Rust library's "(os error N)")
        message = None if debug else write_error(err, argv[0])
        if message is None:
            raise
        stop_with(message, 2)
    except KeyboardInterrupt:  # Ctrl-C where no handler checkpoints (train's loop has one): a line, not a traceback
        if debug:
            raise
        print_error("interrupted (Ctrl-C)")
        sys.exit(130)
    finally:
        finish_watch()
        collector.before_exit()


def stop_with(message: str, code: int) -> None:
    """Print ``message`` as the one ``error:`` line and exit with ``code``; the other processes of a launch (when
    this one watches them, ``lowmem.parallel.peer_watch``) stop with the same line instead of waiting for it."""
    watch = peer_watch.active()
    if watch is not None:
        watch.post_failure(message, code)
    print_error(message)
    sys.exit(code)


def finish_watch() -> None:
    watch = peer_watch.active()
    if watch is not None:
        watch.finish()


def write_error(err: Exception, command: str) -> str | None:
    """The ``error:`` line for a write the user can make possible (a full disk, a file name too long) that
    failed ``command``, or None when ``err`` is no such failure."""
    import errno

    from lowmem.checkpointing.checkpoint import write_failure

    where = getattr(err, "filename", None)
    failure = write_failure(err, None)
    if not (failure or getattr(err, "errno", None) == errno.ENAMETOOLONG):
        return None
    if not failure:  # a path given on the command line, or one made from it
        return f"file name too long: {str(where)[:120]}...; shorten the path you passed"
    # (checkpoints and exports say so themselves, naming the folder: checkpoint.atomic_folder)
    again = ("continue it with --is_keep_training=True (its checkpoints are written whole)"
             if command == "train" else "run the command again")
    return f"{failure[0]}" + (f" ({where})" if where else "") + f": {failure[1]}, then {again}"


# How gloo and NCCL report a peer gone in the middle of a collective
PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused", "communicator was aborted",
             "Connection was likely closed")  # (the last: the launch's store, with machine 0's launcher)
