"""`tfdp-launch`: a multi-worker cluster, one process per worker, supervised.

  tfdp-launch --workers=2 --model=toy --batch_size=256 --powers=1,3

starts `tfdp --mode=multiworker [flags]` N times on this machine, each with a
TF_CONFIG that names the same cluster of free loopback ports and its own task
index. Every output line is prefixed `[worker i] `.

  tfdp-launch --workers=2 -- python3 train.py --epochs=3

starts the command after `--` N times instead, with the same TF_CONFIG: a
script of your own that makes `tfdp.MultiWorkerMirroredStrategy(powers=...)`
(or TensorFlow's) finds its cluster there.

  tfdp-launch --discover='cat hosts.txt' --min_workers=1 --max_workers=4 \
      --network=host --model_dir=/shared/run ...

is elastic: the workers are the hosts the discovery command prints now, one
per line, `HOST` or `HOST:SLOTS` (run every `--discover_every` seconds).
Workers on this machine (localhost, 127.0.0.1, its name) start as above;
workers on other hosts start over `--ssh` (elastic.py and the guide say what
a host needs). When a worker exits abnormally, or discovery offers other
members, the cluster starts again with the members offered then, and the run
resumes from its model_dir: the same run, with the same global batch.

Network: TensorFlow's gRPC server listens on all interfaces without any
authentication, and whoever reaches a worker's port can run code in it. With
`--network=isolated` (the default where Linux allows it) the launcher and its
workers run in a network namespace of their own that has only loopback, so
that no other host can reach their ports; they cannot reach the network
either (nor can a discovery command). Where that is refused, the launcher
says so on one line and the workers run on this machine's network; an
explicit `--network=isolated` is then an error. `--network=host` runs them on
this machine's network, as workers on other hosts need, or workers that
download their data: their ports are then reachable from other hosts, so run
it only on a private network.

Exit status: 0 when every worker succeeds; otherwise that of the failure that
ended the run (128 + N for a worker killed by signal N), and the others are
stopped (SIGINT, then SIGKILL 5 s later) if they have not exited within
`--grace_seconds`. A worker killed by a signal, or one that lost the cluster
(status 138), is started again with the others up to `--max_restarts` times
(default 0; 3 with --discover); a status from 1 to 127 (a bad flag, bad data)
ends the run. SIGTERM or Ctrl-C (SIGINT) to the launcher is passed on once to
every running worker (which saves a checkpoint and exits); workers still
running `--grace_seconds` later are killed, and the status is 128 + the
signal's number (143, 130) unless a worker had failed before. A bad flag, or
an explicit `--network=isolated` that cannot be had, exits with status 2.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import threading

from tfdp.cluster.elastic import Policy, Supervisor
from tfdp.cluster.hosts import Discovery
from tfdp.cluster.network import isolate_network
from tfdp.cluster.workers import Cluster, Ssh

USAGE = (
    "usage: tfdp-launch [--workers=N | --discover=COMMAND [--min_workers=N] [--max_workers=N]] "
    "[--max_restarts=N] [--gpus_per_worker=K] [--grace_seconds=S] [--network=isolated|host] "
    "[tfdp flags | -- COMMAND [ARG ...]]"
)
DEFAULT_WORKERS = 2
DEFAULT_GRACE_SECONDS = 30.0  # longer than TensorFlow's heartbeat timeout (about 10 s)
DEFAULT_ELASTIC_RESTARTS = 3
DEFAULT_SSH = "ssh -o BatchMode=yes"
NETWORKS = ("isolated", "host")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class UsageError(ValueError):
    """A bad tfdp-launch flag: `flag` as given, and what is wrong with it."""

    def __init__(self, flag: str, reason: str):
        self.flag, self.reason = flag, reason
        super().__init__(f"{flag}: {reason}")


@dataclasses.dataclass
class Settings:
    """tfdp-launch's own flags; `flags`: the rest, for tfdp."""

    workers: int = DEFAULT_WORKERS
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    network: str | None = None  # None: isolated where Linux allows it
    gpus_per_worker: int | None = None  # None: CUDA_VISIBLE_DEVICES left as it is
    discover: str | None = None
    discover_every: float = 5.0
    min_workers: int = 1
    max_workers: int | None = None
    max_restarts: int | None = None  # None: 3 with --discover, else 0
    wait_seconds: float = 600.0
    cooldown_seconds: float = 60.0
    ssh: str = DEFAULT_SSH
    flags: list[str] = dataclasses.field(default_factory=list)

    def policy(self) -> Policy:
        restarts = self.max_restarts
        if restarts is None:
            restarts = DEFAULT_ELASTIC_RESTARTS if self.discover else 0
        fixed = self.discover is None
        return Policy(
            min_workers=self.workers if fixed else self.min_workers,
            max_workers=self.workers if fixed else self.max_workers,
            max_restarts=restarts,
            wait_seconds=self.wait_seconds,
            cooldown_seconds=self.cooldown_seconds,
            grace_seconds=self.grace_seconds,
            discovering=not fixed,
        )


