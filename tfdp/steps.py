"""The per-replica math every mode shares: one shard's forward and backward."""

from __future__ import annotations

import tensorflow as tf


def replica_gradients(model, x, y, global_batch_size):
    """Forward and backward on one device's shard of the global batch.

    The loss is the shard's *summed* per-example cross-entropy divided by the
    *global* batch size, so summing these gradients over all shards gives the
    mean gradient of the global batch, however the batch was split. This is
    the tutorial's `grad / batch_size` with the division moved into the loss.

    Returns:
      (gradients, metrics): one gradient per trainable variable, and a dict of
      the shard's summed loss and number of correct predictions (sums, so that
      they add up across shards).
    """
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_sum(losses) / global_batch_size
    gradients = tape.gradient(loss, model.trainable_variables)
    return gradients, shard_metrics(losses, logits, y)


def shard_metrics(losses, logits, y):
    """Summed loss and number of correct predictions of one shard."""
    predictions = tf.argmax(logits, axis=-1, output_type=y.dtype)
    correct = tf.reduce_sum(tf.cast(tf.equal(predictions, y), tf.float32))
    return {"loss_sum": tf.reduce_sum(losses), "correct": correct}


def add_metrics(per_shard):
    """Adds the shards' metric dicts key by key."""
    return {key: tf.add_n([m[key] for m in per_shard]) for key in per_shard[0]}


def replica_correct(model, x, y):
    """Number of correct predictions on one shard, in inference mode."""
    predictions = tf.argmax(model(x, training=False), axis=-1, output_type=y.dtype)
    return tf.reduce_sum(tf.cast(tf.equal(predictions, y), tf.float32))
