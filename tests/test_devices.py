import pytest
from helpers import CPUS, NUM_LOGICAL_CPUS

from tfdp import Config, ConfigError, configure_logical_devices
from tfdp.devices import (
    available_devices,
    canonical_name,
    check_intra_op_threads,
    default_chains,
    default_intra_op_threads,
    parse_devices,
)

MACHINE = ["/device:CPU:0", "/device:GPU:0", "/device:GPU:1"]


@pytest.mark.parametrize(
    "spec, name",
    [
        ("cpu:0", "/device:CPU:0"),
        ("GPU:1", "/device:GPU:1"),
        ("/gpu:1", "/device:GPU:1"),
        ("/device:CPU:3", "/device:CPU:3"),
        (" gpu ", "/device:GPU:0"),
    ],
)
def test_canonical_names(spec, name):
    assert canonical_name(spec) == name


def test_parse_keeps_order():
    assert parse_devices("gpu:1,cpu:0", MACHINE) == ["/device:GPU:1", "/device:CPU:0"]


def test_all_means_every_gpu_else_every_cpu():
    assert parse_devices("all", MACHINE) == ["/device:GPU:0", "/device:GPU:1"]
    assert parse_devices("all", CPUS) == CPUS


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gpu:2", "GPU:2 does not exist here; the devices are CPU:0, GPU:0, GPU:1"),
        ("tpu:0", "is not a device name"),
        ("cpu:0,,gpu:0", "comma list"),
        ("", "comma list"),
        ("gpu:0,GPU:0", "GPU:0 more than once"),
    ],
)
def test_bad_devices_are_named(spec, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_devices(spec, MACHINE)
    assert info.value.field == "devices"


def test_logical_cpus_exist():
    """The 4 logical CPUs, after the host's GPUs (none on a CPU-only host)."""
    import tensorflow as tf

    gpus = [f"/device:GPU:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))]
    assert available_devices() == gpus + CPUS


def test_logical_cpus_cannot_change_after_start():
    configure_logical_devices(logical_cpus=NUM_LOGICAL_CPUS)  # the same number: harmless
    with pytest.raises(ConfigError, match="already started with 4 logical CPU"):
        configure_logical_devices(logical_cpus=2)


def test_logical_gpus_need_a_gpu(monkeypatch):
    """On a host without GPUs (this process's TensorFlow sees none, whatever it found)."""
    import tensorflow as tf

    listed = tf.config.list_physical_devices
    monkeypatch.setattr(
        tf.config, "list_physical_devices", lambda kind=None: [] if kind == "GPU" else listed(kind)
    )
    with pytest.raises(ConfigError) as refused:
        configure_logical_devices(logical_gpus=2)
    assert (refused.value.field, refused.value.reason) == (
        "logical_gpus",
        "needs a GPU, and this machine has none",
    )


EVEN_OVER_FOUR = dict(logical_cpus=4, gpus=0, cores=2)


@pytest.mark.parametrize(
    "config, machine, threads",
    [
        # an even split over more logical CPUs than cores: one thread per kernel
        (Config(mode="mirrored"), EVEN_OVER_FOUR, 1),
        (Config(mode="weighted"), EVEN_OVER_FOUR, 1),
        (Config(mode="weighted", powers=(2, 2, 2, 2)), EVEN_OVER_FOUR, 1),
        (Config(mode="mirrored", devices="cpu:0,cpu:1,cpu:2"), EVEN_OVER_FOUR, 1),
        (Config(mode="mirrored", devices="all"), EVEN_OVER_FOUR, 1),
        # no more replicas than cores: every kernel may use every core
        (Config(mode="mirrored"), dict(logical_cpus=2, gpus=0, cores=2), 0),
        (Config(mode="mirrored"), dict(logical_cpus=4, gpus=0, cores=4), 0),
        (Config(mode="mirrored", devices="cpu:0,cpu:1"), EVEN_OVER_FOUR, 0),
        # one CPU device cutting its shard into chains, one per core
        (Config(mode="single"), EVEN_OVER_FOUR, 1),
        (Config(mode="single", devices="cpu:2"), dict(logical_cpus=0, gpus=0, cores=8), 1),
        (Config(mode="single", chains=2), dict(logical_cpus=0, gpus=0, cores=1), 1),
        # several devices run each share in one piece: their kernels may use the cores
        (Config(mode="mirrored", devices="cpu:0,cpu:1"), dict(logical_cpus=2, gpus=0, cores=8), 0),
        (Config(mode="single"), dict(logical_cpus=0, gpus=0, cores=1), 0),
        (Config(mode="single", chains=1), EVEN_OVER_FOUR, 0),
        (Config(mode="single"), dict(logical_cpus=0, gpus=1, cores=2), 0),
        # an uneven or changing split: the device with more work needs the cores
        (Config(mode="weighted", powers=(1, 3, 1, 1)), EVEN_OVER_FOUR, 0),
        (Config(mode="weighted", powers="auto"), EVEN_OVER_FOUR, 0),
        (Config(mode="weighted", rebalance_every=5), EVEN_OVER_FOUR, 0),
        (Config(mode="weighted", simulate_slowdown="cpu:1=4"), EVEN_OVER_FOUR, 0),
        # GPUs, or a CPU beside them
        (Config(mode="mirrored"), dict(logical_cpus=4, gpus=2, cores=2), 0),
        (Config(mode="mirrored", devices="cpu:0,cpu:1,cpu:2,gpu:0"), EVEN_OVER_FOUR, 0),
        (Config(mode="multiworker"), EVEN_OVER_FOUR, 0),
    ],
)
def test_default_intra_op_threads(config, machine, threads):
    assert default_intra_op_threads(config, **machine) == threads


@pytest.mark.parametrize(
    "devices, cores, chains",
    [
        (["/device:CPU:0"], 2, 2),
        (["/device:CPU:0"], 1, 1),
        (["/device:CPU:0", "/device:CPU:1"], 2, 1),
        (["/device:CPU:0", "/device:CPU:1", "/device:CPU:2", "/device:CPU:3"], 2, 1),
        (["/device:CPU:0", "/device:CPU:1"], 8, 4),
        (["/device:GPU:0"], 8, 1),
        (["/device:CPU:0", "/device:GPU:0"], 8, 1),
    ],
)
def test_default_chains(devices, cores, chains):
    assert default_chains(devices, cores) == chains


@pytest.mark.parametrize("threads", [-1, True, 1.5])
def test_bad_intra_op_threads_are_named(threads):
    with pytest.raises(ConfigError, match="intra_op_threads"):
        check_intra_op_threads(threads)
