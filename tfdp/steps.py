"""The per-replica math every mode shares: one shard's forward and backward."""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf


def replica_gradients(model, x, y, global_batch_size, chains=1):
    """Forward and backward on one device's shard of the global batch.

    The loss is the shard's *summed* per-example cross-entropy divided by the
    *global* batch size, so summing these gradients over all shards gives the
    mean gradient of the global batch, however the batch was split. This is
    the tutorial's `grad / batch_size` with the division moved into the loss.

    chains: the shard is cut into this many near-equal parts whose forward and
      backward passes are independent ops, summed at the end. TensorFlow runs
      them side by side, so a CPU device keeps several cores busy with
      one-threaded kernels (see `devices.default_chains`). The sum is the
      shard's gradient, to float rounding, for any shard size.

    Returns:
      (gradients, metrics): one gradient per trainable variable, and a dict of
      the shard's summed loss and number of correct predictions (sums, so that
      they add up across shards).
    """
    if chains == 1:
        return _chain_gradients(model, x, y, global_batch_size)
    x_parts, y_parts = cut(x, chains), cut(y, chains)
    parts = [_chain_gradients(model, x_parts[0], y_parts[0], global_batch_size)]
    for x_part, y_part in zip(x_parts[1:], y_parts[1:]):
        if x.shape[0] is not None and x.shape[0] >= chains:  # no part is empty
            parts.append(_chain_gradients(model, x_part, y_part, global_batch_size))
            continue
        # A shard with fewer examples than chains leaves the last parts empty,
        # which a convolution does not take: those add nothing.
        parts.append(
            tf.cond(
                tf.size(y_part) > 0,
                lambda x_part=x_part, y_part=y_part: _chain_gradients(
                    model, x_part, y_part, global_batch_size
                ),
                lambda: _nothing(model),
            )
        )
    gradients = [tf.add_n(list(g)) for g in zip(*[g for g, _ in parts])]
    return gradients, add_metrics([m for _, m in parts])


def _chain_gradients(model, x, y, global_batch_size):
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_sum(losses) / global_batch_size
    gradients = tape.gradient(loss, model.trainable_variables)
    return gradients, shard_metrics(losses, logits, y)


def _nothing(model):
    """What an empty chain adds: zero gradients and metrics."""
    zero = tf.constant(0.0)
    return [tf.zeros_like(v) for v in model.trainable_variables], {
        "loss_sum": zero,
        "correct": zero,
    }


def cut(tensor, parts):
    """`tensor` cut along its first axis into `parts` near-equal pieces (sizes known at run time)."""
    n = tf.shape(tensor, out_type=tf.int32)[0]
    sizes = n // parts + tf.cast(tf.range(parts) < n % parts, tf.int32)
    return tf.split(tensor, sizes, num=parts)


def shard_metrics(losses, logits, y):
    """Summed loss and number of correct predictions of one shard."""
    predictions = tf.argmax(logits, axis=-1, output_type=y.dtype)
    correct = tf.reduce_sum(tf.cast(tf.equal(predictions, y), tf.float32))
    return {"loss_sum": tf.reduce_sum(losses), "correct": correct}


def add_metrics(per_shard):
    """Adds the shards' metric dicts key by key."""
    return {key: tf.add_n([m[key] for m in per_shard]) for key in per_shard[0]}


def micro_batch_gradients(model, x, y, global_batch_size, pieces, side_by_side):
    """`replica_gradients` of `pieces` equal micro-batches of (x, y), summed.

    The batch must divide into `pieces`. The sum is the whole batch's gradient,
    to float rounding.

    side_by_side: the micro-batches' ops are independent, and TensorFlow may
    run them at the same time; else they run one after another (a tf.range loop).
    """
    if side_by_side:
        return replica_gradients(model, x, y, global_batch_size, chains=pieces)
    xs = tf.reshape(x, [pieces, -1, *x.shape[1:]])
    ys = tf.reshape(y, [pieces, -1])
    gradients = [tf.zeros_like(v) for v in model.trainable_variables]
    metrics = {"loss_sum": tf.constant(0.0), "correct": tf.constant(0.0)}
    for i in tf.range(pieces):
        part, shard = replica_gradients(model, xs[i], ys[i], global_batch_size)
        gradients = [g + p for g, p in zip(gradients, part)]
        metrics = {key: metrics[key] + shard[key] for key in metrics}
    return gradients, metrics


def replica_correct(model, x, y):
    """Number of correct predictions on one shard, in inference mode."""
    predictions = tf.argmax(model(x, training=False), axis=-1, output_type=y.dtype)
    return tf.reduce_sum(tf.cast(tf.equal(predictions, y), tf.float32))


def timed_replica_gradients(model, x, y, global_batch_size, delay_per_example=None, chains=1):
    """`replica_gradients`, plus the seconds this device spent on them.

    The seconds are read from the host clock in the step itself, when the
    shard is there and when its last gradient is ready, so every device is
    timed as it runs alongside the others.

    Args:
      delay_per_example: a simulated slowdown (a scalar tensor, seconds): after
        its backward pass the device sleeps this long per example of its
        shard. A sleep uses no core, so the other devices keep their speed.

    Returns:
      (gradients, metrics, seconds).
    """
    start = _clock(x)
    with tf.control_dependencies([start]):
        x = tf.identity(x)  # the forward pass starts after the clock is read
    gradients, metrics = replica_gradients(model, x, y, global_batch_size, chains)
    end = _clock(*gradients)
    if delay_per_example is not None:
        examples = tf.cast(tf.shape(x)[0], tf.float64)
        end = tf.numpy_function(
            _sleep_then_clock, [end, examples * delay_per_example], tf.float64, stateful=False
        )
    with tf.control_dependencies([end]):
        gradients = [tf.identity(g) for g in gradients]  # released once the clock is read
    return gradients, metrics, end - start


def _clock(*tensors):
    """The host clock, read once `tensors` are computed.

    A stateless op: tf.function runs stateful ops in program order, which
    would make each device's clock wait for the devices traced before it.
    """
    ready = [tf.reshape(t, [-1])[:1] for t in tensors]  # a slice waits for the whole tensor
    return tf.numpy_function(_now, ready, tf.float64, stateful=False)


def _now(*_):
    return np.float64(time.perf_counter())


def _sleep_then_clock(_, seconds):
    time.sleep(float(seconds))
    return _now()
