"""The cluster of a multi-worker run: where it comes from, joining it, telling a lost peer apart.

The cluster comes from TF_CONFIG (as tfdp-launch and Kubernetes' TFJob set it for
each worker) or from the variables srun sets for each task of a Slurm step
(`slurm_cluster`: one worker per task); `find_cluster` picks the source and
writes a Slurm cluster to TF_CONFIG, so every later step reads one form.

Every worker runs `tfdp.MultiWorkerMirroredStrategy` (engine/multiworker.py).
Only the chief (task `chief`, else `worker:0`) writes the model directory.
A worker that dies makes the others stop with an error: a closed connection
fails the next all-reduce at once, and TensorFlow's coordination service
aborts the collectives of every worker when one stops sending heartbeats
(about 10 s). `collective_timeout` (off by default) also bounds each
all-reduce, for a worker that is alive but never joins.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from tfdp import internals
from tfdp.errors import ConfigError

TF_CONFIG = "TF_CONFIG"
TF_CONFIG_EXAMPLE = (
    '{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}'
)
JOBS = ("chief", "worker")  # in input-pipeline order: the chief, if any, is worker 0
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):\d{1,5}$")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The cluster of TF_CONFIG, and which of its workers this process is.

    Attributes:
        workers: task names in input-pipeline order, e.g. ("worker:0", "worker:1").
        addresses: host:port of each worker, in the same order.
        task: this process's task name.
    """

    workers: tuple[str, ...]
    addresses: tuple[str, ...]
    task: str
    source: str = "tf_config"  # or "slurm"

    @property
    def index(self) -> int:
        """This worker's position in `workers`: its input pipeline and batch share."""
        return self.workers.index(self.task)

    @property
    def is_chief(self) -> bool:
        return self.index == 0

    def tf_config(self) -> str:
        """This worker's TF_CONFIG: the cluster, and its own place in it."""
        jobs: dict[str, list[str]] = {}
        for worker, address in zip(self.workers, self.addresses):
            jobs.setdefault(worker.split(":")[0], []).append(address)
        kind, index = self.task.split(":")
        return json.dumps({"cluster": jobs, "task": {"type": kind, "index": int(index)}})


def _is_address(address) -> bool:
    return (
        isinstance(address, str)
        and bool(_ADDRESS.match(address))
        and 1 <= int(address.rpartition(":")[2]) <= 65535
    )


def read_cluster(text: str | None = None) -> Cluster:
    """Parses and checks TF_CONFIG (default: the environment's); raises ConfigError."""
    text = os.environ.get(TF_CONFIG, "") if text is None else text
    if not text.strip():
        raise ConfigError(
            TF_CONFIG,
            text,
            "is not set; mode multiworker reads the cluster and this worker's task from it, "
            f"e.g. TF_CONFIG='{TF_CONFIG_EXAMPLE}' (tfdp-launch sets it for local workers)",
        )

    def bad(reason):
        return ConfigError(TF_CONFIG, text, reason)

    try:
        spec = json.loads(text)
    except ValueError as error:
        raise bad(f"is not valid JSON ({error})") from None
    if not isinstance(spec, dict):
        raise bad('must be a JSON object with "cluster" and "task"')
    cluster, task = spec.get("cluster"), spec.get("task")
    if not isinstance(cluster, dict) or not cluster.get("worker") and not cluster.get("chief"):
        raise bad('needs "cluster" with a "worker" list of host:port addresses')
    others = sorted(set(cluster) - set(JOBS))
    if others:
        raise bad(f"has jobs {', '.join(others)}; mode multiworker runs chief and worker tasks")
    for job, addresses in cluster.items():
        if not isinstance(addresses, list):
            raise bad(f'job "{job}" must be a list of host:port addresses')
        for address in addresses:
            if not _is_address(address):
                raise bad(
                    f'job "{job}" must be a list of host:port addresses (ports 1 to 65535), '
                    f"not {address!r}"
                )
    if len(cluster.get("chief", [])) > 1:
        raise bad(f"has {len(cluster['chief'])} chiefs; a cluster has at most one")
    workers = [f"{job}:{i}" for job in JOBS for i in range(len(cluster.get(job, [])))]
    addresses = [a for job in JOBS for a in cluster.get(job, [])]
    repeated = sorted({a for a in addresses if addresses.count(a) > 1})
    if repeated:
        raise bad(f"gives {', '.join(repeated)} to more than one task")
    if not isinstance(task, dict):
        raise bad('needs "task": {"type": "worker", "index": i}, this process\'s place')
    kind, index = task.get("type"), task.get("index")
    if kind not in JOBS or isinstance(index, bool) or not isinstance(index, int):
        raise bad(f'"task" must name a type among {", ".join(JOBS)} and an integer index')
    if f"{kind}:{index}" not in workers:
        raise bad(f"task {kind}:{index} is not in the cluster ({', '.join(workers)})")
    return Cluster(tuple(workers), tuple(addresses), f"{kind}:{index}")


