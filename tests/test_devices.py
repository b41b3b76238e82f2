import pytest
from conftest import CPUS, NUM_LOGICAL_CPUS

from tfdp import ConfigError, configure_logical_devices
from tfdp.devices import available_devices, canonical_name, parse_devices

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
    assert available_devices() == CPUS


def test_logical_cpus_cannot_change_after_start():
    configure_logical_devices(logical_cpus=NUM_LOGICAL_CPUS)  # the same number: harmless
    with pytest.raises(ConfigError, match="already started with 4 logical CPU"):
        configure_logical_devices(logical_cpus=2)


def test_logical_gpus_need_a_gpu():
    with pytest.raises(ConfigError, match="needs a GPU"):
        configure_logical_devices(logical_gpus=2)
