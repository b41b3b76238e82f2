"""What a replica computes of the whole global batch, however uneven the pieces: a Keras
step's logs, and a BatchNormalization layer's mean and variance."""

from __future__ import annotations

import tensorflow as tf

from tfdp import internals


def logs(model, given, fraction, context, all_reduce=None):
    """A Keras step's logs (`given`) as the whole batch gives them: every value that is one of the
    model's metrics read from its variables summed over the replicas; any other float
    value the replicas' values weighed by share."""
    all_reduce = all_reduce or context.all_reduce
    metrics = model.metrics
    variables, seen = [], set()
    for metric in metrics:
        for variable in metric.variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    whole = {}
    if variables:
        values = [tf.convert_to_tensor(v.value) for v in variables]
        summable = [i for i, v in enumerate(variables) if v.aggregation in ("sum", "mean")]
        reduced = _sum_by_dtype(all_reduce, [_as_float(values[i]) for i in summable])
        count = float(context.num_replicas_in_sync)
        for i, value in zip(summable, reduced):
            if variables[i].aggregation == "mean":
                value = value / count
            values[i] = tf.cast(value, values[i].dtype)
        with internals.stateless_scope(list(zip(variables, values))):
            for metric in metrics:
                result = metric.result()
                if isinstance(result, dict):
                    whole.update(result)
                else:
                    whole[metric.name] = result
    weighed = {}
    for name, value in given.items():
        if name in whole and _same_shape(whole[name], value):
            weighed[name] = tf.cast(whole[name], tf.convert_to_tensor(value).dtype)
        elif tf.is_tensor(value) and value.dtype.is_floating:
            share = tf.cast(fraction, value.dtype)
            weighed[name] = all_reduce(tf.distribute.ReduceOp.SUM, value * share)
        else:
            weighed[name] = value
    return weighed


def moments(layer, inputs, mask, all_reduce):
    """A BatchNormalization layer's mean and variance over the whole global batch. Each
    replica computes its piece's count, mean and sum of squared deviations, as one
    device computes them; one all-reduce hands every replica every piece's, which
    combine as parallel variance does (Chan et al.): no precision lost to a large mean.
    A mask weighs the examples as Keras' own masked moments do."""
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    axes = internals.reduction_axes(layer)
    if mask is None:
        weights = tf.ones_like(inputs[tuple(slice(0, 1) if i in axes else slice(None)
                                             for i in range(inputs.shape.rank))])
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype) * weights
        weights = None
        epsilon = 0.0
    else:
        weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), inputs.dtype)
        count = tf.reduce_sum(weights, axes, keepdims=True)
        epsilon = internals.keras_epsilon()
    weighed = inputs if weights is None else inputs * weights
    mean = tf.math.divide_no_nan(tf.reduce_sum(weighed, axes, keepdims=True), count)
    deviations = tf.square(inputs - mean)
    if weights is not None:
        deviations *= weights
    squares = tf.reduce_sum(deviations, axes, keepdims=True)
    mine = tf.stack([count, mean, squares])  # [3, 1.., C, ..1]
    slot = tf.reshape(tf.one_hot(replica, replicas, dtype=inputs.dtype),
                      [replicas] + [1] * mine.shape.rank)
    every = all_reduce(tf.distribute.ReduceOp.SUM, slot * mine[tf.newaxis])
    counts, means, squares = every[:, 0], every[:, 1], every[:, 2]
    total = tf.reduce_sum(counts, 0)
    mean = tf.math.divide_no_nan(tf.reduce_sum(counts * means, 0), total + epsilon)
    squares = tf.reduce_sum(squares + counts * tf.square(means - mean), 0)
    variance = tf.math.divide_no_nan(squares, total + epsilon)
    return tf.squeeze(mean, axes), tf.squeeze(variance, axes)


def _sum_by_dtype(all_reduce, values):
    """The replicas' sums of `values`, one all-reduce per dtype (TensorFlow packs a list
    into one tensor, which fails on mixed dtypes: a float64 confusion matrix beside
    float32 totals)."""
    sums = [None] * len(values)
    for dtype in sorted({v.dtype for v in values}, key=lambda d: d.name):  # the same order on every replica
        indices = [i for i, v in enumerate(values) if v.dtype == dtype]
        for i, total in zip(indices, all_reduce(tf.distribute.ReduceOp.SUM, [values[i] for i in indices])):
            sums[i] = total
    return sums


def _as_float(value):
    return value if value.dtype.is_floating else tf.cast(value, tf.float64)


def _same_shape(a, b) -> bool:
    try:
        return tf.convert_to_tensor(a).shape == tf.convert_to_tensor(b).shape
    except (TypeError, ValueError):
        return False
