"""`tfdp-launch`: a multi-worker cluster on this machine, one process per worker.

  tfdp-launch --workers=2 --model=toy --batch_size=256 --powers=1,3

starts `tfdp --mode=multiworker [flags]` N times, each with a TF_CONFIG that
names the same cluster of free loopback ports and its own task index. Every
output line is prefixed `[worker i] `.

  tfdp-launch --workers=2 -- python3 train.py --epochs=3

starts the command after `--` N times instead, with the same TF_CONFIG: a
script of your own that makes `tfdp.MultiWorkerMirroredStrategy(powers=...)`
(or TensorFlow's) finds its cluster there.

Network: TensorFlow's gRPC server listens on all interfaces without any
authentication, and whoever reaches a worker's port can run code in it. With
`--network=isolated` (the default where Linux allows it) the launcher and its
workers run in a network namespace of their own that has only loopback, so
that no other host can reach their ports; they cannot reach the network
either. Where that is refused, the launcher says so on one line and the
workers run on this machine's network; an explicit `--network=isolated` is
then an error. `--network=host` runs them on this machine's network, e.g.
for workers that download their data from the internet: their ports are then
reachable from other hosts, so run it only on a private network.

Exit status: 0 when every worker succeeds; otherwise that of the first worker
to fail (128 + N for one killed by signal N), and the others are stopped
(SIGINT, then SIGKILL 5 s later) if they have not exited within
`--grace_seconds`. SIGTERM or Ctrl-C (SIGINT) to the launcher is passed on
once to every running worker (which saves a checkpoint and exits); workers
still running `--grace_seconds` later are killed, and the status is 128 + the
signal's number (143, 130) unless a worker had failed before. A bad flag, or
an explicit `--network=isolated` that cannot be had, exits with status 2.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

USAGE = (
    "usage: tfdp-launch [--workers=N] [--gpus_per_worker=K] [--grace_seconds=S] "
    "[--network=isolated|host] [tfdp flags | -- COMMAND [ARG ...]]"
)
DEFAULT_WORKERS = 2
DEFAULT_GRACE_SECONDS = 30.0  # longer than TensorFlow's heartbeat timeout (about 10 s)
NETWORKS = ("isolated", "host")
PORT_TAKEN = "Could not start gRPC server"  # TensorFlow's words when a worker cannot bind its port
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class UsageError(ValueError):
    """A bad tfdp-launch flag: `flag` as given, and what is wrong with it."""

    def __init__(self, flag: str, reason: str):
        self.flag, self.reason = flag, reason
        super().__init__(f"{flag}: {reason}")


def parse_args(argv: list[str]) -> tuple[int, float, str | None, int | None, list[str]]:
    """(workers, grace_seconds, network or None for the default, gpus_per_worker or None to
    leave CUDA_VISIBLE_DEVICES as it is, the flags for tfdp)."""
    workers, grace, network, gpus_per_worker, passed = (
        DEFAULT_WORKERS,
        DEFAULT_GRACE_SECONDS,
        None,
        None,
        [],
    )
    for arg in argv:
        name, _, value = arg.partition("=")
        if name == "--gpus_per_worker":
            try:
                gpus_per_worker = int(value)
            except ValueError:
                raise UsageError(arg, "must be a positive integer") from None
            if gpus_per_worker < 1:
                raise UsageError(arg, "must be a positive integer: the GPUs each worker gets")
        elif name == "--workers":
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
        elif name == "--network":
            if value not in NETWORKS:
                raise UsageError(arg, f"must be one of {', '.join(NETWORKS)}")
            network = value
        elif name == "--mode" and value != "multiworker":
            raise UsageError(arg, "tfdp-launch runs mode multiworker")
        elif not arg.startswith("-"):
            raise UsageError(arg, "unexpected argument; flags take the form --name=value")
        else:
            passed.append(arg)
    if not any(arg.startswith("--mode=") for arg in passed):
        passed.insert(0, "--mode=multiworker")
    return workers, grace, network, gpus_per_worker, passed


def split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(the launcher's arguments, the worker command after `--`, or None without one)."""
    if "--" not in argv:
        return argv, None
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def check_command(command: list[str], flags: list[str]) -> None:
    """UsageError for an empty command, or tfdp flags beside one (they go to the command)."""
    if not command:
        raise UsageError("--", "needs a command after it, e.g. -- python3 train.py")
    extra = [flag for flag in flags if flag != "--mode=multiworker"]
    if extra:
        raise UsageError(extra[0], "is a tfdp flag; with -- COMMAND, give the command its own arguments")


