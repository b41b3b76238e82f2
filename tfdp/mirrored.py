"""A custom training loop under tf.distribute.MirroredStrategy."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfdp.data import eval_batches
from tfdp.devices import even_split
from tfdp.steps import replica_correct, replica_gradients


def cross_device_ops_for(devices):
    """The all-reduce to use for a device set.

    NCCL where every device is a GPU (MirroredStrategy's own choice there).
    Elsewhere, reduction to one device: on CPUs MirroredStrategy would pick
    collective ops, and collective groups of different sizes in one process
    collide ("joining a group with size 4, but that group has size 2").
    """
    if all(":GPU:" in d for d in devices) and len(devices) > 1:
        return tf.distribute.NcclAllReduce()
    return tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])


class MirroredTrainer:
    """Synchronous replicas of one Keras model, one per device."""

    def __init__(self, make_model, weights, devices, global_batch_size, learning_rate):
        self.devices = list(devices)
        self.global_batch_size = global_batch_size
        self.shards = even_split(global_batch_size, len(self.devices))
        self.strategy = tf.distribute.MirroredStrategy(
            self.devices, cross_device_ops=cross_device_ops_for(self.devices)
        )
        with self.strategy.scope():
            self.model = make_model()
            self.model.set_weights(weights)
            self.optimizer = keras.optimizers.SGD(learning_rate)
            self.optimizer.build(self.model.trainable_variables)
        self._train_step = tf.function(self._step)
        self._eval_step = tf.function(self._correct, reduce_retracing=True)

    def distribute(self, dataset):
        """Splits each global batch into per-replica batches."""
        return iter(self.strategy.experimental_distribute_dataset(dataset))

    def train_step(self, iterator):
        """One SGD step on the next global batch; returns summed metrics."""
        return self._train_step(iterator)

    def _step(self, iterator):
        x, y = next(iterator)
        per_replica = self.strategy.run(self._replica_step, args=(x, y))
        return {
            key: self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
            for key, value in per_replica.items()
        }

    def _replica_step(self, x, y):
        gradients, metrics = replica_gradients(self.model, x, y, self.global_batch_size)
        # Inside a replica, the optimizer all-reduces (sums) the gradients first.
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        return metrics

    def evaluate(self, arrays) -> float:
        """Accuracy on `arrays`, each batch split over the replicas."""
        batches = self.strategy.experimental_distribute_dataset(
            eval_batches(arrays, self.global_batch_size)
        )
        correct = sum(float(self._eval_step(x, y)) for x, y in batches)
        return correct / len(arrays)

    def _correct(self, x, y):
        per_replica = self.strategy.run(lambda x, y: replica_correct(self.model, x, y), (x, y))
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def sync_copies(self):
        """Nothing to do: MirroredVariables keep every replica's copy equal."""

    def set_weights(self, weights) -> None:
        """Sets `weights` on every replica."""
        with self.strategy.scope():
            self.model.set_weights(weights)

    def get_weights(self) -> list[np.ndarray]:
        return self.model.get_weights()
