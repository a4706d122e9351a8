"""What ``accelerate launch --no_python`` starts for each rank in the tests: ``forked_worker.py SCRIPT ARGS`` asks the
fork server named by ``T5LOWMEM_TEST_FORK_SERVER`` (tests/fork_server.py) to run ``python SCRIPT ARGS`` with this
process's working folder, environment (the launcher's ``RANK``, ``MASTER_PORT``, ...) and standard streams, passes
on the signals a launcher sends (SIGTERM when another rank failed), and ends as the run ended. Killed, or its
launcher gone, it takes the run with it (the server sees it go). Standard library only: it starts in ~30 ms."""

import json
import os
import signal
import socket
import sys

SERVER = "T5LOWMEM_TEST_FORK_SERVER"


def main() -> None:
    env = dict(os.environ)
    address = env.pop(SERVER)
    run = {"pid": None, "pending": []}

    def forward(signum, _frame):
        if run["pid"] is None:
            run["pending"].append(signum)
        else:
            os.kill(run["pid"], signum)

    if sys.platform.startswith("linux"):  # die with the launcher, as a launched rank does (and the run with this)
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(address)
    request = {"argv": [os.path.abspath(sys.argv[1]), *sys.argv[2:]], "cwd": os.getcwd(), "env": env}
    socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
    run["pid"] = json.loads(connection.recv(4096))["pid"]
    for signum in run["pending"]:
        os.kill(run["pid"], signum)
    returncode = json.loads(connection.recv(4096))["returncode"]
    if returncode < 0:  # ended by a signal: so does this process
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    sys.exit(returncode)


if __name__ == "__main__":
    main()