def visible_gpus(environ) -> list[str] | None:
    """The GPUs the launcher may hand out, as CUDA_VISIBLE_DEVICES entries; None: unknown.

    From CUDA_VISIBLE_DEVICES when it is set (CUDA stops at its first negative
    entry), else from `nvidia-smi -L` when there is one. Without TensorFlow,
    which takes seconds to import.
    """
    if "CUDA_VISIBLE_DEVICES" in environ:
        gpus = []
        for entry in environ["CUDA_VISIBLE_DEVICES"].split(","):
            if not entry.strip() or entry.strip().startswith("-"):
                break
            gpus.append(entry.strip())
        return gpus
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    count = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    return [str(i) for i in range(count)]


def check_gpus(workers: int, gpus_per_worker: int, gpus: list[str] | None) -> None:
    """Raises UsageError when the workers need more GPUs than are visible (None: unknown)."""
    if gpus is not None and workers * gpus_per_worker > len(gpus):
        raise UsageError(
            f"--gpus_per_worker={gpus_per_worker}",
            f"{workers} workers x {gpus_per_worker} GPUs need {workers * gpus_per_worker}, "
            f"and {len(gpus)} are visible here ({', '.join(gpus) or 'none'})",
        )


def worker_environment(
    environ, tf_config: str, index: int, gpus_per_worker: int | None = None, gpus=None
) -> dict[str, str]:
    """Worker `index`'s environment: `environ` with its TF_CONFIG, unbuffered output, and,
    with `gpus_per_worker` K, CUDA_VISIBLE_DEVICES naming its own K GPUs: entries
    index*K .. index*K+K-1 of `gpus` (the launcher's visible GPUs; None: GPUs 0, 1, ...).
    Without `gpus_per_worker`, CUDA_VISIBLE_DEVICES is left as it is."""
    env = dict(environ, TF_CONFIG=tf_config, PYTHONUNBUFFERED="1")
    if gpus_per_worker:
        first = index * gpus_per_worker
        own = range(first, first + gpus_per_worker)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) if gpus is None else gpus[i] for i in own)
    return env


CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def isolate_network() -> None:
    """Moves this process into a new network namespace that has only loopback, up.

    The workers started afterwards inherit it. Without the privilege for a
    network namespace, a user namespace of this user's own grants it where
    the kernel allows that. Raises OSError saying why it cannot be done.
    """
    if sys.platform != "linux":
        raise OSError(f"network namespaces are a Linux feature; this is {sys.platform}")
    try:
        _unshare(CLONE_NEWNET)
    except PermissionError as refused:
        uid, gid = os.getuid(), os.getgid()
        try:
            _unshare(CLONE_NEWUSER | CLONE_NEWNET)  # single-threaded processes only
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as file:
                    file.write(text)
        except OSError as error:
            raise OSError(
                f"unshare: {refused.strerror}; in a user namespace: {error.strerror}"
            ) from None
    except OSError as error:
        raise OSError(f"unshare: {error.strerror}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack_from("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def _unshare(flags: int) -> None:
    """libc unshare(2): Python 3.11 has no os.unshare."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


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


def _stream(source, sink, prefix: str, lock: threading.Lock, seen=None) -> None:
    """Copies a worker's output (bytes) to `sink` line by line, up to EOF.

    It never stops early, whatever the bytes or the sink: a worker whose pipe
    is no longer read blocks once the pipe is full. `seen` is called with
    every line.
    """
    for raw in source:
        line = raw.decode("utf-8", errors="replace")
        line = prefix + (line if line.endswith("\n") else line + "\n")
        if seen is not None:
            seen(line)
        try:
            with lock:
                try:
                    sink.write(line)
                except UnicodeEncodeError:  # a sink that cannot write U+FFFD
                    sink.write(line.encode("ascii", "backslashreplace").decode("ascii"))
                sink.flush()
        except (OSError, ValueError):  # the sink is closed or broken: the line is lost
            pass


def _status_text(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


class _Workers:
    """The processes of one start of the cluster, and the threads that copy their output."""

    def __init__(
        self, count: int, flags: list[str], lock: threading.Lock, gpus_per_worker, gpus, command
    ):
        self.port_taken = [False] * count
        self.processes, self.threads = [], []
        for i, tf_config in enumerate(tf_configs(free_ports(count))):
            self.processes.append(
                subprocess.Popen(
                    command or [sys.executable, "-m", "tfdp", *flags],
                    env=worker_environment(os.environ, tf_config, i, gpus_per_worker, gpus),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # Ctrl-C reaches the launcher, which passes it on once
                    preexec_fn=_die_with_parent,  # noqa: PLW1509 (before any thread starts)
                )
            )
        for i, process in enumerate(self.processes):
            prefix = f"[worker {i}] "
            self._copy(process.stdout, sys.stdout, prefix, lock)
            self._copy(process.stderr, sys.stderr, prefix, lock, self._watch(i))

    def _copy(self, *args) -> None:
        thread = threading.Thread(target=_stream, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _watch(self, i: int):
        def seen(line: str) -> None:
            if PORT_TAKEN in line:
                self.port_taken[i] = True

        return seen

    def join(self, seconds: float = 5) -> None:
        """Waits for the output of exited workers to be copied."""
        deadline = time.monotonic() + seconds
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def launch(
    workers: int,
    flags: list[str],
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    gpus_per_worker: int | None = None,
    gpus: list[str] | None = None,
    command: list[str] | None = None,
) -> int:
    """Runs the cluster (of `command`, else of the tfdp command with `flags`); returns 0, the first failing worker's status (128 + N for signal N),
    or 128 + N when signal N (SIGTERM, SIGINT) stopped it.

    gpus_per_worker, gpus: as in `worker_environment`.

    Call it from the main thread: it handles SIGTERM and SIGINT until it returns.
    """
    lock = threading.Lock()
    received = []
    previous = {
        s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in STOP_SIGNALS
    }

    def say(text):
        with lock:
            print(f"tfdp-launch: {text}", file=sys.stderr, flush=True)

    try:
        status = _supervise(
            _Workers(workers, flags, lock, gpus_per_worker, gpus, command),
            grace_seconds,
            received,
            say,
            retry=True,
        )
        if status is None:  # a port was taken between choosing and binding it: once more
            status = _supervise(
                _Workers(workers, flags, lock, gpus_per_worker, gpus, command),
                grace_seconds,
                received,
                say,
            )
        return status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _supervise(cluster: _Workers, grace_seconds, received, say, retry=False) -> int | None:
    """Waits for the workers; the exit status, or None to start them again on new ports."""
    processes = cluster.processes
    status, deadline, forwarded = 0, None, None
    while True:
        codes = [p.poll() for p in processes]
        if received and forwarded is None:
            forwarded = received[0]
            name = signal.Signals(forwarded).name
            say(
                f"{name} received; passing it to the workers, which are killed "
                f"if still running in {grace_seconds:g} s"
            )
            for p in processes:
                if p.poll() is None:
                    p.send_signal(forwarded)
            status = status or 128 + forwarded
            deadline = time.monotonic() + grace_seconds
        failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
        if failed and status == 0:
            i, code = failed[0]
            for thread in cluster.threads[2 * i : 2 * i + 2]:  # its last words, to EOF
                thread.join(timeout=5)
            if retry and cluster.port_taken[i]:
                say(
                    f"worker {i} could not listen on its port, taken since it was chosen; "
                    "starting the workers again on new ports"
                )
                _kill(processes)
                cluster.join()
                return None
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
            if forwarded is None:
                _stop(processes, say)
            else:
                _wait_or_kill(processes, 0, say)
            break
        time.sleep(0.1)
    cluster.join()
    return status


def _stop(processes, say) -> None:
    # SIGINT, not SIGTERM: once a worker has joined the cluster, TensorFlow's own
    # SIGTERM handler (a preemption notice for the coordination service) only
    # records the signal, so outside tfdp's training loop SIGTERM does nothing.
    running = [i for i, p in enumerate(processes) if p.poll() is None]
    say(f"stopping worker(s) {', '.join(map(str, running))}")
    for i in running:
        processes[i].send_signal(signal.SIGINT)
    _wait_or_kill(processes, 5, say)


def _kill(processes) -> None:
    for p in processes:
        if p.poll() is None:
            p.kill()
        p.wait()


def _die_with_parent() -> None:
    """In the worker, before exec: SIGKILL when the launcher dies, so no worker is left behind."""
    if sys.platform == "linux":
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


NETWORK_HELP = """\
  --network=isolated  the workers in a network namespace with only loopback: their
                      ports cannot be reached from other hosts, nor can they reach
                      the network (default where Linux allows it; otherwise a warning)
  --network=host      the workers on this machine's network, e.g. to download data
                      from the internet; their ports are open to every host that
                      reaches this machine, and TensorFlow does not authenticate"""
GPUS_HELP = """\
  --gpus_per_worker=K worker i gets GPUs i*K .. i*K+K-1 of those visible to the
                      launcher, through CUDA_VISIBLE_DEVICES; checked against
                      CUDA_VISIBLE_DEVICES or `nvidia-smi -L` when either is there,
                      otherwise trusted (default: the environment is left as it is)"""


LAUNCH_HELP = f"""\
  --workers=N         processes to start, one worker each (default {DEFAULT_WORKERS})
  --grace_seconds=S   after a worker fails, how long the others may take to stop
                      before they are interrupted, then killed (default {DEFAULT_GRACE_SECONDS:g})
  tfdp flags          every other flag goes to each worker's tfdp --mode=multiworker
                      (tfdp --help lists them)"""


def run() -> None:
    """Console-script entry point."""
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(__doc__.strip() + "\n\n" + "\n".join((USAGE, LAUNCH_HELP, NETWORK_HELP, GPUS_HELP)))
        return
    gpus = None
    argv, command = split_command(sys.argv[1:])
    try:
        workers, grace, network, gpus_per_worker, flags = parse_args(argv)
        if command is not None:
            check_command(command, flags)
        if gpus_per_worker:
            gpus = visible_gpus(os.environ)
            check_gpus(workers, gpus_per_worker, gpus)
    except UsageError as error:
        print(f"tfdp-launch: error: {error}", file=sys.stderr)
        sys.exit(2)
    if gpus_per_worker and gpus is None:
        print(
            "tfdp-launch: note: cannot count the GPUs here (no CUDA_VISIBLE_DEVICES, no "
            f"nvidia-smi); giving worker i GPUs i*{gpus_per_worker} .. "
            f"i*{gpus_per_worker}+{gpus_per_worker - 1} as asked",
            file=sys.stderr,
            flush=True,
        )
    if network != "host":
        try:
            isolate_network()
        except OSError as error:
            if network == "isolated":
                print(
                    f"tfdp-launch: error: --network=isolated: cannot isolate the workers "
                    f"({error}); --network=host runs them on this machine's network",
                    file=sys.stderr,
                )
                sys.exit(2)
            print(
                "tfdp-launch: warning: the workers' ports are reachable from the network, and "
                "TensorFlow does not authenticate: cannot put them in a network namespace of "
                f"their own ({error}); run this only on a private network, "
                "or say so with --network=host",
                file=sys.stderr,
                flush=True,
            )
    sys.exit(launch(workers, flags, grace, gpus_per_worker, gpus, command))


if __name__ == "__main__":
    run()
