"""The per-replica math every mode shares: one shard's forward and backward."""

from __future__ import annotations

import time
import weakref

import numpy as np
import tensorflow as tf

from tfdp.objective import num_examples


def replica_gradients(model, objective, batch, global_batch_size, chains=1, jit_compile=False):
    """Forward and backward on one device's shard of the global batch.

    The loss is the shard's part of the global batch's loss
    (`Objective.shard_loss`): its *summed* per-example losses divided by the
    *global* batch size, so summing these gradients over all shards gives the
    gradient of the whole batch's mean loss, however the batch was split. This
    is the tutorial's `grad / batch_size` with the division moved into the loss.

    chains: the shard is cut into this many near-equal parts whose forward and
      backward passes are independent ops, summed at the end. TensorFlow runs
      them side by side, so a CPU device keeps several cores busy with
      one-threaded kernels (see `devices.default_chains`). The sum is the
      shard's gradient, to float rounding, for any shard size (for models
      without batch statistics: tfdp picks 1 chain for those).
    jit_compile: the whole forward and backward (all its chains) is one XLA
      program (`xla_gradients`), compiled for each shard shape it meets.

    Returns:
      (gradients, loss, predictions): one gradient per trainable variable, the
      shard's part of the loss (parts add up across shards) and its outputs.
    """
    if jit_compile:
        return xla_gradients(model, objective, chains)(batch, global_batch_size)
    if chains == 1:
        return _chain_gradients(model, objective, batch, global_batch_size)
    parts = cut(batch, chains)
    results = [_chain_gradients(model, objective, parts[0], global_batch_size)]
    static = tf.nest.flatten(batch)[0].shape[0]
    for part in parts[1:]:
        if static is not None and static >= chains:  # no part is empty
            results.append(_chain_gradients(model, objective, part, global_batch_size))
            continue
        # A shard with fewer examples than chains leaves the last parts empty,
        # which a convolution does not take: those add nothing.
        results.append(
            tf.cond(
                num_examples(part) > 0,
                lambda part=part: _chain_gradients(model, objective, part, global_batch_size),
                lambda: _nothing(model, results[0][2]),
            )
        )
    gradients = [tf.add_n(list(g)) for g in zip(*[g for g, _, _ in results])]
    loss = tf.add_n([loss for _, loss, _ in results])
    predictions = tf.nest.map_structure(
        lambda *leaves: tf.concat(leaves, axis=0), *[p for _, _, p in results]
    )
    return gradients, loss, predictions


_compiled = weakref.WeakKeyDictionary()  # model -> {(objective id, chains): XLA function}


def xla_gradients(model, objective, chains=1):
    """`replica_gradients` of `model` as one function compiled by XLA
    (tf.function(jit_compile=True)): (batch, global_batch_size) -> its results.

    One function per model copy, objective and chains, made once: every trace of
    a step that calls it embeds the same function, and XLA compiles it once per
    shard shape. It holds only the math: the host clock and the simulated
    slowdown (`timed_replica_gradients`) stay outside, as XLA cannot compile a
    call back into Python (tf.numpy_function).
    """
    functions = _compiled.setdefault(model, {})
    key = (id(objective), chains)
    if key not in functions:
        functions[key] = tf.function(
            lambda batch, global_batch_size: replica_gradients(
                model, objective, batch, global_batch_size, chains
            ),
            jit_compile=True,
        )
    return functions[key]


def _chain_gradients(model, objective, batch, global_batch_size):
    optimizer = getattr(model, "optimizer", None)  # a compiled model: its loss scaling
    with tf.GradientTape() as tape:
        loss, predictions = objective.shard_loss(model, batch, global_batch_size)
        scaled = optimizer.scale_loss(loss) if optimizer is not None else loss
    gradients = tape.gradient(scaled, model.trainable_variables)
    return gradients, loss, predictions


def _nothing(model, like):
    """What an empty chain adds: zero gradients and loss, no predictions (shaped as `like`'s)."""
    zeros = [tf.zeros_like(v) for v in model.trainable_variables]
    return zeros, tf.constant(0.0), tf.nest.map_structure(lambda p: p[:0], like)


def cut(batch, parts):
    """A nested batch cut along its first axis into `parts` near-equal pieces (sizes known at
    run time): a list of `parts` batches of the same structure."""
    n = num_examples(batch)
    sizes = n // parts + tf.cast(tf.range(parts) < n % parts, tf.int32)
    return split(batch, sizes, parts)


def partial_shards(examples, shards):
    """The split of a partial batch of `examples` (a scalar tensor) over devices whose
    full-batch shares are `shards` (a vector): one example each first, when there are
    enough, then the rest in proportion to `shards`, largest remainder first (ties to
    the earlier device), as `devices.split_batch` does."""
    shards = tf.cast(shards, tf.int64)
    n = tf.cast(examples, tf.int64)
    devices = tf.size(shards, out_type=tf.int64)
    ones = tf.cast(n >= devices, tf.int64)
    rest = n - ones * devices
    total = tf.reduce_sum(shards)
    base = rest * shards // total
    remainders = rest * shards - base * total
    missing = rest - tf.reduce_sum(base)
    order = tf.argsort(-remainders, stable=True)
    extra = tf.scatter_nd(
        tf.expand_dims(order[:missing], 1), tf.ones([missing], tf.int64), [devices]
    )
    return tf.cast(base + extra + ones, tf.int32)


