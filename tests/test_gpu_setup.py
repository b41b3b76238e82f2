"""Ready for GPUs, without one: device order, where the gradients are summed, GPU memory
set-up and one worker's GPUs under tfdp-launch.

There is no GPU here. The checks that depend on GPUs are functions of device names,
tested with literal lists of names; TensorFlow's GPU set-up calls are replaced by a
recording fake, and the launcher's workers by fake processes that keep their
environment.
"""

import io
import subprocess
import sys
import types

import numpy as np
import pytest
import tensorflow as tf
from helpers import refusal, tfdp

from tfdp import Config, ConfigError
from tfdp.cluster import launch as launch_module
from tfdp.cluster.launch import UsageError, check_gpus, parse_args, visible_gpus
from tfdp.cluster.workers import worker_environment
from tfdp.data.epochs import Schedule
from tfdp.devices import (
    available_devices,
    configure_logical_devices,
    gpus_first,
    master_on_cpu,
    parse_devices,
)
from tfdp.run.hooks.report import banner
from tfdp.run.plan import Plan, default_devices

CPU0, CPU1, GPU0, GPU1 = "/device:CPU:0", "/device:CPU:1", "/device:GPU:0", "/device:GPU:1"


# Device order ---------------------------------------------------------------------------


def test_gpus_come_first_in_the_order_given():
    assert gpus_first([CPU0, GPU0, CPU1, GPU1]) == [GPU0, GPU1, CPU0, CPU1]
    assert gpus_first([GPU1, CPU0, GPU0]) == [GPU1, GPU0, CPU0]
    assert gpus_first([CPU1, CPU0]) == [CPU1, CPU0]


def test_available_devices_list_gpus_first(monkeypatch):
    job = "/job:localhost/replica:0/task:0/device:"
    listed = {
        "CPU": [tf.config.LogicalDevice(job + "CPU:0", "CPU")],
        "GPU": [tf.config.LogicalDevice(job + f"GPU:{i}", "GPU") for i in (0, 1)],
    }
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind: listed[kind])
    assert available_devices() == [GPU0, GPU1, CPU0]


@pytest.mark.parametrize(
    "mode, available, devices",
    [
        ("weighted", [GPU0, GPU1, CPU0], [GPU0, GPU1]),
        ("weighted", [CPU0, GPU0, GPU1], [GPU0, GPU1]),  # listed CPU first: GPUs still lead
        ("mirrored", [GPU0, CPU0], [GPU0]),
        ("single", [CPU0, GPU1, GPU0], [GPU1]),  # the first GPU listed
        ("single", [CPU0, CPU1], [CPU0]),
        ("weighted", [CPU0, CPU1], [CPU0, CPU1]),
    ],
)
def test_default_devices_put_a_gpu_first(mode, available, devices):
    assert parse_devices(default_devices(mode, available), available) == devices


# The gradients' sum on a CPU ------------------------------------------------------------


@pytest.mark.parametrize(
    "devices, suggestion",
    [
        ([CPU0, GPU0], "--devices=gpu:0,cpu:0"),
        ([CPU1, GPU0, GPU1, CPU0], "--devices=gpu:0,gpu:1,cpu:1,cpu:0"),
        ([GPU0, CPU0], None),
        ([GPU1, GPU0], None),
        ([CPU0, CPU1], None),
        ([CPU0], None),
    ],
)
def test_master_on_cpu_only_when_a_gpu_takes_part(devices, suggestion):
    sentence = master_on_cpu(devices)
    if suggestion is None:
        assert sentence is None
    else:
        assert sentence == (
            f"device 0 is {devices[0][len('/device:') :]}, so the gradients are summed on the "
            f"CPU while a GPU takes part; put the GPU first, e.g. {suggestion}"
        )


class FakeTrainer:
    split = types.SimpleNamespace(unit="device(s)", micro_steps=1, max_rows=None)
    model = types.SimpleNamespace(optimizer=types.SimpleNamespace(learning_rate=0.1))

    def info(self):
        return {"reduction": None}


def plan_on(devices, **settings):
    from tfdp.data.arrays import as_stream

    config = Config(model="toy", batch_size=8, **settings)
    train = as_stream((np.zeros((16, 2), np.float32), np.zeros((16,), np.int32)), 8, 0)
    return Plan(config, devices, [4, 4], None, "toy", train, None, Schedule(2, None, 1, 0, 2))


