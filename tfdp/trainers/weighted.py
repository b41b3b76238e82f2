"""The tutorial's heterogeneous path: weighted shards, sum on device 0, update there.

The model's variables live on device 0 (`replicas.Placement`). Per step:
  1. the global batch (on the host) is cut into shards of the sizes given by
     `split_batch`, and shard j is copied to device j;
  2. each device runs the model's own train_step on its shard, reading device 0's
     weights (TensorFlow copies each weight to it once: the tutorial's broadcast);
     its loss is weighed by its examples and its gradients are handed over
     instead of applied (shards.py);
  3. the gradients of devices 1..n-1 are copied to device 0 and summed there;
  4. device 0 applies the model's optimizer (the tutorial: plain SGD) once, with
     the optimizer's slots kept there.
Moving statistics (batch norm) are the devices' values weighted by their shards;
the metrics add up every shard's examples. With one device this is the model's
own train_step, as Keras runs it.

The shard sizes live in a variable, so that a rebalanced split (balance.py)
takes effect without tracing the step again; each step also reports how long
every device took for its shard.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import shards as shards_lib
from tfdp.errors import ConfigError
from tfdp.replicas import Placement
from tfdp.steps import (
    DeviceWork,
    merged_logs,
    num_examples,
    shard_sizes_for,
    split,
    sum_gradients,
    unknown_batch_size,
)
from tfdp.trainers.base import Trainer


class WeightedTrainer(Trainer):
    """Data-parallel training over devices of any kinds, with uneven shards."""

    def __init__(
        self,
        model,
        devices,
        shards,
        slowdown=False,
        chains=1,
        timed=True,
        balanced=False,
        jit_compile=False,
        may_be_empty=False,
    ):
        """
        Args:
          model: a compiled, built Keras model (any kind): it is trained in place.
          devices: canonical device names; devices[0] holds the weights and the
            optimizer's slots, and applies the update.
          shards: examples per device; they sum to the global batch.
          slowdown: build the simulated slowdown in (delays set by `set_delays`).
          chains: how many side-by-side pieces each device cuts its shard into.
          timed: read each device's seconds in the step (for auto powers and
            rebalancing); False leaves the host clock out of the step.
          balanced: the split is the run's own (mode weighted; single is this
            trainer on one device).
          jit_compile: each piece's forward and backward pass is one XLA program.
          may_be_empty: a batch may hold fewer examples than there are devices.
        """
        self.balanced = balanced
        self.devices = list(devices)
        self.shards = list(shards)
        self.chains = chains
        self.timed = timed
        self.global_batch_size = sum(shards)
        with tf.device("/cpu:0"):  # the batch is split on the host
            self.shard_sizes = tf.Variable(shards, dtype=tf.int32, trainable=False)
            self.delays = (
                tf.Variable([0.0] * len(devices), dtype=tf.float64, trainable=False)
                if slowdown
                else None
            )
        self.model = model
        self.placement = Placement(model, device=self.devices[0])
        self.placement.enter()
        self.optimizer = model.optimizer
        self.jit_compile = jit_compile
        self.work = DeviceWork(model, chains, jit_compile, timed, may_be_empty)
        self.probe = DeviceWork(model, chains, jit_compile, True, may_be_empty)  # timed
        # One device, one piece, nothing timed: the model's train_step, as Keras runs it.
        self.direct = len(self.devices) == 1 and chains == 1 and not timed and not slowdown
        self._direct_step, self._direct_test = model.train_step, model.test_step
        if jit_compile and not model.run_eagerly:  # as Keras' fit compiles them
            self._direct_step = tf.function(model.train_step, jit_compile=True, autograph=False)
            self._direct_test = tf.function(model.test_step, jit_compile=True, autograph=False)
        # Variables a step changes besides the trainable ones (batch-norm moving
        # statistics): each device starts from the same values, and the step ends
        # with the values weighted by the devices' shards.
        self._statistics = [
            w for w in model.non_trainable_weights if "float" in str(w.dtype)
        ] if len(self.devices) > 1 else []
        self.compile()
        self._seconds_alone = tf.function(self._alone, autograph=False)
        self._seconds_together = tf.function(self._together, autograph=False)

    def describe(self) -> str:
        return "; gradients summed by device0" if self.balanced else ""

    def _step(self, batch):
        if self.direct:
            with tf.device(self.devices[0]):
                logs = self._direct_step(batch)
            return {"logs": logs, "device_seconds": tf.zeros([1], tf.float64)}
        examples = num_examples(batch)  # the global batch, or an epoch's partial last one
        sizes = shard_sizes_for(examples, self.global_batch_size, self.shard_sizes)
        logs, gradients, held, seconds, statistics = self._devices(batch, examples, sizes)
        if len(self.devices) > 1 and any("updates the weights itself" in n for n in self.notes()):
            raise ConfigError(
                "model",
                self.model.name,
                f"{type(self.model).__name__}.train_step applies its updates itself, not through "
                "model.optimizer: mode weighted sums the devices' gradients on device 0 and "
                "cannot run it; use mode mirrored or single (its own updates run there as in Keras)",
            )
        with tf.device(self.devices[0]):
            if tf.executing_eagerly():  # run_eagerly: the devices that held examples
                gradients = [g for g, h in zip(gradients, held) if bool(h)] or gradients[:1]
            summed = sum_gradients(gradients)
            if summed:  # (a model without trainable weights has nothing to update)
                self.optimizer.apply_gradients(zip(summed, self.work.variables))
            self._combine_statistics(statistics, sizes, examples)
        return {
            "logs": merged_logs(self.model, logs, held),
            "device_seconds": tf.stack(seconds),
        }

    def _devices(self, batch, examples, sizes, work=None):
        """Every device's train_step on its shard, without the update. Returns per-device
        lists: logs, gradients, whether it held examples, seconds, moving statistics.
        Guarded against pieces without examples only on a step that has one
        (`DeviceWork.train_either`): one conditional around every device, as the
        devices' metric updates share the model's metric variables."""
        work = work or self.work
        if not work.guarded or tf.executing_eagerly():
            return self._on_devices(batch, examples, sizes, work, guard=True)
        return tf.cond(
            work.full(sizes),
            lambda: self._on_devices(batch, examples, sizes, work, guard=False),
            lambda: self._on_devices(batch, examples, sizes, work, guard=True),
        )

    def _on_devices(self, batch, examples, sizes, work, guard):
        shards = self._split(batch, sizes)
        before = [s.value.read_value() for s in self._statistics]
        logs, gradients, held, seconds, statistics = [], [], [], [], []
        with shards_lib.handing_over(self.model):
            for i, (device, shard) in enumerate(zip(self.devices, shards)):
                with tf.device(device):
                    if i:  # every device starts from the same statistics
                        for variable, value in zip(self._statistics, before):
                            variable.assign(value)
                    result = work.train(shard, examples, self._delay(i), guard=guard)
                    statistics.append([s.value.read_value() for s in self._statistics])
                for column, value in zip((logs, gradients, held, seconds), result):
                    column.append(value)
        return logs, gradients, held, seconds, statistics

    def _combine_statistics(self, statistics, sizes, examples):
        """Moving statistics (batch norm) := the devices' values weighted by their shards.
        Each device moved them toward its own shard's statistics; the weighted mean moves
        them toward the whole batch's mean exactly (and toward the shard-weighted mean of
        the shards' variances)."""
        if not self._statistics:
            return
        fractions = tf.cast(sizes, tf.float32) / tf.cast(examples, tf.float32)
        for i, variable in enumerate(self._statistics):
            values = [device[i] for device in statistics]
            mean = tf.add_n(
                [tf.cast(fractions[j], v.dtype) * v for j, v in enumerate(values)]
            )
            variable.assign(mean)

    def _split(self, batch, sizes):
        """A global batch -> one shard per device, of `sizes`."""
        if len(self.devices) == 1:
            return [batch]
        return split(batch, sizes, len(self.devices))

    def _delay(self, index):
        return None if self.delays is None else self.delays[index]

    def _test(self, batch):
        examples = num_examples(batch)
        if len(self.devices) == 1:
            with tf.device(self.devices[0]):
                return self._direct_test(unknown_batch_size(batch))
        sizes = shard_sizes_for(examples, self.global_batch_size, self.shard_sizes)
        logs, held = [], []
        for device, shard in zip(self.devices, self._split(batch, sizes)):
            with tf.device(device):
                logs.append(self.work.test(shard, examples))
                held.append(num_examples(shard) > 0)
        return merged_logs(self.model, logs, held)

    def _together(self, batch):
        examples = num_examples(batch)
        sizes = tf.convert_to_tensor(self.shard_sizes)
        return tf.stack(self._devices(batch, examples, sizes, self.probe)[3])

    def _alone(self, batch, index):
        with tf.device(self.devices[index]), shards_lib.handing_over(self.model):
            return self.probe.train(batch, num_examples(batch), self._delay(index))[3]

    @property
    def host_iterator(self) -> bool:
        return True
