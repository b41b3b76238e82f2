"""Where mode multiworker finds its cluster: TF_CONFIG (tfdp-launch, Kubernetes' TFJob) or
a Slurm step's variables, and the bad inputs of each.

The variables are those srun sets for each task of a step; the two-task run starts
both tasks on this host, over loopback, with the variables of a 2-task step here.
Everything else runs in this process: `cluster.slurm_cluster` on the variables, and
the command's checks (`helpers.refusal`) for the bad ones.
"""

import dataclasses
import json
import os
import socket
import sys

import numpy as np
import pytest
from helpers import environment, load_weights, refusal, result, run_together, train

from tfdp import Config
from tfdp.cluster.spec import find_cluster, read_cluster, slurm_cluster, slurm_gpus
from tfdp.errors import ConfigError


def step(rank, nodelist, tasks_per_node, tasks, host, local, **extra):
    """What srun sets for task `rank` of a step (the variables tfdp reads, and others)."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local),
        "SLURMD_NODENAME": host,
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_NTASKS": str(tasks),
        "SLURM_JOB_NODELIST": nodelist,
        **extra,
    }


# Two nodes of two tasks each, as `srun -N 2 --ntasks-per-node=2` numbers them.
FOUR_TASKS = [
    step(0, "node[01-02]", "2(x2)", 4, "node01", 0),
    step(1, "node[01-02]", "2(x2)", 4, "node01", 1),
    step(2, "node[01-02]", "2(x2)", 4, "node02", 0),
    step(3, "node[01-02]", "2(x2)", 4, "node02", 1),
]
FOUR_ADDRESSES = ("node01:9000", "node01:9001", "node02:9000", "node02:9001")


@pytest.mark.parametrize("rank", range(4))
def test_a_steps_cluster_is_the_one_tensorflows_resolver_finds(rank, monkeypatch):
    import tensorflow as tf

    variables = FOUR_TASKS[rank]
    cluster = slurm_cluster(9000, variables)
    assert cluster.addresses == FOUR_ADDRESSES
    assert cluster.workers == ("worker:0", "worker:1", "worker:2", "worker:3")
    assert cluster.task == f"worker:{rank}" and cluster.source == "slurm"
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    # gpus_* only to let it count tasks on a host without GPUs; it must not set any
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=9000, gpus_per_node=2, gpus_per_task=1, auto_set_gpu=False
    )
    assert resolver.cluster_spec().as_dict() == {"worker": list(FOUR_ADDRESSES)}
    assert resolver.get_task_info() == ("worker", rank)


def test_tasks_are_placed_in_the_node_lists_order():
    # Slurm's block distribution puts tasks 0 and 1 on node9 and node10, the node list's
    # order. (SlurmClusterResolver sorts the names: it would give task 0 node10's address.)
    tasks = [step(r, "node[9-10]", "1(x2)", 2, f"node{9 + r}", 0) for r in range(2)]
    for rank, variables in enumerate(tasks):
        cluster = slurm_cluster(8888, variables)
        assert cluster.addresses == ("node9:8888", "node10:8888")
        assert cluster.task == f"worker:{rank}"


def test_a_slurm_cluster_is_written_to_tf_config_and_read_back(monkeypatch):
    environ = dict(FOUR_TASKS[2])
    config = Config(mode="multiworker", cluster="slurm", slurm_port_base=9000)
    cluster = find_cluster(config, environ)
    assert json.loads(environ["TF_CONFIG"]) == {
        "cluster": {"worker": list(FOUR_ADDRESSES)},
        "task": {"type": "worker", "index": 2},
    }
    assert read_cluster(environ["TF_CONFIG"]) == read_cluster(cluster.tf_config())
    assert read_cluster(environ["TF_CONFIG"]).addresses == FOUR_ADDRESSES
    assert "CUDA_VISIBLE_DEVICES" not in environ  # no GPUs: nothing to set


def test_auto_takes_tf_config_first_then_slurm():
    tf_config = json.dumps(
        {
            "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
            "task": {"index": 1, "type": "worker"},
        }
    )
    auto = Config(mode="multiworker")
    both = dict(FOUR_TASKS[0], TF_CONFIG=tf_config)
    assert find_cluster(auto, both).addresses == ("127.0.0.1:2222", "127.0.0.1:2223")
    assert find_cluster(auto, dict(FOUR_TASKS[3])).task == "worker:3"
    with pytest.raises(ConfigError) as neither:
        find_cluster(auto, {})
    assert (neither.value.field, neither.value.value) == ("cluster", "auto")
    assert "found neither TF_CONFIG nor a Slurm step" in neither.value.reason
    explicit = Config(mode="multiworker", cluster="tf_config")
    with pytest.raises(ConfigError) as unset:
        find_cluster(explicit, dict(FOUR_TASKS[0]))  # Slurm's variables are not used
    assert unset.value.field == "TF_CONFIG" and "is not set" in unset.value.reason


def test_the_tf_config_a_tfjob_sets_is_read(monkeypatch):
    # As Kubeflow's training operator writes it for the pod of Worker replica 1.
    workers = [f"lenet-worker-{i}.default.svc:2222" for i in range(2)]
    tf_config = json.dumps(
        {
            "cluster": {"worker": workers},
            "task": {"type": "worker", "index": 1},
            "environment": "cloud",
        }
    )
    cluster = find_cluster(Config(mode="multiworker"), {"TF_CONFIG": tf_config})
    assert cluster.addresses == tuple(workers)
    assert (cluster.task, cluster.index, cluster.is_chief) == ("worker:1", 1, False)


@pytest.mark.parametrize(
    "visible, extra, local, expected",
    [
        ("0,1,2,3", {}, 0, "0,1"),  # --gres=gpu:4, two tasks a node: half each
        ("0,1,2,3", {}, 1, "2,3"),
        ("4,5", {}, 1, "5"),  # the node's own numbers are kept
        ("0", {"SLURM_GPUS_PER_TASK": "1"}, 1, None),  # Slurm gave each task its GPU
        ("", {}, 0, None),  # no GPUs
    ],
)
def test_tasks_sharing_a_nodes_gpus_take_their_part(visible, extra, local, expected):
    variables = dict(FOUR_TASKS[local], CUDA_VISIBLE_DEVICES=visible, **extra)
    assert slurm_gpus(variables, slurm_cluster(8888, variables)) == expected


def test_a_task_alone_on_its_node_keeps_its_gpus():
    variables = step(1, "gpu[1-2]", "1(x2)", 2, "gpu2", 0, CUDA_VISIBLE_DEVICES="0,1")
    assert slurm_gpus(variables, slurm_cluster(8888, variables)) is None


def without(variables, *names):
    return {k: v for k, v in variables.items() if k not in names}


ONE_NODE = step(0, "node1", "2", 2, "node1", 0)
BAD_STEPS = [
    # (the step's variables, the flags, the field and value the error names, its words)
    ({}, [], ("cluster", "slurm"), "found no Slurm step here"),
    (
        {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
        [],
        ("cluster", "slurm"),
        "SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE unset; a batch "
        "script's own shell is not a step: start tfdp with srun",
    ),
    (
        without(ONE_NODE, "SLURM_STEP_TASKS_PER_NODE"),
        [],
        ("cluster", "slurm"),
        "incomplete: SLURM_STEP_TASKS_PER_NODE unset",
    ),
    (
        dict(ONE_NODE, SLURM_STEP_NODELIST="node[1-"),
        [],
        ("SLURM_STEP_NODELIST", "node[1-"),
        "cannot be expanded",
    ),
    (
        dict(ONE_NODE, SLURM_STEP_TASKS_PER_NODE="1,1"),
        [],
        ("SLURM_STEP_TASKS_PER_NODE", "1,1"),
        "gives 2 task counts [1, 1] for the 1 node(s)",
    ),
    (
        dict(ONE_NODE, SLURM_STEP_NUM_TASKS="3"),
        [],
        ("SLURM_STEP_NUM_TASKS", "3"),
        "disagrees with SLURM_STEP_TASKS_PER_NODE=2 (2 tasks)",
    ),
    (dict(ONE_NODE, SLURM_PROCID="2"), [], ("SLURM_PROCID", "2"), "is not a task of the step's 2"),
    (dict(ONE_NODE, SLURM_PROCID="x"), [], ("SLURM_PROCID", "x"), "must be an integer"),
    (
        dict(ONE_NODE, SLURMD_NODENAME="node7"),
        [],
        ("SLURMD_NODENAME", "node7"),
        "disagrees with the step's layout, which puts task 0 on node1",
    ),
    (ONE_NODE, ["--slurm_port_base=70000"], ("slurm_port_base", 70000), "must be a port number"),
    (ONE_NODE, ["--slurm_port_base=65535"], ("slurm_port_base", 65535), "leaves no port"),
    (
        dict(ONE_NODE, CUDA_VISIBLE_DEVICES="0"),
        [],
        ("CUDA_VISIBLE_DEVICES", "0"),
        "gives 1 GPU(s) to the 2 tasks of node1",
    ),
]


@pytest.mark.parametrize("variables, flags, named, words", BAD_STEPS)
def test_a_bad_slurm_step_is_one_line_before_joining(
    variables, flags, named, words, tmp_path, monkeypatch
):
    clear_cluster(monkeypatch, variables)
    monkeypatch.chdir(tmp_path)
    error, line = refusal("--mode=multiworker", "--model=toy", "--cluster=slurm", *flags)
    assert (error.field, error.value) == named
    assert words in error.reason and "\n" not in line
    assert list(tmp_path.iterdir()) == []


def clear_cluster(monkeypatch, variables):
    """This process's environment holds `variables` and no other cluster."""
    for name in [n for n in os.environ if n.startswith("SLURM") or n == "TF_CONFIG"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TF_CONFIG", "")  # restored (removed) after the test
    monkeypatch.delenv("TF_CONFIG")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_a_port_in_use_names_the_base(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        clear_cluster(monkeypatch, step(1, socket.gethostname(), "2", 2, socket.gethostname(), 1))
        monkeypatch.chdir(tmp_path)
        base = port - 1  # task 1 of the node takes base + 1
        error, _ = refusal("--mode=multiworker", "--model=toy", f"--slurm_port_base={base}")
        assert (error.field, error.value) == ("slurm_port_base", base)
        assert f"gives worker:1 the port of {socket.gethostname()}:{port}" in error.reason
    finally:
        taken.close()


@pytest.mark.parametrize("flag", ["--cluster=slurm", "--slurm_port_base=9000"])
def test_cluster_flags_apply_to_multiworker_only(flag):
    error, line = refusal("--model=toy", flag)
    assert error.field == flag[2:].split("=")[0]
    assert line.endswith("applies to mode multiworker only, not single")


def free_port_pair():
    """A port p with p + 1 free too, on every interface."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as a, socket.socket() as b:
                    a.bind(("", port))
                    b.bind(("", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


@pytest.mark.slow
def test_two_slurm_tasks_make_the_update_of_single_and_a_requeue_on_one_resumes(tmp_path):
    """Two tasks of a 2-task step on this host, started as srun starts them, with uneven
    powers and rebalancing: the update of single, each task's share, the chief's writes.
    Then the job requeued with one task: it resumes, and ends as single does."""
    host, base = socket.gethostname(), free_port_pair()
    flags = [
        "--mode=multiworker",
        "--cluster=slurm",
        f"--slurm_port_base={base}",
        "--model=toy",
        "--batch_size=256",
        "--iterations=3",
        "--log_every=1",
        "--powers=1,3",
        "--rebalance_every=1",  # the workers' own clocks re-split the batch: still exact
        f"--model_dir={tmp_path / 'slurm'}",
        "--progress=never",
    ]
    ran = run_together(
        [[sys.executable, "-m", "tfdp", *flags]] * 2,
        [environment(**step(rank, host, "2", 2, host, rank)) for rank in range(2)],
        timeout=300,
    )
    assert [status for status, _, _ in ran] == [0, 0], [err[-2000:] for _, _, err in ran]
    for _, stdout, _ in ran:
        lines = stdout.splitlines()
        assert lines[0] == "workload partition: [('worker:0', 64), ('worker:1', 192)]"
    saved = result(str(tmp_path / "slurm"))
    assert saved["devices"] == ["worker:0", "worker:1"] and saved["shards"] == [64, 192]
    assert saved["worker"] == "worker:0" and saved["chief"] is True

    single = Config(model="toy", batch_size=256, iterations=3, log_every=1)
    train(dataclasses.replace(single, model_dir=str(tmp_path / "single")))
    for got, expected in zip(
        load_weights(tmp_path / "slurm"), load_weights(tmp_path / "single"), strict=True
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    for got, expected in zip(saved["log"], result(str(tmp_path / "single"))["log"], strict=True):
        assert got["accuracy"] == expected["accuracy"]
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)

    # `sbatch --requeue` of a job given --nodes=1-2 after a preemption: the job's script runs
    # again from its start, with one task now, and srun's variables say so; the run resumes.
    # (A job whose task count may change measures its powers: --powers=auto, or none.)
    again = [flag for flag in flags if not flag.startswith("--powers=")]
    [(status, stdout, stderr)] = run_together(
        [[sys.executable, "-m", "tfdp", *again, "--powers=auto", "--iterations=6"]],
        [environment(**step(0, host, "1", 1, host, 0, SLURM_RESTART_COUNT="1"))],
        timeout=300,
    )
    assert status == 0, stderr[-2000:]
    assert "resuming at iteration 3 from" in stdout
    requeued = result(str(tmp_path / "slurm"))
    assert requeued["devices"] == ["worker:0"] and requeued["start_iteration"] == 3
    train(dataclasses.replace(single, iterations=6, model_dir=str(tmp_path / "single6")))
    for got, expected in zip(
        load_weights(tmp_path / "slurm"), load_weights(tmp_path / "single6"), strict=True
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
