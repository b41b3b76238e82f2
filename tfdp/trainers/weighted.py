"""The tutorial's heterogeneous path: weighted shards, sum on device 0, broadcast.

One model copy lives on each device. Per step:
  1. the global batch (on the host) is cut into shards of the sizes given by
     `split_batch`, and shard j is copied to device j;
  2. each device runs forward and backward on its shard;
  3. the gradients of devices 1..n-1 are copied to device 0 and summed there;
  4. device 0 applies the model's compiled optimizer (the tutorial: plain SGD)
     to its weights, with the optimizer's slots kept there;
  5. device 0's new weights are copied to devices 1..n-1, as the next step (or
     evaluation) begins: so weights set between steps (a callback's, a
     restore's) reach every copy with no copy of their own.
Moving statistics (batch norm) are the copies' values weighted by their shards.
With one device this is plain single-device training: no copies at all.

The shard sizes live in a variable, so that a rebalanced split (balance.py)
takes effect without tracing the step again; each step also reports how long
every device took for its shard.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.devices import split_batch
from tfdp.objective import concat, num_examples
from tfdp.steps import shard_sizes_for, split, timed_replica_gradients
from tfdp.trainers.base import Trainer


class WeightedTrainer(Trainer):
    """Data-parallel training over devices of any kinds, with uneven shards."""

    def __init__(self, spec, devices, shards, slowdown=False, chains=1, timed=True, balanced=False):
        """
        Args:
          spec: the model (`models.ModelSpec`): a factory of compiled copies, the
            initial weights every copy starts from, and the objective.
          devices: canonical device names; devices[0] holds the master weights
            and the optimizer's slots, and applies the update.
          shards: examples per device; they sum to the global batch.
          slowdown: build the simulated slowdown in (delays set by `set_delays`).
          chains: how many side-by-side parts each device cuts its shard into
            (`steps.replica_gradients`).
          timed: read each device's seconds in the step (for auto powers and
            rebalancing); False leaves the host clock out of the step.
          balanced: the split is the run's own (mode weighted; single is this
            trainer on one device).
        """
        self.balanced = balanced
        self.devices = list(devices)
        self.shards = list(shards)
        self.chains = chains
        self.timed = timed
        self.jit_compile = spec.jit_compile  # XLA for each device's forward and backward
        self.objective = spec.objective
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
                model = spec.make()
                model.set_weights(spec.weights)
            self.models.append(model)
        with tf.device(self.devices[0]):
            self.optimizer = self.models[0].optimizer
            self.optimizer.build(self.models[0].trainable_variables)
        # Variables the step changes besides the trainable ones (batch-norm moving
        # statistics): combined over the copies after each step (`_combine_statistics`).
        self._statistics = [
            i
            for i, w in enumerate(self.models[0].weights)
            if not w.trainable and "float" in str(w.dtype)
        ]
        self._train_step = tf.function(self._step)
        self._predict_step = tf.function(self._predict, reduce_retracing=True)
        self._seconds_alone = tf.function(self._alone)
        self._seconds_together = tf.function(self._together)

    def describe(self) -> str:
        return "; gradients summed by device0" if self.balanced else ""

    def distribute(self, dataset):
        """The iterator `train_step` reads: global batches, on the host."""
        return iter(dataset)

    def train_step(self, iterator):
        """One update on the next global batch; returns the loss, the outputs and times."""
        return self._train_step(iterator)

    def _step(self, iterator):
        self._broadcast()  # step 5 of the step before
        batch = next(iterator)
        examples = num_examples(batch)  # the global batch, or an epoch's partial last one
        sizes = shard_sizes_for(examples, self.global_batch_size, self.shard_sizes)
        shards = self._split(batch, sizes)
        gradients, losses, predictions, seconds = self._shard_gradients(shards, examples)
        master = self.models[0]
        with tf.device(self.devices[0]):
            summed = [tf.add_n(list(per_device)) for per_device in zip(*gradients)]
            self.optimizer.apply_gradients(zip(summed, master.trainable_variables))
            loss = tf.add_n(losses)
        self._combine_statistics()
        return self._with_in_step(
            {
                "loss": loss,
                "batch": batch,
                "predictions": tuple(predictions),
                "device_seconds": tf.stack(seconds),
            }
        )

    def _shard_gradients(self, shards, examples=None, timed=None):
        """Every device's forward and backward on its shard of a global batch of
        `examples` (default: a full one), side by side.

        Returns per-device lists: (gradients, losses, predictions, seconds).
        """
        per_device = []
        for i, (device, model, shard) in enumerate(zip(self.devices, self.models, shards)):
            with tf.device(device):
                per_device.append(
                    timed_replica_gradients(
                        model,
                        self.objective,
                        shard,
                        self.global_batch_size if examples is None else examples,
                        self._delay(i),
                        self.chains,
                        self.timed if timed is None else timed,
                        self.jit_compile,
                    )
                )
        return tuple(list(column) for column in zip(*per_device))

    def _combine_statistics(self):
        """Moving statistics (batch norm) on device 0 := the copies' values weighted by
        their shards. Each copy moved its statistics toward its own shard's; the
        weighted mean moves the master toward the whole batch's mean exactly (and
        toward the shard-weighted mean of the shards' variances)."""
        if len(self.devices) == 1 or not self._statistics:
            return
        fractions = tf.cast(self.shard_sizes, tf.float32) / self.global_batch_size
        with tf.device(self.devices[0]):
            for i in self._statistics:
                values = [model.weights[i].value for model in self.models]
                mean = tf.add_n([tf.cast(fractions[j], v.dtype) * v for j, v in enumerate(values)])
                self.models[0].weights[i].assign(mean)

    def _split(self, batch, sizes=None):
        """A global batch -> one shard per device, of the current sizes."""
        if len(self.devices) == 1:
            return [batch]
        sizes = self.shard_sizes if sizes is None else sizes
        return split(batch, sizes, len(self.devices))

    def _delay(self, index):
        return None if self.delays is None else self.delays[index]

    def _together(self, batch):
        return tf.stack(self._shard_gradients(self._split(batch), timed=True)[3])

    def _alone(self, batch, index):
        with tf.device(self.devices[index]):
            *_, seconds = timed_replica_gradients(
                self.models[index],
                self.objective,
                batch,
                self.global_batch_size,
                self._delay(index),
                self.chains,
                jit_compile=self.jit_compile,
            )
        return seconds

    def _broadcast(self):
        """Step 5: device 0's weights -> every other device's copy."""
        for device, model in zip(self.devices[1:], self.models[1:]):
            with tf.device(device):
                for target, source in zip(model.weights, self.models[0].weights):
                    target.assign(source.value)

    def predict(self, batch):
        """The outputs and summed loss of an evaluation batch, split over the devices
        like a training batch (a partial batch in the training proportions)."""
        n = int(num_examples(batch))
        sizes = (
            split_batch(n, self.shards)
            if n >= len(self.shards)
            else [n] + [0] * (len(self.shards) - 1)
        )
        summed, predictions = self._predict_step(batch, tuple(sizes))
        return summed, concat(predictions)

    def _predict(self, batch, sizes):
        self._broadcast()
        losses, outputs = [], []
        for device, model, shard, size in zip(
            self.devices, self.models, self._split(batch, list(sizes)), sizes
        ):
            if size == 0:
                continue
            with tf.device(device):
                loss, predictions = self.objective.summed_loss(model, shard)
            losses.append(loss)
            outputs.append(predictions)
        with tf.device(self.devices[0]):
            return tf.add_n(losses), outputs

    def set_weights(self, weights) -> None:
        """Sets `weights` on every copy."""
        for model in self.models:
            model.set_weights(weights)

    @property
    def model(self):
        return self.models[0]
