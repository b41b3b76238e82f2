"""A custom training loop under tf.distribute.MirroredStrategy."""

from __future__ import annotations

import itertools

import tensorflow as tf

from tfdp.devices import even_split, split_batch
from tfdp.objective import concat, num_examples
from tfdp.steps import clip_before_all_reduce, shard_sizes_for, split, timed_replica_gradients
from tfdp.trainers.base import Trainer

_strategies_made = itertools.count(1)


def cross_device_ops_for(all_reduce: str, devices):
    """The cross-device ops for `all_reduce`; None lets MirroredStrategy choose.

    auto is MirroredStrategy's own choice: ring all-reduce with collective ops
    on CPUs, NCCL on GPUs, reduction to one device for a CPU+GPU mix.
    """
    if all_reduce == "reduce_to_one":
        return tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])
    if all_reduce == "nccl":
        return tf.distribute.NcclAllReduce()
    return None  # auto


def make_strategy(devices, all_reduce: str = "auto"):
    """A MirroredStrategy whose collective ops cannot meet another strategy's.

    Every MirroredStrategy numbers its collective groups from the same start,
    so two strategies over different device sets in one process collide
    ("joining a group with size 4, but that group has size 2"). Giving each
    strategy its own range of group keys (the base TensorFlow reads when the
    strategy is built) keeps them apart.
    """
    tf.distribute.MirroredStrategy._collective_key_base = 100_000 * next(_strategies_made)
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=cross_device_ops_for(all_reduce, devices)
    )


