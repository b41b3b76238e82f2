"""What every mode does on one device: the model's own steps on its shard of the batch.

`DeviceWork` runs `model.train_step` on a device's shard, cut into side-by-side
pieces (chains), each weighed by its examples (shards.py), and returns the
gradients the pieces handed over, summed, for the mode to reduce and apply;
`test` runs `model.test_step` likewise. The cutting of a global batch into
shards (`split`, `shard_sizes_for`) is here too, so that every mode cuts alike.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from tfdp import shards as shards_lib


def num_examples(batch) -> tf.Tensor:
    """The examples in a batch: the length of its first leaf."""
    return tf.shape(tf.nest.flatten(batch)[0])[0]


class DeviceWork:
    """One device's part of a step: the model's train_step (or test_step) on its shard.

    Args:
      model: the Keras model (any kind); its steps run as the model defines them.
      chains: pieces each shard is cut into, run side by side: a CPU device keeps
        several cores busy with one-threaded kernels (`devices.default_chains`).
        The pieces' gradients add up to the shard's (shards.py), for models without
        batch statistics (tfdp picks 1 chain for those).
      jit_compile: each piece's forward and backward pass is one XLA program.
      timed: read the host clock when the shard is there and when its gradients are
        ready (`seconds`); False leaves the clock out.
      may_be_empty: a shard may hold no examples (a batch smaller than the devices):
        its pieces are then skipped (a kernel such as oneDNN's max-pooling gradient
        does not take an empty batch).
    """

    def __init__(self, model, chains=1, jit_compile=False, timed=False, may_be_empty=False):
        self.model = model
        self.chains = chains
        self.jit_compile = jit_compile
        self.timed = timed
        self.may_be_empty = may_be_empty
        self.variables = None  # of the gradients, in order (known once traced)
        self.weighed = False  # a piece's own loss was weighed by its examples (shards.py)
        run = self._train_piece
        test = shards_lib.test_piece
        if jit_compile:
            run = tf.function(run, jit_compile=True, autograph=False)
            test = tf.function(test, jit_compile=True, autograph=False)
        self._run, self._test = run, test

    def train(self, shard, examples, delay_per_example=None):
        """The model's train_step on `shard` of a global batch of `examples`, without the
        update: (its logs, its summed gradients (one per `self.variables`), whether it
        held examples, its seconds)."""
        n = num_examples(shard)
        start = None
        if self.timed or delay_per_example is not None:
            start = _clock(tf.nest.flatten(shard)[0])
            with tf.control_dependencies([start]):  # the work starts after the clock is read
                shard = tf.nest.map_structure(tf.identity, shard)
        parts = cut(shard, self.chains) if self.chains > 1 else [shard]
        logs, gradients = None, None
        for index, part in enumerate(parts):
            guarded = self.may_be_empty or index > 0  # the later pieces of a small shard
            part_logs, part_gradients = self._piece(part, examples, guarded)
            if logs is None:
                logs, gradients = part_logs, part_gradients
                continue
            size = num_examples(part)
            logs = tf.nest.map_structure(lambda new, old: tf.where(size > 0, new, old), part_logs, logs)
            gradients = [g + p for g, p in zip(gradients, part_gradients)]
        seconds = tf.constant(0.0, tf.float64)
        if start is not None:
            end = _clock(*gradients) if gradients else _clock(n)
            if delay_per_example is not None:
                end = tf.numpy_function(
                    _sleep_then_clock,
                    [end, tf.cast(n, tf.float64) * delay_per_example],
                    tf.float64,
                    stateful=False,
                )
            with tf.control_dependencies([end]):
                gradients = [tf.identity(g) for g in gradients]  # released once the clock is read
            seconds = end - start
        return logs, gradients, n > 0, seconds

    def _piece(self, part, examples, guarded):
        fraction = tf.cast(num_examples(part), tf.float32) / tf.cast(examples, tf.float32)
        if not guarded:
            return self._run(part, fraction)
        traced = {}

        def run():
            logs, gradients = self._run(part, fraction)
            traced["logs"] = logs
            return logs, gradients

        def nothing():  # traced after `run` (tf.cond traces the true branch first)
            zeros = tf.nest.map_structure(tf.zeros_like, traced["logs"])
            return zeros, [tf.zeros_like(v) for v in self.variables]

        return tf.cond(num_examples(part) > 0, run, nothing)

    def _train_piece(self, part, fraction):
        logs, handed, scaled = shards_lib.train_piece(self.model, part, fraction)
        if not scaled:
            self.weighed = True
        pairs = handed.pairs()
        variables = [v for _, v in pairs]
        if self.variables is None:
            self.variables = variables
        elif [id(v) for v in variables] != [id(v) for v in self.variables]:
            raise ValueError("the model's train_step handed over other variables on another piece")
        logs = tf.nest.map_structure(tf.convert_to_tensor, logs)
        return logs, [g for g, _ in pairs]

    def test(self, shard, examples):
        """The model's test_step on `shard` of a batch of `examples`: its logs (zeros for a
        shard without examples, which the caller leaves out). Evaluation batches may be
        smaller than the devices, so a shard may always be empty."""
        fraction = tf.cast(num_examples(shard), tf.float32) / tf.cast(examples, tf.float32)
        traced = {}

        def run():
            traced["logs"] = _tensors(self._test(self.model, shard, fraction))
            return traced["logs"]

        def nothing():
            return tf.nest.map_structure(tf.zeros_like, traced["logs"])

        return tf.cond(num_examples(shard) > 0, run, nothing)


def _tensors(logs):
    return tf.nest.map_structure(tf.convert_to_tensor, logs)


def merged_logs(model, per_device, has_examples):
    """A step's logs from its devices' (in a local trainer): the metrics' values read
    after every device's update (the whole batch's running values), and the model's
    other logs from the last device that held examples."""
    logs = per_device[0]
    for device_logs, held in zip(per_device[1:], has_examples[1:]):
        logs = tf.nest.map_structure(lambda new, old: tf.where(held, new, old), device_logs, logs)
    return with_metrics(model, logs)


def with_metrics(model, logs):
    """`logs` with each entry that is one of the model's metrics read from the metric
    itself (in a strategy's cross-replica context: summed over the replicas), as Keras'
    fit reads them at an epoch's end."""
    if not isinstance(logs, dict):
        return logs
    results = model.get_metrics_result()
    return {name: results.get(name, value) for name, value in logs.items()}


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
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if not any(
        getattr(optimizer, name, None) for name in ("clipnorm", "clipvalue", "global_clipnorm")
    ):
        return gradients
    context = tf.distribute.get_replica_context()
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, gradients)
    clipped = optimizer._clip_gradients(summed)  # noqa: SLF001 - Keras' own clipping rule
    replicas = tf.cast(context.num_replicas_in_sync, clipped[0].dtype)
    return [g / replicas for g in clipped]


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