WARNING = (
    "; warning: device 0 is CPU:0, so the gradients are summed on the CPU while "
    "a GPU takes part; put the GPU first, e.g. --devices=gpu:0,cpu:0"
)


def test_banner_warns_of_a_cpu_device_0_beside_a_gpu():
    text = banner(plan_on([CPU0, GPU0], mode="weighted"), FakeTrainer(), 0, [4, 4])
    assert text.startswith("global batch 8 = 4 + 4 over 2 device(s), mode weighted; ")
    assert text.endswith(WARNING)


@pytest.mark.parametrize(
    "devices, settings",
    [
        ([GPU0, CPU0], {"mode": "weighted"}),
        ([CPU0, CPU1], {"mode": "weighted"}),
        # MirroredStrategy replicas: every device keeps and updates its own copy.
        ([CPU0, GPU0], {"mode": "weighted", "reduce": "allreduce"}),
        ([CPU0, GPU0], {"mode": "mirrored"}),
    ],
)
def test_banner_is_quiet_otherwise(devices, settings):
    text = banner(plan_on(devices, **settings), FakeTrainer(), 0, [4, 4])
    assert "warning" not in text
    assert "summed on the CPU" not in text


def test_the_gradients_are_summed_on_device_0_and_each_device_trains_its_shard():
    """devices[0] is CPU:2 here, not TensorFlow's default CPU:0: the gradients are summed
    there (the tutorial's reduction) and the sum is sent to every device's copy of the
    weights, which each device updates; each device computes its own shard's forward and
    backward pass; afterwards the model's variables are where they were before."""
    from tfdp.engine.modes import build_trainer
    from tfdp.models import built_in

    model = built_in(Config(model="toy"), build=True)

    def on(device, variables):
        return [v.value.device.endswith(device) for v in variables]

    assert on("device:CPU:0", model.weights) == [True] * 4  # two kernels, two biases
    config = Config(mode="weighted", model="toy", devices="cpu:2,cpu:0", batch_size=6)
    trainer = build_trainer(config, ["/device:CPU:2", CPU0], [3, 3], model)
    for weight in model.weights:
        copies = trainer.strategy.experimental_local_results(weight.value)
        assert [c.device.split("/")[-1] for c in copies] == ["device:CPU:2", "device:CPU:0"]

    batch = (tf.zeros((6, 128)), tf.zeros((6,), tf.int32))
    iterator = trainer.distribute(tf.data.Dataset.from_tensors(batch).repeat())
    trainer.train_step(iterator)
    graph = trainer._train_step.get_concrete_function(iterator=iterator).graph

    def devices_of(kind):
        return {op.device.split("/")[-1] for op in graph.get_operations() if op.type == kind}

    assert devices_of("AddN") == {"device:CPU:2"}  # the gradients' sum
    assert devices_of("AssignSubVariableOp") == {"device:CPU:2", "device:CPU:0"}  # each copy
    assert devices_of("MatMul") == {"device:CPU:2", "device:CPU:0"}  # each device its own shard's
    trainer.close()
    assert on("device:CPU:0", model.weights) == [True] * 4


# GPU memory set-up ----------------------------------------------------------------------


@pytest.fixture
def fake_tf_config(monkeypatch):
    """Replaces TensorFlow's device set-up calls; returns (the calls made, set_gpus)."""
    calls = []
    machine = {"CPU": [tf.config.PhysicalDevice("/physical_device:CPU:0", "CPU")], "GPU": []}

    def set_gpus(count):
        machine["GPU"] = [
            tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(count)
        ]

    def set_memory_growth(device, enable):
        calls.append(("memory_growth", device.name, enable))

    def set_logical(device, configs):
        calls.append(("logical", device.name, list(configs)))

    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind: machine[kind])
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth", set_memory_growth)
    monkeypatch.setattr(tf.config, "set_logical_device_configuration", set_logical)
    return calls, set_gpus


def logical_gpus(count, mb):
    return [tf.config.LogicalDeviceConfiguration(memory_limit=mb)] * count