class MirroredTrainer(Trainer):
    """Synchronous replicas of one Keras model, one per device."""

    def __init__(
        self,
        spec,
        devices,
        global_batch_size,
        all_reduce="auto",
        input="split",
        shards=None,
        slowdown=False,
        chains=1,
        timed=True,
    ):
        """
        Args:
          spec: the model (`models.ModelSpec`); its factory is called in the
            strategy's scope, so its weights and optimizer slots are mirrored.
          devices: canonical device names, one replica each.
          global_batch_size: examples per step over all replicas.
          all_reduce: see `cross_device_ops_for`.
          input: "split": each global batch is cut on the host into near-equal
            shards (largest remainder), handed to the replicas with
            `experimental_distribute_values_from_function`; "dataset":
            `experimental_distribute_dataset` splits it (ceil(B / n) each).
          shards: with input "split", examples per replica, uneven if need be
            (the weighted split over all-reduce); None: near-equal.
          slowdown: build the simulated slowdown in (delays set by `set_delays`).
          chains: how many side-by-side parts each replica cuts its shard into
            (`steps.replica_gradients`).
          timed: read each replica's seconds in the step (for auto powers and
            rebalancing); False leaves the host clock out of the step.
        """
        self.devices = list(devices)
        self.balanced = shards is not None  # the weighted split over all-reduce
        self.chains = chains
        self.timed = timed
        self.jit_compile = spec.jit_compile  # XLA for each replica's forward and backward
        self.objective = spec.objective
        self.global_batch_size = global_batch_size
        self.input = input
        n = len(self.devices)
        if input == "split":
            self.shards = list(shards or split_batch(global_batch_size, [1] * n))
        elif shards is None:
            self.shards = even_split(global_batch_size, n)
        else:
            raise ValueError("chosen shards need input='split'")
        with tf.device("/cpu:0"):  # the batch is split on the host
            self.shard_sizes = tf.Variable(self.shards, dtype=tf.int32, trainable=False)
            self.delays = (
                tf.Variable([0.0] * n, dtype=tf.float64, trainable=False) if slowdown else None
            )
        self.strategy = make_strategy(self.devices, all_reduce)
        with self.strategy.scope():
            self.model = spec.make()
            self.model.set_weights(spec.weights)
            self.optimizer = self.model.optimizer
            self.optimizer.build(self.model.trainable_variables)
        self._train_step = tf.function(self._step)
        self._predict_step = tf.function(self._predict, reduce_retracing=True)
        self._seconds_alone = tf.function(self._alone)
        self._seconds_together = tf.function(self._together)

    def describe(self) -> str:
        return "; gradients summed by allreduce" if self.balanced else ""

    @property
    def host_iterator(self) -> bool:
        return self.input == "split"  # else tf.distribute's, which cannot be saved

    def distribute(self, dataset):
        """The iterator `train_step` reads."""
        if self.input == "split":
            return iter(dataset)
        return iter(self.strategy.experimental_distribute_dataset(dataset))

    def train_step(self, iterator):
        """One update on the next global batch; returns the loss, the outputs and times."""
        return self._train_step(iterator)

    def _step(self, iterator):
        batch = next(iterator)
        local = self.strategy.experimental_local_results
        if self.input == "split":
            examples = num_examples(batch)  # the global batch, or an epoch's partial last one
            sizes = shard_sizes_for(examples, self.global_batch_size, self.shard_sizes)
            shards = self._split(batch, sizes)
        else:  # tf.distribute split it
            examples = tf.add_n([num_examples(shard) for shard in local(batch)])
            shards = batch
        loss, predictions, seconds = self.strategy.run(self._replica_step, args=(shards, examples))
        inputs = {"batch": batch} if self.input == "split" else {"batches": local(batch)}
        return self._with_in_step(
            {
                "loss": self.strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None),
                **inputs,
                "predictions": local(predictions),
                "device_seconds": tf.stack(local(seconds)),
            }
        )

    def _split(self, batch, sizes=None):
        """A global batch on the host -> one shard per replica."""
        shards = split(batch, self.shard_sizes if sizes is None else sizes, len(self.devices))
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: shards[context.replica_id_in_sync_group]
        )

    def _replica_step(self, batch, examples):
        gradients, loss, predictions, seconds = self._timed_gradients(batch, examples=examples)
        gradients = clip_before_all_reduce(self.optimizer, gradients)
        # Inside a replica, the optimizer all-reduces (sums) the gradients, then updates.
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        return loss, predictions, seconds

    def _timed_gradients(self, batch, timed=None, examples=None):
        delay = None
        if self.delays is not None:
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            delay = tf.gather(self.delays, replica)
        return timed_replica_gradients(
            self.model,
            self.objective,
            batch,
            self.global_batch_size if examples is None else examples,
            delay,
            self.chains,
            self.timed if timed is None else timed,
            self.jit_compile,
        )

    def set_shards(self, shards) -> None:
        if self.input != "split":
            raise ValueError("shards can only be set with input='split'")
        super().set_shards(shards)

    def _together(self, batch):
        seconds = self.strategy.run(
            lambda shard: self._timed_gradients(shard, timed=True)[3], args=(self._split(batch),)
        )
        return tf.stack(self.strategy.experimental_local_results(seconds))

    def _alone(self, batch, index):
        # The other replicas get empty shards: the same program, no work.
        sizes = [0] * len(self.devices)
        sizes[index] = num_examples(batch)
        shards = self._split(batch, tf.stack(sizes))
        seconds = self.strategy.run(
            lambda shard: self._timed_gradients(shard, timed=True)[3], args=(shards,)
        )
        return self.strategy.experimental_local_results(seconds)[index]

    def predict(self, batch):
        """The outputs and summed loss of an evaluation batch, split over the replicas."""
        n = int(num_examples(batch))
        sizes = split_batch(n, [1] * len(self.devices)) if n >= len(self.devices) else None
        if sizes is None:  # fewer examples than replicas: the first ones take one each
            sizes = [1] * n + [0] * (len(self.devices) - n)
        summed, predictions = self._predict_step(batch, tf.constant(sizes))
        return summed, concat(p for p, size in zip(predictions, sizes) if size)

    def _predict(self, batch, sizes):
        per_replica = self.strategy.run(
            lambda shard: self.objective.summed_loss(self.model, shard),
            args=(self._split(batch, sizes),),
        )
        loss, predictions = per_replica
        summed = self.strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)
        return summed, self.strategy.experimental_local_results(predictions)

    def set_weights(self, weights) -> None:
        """Sets `weights` on every replica."""
        with self.strategy.scope():
            self.model.set_weights(weights)
