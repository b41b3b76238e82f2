"""tfdp-launch's supervisor: starts the cluster, watches it, starts it again with new members.

A cluster of TensorFlow workers cannot change its size while it runs, so every
change of members is a new start of every worker (a new TF_CONFIG, new ports)
from the run's model_dir, where the run resumes exactly at its last saved step:

- a worker exits abnormally (killed, or it lost the cluster): the others stop
  with it (they cannot finish the step whose all-reduce failed), and the run
  resumes from its latest checkpoint: at most `--checkpoint_every` steps are
  trained again;
- discovery offers other members: every worker gets SIGINT, they agree on a
  step, save it and exit (as on SIGTERM), and the run resumes from that step:
  no trained step is lost.

The global batch stays what it was; the new members' shares are the run's
powers (measured again with `powers=auto`). Each start has the cluster's
history in TFDP_MEMBERSHIP, and the chief adds to it the step the start
resumed from and the seconds from the change to its first trained step
(run/hooks/membership.py).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections import Counter
from typing import Callable

from tfdp.cluster.hosts import Discovery, Health, members
from tfdp.cluster.workers import LOST_CLUSTER, MEMBERSHIP, Cluster, retryable, status_text


@dataclasses.dataclass
class Policy:
    """When the supervisor starts the cluster again, and how long it waits."""

    min_workers: int = 1
    max_workers: int | None = None
    max_restarts: int = 0  # restarts after failures; discovery's changes are not counted
    wait_seconds: float = 600.0  # below min_workers: how long to wait for discovery
    cooldown_seconds: float = 60.0  # a host that failed twice is left out this long
    grace_seconds: float = 30.0  # after a failure: how long the others may take to stop
    discovering: bool = False  # a discovery command (not a fixed number of workers)


@dataclasses.dataclass
class Outcome:
    """How one start of the cluster ended.

    kind: "done" (every worker succeeded), "stopped" (a signal to the launcher),
    "ended" (a failure a restart would repeat), "failed" (a restart may pass it),
    "changed" (discovery offers other members), "port" (a port was taken).
    """

    kind: str
    status: int = 0
    cause: str = ""
    host: str | None = None  # the host of the worker that failed, when known
    at: float = 0.0  # when the supervisor saw it (time.time())


def describe_hosts(hosts) -> str:
    """ "localhost x2, node1": the members, by host."""
    counts = Counter(hosts)
    return ", ".join(f"{h} x{n}" if n > 1 else h for h, n in counts.items()) or "none"


class Supervisor:
    """Runs the cluster to its end, through failures and changes of members.

    start(hosts, env): starts worker i on hosts[i], each with the variables `env`
    (a `workers.Cluster`). received: the signals the launcher caught (SIGTERM,
    SIGINT), appended by its handler.
    """

    def __init__(
        self,
        policy: Policy,
        discovery: Discovery,
        start: Callable[[list[str], dict], Cluster],
        say: Callable[[str], None],
        received: list,
    ):
        self.policy, self.discovery, self.start = policy, discovery, start
        self.say, self.received = say, received
        self.health = Health(policy.cooldown_seconds)
        self.changes: list[dict] = []

    def run(self) -> int:
        """The launcher's exit status: 0 when the run finished."""
        policy, failures, port_retry = self.policy, 0, True
        cause, at = "start", time.time()
        while True:
            hosts = self.wait_for_members()
            if isinstance(hosts, int):
                return hosts
            restart = len(self.changes)
            self.changes.append({"restart": restart, "at": at, "cause": cause, "members": hosts})
            if restart:
                self.say(
                    f"restart {restart}, after {cause}: starting {len(hosts)} worker(s) "
                    f"({describe_hosts(hosts)})"
                )
            elastic = policy.discovering or policy.max_restarts
            cluster = self.start(hosts, {MEMBERSHIP: json.dumps(self.changes)} if elastic else {})
            restarting = failures < policy.max_restarts
            outcome = self.watch(cluster, hosts, port_retry, restarting)
            if outcome.kind in ("done", "stopped", "ended"):
                return outcome.status
            if outcome.kind == "port":  # not a change of members: the same start again, once
                port_retry = False
                self.changes.pop()
                continue
            if outcome.kind == "failed":
                failures += 1
                if outcome.host is not None:
                    seconds = self.health.failed(outcome.host)
                    if seconds:
                        self.say(
                            f"{outcome.host} has failed {self.health.failures[outcome.host]} "
                            f"times: left out for {seconds:g} s"
                        )
                if failures > policy.max_restarts:
                    if policy.max_restarts or policy.discovering:
                        self.say(
                            f"error: {outcome.cause}; not restarted: failure {failures}, and "
                            f"--max_restarts={policy.max_restarts}; the latest checkpoint stands"
                        )
                    return outcome.status
            cause, at, port_retry = outcome.cause, outcome.at, True
            self.discovery.ask()  # the members offered now, not a few seconds ago

    def wait_for_members(self) -> list[str] | int:
        """The members of the next start, once discovery offers at least min_workers;
        an exit status when it does not within wait_seconds, or a signal came."""
        policy, deadline = self.policy, None
        while True:
            if self.received:
                signum = self.received[0]
                self.say(f"{signal.Signals(signum).name} received while waiting for workers")
                return 128 + signum
            offered, error = self.discovery.latest()
            hosts = members(offered, policy.max_workers, self.health)
            if len(hosts) >= policy.min_workers:
                return hosts
            now = time.monotonic()
            if deadline is None:
                deadline = now + policy.wait_seconds
                self.say(
                    f"waiting for workers: discovery offers {len(hosts)}, and "
                    f"--min_workers={policy.min_workers}; waiting up to "
                    f"{policy.wait_seconds:g} s (--wait_seconds)"
                    + (f"; discovery: {error}" if error else "")
                )
            if now > deadline:
                self.say(
                    f"error: discovery offered fewer than --min_workers={policy.min_workers} "
                    f"workers for {policy.wait_seconds:g} s (--wait_seconds="
                    f"{policy.wait_seconds:g}); last offered: {describe_hosts(hosts)}"
                    + (f"; discovery: {error}" if error else "")
                    + "; the latest checkpoint stands"
                )
                return 1
            time.sleep(0.2)

    def offers_change(self, hosts: list[str]) -> str | None:
        """What discovery offers now, when it would make other members than `hosts`."""
        if not self.policy.discovering:
            return None
        offered, _ = self.discovery.latest()
        wanted = members(offered, self.policy.max_workers, self.health)
        if len(wanted) < self.policy.min_workers or Counter(wanted) == Counter(hosts):
            return None
        return describe_hosts(host for host, slots in offered for _ in range(slots))

    def watch(
        self, cluster: Cluster, hosts: list[str], port_retry: bool, restarting: bool
    ) -> Outcome:
        """Waits for one start of the cluster to end, and says how it did.

        restarting: a failure now would be restarted. Then a worker that died takes the
        others with it at once: they cannot finish the step whose all-reduce lost it, and
        a kill leaves the checkpoints whole (checkpoints.Checkpointer).
        """
        grace = self.policy.grace_seconds
        mode, outcome, deadline = None, None, None  # mode: failing, ending, changing, signal
        while True:
            codes = cluster.codes()
            now = time.monotonic()
            if self.received and mode != "signal":
                signum = self.received[0]
                self.say(
                    f"{signal.Signals(signum).name} received; passing it to the workers, "
                    f"which are killed if still running in {grace:g} s"
                )
                cluster.send_signal(signum)
                status = outcome.status if mode in ("failing", "ending") else 128 + signum
                mode, deadline = "signal", now + grace
                outcome = Outcome("stopped", status)
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if mode is None and failed:
                i, code = next(((i, c) for i, c in failed if c != LOST_CLUSTER), failed[0])
                cluster.last_words(i)
                if port_retry and cluster.port_taken[i]:
                    self.say(
                        f"worker {i} could not listen on its port, taken since it was chosen; "
                        "starting the workers again on new ports"
                    )
                    cluster.kill()
                    cluster.join()
                    return Outcome("port")
                worker = cluster.workers[i]
                cause = f"{worker.describe()} failed ({status_text(code)})"
                if restarting and retryable(code) and code != LOST_CLUSTER:
                    self.say(f"{cause}; stopping the others, to start again")
                    cluster.kill()
                    cluster.join()
                    return Outcome(
                        "failed", 128 - code if code < 0 else code, cause, worker.host, time.time()
                    )
                self.say(
                    cause
                    + (
                        f"; the others are stopped if still running in {grace:g} s"
                        if None in codes
                        else ""
                    )
                )
                mode = "failing" if retryable(code) else "ending"
                outcome = Outcome(
                    "failed" if retryable(code) else "ended",
                    128 - code if code < 0 else code,
                    cause,
                    worker.host if code != LOST_CLUSTER else None,
                    time.time(),
                )
                deadline = now + grace
            elif mode is None and None in codes:
                offered = self.offers_change(hosts)
                if offered is not None:
                    self.say(
                        f"discovery offers {offered}: the workers save their step and stop, "
                        "to start again with the new members"
                    )
                    cluster.send_signal(signal.SIGINT)
                    mode, deadline = "changing", now + grace
                    outcome = Outcome(
                        "changed", cause=f"discovery offered {offered}", at=time.time()
                    )
            elif mode == "failing" and outcome.host is None:
                # it began with a worker that lost the cluster: blame one that failed otherwise
                culprit = next((i for i, c in failed if c != LOST_CLUSTER), None)
                if culprit is not None:
                    worker, code = cluster.workers[culprit], codes[culprit]
                    outcome.host = worker.host
                    outcome.cause = f"{worker.describe()} failed ({status_text(code)})"
                    outcome.status = 128 - code if code < 0 else code
                    if not retryable(code):
                        mode, outcome.kind = "ending", "ended"
            if None not in codes:
                if mode in (None, "changing") and not failed:
                    cluster.join()
                    return Outcome("done", 0)
                break
            if deadline is not None and now > deadline:
                if mode == "failing" and outcome.host is None:  # the others lost it: frozen
                    frozen = cluster.running()[0]
                    outcome.host = frozen.host
                    outcome.cause = f"{frozen.describe()} stopped responding"
                if mode == "signal":
                    cluster.wait_or_kill(0, self.say)
                else:
                    cluster.stop(self.say)
                break
            time.sleep(0.1)
        cluster.join()
        return outcome