# What srun sets for every task of a step: its rank, and the step's tasks and nodes.
SLURM_STEP = (
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
)
SLURM_EXAMPLE = "srun --ntasks-per-node=1 tfdp --mode=multiworker ..."


def in_slurm_step(environ=None) -> bool:
    """Whether this process is a task that srun started (its rank is set)."""
    return "SLURM_PROCID" in (os.environ if environ is None else environ)


def find_cluster(config, environ=None) -> Cluster:
    """This worker's cluster, from `config.cluster`'s source; raises ConfigError.

    A Slurm step's cluster is written to TF_CONFIG (and each task's GPUs to
    CUDA_VISIBLE_DEVICES where its node's tasks share them), before TensorFlow
    starts: MultiWorkerMirroredStrategy and every later step read it there.
    """
    environ = os.environ if environ is None else environ
    source = config.cluster
    if source == "auto":
        if environ.get(TF_CONFIG, "").strip():
            source = "tf_config"
        elif in_slurm_step(environ):
            source = "slurm"
        else:
            raise ConfigError(
                "cluster",
                "auto",
                "found neither TF_CONFIG nor a Slurm step (SLURM_PROCID is not set); mode "
                f"multiworker needs one: TF_CONFIG='{TF_CONFIG_EXAMPLE}', or {SLURM_EXAMPLE}",
            )
    if source == "tf_config":
        return read_cluster(environ.get(TF_CONFIG, ""))
    cluster = slurm_cluster(config.slurm_port_base, environ)
    if not _joined:  # a joined cluster holds its own port
        check_port_free(cluster, config.slurm_port_base)
    gpus = slurm_gpus(environ, cluster)
    if gpus is not None:
        environ["CUDA_VISIBLE_DEVICES"] = gpus
    environ[TF_CONFIG] = cluster.tf_config()
    return cluster


def _slurm_int(environ, name: str, low: int = 0) -> int:
    text = environ[name]
    if not text.isdigit() or int(text) < low:
        raise ConfigError(name, text, f"must be an integer of at least {low}, as srun sets it")
    return int(text)


def slurm_cluster(port_base: int, environ=None) -> Cluster:
    """The cluster of this Slurm step: one worker per task, task r on the node Slurm put
    it on, ports counted from `port_base` on each node; raises ConfigError.

    Host lists and task counts are expanded by TensorFlow's SlurmClusterResolver's
    own functions. Tasks are placed in the node list's order, as Slurm's default
    (block) distribution places them; SlurmClusterResolver sorts the host names,
    which puts node10 before node2, and so gives a rank another node's address.
    """
    environ = os.environ if environ is None else environ
    missing = [name for name in SLURM_STEP if name not in environ]
    if missing == list(SLURM_STEP):
        raise ConfigError(
            "cluster",
            "slurm",
            "found no Slurm step here (SLURM_PROCID is not set); start every worker with "
            f"srun, e.g. {SLURM_EXAMPLE}",
        )
    if missing:
        where = (
            "a batch script's own shell is not a step: start tfdp with srun"
            if "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" not in environ
            else "srun sets them for every task of a step"
        )
        raise ConfigError(
            "cluster",
            "slurm",
            f"Slurm's variables are incomplete: {', '.join(missing)} unset; {where}",
        )
    expand_hostlist, expand_tasks_per_node = internals.slurm_lists()

    rank = _slurm_int(environ, "SLURM_PROCID")
    tasks = _slurm_int(environ, "SLURM_STEP_NUM_TASKS", low=1)
    nodelist, per_node_text = environ["SLURM_STEP_NODELIST"], environ["SLURM_STEP_TASKS_PER_NODE"]
    try:
        hosts = expand_hostlist(nodelist)
    except ValueError as error:
        raise ConfigError(
            "SLURM_STEP_NODELIST", nodelist, f"cannot be expanded ({error})"
        ) from None
    if not hosts or not all(hosts) or len(set(hosts)) < len(hosts):
        raise ConfigError(
            "SLURM_STEP_NODELIST", nodelist, f"expands to {hosts}, not distinct host names"
        )
    try:
        per_node = expand_tasks_per_node(per_node_text)
    except ValueError as error:
        raise ConfigError(
            "SLURM_STEP_TASKS_PER_NODE", per_node_text, f"cannot be expanded ({error})"
        ) from None
    if len(per_node) != len(hosts) or 0 in per_node:
        raise ConfigError(
            "SLURM_STEP_TASKS_PER_NODE",
            per_node_text,
            f"gives {len(per_node)} task counts {per_node} for the {len(hosts)} node(s) of "
            f"SLURM_STEP_NODELIST={nodelist}",
        )
    if sum(per_node) != tasks:
        raise ConfigError(
            "SLURM_STEP_NUM_TASKS",
            environ["SLURM_STEP_NUM_TASKS"],
            f"disagrees with SLURM_STEP_TASKS_PER_NODE={per_node_text} ({sum(per_node)} tasks)",
        )
    if rank >= tasks:
        raise ConfigError(
            "SLURM_PROCID", str(rank), f"is not a task of the step's {tasks} (0 to {tasks - 1})"
        )
    if port_base + max(per_node) - 1 > 65535:
        raise ConfigError(
            "slurm_port_base",
            port_base,
            f"leaves no port for task {max(per_node) - 1} of a node (ports end at 65535)",
        )
    placed = [(host, local) for host, count in zip(hosts, per_node) for local in range(count)]
    host, local = placed[rank]
    for name, expected in (("SLURMD_NODENAME", host), ("SLURM_LOCALID", str(local))):
        if name in environ and environ[name] != expected:
            raise ConfigError(
                name,
                environ[name],
                f"disagrees with the step's layout, which puts task {rank} on {host} as its "
                f"task {local} (SLURM_STEP_NODELIST={nodelist}, SLURM_STEP_TASKS_PER_NODE="
                f"{per_node_text}); tfdp needs srun's default block distribution",
            )
    workers = tuple(f"worker:{i}" for i in range(tasks))
    addresses = tuple(f"{h}:{port_base + i}" for h, i in placed)
    return Cluster(workers, addresses, f"worker:{rank}", source="slurm")