@pytest.mark.parametrize(
    "gpus, settings, expected",
    [
        (
            2,
            {},
            [
                ("memory_growth", "/physical_device:GPU:0", True),
                ("memory_growth", "/physical_device:GPU:1", True),
            ],
        ),
        (
            2,
            {"memory_growth": True},
            [
                ("memory_growth", "/physical_device:GPU:0", True),
                ("memory_growth", "/physical_device:GPU:1", True),
            ],
        ),
        (2, {"memory_growth": False}, []),
        (0, {}, []),
        # Logical GPUs take precedence over the default memory growth, on every GPU.
        (
            2,
            {"logical_gpus": 3, "gpu_memory_mb": 2048},
            [("logical", "/physical_device:GPU:0", logical_gpus(3, 2048))],
        ),
        (1, {"logical_gpus": 2}, [("logical", "/physical_device:GPU:0", logical_gpus(2, 1024))]),
        (
            1,
            {"logical_gpus": 2, "memory_growth": False, "gpu_memory_mb": 512},
            [("logical", "/physical_device:GPU:0", logical_gpus(2, 512))],
        ),
        (
            1,
            {"logical_cpus": 2},
            [
                ("memory_growth", "/physical_device:GPU:0", True),
                ("logical", "/physical_device:CPU:0", [tf.config.LogicalDeviceConfiguration()] * 2),
            ],
        ),
    ],
)
def test_gpu_set_up_calls(fake_tf_config, gpus, settings, expected):
    calls, set_gpus = fake_tf_config
    set_gpus(gpus)
    configure_logical_devices(**settings)
    assert calls == expected


@pytest.mark.parametrize(
    "gpus, settings, field",
    [
        (1, {"logical_gpus": 2, "memory_growth": True}, "gpu_memory_growth"),
        (1, {"logical_gpus": 2, "gpu_memory_mb": 0}, "logical_gpu_memory"),
        (1, {"logical_gpus": 2, "gpu_memory_mb": -512}, "logical_gpu_memory"),
        (1, {"logical_gpus": 2, "gpu_memory_mb": 1.5}, "logical_gpu_memory"),
        (1, {"gpu_memory_mb": 0}, "logical_gpu_memory"),  # checked even without logical GPUs
        (0, {"logical_gpus": 2}, "logical_gpus"),
    ],
)
def test_bad_gpu_set_up_changes_nothing(fake_tf_config, gpus, settings, field):
    calls, set_gpus = fake_tf_config
    set_gpus(gpus)
    with pytest.raises(ConfigError) as info:
        configure_logical_devices(**settings)
    assert info.value.field == field
    assert calls == []


def test_memory_growth_after_tensorflow_started(fake_tf_config, monkeypatch):
    """Not asked for, it is left as TensorFlow started; asked for, it is an error."""
    calls, set_gpus = fake_tf_config
    set_gpus(2)

    def started(device, enable):
        calls.append(("memory_growth", device.name, enable))
        raise RuntimeError("Physical devices cannot be modified after being initialized")

    monkeypatch.setattr(tf.config.experimental, "set_memory_growth", started)
    configure_logical_devices()
    assert calls == [("memory_growth", "/physical_device:GPU:0", True)]
    with pytest.raises(ConfigError, match="already started") as info:
        configure_logical_devices(memory_growth=True)
    assert info.value.field == "gpu_memory_growth"


GPU_FLAGS = [
    (["--logical_gpu_memory=0"], "tfdp: error: --logical_gpu_memory=0: must be a positive"),
    (["--logical_gpu_memory=-512"], "tfdp: error: --logical_gpu_memory=-512: must be a positive"),
    (["--logical_gpu_memory=1.5"], "--logical_gpu_memory=1.5"),
    (
        ["--logical_gpus=2", "--gpu_memory_growth"],
        "tfdp: error: --gpu_memory_growth: cannot be combined with --logical_gpus=2",
    ),
    (["--logical_gpus=2"], "tfdp: error: --logical_gpus=2: needs a GPU"),
]


@pytest.mark.parametrize("args, named", GPU_FLAGS, ids=[" ".join(a) for a, _ in GPU_FLAGS])
def test_bad_gpu_flags_fail_with_one_line(args, named, tmp_path, monkeypatch, capsys):
    import tensorflow as tf

    if "--logical_gpus=2" in args and tf.config.list_physical_devices("GPU"):
        pytest.skip("this host has a GPU to split")
    monkeypatch.chdir(tmp_path)
    error, line = refusal("--model=toy", *args)
    assert error is not None, "accepted"
    assert line.startswith("tfdp: error: ") and "\n" not in line
    assert named in line
    assert capsys.readouterr().out == ""  # no training started
    assert list(tmp_path.iterdir()) == []


