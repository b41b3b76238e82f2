"""A worker on another host, as tfdp-launch starts it over ssh.

  python -m tfdp.cluster.remote COMMAND [ARG ...]

runs COMMAND and passes it the launcher's signals. ssh carries no signals: the
launcher writes a signal's name (INT, TERM or KILL) as a line on this process's
standard input. The end of that input (the launcher, or its connection, gone)
kills the worker, so that no worker is left running behind a launcher that
died. SIGTERM, SIGINT and SIGHUP to this process reach the worker too. The exit
status is the worker's, 128 + N for one killed by signal N.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

NAMES = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "KILL": signal.SIGKILL}


def main(command: list[str]) -> int:
    if not command:
        print("usage: python -m tfdp.cluster.remote COMMAND [ARG ...]", file=sys.stderr)
        return 2
    worker = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)

    def send(signum) -> None:
        if worker.poll() is None:
            try:
                worker.send_signal(signum)
            except ProcessLookupError:
                pass

    def relay() -> None:
        for line in sys.stdin:
            if line.strip() in NAMES:
                send(NAMES[line.strip()])
        send(signal.SIGKILL)  # the launcher is gone

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, frame: send(s))
    signal.signal(signal.SIGHUP, lambda s, frame: send(signal.SIGKILL))
    threading.Thread(target=relay, daemon=True).start()
    code = worker.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
