"""One cut and one balancing for every door: `tfdp.fit` and the command (the trainer's
host cut, its Rebalance hook) and plain `model.fit` under `tfdp.MirroredStrategy` (its
distributed dataset, its in-step balancing) give each replica the same rows of every
batch, short batches included (engine/pieces.py), and move the shares alike."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import CPUS

import tfdp
from tfdp import Config
from tfdp.devices import split_batch
from tfdp.engine.modes import build_trainer
from tfdp.engine.pieces import piece_sizes
from tfdp.errors import ConfigError


@pytest.mark.parametrize(
    "rows, weights, expected",
    [
        (100, [1, 1, 1], [34, 33, 33]),  # ties: the earlier replica first
        (100, [5, 1, 1], [72, 14, 14]),
        (100, [1, 5], [17, 83]),  # the tutorial's partition
        (64, [1, 3], [16, 48]),
        (30, [72, 14, 14], [22, 4, 4]),  # a short batch, by a split of 100
        (3, [1, 5], [1, 2]),  # largest remainder would leave replica 0 none: one row each first
        (1, [1, 5], [0, 1]),  # fewer rows than replicas
        (7, [1, 5, 0], [1, 6, 0]),  # a replica of weight 0 takes none
        (0, [1, 1], [0, 0]),
    ],
)
def test_the_rule_on_literal_cases(rows, weights, expected):
    assert list(piece_sizes(rows, weights).numpy()) == expected


def test_the_graphs_rule_is_the_hosts_split_batch():
    """Where the host's `split_batch` splits a full batch (every device at least one
    example), the step's rule gives the same pieces."""
    random, compared = np.random.default_rng(3), 0
    for _ in range(200):
        weights = [float(w) for w in random.uniform(0.1, 10, size=random.integers(1, 6))]
        rows = int(random.integers(len(weights), 400))
        try:
            host = split_batch(rows, weights)
        except ConfigError:  # a device would get no example: the host refuses such a split
            continue
        assert list(piece_sizes(rows, weights).numpy()) == host
        compared += 1
    assert compared > 150


def _rows_by_replica(strategy, values):
    return [int(tf.shape(tf.nest.flatten(v)[0])[0]) for v in strategy.experimental_local_results(values)]


@pytest.mark.parametrize(
    "powers, batch",
    [((1, 1, 1), 100), ((5, 1, 1), 100), ((1, 3), 64), ((1, 1, 4, 2), 50)],
)
def test_both_doors_cut_every_batch_alike(powers, batch):
    devices = CPUS[: len(powers)]
    rows = 2 * batch + 7  # two full batches and a short one
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    y = np.arange(rows, dtype=np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    config = Config(mode="weighted", devices=",".join(devices), powers=powers,
                    batch_size=batch, model="toy")
    trainer = build_trainer(config, devices, split_batch(batch, powers))
    try:
        trainers = [
            _rows_by_replica(trainer.strategy, trainer._pieces(element)[0]) for element in dataset
        ]
        # the rows themselves: replica i holds the batch's rows in order
        first = trainer.strategy.experimental_local_results(trainer._pieces(next(iter(dataset)))[1])
    finally:
        trainer.close()

    strategy = tfdp.MirroredStrategy(devices, powers=list(powers))
    distributed = strategy.experimental_distribute_dataset(dataset)
    models = [_rows_by_replica(strategy, element[0]) for element in distributed]
    strategys_first = strategy.experimental_local_results(next(iter(distributed))[1])

    assert trainers == models
    assert [sum(pieces) for pieces in models] == [batch, batch, 7]
    assert models[0] == split_batch(batch, powers)  # a full batch: the host's split
    for ours, theirs in zip(first, strategys_first):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


# A device model for the balancing test: replica 1 is 4x slower per example than replica 0,
# and replica 0 has a fixed cost per step (seconds per step = overhead + examples x cost),
# the same in both doors whatever the machine does.
OVERHEAD, COST = (3e-3, 0.0), (1e-4, 4e-4)


def modelled_seconds(monkeypatch):
    """Every `balance.Rebalancing` reads the modelled seconds of its split's shards, not the
    clock's: the balancing's decisions then depend on the door's wiring only."""
    from tfdp.balance.rebalancing import Rebalancing

    measured = Rebalancing.observe

    def observe(self, iteration, device_seconds):
        shards = self.probes.split.shards
        return measured(self, iteration, [o + s * c for o, s, c in zip(OVERHEAD, shards, COST)])

    monkeypatch.setattr(Rebalancing, "observe", observe)


def small_model():
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def test_both_doors_rebalance_alike(monkeypatch):
    """powers [1, 1], rebalance_every=4, replica 1 4x slower: the same re-splits, in the same
    order, through `tfdp.fit` and through plain `model.fit` under the strategy (the
    strategy's may come a step or two later: a dataset is cut a batch or two ahead)."""
    modelled_seconds(monkeypatch)
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(64 * 40, 8)).astype(np.float32), rng.normal(size=(64 * 40, 1)).astype(np.float32)

    history = tfdp.fit(small_model(), x, y, batch_size=64, epochs=1, shuffle=False, verbose=0,
                       mode="weighted", devices="cpu:0,cpu:1", powers=(1, 1), rebalance_every=4)
    trainers = [(r["old"], r["new"]) for r in history.result["rebalances"]]

    strategy = tfdp.MirroredStrategy(CPUS[:2], powers=[1, 1], rebalance_every=4)
    with strategy.scope():
        model = small_model()
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    models = [(r["old"], r["new"]) for r in strategy.balancing.resplits]

    assert len(trainers) >= 2, trainers  # it moved, and more than once
    assert trainers[0][0] == [32, 32] and trainers[0][1][0] > 40  # work off the slow replica
    shortest = min(len(trainers), len(models))
    assert shortest >= 2 and models[:shortest] == trainers[:shortest], (trainers, models)
    assert strategy.shares == [s / 64 for s in models[-1][1]]


def test_powers_set_by_hand_are_balanced_on(monkeypatch):
    """`set_powers` under rebalance_every: the balancing starts again from the new split
    and moves work off the slow replica again (it held a split of the old shares, and
    would wait for it forever)."""
    modelled_seconds(monkeypatch)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(64 * 30, 8)).astype(np.float32), rng.normal(size=(64 * 30, 1)).astype(np.float32)
    strategy = tfdp.MirroredStrategy(CPUS[:2], powers=[1, 1], rebalance_every=4)
    with strategy.scope():
        model = small_model()
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert strategy.shares[0] > 0.6, strategy.shares  # moved off the slow replica

    strategy.set_powers([1, 1])
    assert strategy.shares == [0.5, 0.5]
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    moves = [(r["old"], r["new"]) for r in strategy.balancing.resplits]
    assert moves and moves[0][0] == [32, 32], moves  # from the split set by hand
    assert strategy.shares[0] > 0.6, strategy.shares  # and off the slow replica again
