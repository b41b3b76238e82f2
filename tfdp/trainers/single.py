"""Mode single: the model's own train_step on one device.

Keras' own step as Keras runs it (the direct path), unless the step is timed (auto
powers, rebalancing, the simulated slowdown) or the batch is cut into side-by-side
chains (`steps.DeviceWork`: each piece's loss weighed by its examples, the pieces'
gradients summed and applied once with the model's optimizer).
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import shards as shards_lib
from tfdp.replicas import Placement
from tfdp.steps import DeviceWork, num_examples, unknown_batch_size, with_metrics
from tfdp.trainers.base import Trainer


class SingleDeviceTrainer(Trainer):
    """The model on one device."""

    def __init__(self, model, device, batch_size, slowdown=False, chains=1, timed=True,
                 jit_compile=False):
        """
        Args:
          model: a compiled, built Keras model (any kind): it is trained in place.
          device: the canonical device name.
          batch_size: examples per step.
          slowdown: build the simulated slowdown in (delays set by `set_delays`).
          chains: how many side-by-side pieces the batch is cut into.
          timed: read the device's seconds in the step (for auto powers); False leaves the
            host clock out of the step.
          jit_compile: each piece's forward and backward pass is one XLA program.
        """
        self.devices = [device]
        self.shards = [batch_size]
        self.global_batch_size = batch_size
        self.chains = chains
        self.timed = timed
        with tf.device("/cpu:0"):
            self.shard_sizes = tf.Variable(self.shards, dtype=tf.int32, trainable=False)
            self.delays = tf.Variable([0.0], dtype=tf.float64, trainable=False) if slowdown else None
        self.model = model
        self.placement = Placement(model, device=device)
        self.placement.enter()
        self.optimizer = model.optimizer
        self.jit_compile = jit_compile
        self.work = DeviceWork(model, chains, jit_compile, timed, may_be_empty=False)
        self.probe = DeviceWork(model, chains, jit_compile, True, may_be_empty=False)  # timed
        # One piece, nothing timed: the model's train_step, as Keras runs it.
        self.direct = chains == 1 and not timed and not slowdown
        self._direct_step, self._direct_test = model.train_step, model.test_step
        if jit_compile and not model.run_eagerly:  # as Keras' fit compiles them
            self._direct_step = tf.function(model.train_step, jit_compile=True, autograph=False)
            self._direct_test = tf.function(model.test_step, jit_compile=True, autograph=False)
        self.compile()
        self._seconds_alone = tf.function(self._alone, autograph=False)
        self._seconds_together = tf.function(self._together, autograph=False)

    def _step(self, batch):
        with tf.device(self.devices[0]):
            if self.direct:
                return {"logs": self._direct_step(batch), "device_seconds": tf.zeros([1], tf.float64)}
            with shards_lib.handing_over(self.model):
                logs, gradients, _, seconds = self.work.train_either(
                    batch, num_examples(batch), self._delay()
                )
            if gradients:  # (a model without trainable weights has nothing to update)
                self.optimizer.apply_gradients(zip(gradients, self.work.variables))
        return {"logs": with_metrics(self.model, logs), "device_seconds": tf.stack([seconds])}

    def _test(self, batch):
        with tf.device(self.devices[0]):
            return self._direct_test(unknown_batch_size(batch))

    def _delay(self):
        return None if self.delays is None else self.delays[0]

    def _together(self, batch):
        return tf.stack([self._alone(batch, 0)])

    def _alone(self, batch, index):
        with tf.device(self.devices[index]), shards_lib.handing_over(self.model):
            return self.probe.train(batch, num_examples(batch), self._delay())[3]
