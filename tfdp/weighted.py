"""The tutorial's heterogeneous path: weighted shards, sum on device 0, broadcast.

One model copy lives on each device. Per step:
  1. the global batch (on the host) is cut into shards of the sizes given by
     `split_batch`, and shard j is copied to device j;
  2. each device runs forward and backward on its shard;
  3. the gradients of devices 1..n-1 are copied to device 0 and summed there;
  4. device 0 applies plain SGD to its weights;
  5. device 0's new weights are copied to devices 1..n-1.
With one device this is plain single-device training: no copies at all.

The shard sizes live in a variable, so that a rebalanced split (balance.py)
takes effect without tracing the step again; each step also reports how long
every device took for its shard.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfdp.data import eval_batches
from tfdp.devices import split_batch
from tfdp.steps import add_metrics, replica_correct, timed_replica_gradients


class WeightedTrainer:
    """Data-parallel SGD over devices of any kinds, with uneven shards."""

    def __init__(
        self, make_model, weights, devices, shards, learning_rate, slowdown=False, chains=1
    ):
        """
        Args:
          make_model: builds one fresh model copy.
          weights: initial weights, set on every copy.
          devices: canonical device names; devices[0] holds the master weights.
          shards: examples per device; they sum to the global batch.
          learning_rate: plain SGD step size.
          slowdown: build the simulated slowdown in (delays set by `set_delays`).
          chains: how many side-by-side parts each device cuts its shard into
            (`steps.replica_gradients`).
        """
        self.devices = list(devices)
        self.shards = list(shards)
        self.chains = chains
        self.global_batch_size = sum(shards)
        with tf.device("/cpu:0"):  # the batch is split on the host
            self.shard_sizes = tf.Variable(shards, dtype=tf.int32, trainable=False)
            self.delays = (
                tf.Variable([0.0] * len(devices), dtype=tf.float64, trainable=False)
                if slowdown
                else None
            )
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
        self._seconds_alone = tf.function(self._alone)
        self._seconds_together = tf.function(self._together)

    def distribute(self, dataset):
        """The iterator `train_step` reads: global batches, on the host."""
        return iter(dataset)

    def train_step(self, iterator):
        """One SGD step on the next global batch; returns summed metrics."""
        return self._train_step(iterator)

    def _step(self, iterator):
        x, y = next(iterator)
        gradients, metrics, seconds = self._shard_gradients(x, y)
        master = self.models[0]
        with tf.device(self.devices[0]):
            summed = [tf.add_n(list(per_device)) for per_device in zip(*gradients)]
            self.optimizer.apply_gradients(zip(summed, master.trainable_variables))
            metrics = add_metrics(metrics)
        self.sync_copies()
        return {**metrics, "device_seconds": tf.stack(seconds)}

    def _shard_gradients(self, x, y):
        """Every device's forward and backward on its shard of (x, y), side by side.

        Returns per-device lists: (gradients, metrics, seconds).
        """
        per_device = []
        for i, (device, model, x_shard, y_shard) in enumerate(
            zip(self.devices, self.models, self._split(x), self._split(y))
        ):
            with tf.device(device):
                per_device.append(
                    timed_replica_gradients(
                        model,
                        x_shard,
                        y_shard,
                        self.global_batch_size,
                        self._delay(i),
                        self.chains,
                    )
                )
        return tuple(list(column) for column in zip(*per_device))

    def _split(self, tensor):
        """A global batch -> one shard per device, of the current sizes."""
        if len(self.devices) == 1:
            return [tensor]
        return tf.split(tensor, self.shard_sizes, num=len(self.devices))

    def _delay(self, index):
        return None if self.delays is None else self.delays[index]

    def set_shards(self, shards) -> None:
        """Splits the following batches as `shards` (same global batch)."""
        if sum(shards) != self.global_batch_size or len(shards) != len(self.devices):
            raise ValueError(f"shards {shards} do not split {self.global_batch_size} examples")
        self.shards = list(shards)
        self.shard_sizes.assign(shards)

    def set_delays(self, delays) -> None:
        """Simulated slowdown: seconds of sleep per example, per device."""
        self.delays.assign(delays)

    def seconds_alone(self, x, y, index: int) -> float:
        """Device `index`'s seconds for forward and backward on (x, y), the others idle."""
        return float(self._seconds_alone(x, y, index))

    def seconds_together(self, x, y):
        """Each device's seconds for forward and backward on its shard of the global
        batch (x, y), all devices at once as in a step, without an update."""
        return self._seconds_together(x, y)

    def _together(self, x, y):
        return tf.stack(self._shard_gradients(x, y)[2])

    def _alone(self, x, y, index):
        with tf.device(self.devices[index]):
            _, _, seconds = timed_replica_gradients(
                self.models[index],
                x,
                y,
                self.global_batch_size,
                self._delay(index),
                self.chains,
            )
        return seconds

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
