"""The key invariant: for the same global batches and initial weights, every
mode makes the same update, however the batch is split over devices."""

import helpers
import numpy as np
import pytest
from helpers import CPUS

from tfdp import Config
from tfdp.data.arrays import train_dataset
from tfdp.engine.modes import build_trainer
from tfdp.run.hooks.report import floats
from tfdp.run.training import partition

BATCH = 100
SEED = 5


def train_steps(mode, devices, powers, steps, images, **options):
    config = Config(
        mode=mode,
        devices=",".join(devices),
        powers=powers,
        batch_size=BATCH,
        seed=SEED,
        **options,
    )
    trainer, metrics = helpers.train_steps(config, devices, images, steps)
    return trainer.model.get_weights(), metrics


@pytest.fixture(scope="module")
def reference(images):
    # the plain algorithm: one device, its batch as one chain of kernels
    return {steps: train_steps("single", CPUS[:1], (), steps, images, chains=1) for steps in (1, 3)}


CASES = [
    ("mirrored", CPUS[:2], (), {}),
    ("mirrored", CPUS[:4], (), {}),
    ("mirrored", CPUS[:3], (), {}),  # 100 = 34 + 33 + 33
    ("mirrored", CPUS[:3], (), {"mirrored_input": "dataset"}),  # tf.distribute: 34 + 34 + 32
    ("mirrored", CPUS[:4], (), {"all_reduce": "reduce_to_one"}),
    ("weighted", CPUS[:2], (1, 1), {}),
    ("weighted", CPUS[:2], (1, 5), {}),
    ("weighted", CPUS[:4], (3, 1, 1, 1), {}),
    ("weighted", CPUS[:2], (1, 5), {"reduce": "allreduce"}),
    ("weighted", CPUS[:4], (3, 1, 1, 1), {"reduce": "allreduce"}),
    ("weighted", CPUS[:2], (1, 5), {"simulate_slowdown": "cpu:1=2"}),  # delays still 0
    # shards cut into side-by-side chains (steps.DeviceWork)
    ("single", CPUS[:1], (), {"chains": 2}),
    ("single", CPUS[:1], (), {"chains": 3}),  # 100 = 34 + 33 + 33
]


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("mode, devices, powers, options", CASES)
def test_same_update_as_single(mode, devices, powers, options, steps, images, reference):
    weights, metrics = train_steps(mode, devices, powers, steps, images, **options)
    expected_weights, expected_metrics = reference[steps]
    for got, expected in zip(weights, expected_weights, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert metrics["accuracy"] == expected_metrics["accuracy"]
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], rel=1e-5)


def test_the_update_is_not_trivial(reference):
    from tfdp.models import initial_weights

    start = initial_weights("lenet", "tutorial", SEED)
    moved = [np.abs(w - w0).max() for w, w0 in zip(reference[1][0], start)]
    assert min(moved) > 1e-4  # every variable moves, far beyond the tolerance above
    assert not np.allclose(reference[1][0][0], reference[3][0][0], atol=1e-4)


def test_weighted_runs_each_shard_on_its_device(images):
    """A copy of the weights on every device (the update made from gradients summed on
    device 0); each device's forward and backward pass on itself."""
    config = Config(mode="weighted", devices="all", batch_size=BATCH)
    trainer = build_trainer(config, CPUS, partition(config, CPUS))
    for weight in trainer.model.weights:
        copies = trainer.strategy.experimental_local_results(weight.value)
        assert [c.device.split("/")[-1] for c in copies] == [d.split("/")[-1] for d in CPUS]
    iterator = trainer.distribute(train_dataset(images, BATCH, SEED))
    graph = trainer._train_step.get_concrete_function(iterator=iterator).graph
    convolutions = [op.device.split("/")[-1] for op in graph.get_operations() if op.type == "Conv2D"]
    assert sorted(set(convolutions)) == [d.split("/")[-1] for d in CPUS]
    assert len(convolutions) == 2 * len(CPUS)  # LeNet's two, on each device's shard


