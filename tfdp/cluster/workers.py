"""One start of a cluster: its TF_CONFIGs, its worker processes and their output.

A worker on this machine is a child process. A worker on another host runs
under ssh, through `python -m tfdp.cluster.remote`, which takes the
launcher's signals from its standard input (ssh carries none) and kills the
worker when the launcher or its connection is gone. Every output line is
copied with the prefix `[worker i] `.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from tfdp.cluster.hosts import is_local

PORT_TAKEN = "Could not start gRPC server"  # TensorFlow's words when a worker cannot bind its port
LOST_CLUSTER = 138  # a worker's exit status when a peer is gone (spec.describe_failure)
MEMBERSHIP = "TFDP_MEMBERSHIP"  # the variable that tells workers the cluster's history
FREE_PORTS = (
    "import socket\n"
    "s = [socket.socket() for _ in range({n})]\n"
    "[x.bind(('', 0)) for x in s]\n"
    "print(' '.join(str(x.getsockname()[1]) for x in s))\n"
)


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


def tf_configs(ports: list[int], hosts: list[str] | None = None) -> list[str]:
    """One TF_CONFIG per worker: the same cluster, each its own task index; worker i at
    hosts[i] (None: every worker on 127.0.0.1)."""
    hosts = hosts or ["127.0.0.1"] * len(ports)
    cluster = {"worker": [f"{host}:{port}" for host, port in zip(hosts, ports, strict=True)]}
    return [
        json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        for i in range(len(ports))
    ]


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


def status_text(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == LOST_CLUSTER:
        return f"exit status {code}, it lost the cluster"
    return f"exit status {code}"


def retryable(code: int) -> bool:
    """Whether a worker's exit may pass on a restart: killed by a signal (here, or 128 + N
    from another host), or it lost the cluster. A status from 1 to 127 is the run's own
    error (a bad flag, bad data), which a restart would only repeat."""
    return code < 0 or code >= 128


class Ssh:
    """How workers start on other hosts: the ssh command, and the paths they run at."""

    def __init__(self, command: list[str], cwd: str | None = None, python: str | None = None):
        self.command = command
        self.cwd = cwd or os.getcwd()
        self.python = python or sys.executable

    def line(self, env: dict[str, str], command: list[str]) -> str:
        """The remote shell's command: same directory, the launcher's variables, the worker
        under tfdp.cluster.remote."""
        variables = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        remote = [self.python, "-m", "tfdp.cluster.remote", *command]
        return f"cd {shlex.quote(self.cwd)} && exec env {variables} {shlex.join(remote)}"

    def free_ports(self, host: str, n: int) -> list[int]:
        """N ports free on `host` a moment ago. Raises OSError when the host cannot be asked."""
        script = FREE_PORTS.format(n=n)
        command = [*self.command, host, f"{shlex.quote(self.python)} -c {shlex.quote(script)}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise OSError(f"{shlex.join(command[: len(self.command) + 1])}: {error}") from None
        try:
            ports = [int(p) for p in done.stdout.split()]
        except ValueError:
            ports = []
        if done.returncode != 0 or len(ports) != n:
            last = (done.stderr.strip().splitlines() or [""])[-1]
            raise OSError(f"ssh {host}: exit status {done.returncode} {last}".strip())
        return ports


class Worker:
    """One worker process: on this machine, or on `host` over `ssh`."""

    def __init__(self, index: int, host: str, command: list[str], env: dict, extra: dict, ssh):
        self.index, self.host = index, host
        self.local = ssh is None
        options = dict(
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches the launcher, which passes it on once
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (before any thread starts)
        )
        if self.local:
            self.process = subprocess.Popen(command, env=env, **options)
        else:
            line = ssh.line(extra, command)
            self.process = subprocess.Popen(
                [*ssh.command, host, line], stdin=subprocess.PIPE, **options
            )

    def poll(self) -> int | None:
        return self.process.poll()

    def send_signal(self, signum: int) -> None:
        if self.poll() is not None:
            return
        if self.local:
            self.process.send_signal(signum)
            return
        try:
            self.process.stdin.write(f"{signal.Signals(signum).name[3:]}\n".encode())
            self.process.stdin.flush()
        except (OSError, ValueError):  # its connection is gone
            pass

    def kill(self) -> None:
        if self.poll() is None:
            if not self.local:
                self.send_signal(signal.SIGKILL)
            self.process.kill()
        self.process.wait()

    def wait(self, timeout=None) -> int:
        return self.process.wait(timeout=timeout)

    def describe(self) -> str:
        return f"worker {self.index}" + ("" if self.local else f" on {self.host}")


class Cluster:
    """The workers of one start: worker i on hosts[i], each with its TF_CONFIG.

    command: what each worker runs; env: variables every worker gets besides its
    TF_CONFIG; ssh: how to reach other hosts (`Ssh`), or None when all are here.
    gpus_per_worker, gpus: as in `worker_environment`, counted per host.
    """

    def __init__(
        self,
        hosts: list[str],
        command: list[str],
        lock: threading.Lock,
        env: dict | None = None,
        ssh: Ssh | None = None,
        gpus_per_worker=None,
        gpus=None,
    ):
        self.port_taken = [False] * len(hosts)
        self.workers, self.threads = [], []
        configs = tf_configs(*self._addresses(hosts, ssh))
        slot = {}
        for i, (host, tf_config) in enumerate(zip(hosts, configs)):
            local = is_local(host)
            j = slot[host] = slot.get(host, -1) + 1  # this worker's slot on its host
            extra = worker_environment(
                env or {}, tf_config, j, gpus_per_worker, gpus if local else None
            )
            environ = dict(os.environ, **extra)
            self.workers.append(Worker(i, host, command, environ, extra, None if local else ssh))
        for worker in self.workers:
            prefix = f"[worker {worker.index}] "
            self._copy(worker.process.stdout, sys.stdout, prefix, lock)
            self._copy(worker.process.stderr, sys.stderr, prefix, lock, self._watch(worker.index))

    @staticmethod
    def _addresses(hosts: list[str], ssh: Ssh | None) -> tuple[list[int], list[str]]:
        """(ports, host names) of the workers: loopback when all are here; otherwise
        this machine by its name, and each other host's free ports, asked over ssh."""
        if all(is_local(host) for host in hosts):
            return free_ports(len(hosts)), ["127.0.0.1"] * len(hosts)
        ports, names = [0] * len(hosts), list(hosts)
        for host in dict.fromkeys(hosts):
            places = [i for i, h in enumerate(hosts) if h == host]
            if is_local(host):
                found = free_ports(len(places))
                for i in places:
                    names[i] = socket.gethostname()
            else:
                found = ssh.free_ports(host, len(places))
            for i, port in zip(places, found):
                ports[i] = port
        return ports, names

    def _copy(self, *args) -> None:
        thread = threading.Thread(target=copy_lines, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _watch(self, i: int):
        def seen(line: str) -> None:
            if PORT_TAKEN in line:
                self.port_taken[i] = True

        return seen

    def codes(self) -> list[int | None]:
        return [worker.poll() for worker in self.workers]

    def running(self) -> list[Worker]:
        return [worker for worker in self.workers if worker.poll() is None]

    def send_signal(self, signum: int) -> None:
        for worker in self.running():
            worker.send_signal(signum)

    def kill(self) -> None:
        for worker in self.workers:
            worker.kill()

    def last_words(self, i: int) -> None:
        """Waits (a little) for worker i's output to be copied to its end."""
        for thread in self.threads[2 * i : 2 * i + 2]:
            thread.join(timeout=5)

    def join(self, seconds: float = 5) -> None:
        """Waits for the output of exited workers to be copied."""
        deadline = time.monotonic() + seconds
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def stop(self, say) -> None:
        """SIGINT to the workers still running, then SIGKILL to those still running 5 s later.

        SIGINT, not SIGTERM: once a worker has joined the cluster, TensorFlow's own
        SIGTERM handler (a preemption notice for the coordination service) only records
        the signal, so outside tfdp's training loop SIGTERM does nothing.
        """
        running = self.running()
        say(f"stopping worker(s) {', '.join(str(w.index) for w in running)}")
        for worker in running:
            worker.send_signal(signal.SIGINT)
        self.wait_or_kill(5, say)

    def wait_or_kill(self, seconds: float, say) -> None:
        deadline = time.monotonic() + seconds
        for worker in self.workers:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{worker.describe()} did not stop; killing it")
                worker.kill()


def copy_lines(source, sink, prefix: str, lock: threading.Lock, seen=None) -> None:
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


def _die_with_parent() -> None:
    """In the worker, before exec: SIGKILL when the launcher dies, so no worker is left behind."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
