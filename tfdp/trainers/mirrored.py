"""A custom training loop under tf.distribute.MirroredStrategy.

The model's variables are made again in the strategy's scope (`replicas.Placement`),
as if the model had been built there. Per step, each replica runs the model's own
train_step on its shard (`steps.DeviceWork`, the loss weighed by the shard's
examples), and the model's optimizer sums the replicas' gradients in its
all-reduce and applies them on every replica, as Keras' fit does under the
strategy. The metrics are sync-on-read variables: read after the step, they hold
the whole batch's values.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import shards as shards_lib
from tfdp.devices import even_split, split_batch
from tfdp.replicas import Placement
from tfdp.strategy import next_collective_key_base
from tfdp.steps import (
    DeviceWork,
    clip_before_all_reduce,
    num_examples,
    shard_sizes_for,
    split,
    with_metrics,
)
from tfdp.trainers.base import Trainer

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
    tf.distribute.MirroredStrategy._collective_key_base = next_collective_key_base()
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=cross_device_ops_for(all_reduce, devices)
    )


def replica_logs(strategy, model, logs, held):
    """A step's logs from its replicas': the model's metrics read across the replicas
    (the whole batch's), its other logs the mean over the replicas that held examples
    (Keras' fit takes the mean over all of them)."""
    weights = [tf.cast(h, tf.float32) for h in strategy.experimental_local_results(held)]
    count = tf.maximum(tf.add_n(weights), 1.0)

    def mean(value):
        values = strategy.experimental_local_results(value)
        summed = tf.add_n([tf.cast(v, tf.float32) * w for v, w in zip(values, weights)])
        return tf.cast(summed / count, values[0].dtype)

    return with_metrics(model, tf.nest.map_structure(mean, logs))


class MirroredTrainer(Trainer):
    """Synchronous replicas of one Keras model, one per device."""

    def __init__(
        self,
        model,
        devices,
        global_batch_size,
        all_reduce="auto",
        input="split",
        shards=None,
        slowdown=False,
        chains=1,
        timed=True,
        jit_compile=False,
        may_be_empty=False,
    ):
        """
        Args:
          model: a compiled, built Keras model (any kind): it is trained in place, its
            variables mirrored over `devices` while the trainer is open.
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
          chains: how many side-by-side pieces each replica cuts its shard into.
          timed: read each replica's seconds in the step (for auto powers and
            rebalancing); False leaves the host clock out of the step.
          jit_compile: each piece's forward and backward pass is one XLA program.
          may_be_empty: a batch may hold fewer examples than there are replicas.
        """
        self.devices = list(devices)
        self.balanced = shards is not None  # the weighted split over all-reduce
        self.chains = chains
        self.timed = timed
        self.global_batch_size = global_batch_size
        self.input = input
        n = len(self.devices)
        if input == "split":
            self.shards = list(shards or split_batch(global_batch_size, [1] * n, few=True))
        elif shards is None:
            self.shards = even_split(global_batch_size, n)
        else:
            raise ValueError("chosen shards need input='split'")
        with tf.device("/cpu:0"):  # the batch is split on the host
            self.shard_sizes = tf.Variable(self.shards, dtype=tf.int32, trainable=False)
            self.delays = (
                tf.Variable([0.0] * n, dtype=tf.float64, trainable=False) if slowdown else None
            )
        self.all_reduce = all_reduce
        self.strategy = make_strategy(self.devices, all_reduce)
        self.model = model
        self.placement = Placement(model, strategy=self.strategy)
        self.placement.enter()
        self.optimizer = model.optimizer
        self.jit_compile = jit_compile
        may_be_empty = may_be_empty or input == "dataset"
        self.work = DeviceWork(model, chains, jit_compile, timed, may_be_empty)
        self.probe = DeviceWork(model, chains, jit_compile, True, may_be_empty=True)
        self.compile()
        self._seconds_alone = tf.function(self._alone, autograph=False)
        self._seconds_together = tf.function(self._together, autograph=False)

    def describe(self) -> str:
        if not self.balanced:
            return ""
        if self.all_reduce == "reduce_to_one":
            return "; gradients summed on device0 and sent back to the replicas"
        return "; gradients summed by allreduce"

    @property
    def host_iterator(self) -> bool:
        return self.input == "split"  # else tf.distribute's, which cannot be saved

    def distribute(self, dataset):
        """The iterator `train_step` reads."""
        if self.input == "split":
            return iter(dataset)
        return iter(self.strategy.experimental_distribute_dataset(dataset))

    def _shards(self, batch):
        """(this step's shards, one per replica, and the examples of the global batch)."""
        if self.input == "split":
            examples = num_examples(batch)  # the global batch, or an epoch's partial last one
            sizes = shard_sizes_for(examples, self.global_batch_size, self.shard_sizes)
            return self._split(batch, sizes), examples
        local = self.strategy.experimental_local_results(batch)  # tf.distribute split it
        return batch, tf.add_n([num_examples(shard) for shard in local])

    def _step(self, batch):
        shards, examples = self._shards(batch)
        with shards_lib.handing_over(self.model):
            logs, seconds, held = self.strategy.run(self._replica_step, args=(shards, examples))
        return {
            "logs": replica_logs(self.strategy, self.model, logs, held),
            "device_seconds": tf.stack(self.strategy.experimental_local_results(seconds)),
        }

    def _replica_step(self, shard, examples):
        logs, gradients, held, seconds = self.work.train_either(shard, examples, self._delay())
        if gradients:  # (a model without trainable weights has nothing to update)
            gradients = clip_before_all_reduce(self.optimizer, gradients)
            # Inside a replica, the optimizer all-reduces (sums) the gradients, then updates.
            self.optimizer.apply_gradients(zip(gradients, self.work.variables))
        return logs, seconds, held

    def _test(self, batch):
        examples = num_examples(batch)  # split on the host, as a training batch would be
        sizes = shard_sizes_for(examples, self.global_batch_size, self.shard_sizes)
        shards = self._split(batch, sizes)
        logs, held = self.strategy.run(
            lambda shard: (self.work.test(shard, examples), num_examples(shard) > 0),
            args=(shards,),
        )
        return replica_logs(self.strategy, self.model, logs, held)

    def _split(self, batch, sizes):
        """A global batch on the host -> one shard per replica."""
        shards = split(batch, sizes, len(self.devices))
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: shards[context.replica_id_in_sync_group]
        )

    def _delay(self):
        if self.delays is None:
            return None
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.gather(self.delays, replica)

    def set_shards(self, shards) -> None:
        if self.input != "split":
            raise ValueError("shards can only be set with input='split'")
        super().set_shards(shards)

    def _together(self, batch):
        sizes = tf.convert_to_tensor(self.shard_sizes)
        return self._timed(batch, sizes)

    def _alone(self, batch, index):
        # The other replicas get empty shards: the same program, no work.
        sizes = [0] * len(self.devices)
        sizes[index] = num_examples(batch)
        return self._timed(batch, tf.stack(sizes))[index]

    def _timed(self, batch, sizes):
        """Each replica's seconds for its train_step on its shard, without the update."""
        examples = num_examples(batch)

        def seconds(shard):
            return self.probe.train(shard, examples, self._delay())[3]

        with shards_lib.handing_over(self.model):
            per_replica = self.strategy.run(seconds, args=(self._split(batch, sizes),))
        return tf.stack(self.strategy.experimental_local_results(per_replica))

