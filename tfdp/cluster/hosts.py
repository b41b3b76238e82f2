"""The hosts a cluster may run on: what discovery offers, and the hosts left out a while.

A discovery command prints the hosts available now, one per line, `HOST` (one
worker) or `HOST:SLOTS` (as Horovod's host discovery script). The supervisor
runs it every few seconds (`Discovery`) and takes the workers from its latest
answer (`members`), less the hosts that failed again and again (`Health`).
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time

LOCAL_NAMES = ("localhost", "127.0.0.1")
DISCOVERY_TIMEOUT = 30.0  # seconds a discovery command may take


class DiscoveryError(ValueError):
    """A discovery command that failed, or printed a line that names no host."""


def is_local(host: str) -> bool:
    """Whether `host` names this machine (its workers start here, not over ssh)."""
    return host in LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """[(host, slots)] from discovery's output, in its order; a host named twice adds up.
    Blank lines and lines starting with # are skipped. Raises DiscoveryError naming a bad line."""
    offered: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        host, colon, slots = line.rpartition(":")
        if not colon:
            host, slots = line, "1"
        if not host or any(c.isspace() for c in host) or not slots.isdigit():
            raise DiscoveryError(
                f"line {number}, {line!r}: expected HOST or HOST:SLOTS, SLOTS a count"
            )
        count = int(slots)
        offered[host] = offered.get(host, 0) + count
    return [(host, slots) for host, slots in offered.items() if slots]


def run_discovery(command: str) -> list[tuple[str, int]]:
    """What `command` (a shell command) offers now. Raises DiscoveryError."""
    try:
        done = subprocess.run(
            command, shell=True, capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"gave no answer in {DISCOVERY_TIMEOUT:g} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise DiscoveryError(f"exit status {done.returncode}" + (f": {last}" if last else ""))
    return parse_hosts(done.stdout)


class Discovery:
    """The latest answer of a discovery command, run every `every` seconds in a thread;
    or a fixed offer (`static`), for a cluster of a fixed size.

    local_only: other hosts are left out (workers in an isolated network cannot reach
    them), each said once through `say`; `dropped` holds them. local_slots: at most this
    many workers on this machine (its GPUs' share), said once through `say`.
    """

    def __init__(
        self,
        command: str | None = None,
        every: float = 5.0,
        local_only=False,
        say=None,
        static=None,
        local_slots: int | None = None,
    ):
        self.command, self.every = command, every
        self.local_only, self.say, self.local_slots = local_only, say, local_slots
        self.capped = False
        self.dropped: set[str] = set()
        self.offered = list(static or [])
        self.error: str | None = None
        self.answers = 0  # discovery's answers so far (a fixed offer: one)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        if command is None:
            self.answers = 1
            return
        self.ask()
        threading.Thread(target=self._poll, daemon=True).start()

    def ask(self) -> None:
        """Runs the command once, now (a fixed offer stays as it is)."""
        if self.command is None:
            return
        try:
            offered, error = run_discovery(self.command), None
        except DiscoveryError as failed:
            offered, error = None, str(failed)
        if offered is not None and self.local_only:
            for host, _ in offered:
                if not is_local(host) and host not in self.dropped:
                    self.dropped.add(host)
                    if self.say is not None and self.answers:
                        self.say(
                            f"warning: discovery offers {host}, left out: workers in an "
                            "isolated network cannot reach other hosts (--network=host)"
                        )
            offered = [(host, slots) for host, slots in offered if is_local(host)]
        if offered is not None and self.local_slots is not None:
            offered = self._cap(offered)
        with self._lock:
            if offered is not None:
                self.offered = offered
            self.error = error
            self.answers += 1

    def _cap(self, offered):
        """`offered` with at most local_slots workers on this machine."""
        capped, left = [], self.local_slots
        for host, slots in offered:
            if is_local(host):
                if slots > left and not self.capped and self.say is not None:
                    self.capped = True
                    self.say(
                        f"warning: discovery offers {host}:{slots}; this machine's GPUs "
                        f"make room for {self.local_slots} worker(s) (--gpus_per_worker)"
                    )
                slots, left = min(slots, left), left - min(slots, left)
            if slots:
                capped.append((host, slots))
        return capped

    def latest(self) -> tuple[list[tuple[str, int]], str | None]:
        """(the hosts offered by the last answer that worked, the last answer's error)."""
        with self._lock:
            return list(self.offered), self.error

    def _poll(self) -> None:
        while not self._stopped.wait(self.every):
            self.ask()

    def close(self) -> None:
        self._stopped.set()


class Health:
    """Hosts whose workers failed: a host is left out after its second failure, for
    `cooldown` seconds, twice as long after each further one (up to an hour)."""

    def __init__(self, cooldown: float):
        self.cooldown = cooldown
        self.failures: dict[str, int] = {}
        self.out_until: dict[str, float] = {}

    def failed(self, host: str, now: float | None = None) -> float:
        """Counts a failure of `host`; the seconds it is now left out for (0: none)."""
        now = time.monotonic() if now is None else now
        count = self.failures[host] = self.failures.get(host, 0) + 1
        if count < 2:
            return 0.0
        seconds = min(self.cooldown * 2 ** (count - 2), 3600.0)
        self.out_until[host] = now + seconds
        return seconds

    def left_out(self, host: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.out_until.get(host, 0.0) > now


def members(offered, max_workers: int | None, health: Health | None = None, now=None) -> list[str]:
    """The workers to start: one host name per worker, slots taken in discovery's order,
    at most `max_workers`, without the hosts `health` leaves out."""
    chosen = []
    for host, slots in offered:
        if health is not None and health.left_out(host, now):
            continue
        chosen.extend([host] * slots)
    return chosen if max_workers is None else chosen[:max_workers]
