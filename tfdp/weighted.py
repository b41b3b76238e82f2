"""The tutorial's heterogeneous path: weighted shards, sum on device 0, broadcast.

One model copy lives on each device. Per step:
  1. the global batch (on the host) is cut into shards of the sizes given by
     `split_batch`, and shard j is copied to device j;
  2. each device runs forward and backward on its shard;
  3. the gradients of devices 1..n-1 are copied to device 0 and summed there;
  4. device 0 applies plain SGD to its weights;
  5. device 0's new weights are copied to devices 1..n-1.
With one device this is plain single-device training: no copies at all.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfdp.data import eval_batches
from tfdp.devices import split_batch
from tfdp.steps import add_metrics, replica_correct, replica_gradients


class WeightedTrainer:
    """Data-parallel SGD over devices of any kinds, with uneven shards."""

    def __init__(self, make_model, weights, devices, shards, learning_rate):
        """
        Args:
          make_model: builds one fresh model copy.
          weights: initial weights, set on every copy.
          devices: canonical device names; devices[0] holds the master weights.
          shards: examples per device; they sum to the global batch.
          learning_rate: plain SGD step size.
        """
        self.devices = list(devices)
        self.shards = list(shards)
        self.global_batch_size = sum(shards)
        self.models = []
        for device in self.devices:
            with tf.device(device):
                model = make_model()
                model.set_weights(weights)
            self.models.append(model)
        with tf.device(self.devices[0]):
            self.optimizer = keras.optimizers.SGD(learning_rate)
            self.optimizer.build(self.models[0].trainable_variables)
        self._train_step = tf.function(self._step)
        self._eval_step = tf.function(self._correct, reduce_retracing=True)

    def distribute(self, dataset):
        """The iterator `train_step` reads: global batches, on the host."""
        return iter(dataset)

    def train_step(self, iterator):
        """One SGD step on the next global batch; returns summed metrics."""
        return self._train_step(iterator)

    def _step(self, iterator):
        x, y = next(iterator)
        gradients, metrics = [], []
        for device, model, x_shard, y_shard in zip(
            self.devices, self.models, tf.split(x, self.shards), tf.split(y, self.shards)
        ):
            with tf.device(device):
                shard_gradients, shard_metrics = replica_gradients(
                    model, x_shard, y_shard, self.global_batch_size
                )
            gradients.append(shard_gradients)
            metrics.append(shard_metrics)
        master = self.models[0]
        with tf.device(self.devices[0]):
            summed = [tf.add_n(list(per_device)) for per_device in zip(*gradients)]
            self.optimizer.apply_gradients(zip(summed, master.trainable_variables))
            metrics = add_metrics(metrics)
        self.sync_copies()
        return metrics

    def sync_copies(self):
        """Copies device 0's weights to every other device."""
        for device, model in zip(self.devices[1:], self.models[1:]):
            with tf.device(device):
                for target, source in zip(model.weights, self.models[0].weights):
                    target.assign(source.value)

    def evaluate(self, arrays) -> float:
        """Accuracy on `arrays`, each batch split over the devices like a training batch."""
        correct = 0.0
        for x, y in eval_batches(arrays, self.global_batch_size):
            n = int(x.shape[0])
            # A partial last batch is split in the training proportions.
            sizes = (
                split_batch(n, self.shards)
                if n >= len(self.shards)
                else [n] + [0] * (len(self.shards) - 1)
            )
            correct += float(self._eval_step(x, y, tuple(sizes)))
        return correct / len(arrays)

    def _correct(self, x, y, sizes):
        counts = []
        for device, model, x_shard, y_shard in zip(
            self.devices, self.models, tf.split(x, sizes), tf.split(y, sizes)
        ):
            with tf.device(device):
                counts.append(replica_correct(model, x_shard, y_shard))
        with tf.device(self.devices[0]):
            return tf.add_n(counts)

    def set_weights(self, weights) -> None:
        """Sets `weights` on every copy."""
        for model in self.models:
            model.set_weights(weights)

    def get_weights(self) -> list[np.ndarray]:
        """Device 0's weights (the others are copies of them)."""
        return self.models[0].get_weights()

    @property
    def model(self):
        return self.models[0]