def _count(arg: str, value: str, least: int, what: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        kind = "a positive integer" if least == 1 else f"an integer, {least} or more"
        raise UsageError(arg, f"must be {kind}{what}")
    return number


def _seconds(arg: str, value: str, least: float = 0.0) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not least <= seconds < float("inf"):
        raise UsageError(arg, f"must be a number of seconds, {least:g} or more")
    return seconds


ELASTIC_ONLY = ("--min_workers", "--max_workers", "--discover_every", "--wait_seconds")


def parse_args(argv: list[str]) -> Settings:
    """tfdp-launch's flags (raises UsageError naming a bad one)."""
    settings, given = Settings(), set()
    for arg in argv:
        name, _, value = arg.partition("=")
        given.add(name)
        if name == "--gpus_per_worker":
            settings.gpus_per_worker = _count(arg, value, 1, ": the GPUs each worker gets")
        elif name == "--workers":
            settings.workers = _count(arg, value, 1, "; each worker is one process")
        elif name == "--min_workers":
            settings.min_workers = _count(arg, value, 1, "")
        elif name == "--max_workers":
            settings.max_workers = _count(arg, value, 1, "")
        elif name == "--max_restarts":
            settings.max_restarts = _count(arg, value, 0, "")
        elif name == "--grace_seconds":
            settings.grace_seconds = _seconds(arg, value)
        elif name == "--discover_every":
            settings.discover_every = _seconds(arg, value, 0.1)
        elif name == "--wait_seconds":
            settings.wait_seconds = _seconds(arg, value)
        elif name == "--cooldown_seconds":
            settings.cooldown_seconds = _seconds(arg, value)
        elif name == "--discover":
            if not value.strip():
                raise UsageError(arg, "needs a command that prints HOST or HOST:SLOTS lines")
            settings.discover = value
        elif name == "--ssh":
            if not shlex.split(value):
                raise UsageError(arg, "needs a command, e.g. --ssh='ssh -p 2222'")
            settings.ssh = value
        elif name == "--network":
            if value not in NETWORKS:
                raise UsageError(arg, f"must be one of {', '.join(NETWORKS)}")
            settings.network = value
        elif name == "--mode" and value != "multiworker":
            raise UsageError(arg, "tfdp-launch runs mode multiworker")
        elif not arg.startswith("-"):
            raise UsageError(arg, "unexpected argument; flags take the form --name=value")
        else:
            given.discard(name)
            settings.flags.append(arg)
    if settings.discover is None:
        for name in ELASTIC_ONLY:
            if name in given:
                raise UsageError(_given(argv, name), "needs --discover (the hosts to run on)")
    elif "--workers" in given:
        raise UsageError(
            _given(argv, "--workers"), "with --discover, discovery says how many (--max_workers)"
        )
    if settings.max_workers is not None and settings.max_workers < settings.min_workers:
        raise UsageError(
            _given(argv, "--max_workers"),
            f"is less than --min_workers={settings.min_workers}",
        )
    if not any(arg.startswith("--mode=") for arg in settings.flags):
        settings.flags.insert(0, "--mode=multiworker")
    return settings


def _given(argv: list[str], name: str) -> str:
    return next(arg for arg in argv if arg.partition("=")[0] == name)


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
        raise UsageError(
            extra[0], "is a tfdp flag; with -- COMMAND, give the command its own arguments"
        )


def check_resumable(settings: Settings) -> None:
    """UsageError for tfdp workers that may be started again without a --model_dir to
    resume from, or with powers for a number of workers that discovery may change."""
    powers = [flag for flag in settings.flags if flag.startswith("--powers=")]
    if settings.discover and powers and powers[-1] != "--powers=auto":
        raise UsageError(
            powers[-1],
            "gives each worker a power, and discovery changes the workers; --powers=auto "
            "measures them at every start (or leave it out: even shares)",
        )
    restarts = settings.policy().max_restarts
    if (settings.discover or restarts) and not any(
        flag.startswith("--model_dir=") and flag != "--model_dir=" for flag in settings.flags
    ):
        given = (
            f"--discover={settings.discover}" if settings.discover else f"--max_restarts={restarts}"
        )
        raise UsageError(
            given, "needs --model_dir, where the workers started again resume the run from"
        )


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


def launch(
    workers: int,
    flags: list[str],
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    gpus_per_worker: int | None = None,
    gpus: list[str] | None = None,
    command: list[str] | None = None,
) -> int:
    """`workers` workers on this machine, run to their end: `supervise` with a fixed
    cluster that is not started again (as `tfdp-launch --workers=N`)."""
    settings = Settings(
        workers=workers, grace_seconds=grace_seconds, gpus_per_worker=gpus_per_worker, flags=flags
    )
    return supervise(settings, gpus, command)


def supervise(settings: Settings, gpus=None, command: list[str] | None = None) -> int:
    """Runs the cluster (of `command`, else of the tfdp command with the settings' flags)
    to its end, through restarts (`elastic.Supervisor`). Returns 0, the status of the
    failure that ended it (128 + N for a worker killed by signal N), or 128 + N when
    signal N (SIGTERM, SIGINT) stopped it.

    gpus: the GPUs the workers on this machine share (`visible_gpus`).

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

    worker_command = command or [sys.executable, "-m", "tfdp", *settings.flags]
    ssh = Ssh(shlex.split(settings.ssh))

    def start(hosts, env):
        return Cluster(hosts, worker_command, lock, env, ssh, settings.gpus_per_worker, gpus)

    if settings.discover is None:
        discovery = Discovery(static=[("localhost", settings.workers)])
    else:
        isolated = settings.network == "isolated"
        per_worker = settings.gpus_per_worker
        room = len(gpus) // per_worker if per_worker and gpus is not None else None
        discovery = Discovery(
            settings.discover, settings.discover_every, isolated, say, local_slots=room
        )
        first, error = discovery.latest()
        if error or discovery.dropped:
            discovery.close()
            reason = error or (
                f"offers {', '.join(sorted(discovery.dropped))}, which workers in an isolated "
                "network cannot reach; --network=host runs them on this machine's network"
            )
            say(f"error: --discover={settings.discover}: {reason}")
            return 2
    try:
        return Supervisor(settings.policy(), discovery, start, say, received).run()
    finally:
        discovery.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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
  --workers=N         processes to start on this machine, one worker each (default {DEFAULT_WORKERS})
  --max_restarts=N    start the workers again after a worker is killed or loses the
                      cluster, up to N times (default 0; {DEFAULT_ELASTIC_RESTARTS} with --discover);
                      the run resumes from its --model_dir
  --grace_seconds=S   after a worker fails, how long the others may take to stop
                      before they are interrupted, then killed (default {DEFAULT_GRACE_SECONDS:g})
  tfdp flags          every other flag goes to each worker's tfdp --mode=multiworker
                      (tfdp --help lists them)"""
ELASTIC_HELP = f"""\
  --discover=COMMAND  elastic: a shell command that prints the hosts available now,
                      one per line, HOST or HOST:SLOTS (localhost:2 is two workers
                      here); the cluster starts again when what it offers changes
  --discover_every=S  seconds between two runs of the command (default 5)
  --min_workers=N     fewer offered: wait for discovery (default 1)
  --max_workers=N     the most workers to start (default: every slot offered)
  --wait_seconds=S    how long to wait below --min_workers before giving up (default 600)
  --cooldown_seconds=S a host whose workers failed twice is left out S seconds, twice
                      as long after each further failure (default 60)
  --ssh=COMMAND       how to start a worker on another host (default '{DEFAULT_SSH}');
                      needs --network=host"""


def run() -> None:
    """Console-script entry point."""
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        helps = (USAGE, LAUNCH_HELP, ELASTIC_HELP, NETWORK_HELP, GPUS_HELP)
        print(__doc__.strip() + "\n\n" + "\n".join(helps))
        return
    gpus = None
    argv, command = split_command(sys.argv[1:])
    try:
        settings = parse_args(argv)
        if command is not None:
            check_command(command, settings.flags)
        else:
            check_resumable(settings)
        if settings.gpus_per_worker:
            gpus = visible_gpus(os.environ)
            if settings.discover is None:
                check_gpus(settings.workers, settings.gpus_per_worker, gpus)
    except UsageError as error:
        print(f"tfdp-launch: error: {error}", file=sys.stderr)
        sys.exit(2)
    per_worker = settings.gpus_per_worker
    if per_worker and gpus is None:
        print(
            "tfdp-launch: note: cannot count the GPUs here (no CUDA_VISIBLE_DEVICES, no "
            f"nvidia-smi); giving worker i GPUs i*{per_worker} .. "
            f"i*{per_worker}+{per_worker - 1} as asked",
            file=sys.stderr,
            flush=True,
        )
    network = settings.network
    if network != "host":
        try:
            isolate_network()
            settings.network = "isolated"
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
    sys.exit(supervise(settings, gpus, command))


if __name__ == "__main__":
    run()