@pytest.mark.parametrize(
    "mirrored_input, shards", [("split", [34, 33, 33]), ("dataset", [34, 34, 32])]
)
def test_mirrored_shards_are_what_the_replicas_get(mirrored_input, shards, images):
    config = Config(
        mode="mirrored",
        devices="cpu:0,cpu:1,cpu:2",
        batch_size=BATCH,
        mirrored_input=mirrored_input,
    )
    trainer = build_trainer(config, CPUS[:3], partition(config, CPUS[:3]))
    assert trainer.split.shards == partition(config, CPUS[:3]) == shards
    batch = next(trainer.distribute(train_dataset(images, BATCH, SEED)))
    if mirrored_input == "split":
        batch = trainer.cut(batch, trainer.split.sizes)
    x, _ = batch
    assert [len(t) for t in trainer.strategy.experimental_local_results(x)] == shards


@pytest.mark.parametrize("reduce", ["device0", "allreduce"])
def test_resplits_and_slowdown_keep_the_update(reduce, images, reference):
    """Shares changed between steps (as rebalancing does) and a simulated slowdown
    change where and when examples are computed, never the update."""
    config = Config(
        mode="weighted",
        devices="cpu:0,cpu:1",
        batch_size=BATCH,
        seed=SEED,
        reduce=reduce,
        simulate_slowdown="cpu:1=4",
    )
    trainer = build_trainer(config, CPUS[:2], partition(config, CPUS[:2]))
    delay = 2e-4  # seconds of sleep per example on cpu:1
    trainer.balancer.probes.set_delays([0.0, delay])
    iterator = trainer.distribute(train_dataset(images, BATCH, SEED))
    for shards in ([50, 50], [80, 20], [10, 90]):
        trainer.split.set(shards)
        trainer.model.reset_metrics()
        metrics = trainer.train_step(iterator)
        # cpu:1 slept delay x its shard after its backward pass: a lower bound on its time.
        assert float(metrics["device_seconds"][1]) >= shards[1] * delay
    expected_weights, expected_metrics = reference[3]
    for got, expected in zip(trainer.model.get_weights(), expected_weights, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert floats(metrics["logs"])["accuracy"] == expected_metrics["accuracy"]


def test_a_split_must_split_the_global_batch():
    config = Config(mode="weighted", devices="cpu:0,cpu:1", batch_size=BATCH)
    trainer = build_trainer(config, CPUS[:2], partition(config, CPUS[:2]))
    with pytest.raises(ValueError, match="do not split 100"):
        trainer.split.set([50, 49])


def host_callbacks(trainer, images):
    """The ops of the traced step that call back into Python on the host."""
    iterator = trainer.distribute(train_dataset(images, BATCH, SEED))
    graph = trainer._train_step.get_concrete_function(iterator=iterator).graph
    return [op.type for op in graph.get_operations() if "PyFunc" in op.type]


@pytest.mark.parametrize(
    "options, timed",
    [
        ({"mode": "weighted", "powers": (1, 5)}, False),  # fixed powers: nothing reads times
        ({"mode": "mirrored"}, False),
        ({"mode": "weighted", "powers": (1, 5), "reduce": "allreduce"}, False),
        ({"mode": "weighted", "powers": "auto"}, True),
        ({"mode": "weighted", "powers": (1, 5), "rebalance_every": 5}, True),
        ({"mode": "mirrored", "simulate_slowdown": "cpu:1=2"}, True),
    ],
)
def test_the_step_reads_the_host_clock_only_when_it_is_used(options, timed, images):
    """On a GPU the clock syncs the device with the host every step; both kinds of step
    make the single update (test_same_update_as_single: fixed powers are untimed, and
    test_resplits_and_slowdown_keep_the_update is timed)."""
    config = Config(devices="cpu:0,cpu:1", batch_size=BATCH, seed=SEED, **options)
    trainer = build_trainer(config, CPUS[:2], partition(config, CPUS[:2]))
    assert trainer.balancer.probes.timed is timed
    assert bool(host_callbacks(trainer, images)) is timed