def test_help_names_the_gpu_flags():
    process = tfdp("--help")
    assert process.returncode == 0
    for flag in ("--[no]gpu_memory_growth", "--logical_gpu_memory", "--logical_gpus"):
        assert flag in process.stdout


# tfdp-launch --gpus_per_worker ----------------------------------------------------------


def test_each_worker_gets_its_own_gpus():
    base = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert [
        worker_environment(base, "{}", i, 2, ["4", "5", "6", "7"])["CUDA_VISIBLE_DEVICES"]
        for i in range(2)
    ] == ["4,5", "6,7"]
    assert [worker_environment({}, "{}", i, 3)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == [
        "0,1,2",
        "3,4,5",
        "6,7,8",
    ]
    env = worker_environment(base, '{"task": 1}', 1)
    assert env == dict(
        base, TF_CONFIG='{"task": 1}', PYTHONUNBUFFERED="1"
    )  # no --gpus_per_worker: as it was


class FakeWorker:
    """A worker that exited at once; keeps the environment it was given."""

    started: list = []  # noqa: RUF012 (the environments of one test's workers)

    def __init__(self, command, env, **options):
        FakeWorker.started.append(env)
        self.stdout, self.stderr = io.BytesIO(b""), io.BytesIO(b"")

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


@pytest.mark.parametrize(
    "gpus_per_worker, gpus, expected",
    [(2, None, ["0,1", "2,3"]), (1, ["GPU-a", "GPU-b"], ["GPU-a", "GPU-b"]), (None, None, None)],
)
def test_the_launcher_gives_its_workers_their_gpus(monkeypatch, gpus_per_worker, gpus, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    monkeypatch.setattr(launch_module.subprocess, "Popen", FakeWorker)
    FakeWorker.started = []
    assert launch_module.launch(2, ["--mode=multiworker"], 1, gpus_per_worker, gpus) == 0
    visible = [env["CUDA_VISIBLE_DEVICES"] for env in FakeWorker.started]
    assert visible == (expected or ["7", "7"])


def test_visible_gpus(tmp_path, monkeypatch):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]  # CUDA stops at -1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    monkeypatch.setenv("PATH", str(tmp_path))
    assert visible_gpus({}) is None  # no nvidia-smi: unknown
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'GPU 0: A100 (UUID: GPU-a)'\necho '  MIG 1g.5gb Device 0'\n"
        "echo 'GPU 1: A100 (UUID: GPU-b)'\n"
    )
    smi.chmod(0o755)
    assert visible_gpus({}) == ["0", "1"]


def test_more_gpus_than_visible_is_refused():
    check_gpus(2, 2, ["0", "1", "2", "3"])
    check_gpus(8, 4, None)  # unknown: trusted
    with pytest.raises(UsageError, match="2 workers x 2 GPUs need 4, and 3 are visible here"):
        check_gpus(2, 2, ["0", "1", "2"])


def test_gpus_per_worker_parses():
    settings = parse_args(["--gpus_per_worker=2", "--model=toy"])
    assert settings.gpus_per_worker == 2
    assert settings.flags == ["--mode=multiworker", "--model=toy"]
    assert parse_args(["--model=toy"]).gpus_per_worker is None


def launcher(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "tfdp.cluster.launch", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "two", ""])
def test_bad_gpus_per_worker_is_a_usage_error(value):
    process = launcher(f"--gpus_per_worker={value}", "--model=toy")
    assert process.returncode == 2
    assert process.stderr.startswith(
        f"tfdp-launch: error: --gpus_per_worker={value}: must be a positive integer"
    )
    assert len(process.stderr.splitlines()) == 1


def test_too_many_gpus_per_worker_is_a_usage_error():
    import os

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1,2")
    process = launcher("--workers=2", "--gpus_per_worker=2", "--model=toy", env=env)
    assert process.returncode == 2
    assert process.stderr == (
        "tfdp-launch: error: --gpus_per_worker=2: 2 workers x 2 GPUs need 4, and 3 are "
        "visible here (0, 1, 2)\n"
    )


def test_launcher_help_describes_gpus_per_worker():
    process = launcher("--help")
    assert process.returncode == 0
    assert "--gpus_per_worker=K worker i gets GPUs i*K .. i*K+K-1" in process.stdout
