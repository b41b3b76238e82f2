"""What a weighed replica step carries while it is traced: its share of the batch, its
all-reduce, and what the replacements of engine/patches.py read of it.

tf.distribute traces each replica in a thread of its own, so the state is per thread.
Outside a step of tfdp's strategy `current()` is None, and every replacement is the
original it replaces.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

_local = threading.local()


class ReplicaStep:
    """One replica's step being traced.

    Attributes:
      fraction: the replica's rows over the batch's (a tensor).
      all_reduce: the replica context's all-reduce, its values placed on the replica's
        device (`placed_all_reduce`).
      traced: the step is traced in a tf.function (not run eagerly).
      own_loss: the step is a model's own `train_step`/`test_step` override.
      weighed_own: an own step's gradients were weighed by `fraction` (engine/patches.py).
      moving_statistics: ids of BatchNormalization moving statistics assigned in the
        step, with per-replica statistics (combined by share when assigned).
    """

    def __init__(self, fraction, all_reduce, traced, own_loss):
        self.fraction, self.all_reduce = fraction, all_reduce
        self.traced, self.own_loss = traced, own_loss
        self.weighed_own = False
        self.moving_statistics = set()


def current() -> ReplicaStep | None:
    """The replica step being traced in this thread, or None."""
    return getattr(_local, "step", None)


@contextlib.contextmanager
def weighed(fraction, all_reduce, own_loss):
    """Inside: a weighed replica step (`current()`)."""
    outer = current()
    # (a model built inside the step may lift out to eager: read it now)
    step = _local.step = ReplicaStep(fraction, all_reduce, not tf.executing_eagerly(), own_loss)
    try:
        yield step
    finally:
        _local.step = outer


def placed_all_reduce(context, strategy):
    """The replica context's all-reduce, its values first placed on the replica's device (a
    collective needs a device to send from; a value Keras reads from a variable may have
    none)."""
    replica = int(tf.get_static_value(context.replica_id_in_sync_group))
    device = strategy.extended.worker_devices[replica % strategy.local_replicas]
    keras_all_reduce = context.all_reduce

    def all_reduce(reduce_op, value, options=None):
        with tf.device(device):
            value = tf.nest.map_structure(tf.identity, value)
        return keras_all_reduce(reduce_op, value, options)

    return all_reduce