def slurm_gpus(environ, cluster: Cluster) -> str | None:
    """This task's CUDA_VISIBLE_DEVICES where the tasks of its node share the node's GPUs,
    else None (keep what Slurm set: a task's own GPUs, or none).

    Slurm gives each task its own GPUs with --gpus-per-task or --gpu-bind; with only
    --gres=gpu:N every task of a node sees all N, and task l of the node's k takes
    the l-th N/k of them, as SlurmClusterResolver's auto_set_gpu splits them.
    """
    visible = [g.strip() for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    host = cluster.addresses[cluster.index].rpartition(":")[0]
    node = [i for i, a in enumerate(cluster.addresses) if a.rpartition(":")[0] == host]
    own = "SLURM_GPUS_PER_TASK" in environ or "SLURM_GPU_BIND" in environ
    if not visible or len(node) == 1 or own:
        return None
    if len(visible) < len(node):
        raise ConfigError(
            "CUDA_VISIBLE_DEVICES",
            ",".join(visible),
            f"gives {len(visible)} GPU(s) to the {len(node)} tasks of {host}: give each task "
            "its own (srun --gpus-per-task=1) or start fewer tasks per node",
        )
    share, local = len(visible) // len(node), node.index(cluster.index)
    return ",".join(visible[local * share : (local + 1) * share])


def check_port_free(cluster: Cluster, port_base: int) -> None:
    """This task's port is free on this host; else a ConfigError naming --slurm_port_base."""
    import errno
    import socket

    address = cluster.addresses[cluster.index]
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("", int(address.rpartition(":")[2])))
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            raise
        raise ConfigError(
            "slurm_port_base",
            port_base,
            f"gives {cluster.task} the port of {address}, which another process uses; "
            "give a base whose ports are free on every node",
        ) from None
    finally:
        probe.close()


_joined = False  # this process has joined its cluster (`cluster_strategy.join_cluster`)


def mark_joined() -> None:
    """This process's server is up: it holds its own port from now on."""
    global _joined
    _joined = True


def is_cluster_error(error: BaseException) -> bool:
    """Whether `error` is TensorFlow's way of saying that a peer is gone or stuck."""
    import tensorflow as tf

    return isinstance(
        error,
        (
            tf.errors.UnavailableError,
            tf.errors.DeadlineExceededError,
            tf.errors.AbortedError,
            tf.errors.CancelledError,
            tf.errors.FailedPreconditionError,
        ),
    )


def describe_failure(error: BaseException, config) -> str:
    """One line for a worker that lost the cluster: what TensorFlow saw, and how to resume."""
    import tensorflow as tf

    message = getattr(error, "message", str(error))
    cause = message.split("aborted by:", 1)[-1]  # collectives name the cause after this
    lines = []
    for line in (line.strip() for line in cause.splitlines()):
        if line.startswith(("Additional GRPC", "The error could be", "The tasks have", "[[")):
            break  # TensorFlow's boilerplate after the cause
        if line and not line.startswith(("Graph execution error", "Detected at node", "File ")):
            lines.append(line)
    reason = " ".join(lines) or (message.strip().splitlines() or [""])[0]
    reason = reason if len(reason) <= 240 else reason[:237] + "..."
    text = (
        f"{read_cluster().task} lost the cluster, a worker died or stopped responding "
        f"({type(error).__name__}: {reason})"
    )
    latest = (
        tf.train.latest_checkpoint(os.path.join(config.model_dir, "checkpoints"))
        if config.model_dir
        else None
    )
    if latest:
        return f"{text}; restart every worker with the same flags to resume from {latest}"
    return f"{text}; no checkpoint was saved"
