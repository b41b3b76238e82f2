"""The host clock inside a compiled step, read without ordering the replicas.

`tf.timestamp` and a stateful `tf.numpy_function` are stateful ops, and a
tf.function runs its stateful ops in program order: under a strategy, the
replicas are traced one after the other, so a clock in each replica's part would
make replica 1 start only once replica 0's clock has run (their steps would run
one after the other). These ops are stateless: each waits only for the tensors it
is given.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf


def read_after(*tensors) -> tf.Tensor:
    """The host clock (seconds, float64), read once `tensors` are computed."""
    ready = [tf.reshape(t, [-1])[:1] for t in tensors]  # a slice waits for the whole tensor
    return tf.numpy_function(_now, ready, tf.float64, stateful=False)


def sleep_then_read(after, seconds) -> tf.Tensor:
    """Sleeps `seconds` once `after` is computed (a sleep holds an inter-op thread, no
    core), then reads the host clock."""
    return tf.numpy_function(
        _sleep_then_now, [after, tf.cast(seconds, tf.float64)], tf.float64, stateful=False
    )


def _now(*_):
    return np.float64(time.perf_counter())


def _sleep_then_now(_, seconds):
    time.sleep(max(float(seconds), 0.0))
    return _now()
