import math

import pytest

from tfdp import Config, ConfigError
from tfdp.config import DEFAULT_ITERATIONS


def test_defaults_are_the_tutorial_lenet_run():
    from tfdp.run.plan import with_batch_size

    config = Config()
    assert (
        config.model,
        config.dataset,
        with_batch_size(config).batch_size,  # MNIST arrays: no batches of their own
        config.learning_rate,
        config.log_every,
        config.init,
    ) == ("lenet", "mnist", 1024, 0.1, 10, "tutorial")
    assert config.batch_size is None  # the data's own batches where it has them
    assert config.iterations is None and config.epochs is None  # i.e. DEFAULT_ITERATIONS
    assert DEFAULT_ITERATIONS == 50


def test_dataset_follows_the_model():
    assert Config(model="toy").dataset == "toy"


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(mode="async"), "mode"),
        (dict(model="resnet"), "model"),
        (dict(dataset="cifar10"), "dataset"),
        (dict(model="toy", dataset="mnist"), "dataset"),
        (dict(init="he"), "init"),
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=2.5), "batch_size"),
        (dict(iterations=-1), "iterations"),
        (dict(epochs=0), "epochs"),
        (dict(epochs=2, iterations=5), "epochs"),
        (dict(eval_every=-1), "eval_every"),
        (dict(checkpoint_every=0), "checkpoint_every"),
        (dict(keep_checkpoints=0), "keep_checkpoints"),
        (dict(log_every=-1), "log_every"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(learning_rate=math.nan), "learning_rate"),
        (dict(seed=-3), "seed"),
        (dict(mode="mirrored", powers=(1, 5)), "powers"),
        (dict(mode="weighted", powers=(1, 0)), "powers"),
        (dict(mode="weighted", powers=(1, math.nan)), "powers"),
        (dict(chains=-1), "chains"),
        (dict(chains=1.5), "chains"),
        (dict(chains=True), "chains"),
        (dict(mode="multiworker", chains=2), "chains"),
        (dict(mode="mirrored", chains=2), "chains"),
        # TensorFlow truncates these to 0 microseconds (no limit), or aborts healthy steps
        (dict(mode="multiworker", collective_timeout=1e-9), "collective_timeout"),
        (dict(mode="multiworker", collective_timeout=0.5), "collective_timeout"),
        # a thread per all-reduce for the whole timeout; too large for int64 microseconds
        (dict(mode="multiworker", collective_timeout=86401), "collective_timeout"),
        (dict(mode="multiworker", collective_timeout=1e300), "collective_timeout"),
        (dict(mode="multiworker", collective_timeout=math.inf), "collective_timeout"),
        (dict(mode="multiworker", collective_timeout=math.nan), "collective_timeout"),
        (dict(mode="multiworker", collective_timeout=-1), "collective_timeout"),
        (dict(devices=["cpu:0", 1]), "devices"),
        (dict(devices=["cpu:0", " "]), "devices"),
        (dict(devices=0), "devices"),
    ],
)
def test_bad_settings_name_their_field(changes, field):
    with pytest.raises(ConfigError) as info:
        Config(**changes)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")


def test_devices_may_be_a_list_of_names_as_the_strategies_take_them():
    listed = Config(mode="weighted", devices=["cpu:0", "cpu:1"], powers=[1, 3])
    assert listed == Config(mode="weighted", devices="cpu:0,cpu:1", powers=(1, 3))


@pytest.mark.parametrize("seconds", [0, 1, 30.5, 86400])
def test_collective_timeout_is_off_or_one_second_to_a_day(seconds):
    assert Config(mode="multiworker", collective_timeout=seconds).collective_timeout == seconds
