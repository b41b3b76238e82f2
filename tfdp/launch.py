"""`tfdp-launch`: a multi-worker cluster on this machine, one process per worker.

  tfdp-launch --workers=2 --model=toy --batch_size=256 --powers=1,3

starts `tfdp --mode=multiworker [flags]` N times, each with a TF_CONFIG that
names the same cluster of free loopback ports and its own task index. Every
output line is prefixed `[worker i] `. The exit status is 0 when every worker
succeeds; otherwise that of the first worker to fail, and the others are
stopped if they have not exited within `--grace_seconds`. Ctrl-C is passed on
to the workers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

USAGE = "usage: tfdp-launch [--workers=N] [--grace_seconds=S] [tfdp flags]"
DEFAULT_WORKERS = 2
DEFAULT_GRACE_SECONDS = 30.0  # longer than TensorFlow's heartbeat timeout (about 10 s)


class UsageError(ValueError):
    """A bad tfdp-launch flag: `flag` as given, and what is wrong with it."""

    def __init__(self, flag: str, reason: str):
        self.flag, self.reason = flag, reason
        super().__init__(f"{flag}: {reason}")


def parse_args(argv: list[str]) -> tuple[int, float, list[str]]:
    """(workers, grace_seconds, the flags for tfdp) from the command line."""
    workers, grace, passed = DEFAULT_WORKERS, DEFAULT_GRACE_SECONDS, []
    for arg in argv:
        name, _, value = arg.partition("=")
        if name == "--workers":
            try:
                workers = int(value)
            except ValueError:
                raise UsageError(arg, "must be a positive integer") from None
            if workers < 1:
                raise UsageError(arg, "must be a positive integer; each worker is one process")
        elif name == "--grace_seconds":
            try:
                grace = float(value)
            except ValueError:
                raise UsageError(arg, "must be a number of seconds") from None
            if not 0 <= grace < float("inf"):
                raise UsageError(arg, "must be a number of seconds, 0 or more")
        elif name == "--mode" and value != "multiworker":
            raise UsageError(arg, "tfdp-launch runs mode multiworker")
        elif not arg.startswith("-"):
            raise UsageError(arg, "unexpected argument; flags take the form --name=value")
        else:
            passed.append(arg)
    if not any(arg.startswith("--mode=") for arg in passed):
        passed.insert(0, "--mode=multiworker")
    return workers, grace, passed


def free_ports(n: int) -> list[int]:
    """N distinct loopback ports that were free a moment ago."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_configs(ports: list[int]) -> list[str]:
    """One TF_CONFIG per worker: the same cluster, each its own task index."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    return [
        json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        for i in range(len(ports))
    ]


def _stream(source, sink, prefix: str, lock: threading.Lock) -> None:
    for line in source:
        with lock:
            sink.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            sink.flush()


def _status_text(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def launch(workers: int, flags: list[str], grace_seconds: float = DEFAULT_GRACE_SECONDS) -> int:
    """Runs the cluster; returns 0 or the first failing worker's status (128 + N for signal N)."""
    lock = threading.Lock()
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tfdp", *flags],
            env=dict(os.environ, TF_CONFIG=tf_config, PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # Ctrl-C reaches the launcher, which passes it on once
            preexec_fn=_die_with_parent,
        )
        for tf_config in tf_configs(free_ports(workers))
    ]
    threads = []
    for i, process in enumerate(processes):
        for source, sink in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
            thread = threading.Thread(
                target=_stream, args=(source, sink, f"[worker {i}] ", lock), daemon=True
            )
            thread.start()
            threads.append(thread)

    def say(text):
        with lock:
            print(f"tfdp-launch: {text}", file=sys.stderr, flush=True)

    status, deadline = 0, None
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed and status == 0:
                i, code = failed[0]
                status = 128 - code if code < 0 else code
                deadline = time.monotonic() + grace_seconds
                running = None in codes
                say(
                    f"worker {i} failed ({_status_text(code)})"
                    + (
                        f"; the others are stopped if still running in {grace_seconds:g} s"
                        if running
                        else ""
                    )
                )
            if all(code is not None for code in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                _stop(processes, say)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        say("interrupted; passing Ctrl-C to the workers")
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        _wait_or_kill(processes, grace_seconds, say)
        status = 130
    for thread in threads:
        thread.join(timeout=5)
    return status


def _stop(processes, say) -> None:
    # SIGINT, not SIGTERM: TensorFlow's distributed runtime takes SIGTERM as a preemption notice.
    running = [i for i, p in enumerate(processes) if p.poll() is None]
    say(f"stopping worker(s) {', '.join(map(str, running))}")
    for i in running:
        processes[i].send_signal(signal.SIGINT)
    _wait_or_kill(processes, 5, say)


def _die_with_parent() -> None:
    """In the worker, before exec: SIGKILL when the launcher dies, so no worker is left behind."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _wait_or_kill(processes, seconds: float, say) -> None:
    deadline = time.monotonic() + seconds
    for i, p in enumerate(processes):
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"worker {i} did not stop; killing it")
            p.kill()
            p.wait()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run() -> None:
    """Console-script entry point."""
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(__doc__.strip() + "\n\n" + USAGE)
        return
    signal.signal(signal.SIGTERM, _interrupt)  # stopping the launcher stops its workers
    try:
        workers, grace, flags = parse_args(sys.argv[1:])
    except UsageError as error:
        print(f"tfdp-launch: error: {error}", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(workers, flags, grace))


if __name__ == "__main__":
    run()
