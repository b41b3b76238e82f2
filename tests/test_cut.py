"""One cut for every door: `tfdp.fit` and the command (the trainer's host cut) and plain
`model.fit` under `tfdp.MirroredStrategy` (its distributed dataset) give each replica the
same rows of every batch, short batches included (engine/pieces.py)."""

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