def shard_sizes_for(examples, global_batch_size, shards):
    """`shards` for a full global batch, `partial_shards` for the last, partial one."""
    return tf.cond(
        tf.equal(examples, global_batch_size),
        lambda: tf.convert_to_tensor(shards, tf.int32),
        lambda: partial_shards(examples, shards),
    )


def split(batch, sizes, parts):
    """A nested batch cut along its first axis into pieces of `sizes`: a list of batches."""
    leaves = [tf.split(leaf, sizes, num=parts) for leaf in tf.nest.flatten(batch)]
    return [tf.nest.pack_sequence_as(batch, [pieces[j] for pieces in leaves]) for j in range(parts)]


def clip_before_all_reduce(optimizer, gradients):
    """Gradients for `optimizer.apply_gradients` inside a replica, so that its clipping
    (clipnorm, clipvalue, global_clipnorm) acts on the summed gradient.

    Keras' optimizer clips each replica's gradient and only then sums them, so
    a replica's clip would depend on its shard. With clipping set, this sums
    the gradients first, clips the sum as the optimizer would, and hands each
    replica 1/n of it: the optimizer's own clip then changes nothing (each
    part is within its bound) and its sum is the clipped sum. Without
    clipping, the gradients go as they are (no extra all-reduce).
    """
    if not any(
        getattr(optimizer, name, None) for name in ("clipnorm", "clipvalue", "global_clipnorm")
    ):
        return gradients
    context = tf.distribute.get_replica_context()
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, gradients)
    clipped = optimizer._clip_gradients(summed)  # Keras' own clipping rule
    replicas = tf.cast(context.num_replicas_in_sync, clipped[0].dtype)
    return [g / replicas for g in clipped]


def micro_batch_gradients(model, objective, batch, global_batch_size, pieces, side_by_side):
    """`replica_gradients` of `pieces` equal micro-batches of `batch`, summed: (gradients, loss).

    The batch must divide into `pieces`. The sum is the whole batch's gradient,
    to float rounding.

    side_by_side: the micro-batches' ops are independent, and TensorFlow may
    run them at the same time; else they run one after another (a tf.range loop).
    """
    if side_by_side:
        gradients, loss, _ = replica_gradients(model, objective, batch, global_batch_size, pieces)
        return gradients, loss
    stacked = tf.nest.map_structure(lambda t: tf.reshape(t, [pieces, -1, *t.shape[1:]]), batch)
    gradients = [tf.zeros_like(v) for v in model.trainable_variables]
    loss = tf.constant(0.0)
    for i in tf.range(pieces):
        part = tf.nest.map_structure(lambda t: t[i], stacked)
        part_gradients, part_loss, _ = replica_gradients(model, objective, part, global_batch_size)
        gradients = [g + p for g, p in zip(gradients, part_gradients)]
        loss += part_loss
    return gradients, loss


def timed_replica_gradients(
    model,
    objective,
    batch,
    global_batch_size,
    delay_per_example=None,
    chains=1,
    timed=True,
    jit_compile=False,
):
    """`replica_gradients`, plus the seconds this device spent on them.

    The seconds are read from the host clock in the step itself, when the
    shard is there and when its last gradient is ready, so every device is
    timed as it runs alongside the others.

    Args:
      delay_per_example: a simulated slowdown (a scalar tensor, seconds): after
        its backward pass the device sleeps this long per example of its
        shard. A sleep uses no core, so the other devices keep their speed.
      timed: False leaves the clock out (the seconds are 0).
      jit_compile: XLA compiles the forward and backward; the clock reads
        around it stay outside, on the host.

    Returns:
      (gradients, loss, predictions, seconds).
    """
    if not timed and delay_per_example is None:
        gradients, loss, predictions = replica_gradients(
            model, objective, batch, global_batch_size, chains, jit_compile
        )
        return gradients, loss, predictions, tf.constant(0.0, tf.float64)
    first = tf.nest.flatten(batch)[0]
    start = _clock(first)
    with tf.control_dependencies([start]):  # the forward pass starts after the clock is read
        batch = tf.nest.map_structure(tf.identity, batch)
    gradients, loss, predictions = replica_gradients(
        model, objective, batch, global_batch_size, chains, jit_compile
    )
    end = _clock(*gradients)
    if delay_per_example is not None:
        examples = tf.cast(num_examples(batch), tf.float64)
        end = tf.numpy_function(
            _sleep_then_clock, [end, examples * delay_per_example], tf.float64, stateful=False
        )
    with tf.control_dependencies([end]):
        gradients = [tf.identity(g) for g in gradients]  # released once the clock is read
    return gradients, loss, predictions, end - start


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
